//! `gpufeed consume` (and the `consume` example, which is this file): consumes batches from a
//! running gpufeed daemon over its Unix socket and reports what arrived.
//!
//! ```text
//! gpufeed consume --socket /run/gpufeed/gpufeed.sock \
//!     --dataset demo --batch-size 256 --shuffle window --rank 0 --world-size 1 --dump out.npy
//! ```
//!
//! It prints one JSON line on stdout when done:
//! `{"batches":..,"samples":..,"bytes":..,"seconds":..,"cursor":..,"replaced":..,"handoff_us_p50":..}`
//! where `bytes` counts every field of every batch received, `seconds` runs from before connecting to
//! the daemon to the last batch, `first_batch_seconds` to the first, `cursor` is the last epoch's
//! cursor to resume from (`--resume-cursor`), and `handoff_us_*` are quantiles of the hand-off
//! latency: from a batch being ready (or from the consumer asking, if it asked later) to its arrival.
//! `--epochs N` consumes N epochs one after another, a stream each. `--source web=0.7 --source
//! code=0.3` instead of `--dataset` consumes a mixture of those datasets with those weights.
//! `consumer_cpu_s_stream` is this process's CPU time over `seconds`, and with `--daemon-pid PID`
//! `daemon_cpu_s_stream` the daemon's (from `/proc/PID/stat`); `cpu_samples` holds the readings at
//! both ends, with their instants on the monotonic clock.
//!
//! `--dump FILE.npy` writes the samples of the first field (the first `--field`, or the dataset's
//! first field) in the order received, as an array of shape `[samples, ...sample_shape]`. The samples
//! are buffered in memory, at most [`DUMP_BYTES_MAX`], because the count is not known until the end.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use gpufeed::input::write_npy;
use gpufeed_client::consumer::{Batch, Client, OpeningStream, Stream};
use gpufeed_client::protocol::{
    monotonic_ns, Backend, CorruptPolicy, Device, FieldRequest, MixtureSource, Shuffle,
    StreamLayout, StreamSpec, Tail,
};
use gpufeed_client::{DType, ALL_DTYPES};

/// Most bytes `--dump` buffers before writing the `.npy` file.
const DUMP_BYTES_MAX: u64 = 4 << 30;

