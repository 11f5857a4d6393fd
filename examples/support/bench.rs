//! What the serving benchmarks share (`serve_bench`, `handoff_bench`): packing a generated dataset,
//! the GPU pipeline alone (no socket, no consumer), and CPU time from `getrusage`.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// The daemon's allocator (see `src/main.rs`), for the pipeline and the daemon these benchmarks run
/// in their own process.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use anyhow::Result;
use gpufeed::device::{DeviceRegion, Event, ExportableBuffer};
use gpufeed::format::Dataset;
use gpufeed::input::FieldSource;
use gpufeed::metrics::Metrics;
use gpufeed::pack::{self, CodecChoice, OnExisting, PackOptions, Quiet, ShuffleChoice};
use gpufeed::pipeline::gpu::GpuFillTimings;
use gpufeed::pipeline::{GpuBackend, StreamPlan};

/// Packs `fields` into `dir` as dataset `name` (64 KiB blocks, the default shard size, byte
/// shuffle chosen per block, every core) with `codec`, and opens it.
pub fn pack_dataset(
    dir: &Path,
    name: &str,
    fields: &[FieldSource],
    codec: CodecChoice,
    on_existing: OnExisting,
) -> Result<Arc<Dataset>> {
    let options = PackOptions {
        name: name.into(),
        block_bytes: 64 << 10,
        samples_per_shard: None,
        codec,
        shuffle: ShuffleChoice::Auto,
        on_existing,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    pack::pack(dir, fields, &options, &Quiet)?;
    Ok(Arc::new(Dataset::open(dir)?))
}

/// Seconds of CPU this process used, and its waited-for children used, so far.
pub fn cpu_seconds() -> (f64, f64) {
    let usage = |who| {
        // SAFETY: getrusage writes one rusage struct into a live local.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe { libc::getrusage(who, &mut usage) };
        let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        seconds(usage.ru_utime) + seconds(usage.ru_stime)
    };
    (usage(libc::RUSAGE_SELF), usage(libc::RUSAGE_CHILDREN))
}

/// The GPU pipeline alone: fills every step of `plan` into a ring of `slots` exportable slots on
/// `backend`'s device, batches submitted up to the daemon's depth ahead of their completion as its
/// filler does, reading through the daemon's shared page-cache windows. Returns the seconds from
/// the first submission to the device being idle, and the assembler's phase timings.
pub fn gpu_pipeline_alone(
    backend: &GpuBackend,
    plan: &Arc<StreamPlan>,
    slots: usize,
) -> Result<(f64, GpuFillTimings)> {
    let mut assembler = backend.open_assembler(Arc::clone(plan), Arc::new(Metrics::new()))?;
    // The daemon's ring: one exportable allocation, a region of it per slot, two events per slot.
    let stride = gpufeed_client::protocol::slot_stride(plan.slot_bytes as u64) as usize;
    let memory = ExportableBuffer::new(&backend.device, stride * slots.max(1))?;
    let ring: Vec<(DeviceRegion, Event, Event)> = (0..slots.max(1))
        .map(|slot| {
            Ok((
                // SAFETY: `memory` outlives the ring and the assembler, whose work is synchronized
                // before this function returns.
                unsafe { memory.region(slot * stride, plan.slot_bytes) }?,
                Event::new_interprocess(&backend.device)?,
                Event::new_interprocess(&backend.device)?,
            ))
        })
        .collect::<Result<_, gpufeed::device::DeviceError>>()?;
    let started = Instant::now();
    for step in 0..plan.steps {
        let (slot, ready, released) = &ring[(step % ring.len() as u64) as usize];
        // As the daemon's filler: never more batches pending than slots (its ring has no other).
        if assembler.pending_batches() == assembler.batches_ahead().min(ring.len()) {
            assembler.complete(None)?;
        }
        assembler.submit(step, slot, released, Some(ready))?;
    }
    while assembler.pending_batches() > 0 {
        assembler.complete(None)?;
    }
    assembler.stream().synchronize()?;
    Ok((started.elapsed().as_secs_f64(), assembler.timings()))
}
