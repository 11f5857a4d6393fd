//! The CPU backend's shared decoded-block cache.
//!
//! Each host stream used to keep a decoded-block cache of its own of up to 256 MiB, outside the slot
//! memory budget: 20 full-shuffle streams on a 410 MB dataset took the daemon from 680 MB to 6.3 GB
//! of RSS, and the memory stayed after they closed. Now the daemon's host streams share one cache
//! within the budget: a block decoded for one stream is a hit for the next, what is kept stays within
//! the budget however many streams fill at once, the memory counted returns to zero when the streams
//! close, and every order is still delivered bit for bit as the source rows, with a cache much
//! smaller than the dataset.

mod common;

use std::path::Path;
use std::sync::Arc;

use gpufeed::format::Dataset;
use gpufeed::metrics::Metrics;
use gpufeed::pack::CodecChoice;
use gpufeed::pipeline::block_cache::BlockCache;
use gpufeed::pipeline::cpu::working_set_bytes;
use gpufeed::pipeline::{Assembler, StreamLimits, StreamPlan, StreamRequest};
use gpufeed_client::protocol::{Shuffle, StreamSpec};
use gpufeed_client::DType;

/// Tokens per row.
const ROW: usize = 256;

/// An LZ4 dataset of `samples` rows of `ROW` int32 tokens, 4 KiB blocks (4 rows each), and its
/// source bytes.
fn tokens(dir: &Path, name: &str, samples: usize, per_shard: u64) -> (Arc<Dataset>, Vec<u8>) {
    // Compressible, and different in every row.
    let source = common::i32_bytes(samples * ROW, |i| ((i / 3) % 500 + i / ROW) as i32);
    let fields = vec![common::field(
        "tokens",
        DType::I32,
        &[ROW as u64],
        source.clone(),
    )];
    let mut options = common::options(name, 4096, Some(per_shard));
    options.codec = CodecChoice::Lz4;
    let out = dir.join(name);
    common::pack_fields(&out, &fields, &options);
    (Arc::new(Dataset::open(&out).unwrap()), source)
}

fn plan(dataset: &Arc<Dataset>, name: &str, shuffle: Shuffle, batch: u32) -> Arc<StreamPlan> {
    let mut spec = StreamSpec::new(name.to_string(), batch);
    spec.shuffle = shuffle;
    spec.seed = 11;
    Arc::new(
        StreamPlan::new(
            Arc::clone(dataset),
            &StreamRequest::from(&spec),
            &StreamLimits::node_defaults(),
        )
        .unwrap(),
    )
}

/// Fills every step of `plan` and checks each batch against the source rows in the plan's order.
fn fill_and_check(assembler: &mut Assembler, plan: &StreamPlan, source: &[u8]) {
    let row_bytes = ROW * 4;
    let mut slot = vec![0u8; plan.slot_bytes];
    for step in 0..plan.steps {
        assembler.fill(step, &mut slot).unwrap();
        for (row, sample) in plan.batch_samples(step).enumerate() {
            let sample = sample as usize;
            assert_eq!(
                &slot[row * row_bytes..(row + 1) * row_bytes],
                &source[sample * row_bytes..(sample + 1) * row_bytes],
                "step {step} row {row} (sample {sample})"
            );
        }
    }
}

fn blocks(dataset: &Dataset) -> u64 {
    dataset
        .shards
        .iter()
        .map(|s| s.metadata.field_blocks(0).len() as u64)
        .sum()
}

#[test]
fn two_streams_of_a_dataset_decode_each_block_once() {
    let dir = tempfile::tempdir().unwrap();
    let (dataset, source) = tokens(dir.path(), "shared", 2048, 512);
    let metrics = Arc::new(Metrics::new());
    let cache = BlockCache::new(64 << 20, Arc::clone(&metrics));
    let limits = StreamLimits::node_defaults();
    let first = plan(&dataset, "shared", Shuffle::None, 64);
    let mut a =
        Assembler::with_cache(Arc::clone(&first), &limits, Arc::clone(&metrics), &cache).unwrap();
    fill_and_check(&mut a, &first, &source);
    let decoded_by_a = metrics.block_cache().snapshot();
    assert_eq!(decoded_by_a.misses, blocks(&dataset));
    // The second stream, in another order, while the first is still open: every block is a hit.
    let second = plan(&dataset, "shared", Shuffle::Full, 64);
    let mut b =
        Assembler::with_cache(Arc::clone(&second), &limits, Arc::clone(&metrics), &cache).unwrap();
    fill_and_check(&mut b, &second, &source);
    let both = metrics.block_cache().snapshot();
    assert_eq!(both.misses, decoded_by_a.misses, "no block decoded twice");
    assert!(both.hits >= decoded_by_a.hits + 2048 / 4, "{both:?}");
    assert_eq!(both.kept_bytes, 2048 * ROW as u64 * 4);
    drop((a, b));
    let closed = metrics.block_cache().snapshot();
    assert_eq!((closed.held_bytes, closed.kept_bytes), (0, 0));
}