/// Consume batches from a gpufeed daemon and print a JSON summary.
#[derive(Parser, Debug)]
#[command(about, long_about = None)]
pub struct Args {
    /// The daemon's Unix socket.
    #[arg(long)]
    socket: PathBuf,
    /// Dataset name as registered with the daemon.
    #[arg(long, required_unless_present = "sources", conflicts_with = "sources")]
    dataset: Option<String>,
    /// Instead of --dataset, a source of a mixture and its weight, as DATASET=WEIGHT (repeatable:
    /// two to 64 sources; every source must have the same fields).
    #[arg(long = "source", value_name = "DATASET=WEIGHT", value_parser = parse_source)]
    sources: Vec<MixtureSource>,
    /// Samples per batch on this rank.
    #[arg(long)]
    batch_size: u32,
    /// A field to serve, in slot order (repeatable); every field when none is named.
    #[arg(long = "field", value_name = "NAME")]
    fields: Vec<String>,
    /// Convert the named fields (or every field when none is named) to this dtype.
    #[arg(long, value_parser = dtype_parser())]
    dtype: Option<DType>,
    /// Stop after this many batches (default: the end of the epoch).
    #[arg(long)]
    steps: Option<u64>,
    /// Epoch to serve (the first, with --epochs).
    #[arg(long, default_value_t = 0)]
    epoch: u64,
    /// Epochs to serve one after another, a stream each on the same connection.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    epochs: u64,
    /// Shuffle seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Sample order.
    #[arg(long, value_enum, default_value_t = ShuffleArg::None)]
    shuffle: ShuffleArg,
    /// Shards per window of `--shuffle window`.
    #[arg(long, default_value_t = 4)]
    window_shards: u32,
    /// This rank.
    #[arg(long, default_value_t = 0)]
    rank: u32,
    /// Ranks consuming the epoch together (`--world` is its old name, still accepted).
    #[arg(long = "world-size", alias = "world", default_value_t = 1)]
    world: u32,
    /// Start at this step of the epoch (cursor = step × world × batch size).
    #[arg(long, conflicts_with = "resume_cursor")]
    start_step: Option<u64>,
    /// Start at this cursor of the epoch's global order (a checkpoint's `cursor`, at any world size).
    #[arg(long)]
    resume_cursor: Option<u64>,
    /// What to do with the samples that do not fill a last step.
    #[arg(long, value_enum, default_value_t = TailArg::Drop)]
    tail: TailArg,
    /// Slots the daemon fills ahead.
    #[arg(long, default_value_t = 4)]
    prefetch: u32,
    /// What to do about a corrupt block.
    #[arg(long, value_enum, default_value_t = CorruptArg::Fail)]
    on_corrupt: CorruptArg,
    /// Write the first field's samples, in the order received, to this .npy file.
    #[arg(long, value_name = "FILE.npy")]
    dump: Option<PathBuf>,
    /// After this many batches, keep the latest ones (as many as the stream has slots) and the
    /// stream, print a line starting with `holding` and wait until stdin closes, then go on. Lets a
    /// test kill a consumer that holds slots.
    #[arg(long, value_name = "N")]
    hold_after: Option<u64>,
    /// Where the batches should live: `cpu` (host memory), `cuda:N`, or `auto` (cuda:0 when the
    /// daemon runs on a GPU, else host memory).
    #[arg(long, default_value = "auto")]
    device: String,
    /// With several epochs: open the next epoch's stream, on a helper thread, once this fraction of
    /// the current epoch's batches is left (0: open it only when the epoch is over). The daemon
    /// fills its first batches (and, in a window shuffle, copies its first window) meanwhile.
    #[arg(long, default_value_t = 0.0, value_parser = parse_fraction)]
    open_ahead: f64,
    /// With `--device cuda:N`: do not move this thread off the CPUs that service the device's
    /// interrupts (by default it moves, when other CPUs are allowed to it).
    #[arg(long)]
    stay_on_interrupt_cpus: bool,
    /// The daemon's process id: its CPU time (all threads, user + system) is read when the clock
    /// starts and after the last batch, and reported as `daemon_cpu_s_stream`, so that its cores are
    /// counted over the stream rather than over this process's whole life.
    #[arg(long, value_name = "PID")]
    daemon_pid: Option<u32>,
}

/// User + system CPU seconds of process `pid` (`self` for this one), all its threads: fields 14 and
/// 15 of `/proc/PID/stat`, in clock ticks. `None` when the process is gone or the file unreadable.
fn process_cpu_s(pid: &str) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces: the first of
    // them is field 3 (state), so utime (14) and stime (15) are the 12th and 13th.
    let after_name = &text[text.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace().skip(11);
    let user_ticks: u64 = fields.next()?.parse().ok()?;
    let system_ticks: u64 = fields.next()?.parse().ok()?;
    // SAFETY: sysconf reads a constant of the system; no memory is passed.
    let ticks_per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (ticks_per_s > 0).then(|| (user_ticks + system_ticks) as f64 / ticks_per_s as f64)
}

/// CPU time of the daemon (with `--daemon-pid`) and of this process at one instant, with the instant
/// on the monotonic clock (nanoseconds), so that the CPU over an interval of several consumers (the
/// first start to the last end) can be worked out from their summaries.
#[derive(Clone, Copy, Debug)]
struct CpuSample {
    monotonic_ns: u64,
    daemon_s: Option<f64>,
    consumer_s: Option<f64>,
}

impl CpuSample {
    fn now(daemon_pid: Option<u32>) -> CpuSample {
        CpuSample {
            monotonic_ns: monotonic_ns(),
            daemon_s: daemon_pid.and_then(|pid| process_cpu_s(&pid.to_string())),
            consumer_s: process_cpu_s("self"),
        }
    }
}

