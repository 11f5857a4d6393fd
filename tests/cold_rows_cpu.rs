//! The CPU backend's full and window shuffles of a dataset larger than the daemon's memory: rows
//! read from the disk (`pipeline::cold_rows`) instead of copied from the page-cache maps, where each row's fault
//! and read-around thrash the page cache (a 1.5 GiB dataset in a 512 MiB memory cgroup served
//! 0.42 MB/s on the 2-core VM). These tests hold the disk reads to the page-cache path's results:
//! every batch bit for bit, in a full and a window shuffle, at batch sizes whose rows cross blocks
//! or not, for two ranks, fp16
//! converted to f32 or not; and a corrupt block replaced in the same rows, with the same count, or
//! failing the stream with the same error.
//!
//! The path is chosen when the stream opens, from `GPUFEED_ROW_READS` (this file's only test sets
//! it, so no other test of this binary sees it).

mod common;

use std::path::Path;
use std::sync::Arc;

use gpufeed::format::Dataset;
use gpufeed::metrics::Metrics;
use gpufeed::pack::CodecChoice;
use gpufeed::pipeline::block_cache::BlockCache;
use gpufeed::pipeline::{Assembler, StreamLimits, StreamPlan, StreamRequest};
use gpufeed_client::protocol::{FieldRequest, Shuffle, StreamSpec};
use gpufeed_client::{CorruptPolicy, DType};

/// Rows of the dataset.
const SAMPLES: usize = 3000;

/// A raw dataset: `emb`, 700 fp16 values a row (1400 bytes: rows cross the 4 KiB blocks), and `id`,
/// one int32, in shards of 1000 rows.
fn dataset(dir: &Path) -> Arc<Dataset> {
    let emb: Vec<u8> = (0..SAMPLES * 700)
        .flat_map(|i| half::f16::from_f32((i % 1013) as f32 * 0.125).to_le_bytes())
        .collect();
    let id = common::i32_bytes(SAMPLES, |i| i as i32);
    let fields = vec![
        common::field("emb", DType::F16, &[700], emb),
        common::field("id", DType::I32, &[], id),
    ];
    let mut options = common::options("rows", 4096, Some(1000));
    options.codec = CodecChoice::Raw;
    let out = dir.join("rows");
    common::pack_fields(&out, &fields, &options);
    Arc::new(Dataset::open(&out).unwrap())
}

fn plan(
    dataset: &Arc<Dataset>,
    shuffle: Shuffle,
    batch: u32,
    rank: (u32, u32),
    f32_out: bool,
    on_corrupt: CorruptPolicy,
) -> Arc<StreamPlan> {
    let mut spec = StreamSpec::new("rows".to_string(), batch);
    spec.shuffle = shuffle;
    spec.seed = 11;
    (spec.rank, spec.world_size) = rank;
    spec.on_corrupt = on_corrupt;
    spec.fields = vec![
        FieldRequest {
            name: "emb".into(),
            dtype: f32_out.then_some(DType::F32),
        },
        FieldRequest {
            name: "id".into(),
            dtype: None,
        },
    ];
    Arc::new(
        StreamPlan::new(
            Arc::clone(dataset),
            &StreamRequest::from(&spec),
            &StreamLimits::node_defaults(),
        )
        .unwrap(),
    )
}

/// Every batch delivered: its slot and its replaced rows.
type Batches = Vec<(Vec<u8>, u32)>;

/// Every batch of `plan` read through `reads` (`disk` or `page-cache`), and the first error and its
/// step, if any.
fn deliver(plan: &Arc<StreamPlan>, reads: &str) -> (Batches, Option<(u64, String)>) {
    std::env::set_var("GPUFEED_ROW_READS", reads);
    let metrics = Arc::new(Metrics::new());
    let cache = BlockCache::new(64 << 20, Arc::clone(&metrics));
    let limits = StreamLimits::node_defaults();
    let mut assembler =
        Assembler::with_cache(Arc::clone(plan), &limits, Arc::clone(&metrics), &cache).unwrap();
    std::env::remove_var("GPUFEED_ROW_READS");
    let mut batches = Vec::new();
    for step in 0..plan.steps {
        let mut slot = vec![0xAAu8; plan.slot_bytes];
        match assembler.fill(step, &mut slot) {
            Ok(report) => batches.push((slot, report.replaced)),
            Err(error) => return (batches, Some((step, error.to_string()))),
        }
    }
    (batches, None)
}

#[test]
fn rows_read_from_the_disk_are_the_rows_the_page_cache_path_serves() {
    let dir = tempfile::tempdir().unwrap();
    let dataset = dataset(dir.path());
    for (shuffle, batch, rank, f32_out) in [
        (Shuffle::Full, 64, (0, 1), true),
        (Shuffle::Full, 1000, (0, 1), false),
        (Shuffle::Full, 7, (1, 3), true),
        (Shuffle::Full, 3000, (0, 1), true),
        (Shuffle::Window(2), 64, (0, 1), true),
        (Shuffle::Window(2), 333, (1, 2), false),
    ] {
        let plan = plan(&dataset, shuffle, batch, rank, f32_out, CorruptPolicy::Fail);
        let (disk, error) = deliver(&plan, "disk");
        assert!(error.is_none(), "{error:?}");
        let (cached, error) = deliver(&plan, "page-cache");
        assert!(error.is_none(), "{error:?}");
        assert_eq!(disk.len() as u64, plan.steps);
        assert!(
            disk == cached,
            "{shuffle:?} batch {batch}, rank {rank:?}: the disk and the page cache differ"
        );
        // The ids are the plan's samples: the rows are the ones asked for.
        let id_at = plan.fields[1].offset;
        for (step, (slot, _)) in disk.iter().enumerate() {
            for (row, sample) in plan.batch_samples(step as u64).enumerate() {
                let at = id_at + row * 4;
                let id = i32::from_le_bytes(slot[at..at + 4].try_into().unwrap());
                assert_eq!(id as u64, sample, "step {step} row {row}");
            }
        }
    }

    // A corrupt block of `emb` in the second shard: replaced in the same rows, counted the same,
    // or the same error at the same step.
    let shard = &dataset.shards[1];
    let entry = shard.metadata.field_blocks(0)[5];
    let mut bytes = std::fs::read(&shard.path).unwrap();
    bytes[(entry.stored_offset + 17) as usize] ^= 0x10;
    std::fs::write(&shard.path, bytes).unwrap();
    let dataset = Arc::new(Dataset::open(&dataset.dir).unwrap());
    let replace = plan(
        &dataset,
        Shuffle::Full,
        100,
        (0, 1),
        true,
        CorruptPolicy::Replace,
    );
    let (disk, error) = deliver(&replace, "disk");
    assert!(error.is_none(), "{error:?}");
    let (cached, _) = deliver(&replace, "page-cache");
    assert!(disk == cached, "the corrupt block's rows differ");
    let replaced: u32 = disk.iter().map(|(_, r)| r).sum();
    assert!(replaced > 0, "no row was replaced");
    let fail = plan(
        &dataset,
        Shuffle::Window(2),
        100,
        (0, 1),
        true,
        CorruptPolicy::Fail,
    );
    let (disk, disk_error) = deliver(&fail, "disk");
    let (cached, cached_error) = deliver(&fail, "page-cache");
    let (step, message) = disk_error.expect("the stream fails");
    assert_eq!(Some(step), cached_error.as_ref().map(|e| e.0), "{message}");
    assert_eq!(disk.len(), cached.len());
    assert!(
        message.contains("block 5") && message.contains(&*shard.path.to_string_lossy()),
        "{message}"
    );
}