#[test]
fn every_order_is_bit_exact_with_a_cache_much_smaller_than_the_dataset() {
    let dir = tempfile::tempdir().unwrap();
    // 16 MiB decoded in 4096 blocks over 4 shards; a batch of 4096 fully shuffled rows reads more
    // blocks than the stream's working set, so it is filled in several parts.
    let samples = 16384;
    let (dataset, source) = tokens(dir.path(), "small", samples, 4096);
    let budget = 1 << 20;
    for shuffle in [Shuffle::None, Shuffle::Window(2), Shuffle::Full] {
        let metrics = Arc::new(Metrics::new());
        let cache = BlockCache::new(budget, Arc::clone(&metrics));
        let plan = plan(&dataset, "small", shuffle, 4096);
        assert!(
            (plan.dataset.manifest.sample_count as usize * ROW * 4) as u64
                > 2 * working_set_bytes(&plan)
        );
        let mut assembler = Assembler::with_cache(
            Arc::clone(&plan),
            &StreamLimits::node_defaults(),
            Arc::clone(&metrics),
            &cache,
        )
        .unwrap();
        fill_and_check(&mut assembler, &plan, &source);
        let counts = metrics.block_cache().snapshot();
        assert!(counts.kept_bytes <= budget, "{shuffle:?}: {counts:?}");
        assert!(counts.evictions > 0, "{shuffle:?}: {counts:?}");
    }
}

#[test]
fn what_is_kept_stays_within_the_budget_while_many_streams_fill() {
    let dir = tempfile::tempdir().unwrap();
    let (one, source_one) = tokens(dir.path(), "one", 4096, 1024);
    let (two, source_two) = tokens(dir.path(), "two", 4096, 2048);
    let metrics = Arc::new(Metrics::new());
    let budget = 512 << 10;
    let cache = BlockCache::new(budget, Arc::clone(&metrics));
    let streams = 6u64;
    std::thread::scope(|scope| {
        for stream in 0..streams as usize {
            let (dataset, source, name) = if stream % 3 == 2 {
                (&two, &source_two, "two")
            } else {
                (&one, &source_one, "one")
            };
            let cache = &cache;
            let metrics = &metrics;
            scope.spawn(move || {
                let shuffle = [Shuffle::Full, Shuffle::Window(2), Shuffle::None][stream % 3];
                let plan = plan(dataset, name, shuffle, 128);
                let working_set = working_set_bytes(&plan);
                let mut assembler = Assembler::with_cache(
                    Arc::clone(&plan),
                    &StreamLimits::node_defaults(),
                    Arc::clone(metrics),
                    cache,
                )
                .unwrap();
                let row_bytes = ROW * 4;
                let mut slot = vec![0u8; plan.slot_bytes];
                for step in 0..plan.steps {
                    assembler.fill(step, &mut slot).unwrap();
                    for (row, sample) in plan.batch_samples(step).enumerate() {
                        let sample = sample as usize;
                        assert_eq!(
                            &slot[row * row_bytes..(row + 1) * row_bytes],
                            &source[sample * row_bytes..(sample + 1) * row_bytes]
                        );
                    }
                    let counts = metrics.block_cache().snapshot();
                    assert!(cache.kept_bytes() <= budget, "{counts:?}");
                    // Beyond what the cache keeps, each stream holds at most its working set.
                    assert!(
                        counts.held_bytes <= budget + streams * working_set,
                        "{counts:?}"
                    );
                }
            });
        }
    });
    let closed = metrics.block_cache().snapshot();
    assert_eq!((closed.held_bytes, closed.kept_bytes), (0, 0), "{closed:?}");
    assert!(closed.hits > 0 && closed.evictions > 0, "{closed:?}");
}