/// A fraction from 0 to 1.
fn parse_fraction(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if (0.0..=1.0).contains(&value) => Ok(value),
        _ => Err(format!("{text:?} is not a fraction from 0 to 1")),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ShuffleArg {
    /// Dataset order.
    None,
    /// Shuffle shards, then samples within windows of `--window-shards` shards.
    Window,
    /// Shuffle all samples.
    Full,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum TailArg {
    /// Leave the last partial step out.
    Drop,
    /// Serve one more full step, wrapping to the start of the epoch.
    Pad,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CorruptArg {
    /// End the stream with an error.
    Fail,
    /// Serve zero-filled substitutes.
    Replace,
}

/// The stream spec the arguments describe, serving `field_names` (empty: every field, stored dtype).
/// A `--source DATASET=WEIGHT`.
fn parse_source(text: &str) -> Result<MixtureSource, String> {
    let (dataset, weight) = text
        .rsplit_once('=')
        .ok_or_else(|| format!("{text:?} is not DATASET=WEIGHT"))?;
    let weight: f64 = weight
        .parse()
        .map_err(|_| format!("{text:?}: the weight {weight:?} is not a number"))?;
    Ok(MixtureSource {
        dataset: dataset.to_string(),
        weight,
    })
}

fn build_spec(args: &Args, field_names: &[String]) -> StreamSpec {
    let mut spec = match &args.dataset {
        Some(dataset) => StreamSpec::new(dataset.clone(), args.batch_size),
        None => StreamSpec::mixture(args.sources.clone(), args.batch_size),
    };
    spec.fields = field_names
        .iter()
        .map(|name| FieldRequest {
            name: name.clone(),
            dtype: args.dtype,
        })
        .collect();
    spec.seed = args.seed;
    spec.epoch = args.epoch;
    spec.shuffle = match args.shuffle {
        ShuffleArg::None => Shuffle::None,
        ShuffleArg::Window => Shuffle::Window(args.window_shards),
        ShuffleArg::Full => Shuffle::Full,
    };
    spec.rank = args.rank;
    spec.world_size = args.world;
    spec.tail = match args.tail {
        TailArg::Drop => Tail::Drop,
        TailArg::Pad => Tail::Pad,
    };
    spec.prefetch = args.prefetch;
    spec.on_corrupt = match args.on_corrupt {
        CorruptArg::Fail => CorruptPolicy::Fail,
        CorruptArg::Replace => CorruptPolicy::Replace,
    };
    if let Some(step) = args.start_step {
        spec.start_at_step(step);
    }
    if let Some(cursor) = args.resume_cursor {
        spec.start_cursor = cursor;
    }
    spec
}

/// The names of the fields to request. `--dtype` without `--field` converts every field, but the
/// protocol names each converted field, so the dataset's field names are learned first from the layout
/// of a short-lived stream (one slot, closed at once).
fn field_names(args: &Args) -> Result<Vec<String>> {
    if !args.fields.is_empty() || args.dtype.is_none() {
        return Ok(args.fields.clone());
    }
    let mut probe = build_spec(args, &[]);
    probe.prefetch = 1;
    let stream = Client::connect(&args.socket)?
        .open_stream(probe)
        .context("opening a stream to learn the dataset's field names")?;
    Ok(stream
        .layout()
        .fields
        .iter()
        .map(|field| field.name.clone())
        .collect())
}

/// The first field's dtype and per-sample shape, refused early when `.npy` cannot hold it.
fn dump_geometry(layout: &StreamLayout) -> Result<DumpGeometry> {
    let field = &layout.fields[0];
    if !layout.variable.is_empty() && layout.variable.iter().any(|v| v.values == 0) {
        bail!(
            "--dump: field {:?} is variable-length, which one .npy array cannot hold; dump a fixed-shape field (--field)",
            field.name
        );
    }
    if field.dtype == DType::BF16 {
        bail!(
            "--dump: field {:?} is bf16, which NumPy has no type for; add --dtype f32",
            field.name
        );
    }
    Ok((field.dtype, field.sample_shape.clone()))
}

/// What arrived.
#[derive(Debug, Default)]
struct Totals {
    batches: u64,
    samples: u64,
    bytes: u64,
    replaced: u64,
}

fn run(args: &Args) -> Result<()> {
    // A training process has its CUDA context (its framework made it) before it asks for data, and
    // keeps it across epochs: so does this one, before the clock starts.
    let _context = match args.device.strip_prefix("cuda:").map(str::parse::<u32>) {
        Some(Ok(ordinal)) => {
            let context = gpufeed_client::cuda::retain_primary_context(ordinal)
                .with_context(|| format!("initializing CUDA device {ordinal}"))?;
            // Take batches on a CPU that does not service the device's interrupts (unless asked
            // not to): the driver queries of each batch wait behind the interrupt handler there.
            if !args.stay_on_interrupt_cpus {
                if let Err(error) = gpufeed_client::cuda::keep_thread_off_interrupt_cpus(ordinal) {
                    eprintln!("consume: keeping off cuda:{ordinal}'s interrupt CPUs: {error}");
                }
            }
            Some(context)
        }
        _ => None,
    };
    // The clock starts before the consumer connects: connecting, opening streams and mapping their
    // slots are part of what a training loop waits for.
    let started = Instant::now();
    let cpu_at_start = CpuSample::now(args.daemon_pid);
    let mut spec = build_spec(args, &field_names(args)?);
    let client = Client::connect(&args.socket)?;
    spec.device = match args.device.as_str() {
        "auto" if client.backend() == Backend::Cuda => Device::Cuda(0),
        "auto" | "cpu" => Device::Cpu,
        other => match other.strip_prefix("cuda:").map(str::parse::<u32>) {
            Some(Ok(ordinal)) => Device::Cuda(ordinal),
            _ => bail!("--device {other}: expected auto, cpu or cuda:N"),
        },
    };
    let mut received = Received {
        dump: args.dump.as_ref().map(|_| (None, Vec::new())),
        ..Received::default()
    };
    let mut last = None;
    // A session serves one stream: later epochs connect again, ahead of need (--open-ahead).
    let mut first_client = Some(client);
    let mut opening: Option<OpeningStream> = None;
    let end = args.epoch + args.epochs;
    for epoch in args.epoch..end {
        spec.epoch = epoch;
        if epoch != args.epoch {
            // Later epochs start at their beginning.
            spec.start_cursor = 0;
        }
        let waiting = Instant::now();
        let stream = match (opening.take(), first_client.take()) {
            // An ahead-open needs a second session and ring while the current one lives: if the
            // daemon refused it (its bounds), open again now that the current stream is gone.
            (Some(opening), _) => opening.wait().or_else(|error| {
                eprintln!("consume: opening epoch {epoch} ahead failed ({error}); opening it now");
                Client::connect(&args.socket)?.open_stream(spec.clone())
            }),
            (None, Some(client)) => client.open_stream(spec.clone()),
            (None, None) => Client::connect(&args.socket)?.open_stream(spec.clone()),
        }
        .with_context(|| format!("opening a stream of {}, epoch {epoch}", spec.source_name()))?;
        let next = (epoch + 1 < end && args.open_ahead > 0.0).then(|| {
            let mut next = spec.clone();
            next.epoch = epoch + 1;
            next.start_cursor = 0;
            next
        });
        last = Some(consume_epoch(
            args,
            stream,
            (waiting, next, &mut opening),
            &mut received,
            started,
        )?);
        if received.totals.batches >= args.steps.unwrap_or(u64::MAX) {
            break;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu_at_end = CpuSample::now(args.daemon_pid);
    let (cursor, spec_device) = last.expect("at least one epoch");
    let totals = &received.totals;
    if let (Some(path), Some((Some((dtype, sample_shape)), dump_bytes))) =
        (&args.dump, &received.dump)
    {
        let mut shape = vec![totals.samples];
        shape.extend_from_slice(sample_shape);
        let mut writer = write_npy(path, *dtype, &shape)?;
        writer.write_all(dump_bytes)?;
        writer.finish()?;
    }
    println!(
        "{}",
        serde_json::json!({
            "batches": totals.batches,
            "samples": totals.samples,
            "bytes": totals.bytes,
            "seconds": seconds,
            "first_batch_seconds": received.first_batch_s,
            "epochs": args.epochs,
            "cursor": cursor,
            "replaced": totals.replaced,
            "device": format!("{:?}", spec_device),
            "handoff_us_p50": quantile_us(&mut received.handoff_ns, 0.50),
            "handoff_us_p99": quantile_us(&mut received.handoff_ns, 0.99),
            "handoff_us_max": quantile_us(&mut received.handoff_ns, 1.0),
            "release_us_p50": quantile_us(&mut received.release_ns, 0.50),
            "release_us_p99": quantile_us(&mut received.release_ns, 0.99),
            "release_us_mean": mean_us(&received.release_ns),
            "handoff_us_p90": quantile_us(&mut received.handoff_ns, 0.90),
            "handoff_us_mean": mean_us(&received.handoff_ns),
            "ready_before_asked": received.ready_before_asked,
            "epoch_times": received.epochs,
            "ready_queries": gpufeed_client::cuda::QUERY_STATS.ready.read(),
            "stream_queries": gpufeed_client::cuda::QUERY_STATS.stream.read(),
            // Over `seconds` (from before connecting to the last batch): the daemon's CPU (null
            // without --daemon-pid) and this process's, and the samples they come from.
            "daemon_cpu_s_stream": cpu_at_start.daemon_s.zip(cpu_at_end.daemon_s).map(|(a, b)| b - a),
            "consumer_cpu_s_stream": cpu_at_start.consumer_s.zip(cpu_at_end.consumer_s).map(|(a, b)| b - a),
            "cpu_samples": {
                "start_monotonic_s": cpu_at_start.monotonic_ns as f64 / 1e9,
                "end_monotonic_s": cpu_at_end.monotonic_ns as f64 / 1e9,
                "daemon_cpu_s": [cpu_at_start.daemon_s, cpu_at_end.daemon_s],
                "consumer_cpu_s": [cpu_at_start.consumer_s, cpu_at_end.consumer_s],
            },
        })
    );
    Ok(())
}

/// The dumped field's dtype and per-sample shape.
type DumpGeometry = (DType, Vec<u64>);

/// What arrived over every epoch.
#[derive(Debug, Default)]
struct Received {
    totals: Totals,
    /// Hand-off latency of each batch.
    handoff_ns: Vec<u64>,
    /// Time the releases took (dropping a batch: the release query and the ring entry), of one batch
    /// in [`RELEASE_TIMED_EVERY`].
    release_ns: Vec<u64>,
    /// Batches that were ready before this consumer asked for them (it was behind the daemon).
    ready_before_asked: u64,
    /// Each epoch's stream as the consumer saw it.
    epochs: Vec<EpochTimes>,
    /// Seconds from the start to the first batch.
    first_batch_s: Option<f64>,
    /// `--dump`: the first field's geometry (learned from the first stream) and its bytes.
    dump: Option<(Option<DumpGeometry>, Vec<u8>)>,
}

/// Consumes one epoch's stream; returns its cursor at the end and its device.
///
/// `ahead` is when the consumer began to wait for the stream, and the next epoch's spec, to be
/// opened into the `OpeningStream` once `--open-ahead` of this epoch is left.
fn consume_epoch(
    args: &Args,
    mut stream: Stream,
    ahead: (Instant, Option<StreamSpec>, &mut Option<OpeningStream>),
    received: &mut Received,
    started: Instant,
) -> Result<(u64, Device)> {
    let (opening, mut next, next_stream) = ahead;
    let opened_ms = opening.elapsed().as_secs_f64() * 1e3;
    let open_phases = stream.open_phases();
    let usage_at_start = gpufeed::pipeline::filler::thread_usage();
    let steps = stream.layout().steps;
    // Open the next stream once this many batches are left.
    let open_when_left = (args.open_ahead * steps as f64).ceil() as u64;
    let mut epoch_batches = 0u64;
    let mut first_batch_ms = None;
    // When each batch arrived, in milliseconds from the wait for the stream (for the epoch's
    // progress and its longest gaps).
    let mut arrivals_ms: Vec<f64> = Vec::with_capacity(steps.min(1 << 20) as usize);
    if let Some((geometry @ None, _)) = &mut received.dump {
        *geometry = Some(dump_geometry(stream.layout())?);
    }
    let dump_field = stream.layout().fields[0].name.clone();
    // Batches kept for --hold-after: fewer than the slot count while still receiving, so that the
    // daemon always has a slot to fill.
    let slot_count = stream.layout().slot_count as usize;
    let mut held: VecDeque<Batch> = VecDeque::with_capacity(slot_count);
    let limit = args.steps.unwrap_or(u64::MAX);
    let totals = &mut received.totals;
    // The opening's instant on the monotonic clock that batches are stamped with: one clock read a
    // batch serves both its hand-off latency and its arrival time.
    let opening_ns = monotonic_ns().saturating_sub(opening.elapsed().as_nanos() as u64);
    while totals.batches < limit {
        let waiting_since = monotonic_ns();
        let Some(batch) = stream.next() else { break };
        let arrived_ns = monotonic_ns();
        let batch = batch
            .with_context(|| format!("receiving the batch after {} batches", totals.batches))?;
        totals.batches += 1;
        epoch_batches += 1;
        if steps.saturating_sub(epoch_batches) <= open_when_left
            && totals.batches < limit.saturating_sub(steps.saturating_sub(epoch_batches))
        {
            if let Some(spec) = next.take() {
                *next_stream = Some(OpeningStream::start(args.socket.clone(), spec));
            }
        }
        first_batch_ms.get_or_insert_with(|| opening.elapsed().as_secs_f64() * 1e3);
        if arrivals_ms.len() < 1 << 20 {
            arrivals_ms.push(arrived_ns.saturating_sub(opening_ns) as f64 / 1e6);
        }
        totals.samples += u64::from(batch.samples());
        totals.replaced += u64::from(batch.replaced());
        // The hand-off latency: from the batch being ready, or from the moment this consumer
        // started waiting for it if it was ready before (prefetched), to its arrival here.
        let ready_or_asked = batch.info().ready_ns.max(waiting_since);
        received.ready_before_asked += u64::from(batch.info().ready_ns < waiting_since);
        received
            .handoff_ns
            .push(arrived_ns.saturating_sub(ready_or_asked));
        received
            .first_batch_s
            .get_or_insert_with(|| started.elapsed().as_secs_f64());
        totals.bytes += batch
            .fields()
            .map(|field| field.byte_len() as u64)
            .sum::<u64>();
        if let Some((_, dump_bytes)) = &mut received.dump {
            let field = batch
                .field(&dump_field)
                .expect("every batch has the layout's fields");
            if dump_bytes.len() as u64 + field.byte_len() as u64 > DUMP_BYTES_MAX {
                bail!(
                    "--dump: more than {DUMP_BYTES_MAX} bytes of field {dump_field:?}; pass --steps to dump fewer batches"
                );
            }
            field.copy_to_host(dump_bytes)?;
        }
        let mut batch = Some(batch);
        if let Some(hold_after) = args.hold_after {
            if totals.batches <= hold_after {
                held.push_back(batch.take().expect("not yet moved"));
                if totals.batches == hold_after {
                    hold_until_stdin_closes(&held)?;
                    held.clear();
                } else if held.len() >= slot_count {
                    held.pop_front();
                }
            }
        }
        if let Some(batch) = batch {
            // One release in RELEASE_TIMED_EVERY is timed (two clock reads cost about a third of a
            // release).
            if totals.batches % RELEASE_TIMED_EVERY == 0 {
                let releasing = monotonic_ns();
                drop(batch);
                received
                    .release_ns
                    .push(monotonic_ns().saturating_sub(releasing));
            } else {
                drop(batch);
            }
        }
    }
    let usage = gpufeed::pipeline::filler::thread_usage().since(&usage_at_start);
    received.epochs.push(EpochTimes {
        open_ms: opened_ms,
        open_daemon_ms: open_phases.daemon_s * 1e3,
        open_map_ms: open_phases.map_s * 1e3,
        first_batch_ms,
        progress_ms: progress_ms(&arrivals_ms),
        gaps_ms: longest_gaps(&arrivals_ms, 4),
        ms: opening.elapsed().as_secs_f64() * 1e3,
        cpu_ms: usage.cpu_s * 1e3,
        involuntary_switches: usage.involuntary_switches,
        voluntary_switches: usage.voluntary_switches,
    });
    Ok((stream.state().cursor, stream.spec().device))
}

/// One release in this many is timed (`release_us_*`): prime, so that the timed releases do not fall
/// on the same batch of every group of batches published together.
const RELEASE_TIMED_EVERY: u64 = 5;

/// One epoch's stream, from the consumer's side, in milliseconds from when the consumer began to
/// wait for it: the wait for the stream (its whole opening, connection included after the first
/// epoch; or what was left of an opening started ahead), its first batch, and all of it; and the
/// consuming thread's CPU time and context switches over the epoch (whether a slow epoch's thread
/// was kept off its CPU or waited).
#[derive(Debug, serde::Serialize)]
struct EpochTimes {
    open_ms: f64,
    /// Of the opening: the daemon's answer, and mapping the slots here (`Stream::open_phases`).
    open_daemon_ms: f64,
    open_map_ms: f64,
    first_batch_ms: Option<f64>,
    /// When the last batch of each eighth of the epoch's batches arrived (a window shuffle of four
    /// windows shows each window's service in two of them); of its first 2^20 batches when it has
    /// more, and likewise for the gaps.
    progress_ms: Vec<f64>,
    /// The longest waits between consecutive batches: (index of the later batch, milliseconds).
    gaps_ms: Vec<(usize, f64)>,
    ms: f64,
    cpu_ms: f64,
    involuntary_switches: i64,
    voluntary_switches: i64,
}

/// When the last batch of each eighth of the batches arrived (`arrivals_ms`, in order).
fn progress_ms(arrivals_ms: &[f64]) -> Vec<f64> {
    let count = arrivals_ms.len();
    if count == 0 {
        return Vec::new();
    }
    (1..=8)
        .map(|eighth| arrivals_ms[(count * eighth).div_ceil(8).max(1) - 1])
        .collect()
}

/// The `most` longest waits between consecutive arrivals, longest first: (index of the later
/// arrival, milliseconds).
fn longest_gaps(arrivals_ms: &[f64], most: usize) -> Vec<(usize, f64)> {
    let mut gaps: Vec<(usize, f64)> = arrivals_ms
        .windows(2)
        .enumerate()
        .map(|(i, pair)| (i + 1, pair[1] - pair[0]))
        .collect();
    gaps.sort_by(|a, b| b.1.total_cmp(&a.1));
    gaps.truncate(most);
    gaps
}

/// The mean of `values` (nanoseconds) in microseconds; null when there are none.
fn mean_us(values: &[u64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<u64>() as f64 / values.len() as f64 / 1e3)
}

/// The `q` quantile of `values` (nanoseconds) in microseconds; null when there are none.
fn quantile_us(values: &mut [u64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let index = ((values.len() - 1) as f64 * q).round() as usize;
    Some(values[index] as f64 / 1e3)
}

/// Announces the held batches on stdout and blocks until stdin reaches its end.
fn hold_until_stdin_closes(held: &VecDeque<Batch>) -> Result<()> {
    let slots: Vec<u32> = held.iter().map(Batch::slot).collect();
    let mut stdout = std::io::stdout().lock();
    writeln!(
        stdout,
        "holding {} batches in slots {slots:?} until stdin closes",
        held.len()
    )?;
    stdout.flush()?;
    let mut stdin = std::io::stdin().lock();
    let mut discard = [0u8; 4096];
    while stdin.read(&mut discard).context("reading stdin")? > 0 {}
    Ok(())
}

/// The element types by name, for `--dtype` options: `--help` lists them.
pub fn dtype_parser() -> impl clap::builder::TypedValueParser<Value = DType> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(ALL_DTYPES.iter().map(|d| d.name()))
        .map(|name| name.parse::<DType>().expect("one of the listed names"))
}

/// Runs `gpufeed consume` with `args`; errors are printed, the exit code says whether it worked.
pub fn main_with(args: Args) -> ExitCode {
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("consume: error: {}", gpufeed::error_chain(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
        let base = [
            "consume",
            "--socket",
            "/tmp/s.sock",
            "--dataset",
            "demo",
            "--batch-size",
            "32",
        ];
        Args::try_parse_from(base.iter().chain(extra))
    }

    #[test]
    fn progress_and_gaps_summarise_the_arrivals() {
        // 16 arrivals 1 ms apart, with a 10 ms wait before the ninth.
        let arrivals: Vec<f64> = (0..16)
            .map(|i| i as f64 + if i >= 8 { 10.0 } else { 0.0 })
            .collect();
        assert_eq!(
            progress_ms(&arrivals),
            vec![1.0, 3.0, 5.0, 7.0, 19.0, 21.0, 23.0, 25.0]
        );
        assert_eq!(longest_gaps(&arrivals, 2), vec![(8, 11.0), (1, 1.0)]);
        // Fewer arrivals than eighths: the last arrival so far stands for the later eighths.
        assert_eq!(
            progress_ms(&[2.0, 5.0]),
            vec![2.0, 2.0, 2.0, 2.0, 5.0, 5.0, 5.0, 5.0]
        );
        assert!(progress_ms(&[]).is_empty() && longest_gaps(&[1.0], 4).is_empty());
    }

    #[test]
    fn defaults_make_the_default_spec() {
        let args = parse(&[]).unwrap();
        assert_eq!(build_spec(&args, &[]), StreamSpec::new("demo", 32));
    }

    #[test]
    fn every_option_reaches_the_spec() {
        let args = parse(&[
            "--field",
            "ids",
            "--field",
            "emb",
            "--dtype",
            "f32",
            "--epoch",
            "3",
            "--seed",
            "9",
            "--shuffle",
            "window",
            "--window-shards",
            "8",
            "--rank",
            "2",
            "--world-size",
            "4",
            "--start-step",
            "10",
            "--tail",
            "pad",
            "--prefetch",
            "6",
            "--on-corrupt",
            "replace",
        ])
        .unwrap();
        let spec = build_spec(&args, &field_names(&args).unwrap());
        assert_eq!(spec.fields.len(), 2);
        assert_eq!(spec.fields[1].name, "emb");
        assert_eq!(spec.fields[1].dtype, Some(DType::F32));
        assert_eq!((spec.epoch, spec.seed), (3, 9));
        assert_eq!(spec.shuffle, Shuffle::Window(8));
        assert_eq!((spec.rank, spec.world_size), (2, 4));
        assert_eq!(spec.start_cursor, 10 * 4 * 32);
        let old_name = parse(&["--rank", "1", "--world", "3"]).unwrap();
        assert_eq!(
            build_spec(&old_name, &[]).world_size,
            3,
            "--world stays an alias"
        );
        assert_eq!(
            (spec.tail, spec.prefetch, spec.on_corrupt),
            (Tail::Pad, 6, CorruptPolicy::Replace)
        );
    }

    #[test]
    fn resume_cursor_sets_the_cursor_and_excludes_start_step() {
        let args = parse(&["--resume-cursor", "1000"]).unwrap();
        assert_eq!(build_spec(&args, &[]).start_cursor, 1000);
        assert!(parse(&["--resume-cursor", "1000", "--start-step", "3"]).is_err());
        assert!(parse(&["--shuffle", "sideways"]).is_err());
        assert!(parse(&["--dtype", "float"]).is_err());
        assert_eq!(parse(&["--hold-after", "3"]).unwrap().hold_after, Some(3));
    }
}
