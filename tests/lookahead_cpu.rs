//! The CPU backend's look-ahead (`pipeline::lookahead`).
//!
//! A full shuffle of an LZ4 dataset four times larger than the decoded-block cache decoded every
//! 64 KiB block about six times an epoch, because a cached block was kept whole to serve the one of
//! its eight rows needed next, and was mostly evicted before that. The look-ahead takes the rows of
//! the next batches out of each block when it is decoded. These tests hold it to the rules of the
//! path without it: every order, batch size, world size, start cursor and field is delivered bit for
//! bit as without the look-ahead (and as the source rows); a corrupt block fails the stream at the
//! same step with the same error, or is replaced in the same rows; an arena too small to keep
//! everything only costs decodes; and in a shuffled order fewer bytes are decoded than without it.

mod common;

use std::path::Path;
use std::sync::Arc;

use gpufeed::format::Dataset;
use gpufeed::metrics::{BlockCacheCounts, Metrics};
use gpufeed::pack::CodecChoice;
use gpufeed::pipeline::block_cache::BlockCache;
use gpufeed::pipeline::cpu::lookahead_bytes;
use gpufeed::pipeline::{Assembler, StreamLimits, StreamPlan, StreamRequest};
use gpufeed_client::protocol::{FieldRequest, Shuffle, StreamSpec};
use gpufeed_client::{CorruptPolicy, DType};

/// Tokens per row.
const ROW: usize = 256;
/// Rows of the dataset.
const SAMPLES: usize = 4096;

/// An LZ4 dataset of `SAMPLES` rows: `tok`, `ROW` int32 tokens (4 KiB blocks of 4 rows), and
/// `emb`, 8 fp16 values a row (delivered as f32 when asked), in shards of 1024 rows.
fn dataset(dir: &Path, name: &str) -> Arc<Dataset> {
    let tok = common::i32_bytes(SAMPLES * ROW, |i| ((i / 3) % 500 + i / ROW) as i32);
    let emb: Vec<u8> = (0..SAMPLES * 8)
        .flat_map(|i| half::f16::from_f32((i % 97) as f32 * 0.25).to_le_bytes())
        .collect();
    let fields = vec![
        common::field("tok", DType::I32, &[ROW as u64], tok),
        common::field("emb", DType::F16, &[8], emb),
    ];
    let mut options = common::options(name, 4096, Some(1024));
    options.codec = CodecChoice::Lz4;
    let out = dir.join(name);
    common::pack_fields(&out, &fields, &options);
    Arc::new(Dataset::open(&out).unwrap())
}

struct Stream {
    shuffle: Shuffle,
    batch: u32,
    world_size: u32,
    rank: u32,
    start_cursor: u64,
    on_corrupt: CorruptPolicy,
    emb_as_f32: bool,
}

impl Stream {
    fn new(shuffle: Shuffle, batch: u32) -> Stream {
        Stream {
            shuffle,
            batch,
            world_size: 1,
            rank: 0,
            start_cursor: 0,
            on_corrupt: CorruptPolicy::Fail,
            emb_as_f32: false,
        }
    }

    fn plan(&self, dataset: &Arc<Dataset>, name: &str) -> Arc<StreamPlan> {
        let mut spec = StreamSpec::new(name.to_string(), self.batch);
        spec.shuffle = self.shuffle;
        spec.seed = 5;
        spec.world_size = self.world_size;
        spec.rank = self.rank;
        spec.start_cursor = self.start_cursor;
        spec.on_corrupt = self.on_corrupt;
        spec.fields = vec![
            FieldRequest {
                name: "tok".into(),
                dtype: None,
            },
            FieldRequest {
                name: "emb".into(),
                dtype: self.emb_as_f32.then_some(DType::F32),
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
}

/// What a stream delivered: every batch's slot and replaced count, or the first error's message
/// and its step.
struct Delivered {
    batches: Vec<(Vec<u8>, u32)>,
    error: Option<(u64, String)>,
    counts: BlockCacheCounts,
}

/// Fills every step of `plan` with a cache of `cache_bytes` and a look-ahead of at most
/// `lookahead_max` bytes.
fn deliver(plan: &Arc<StreamPlan>, cache_bytes: u64, lookahead_max: u64) -> Delivered {
    let metrics = Arc::new(Metrics::new());
    let cache = BlockCache::new(cache_bytes, Arc::clone(&metrics));
    let limits = StreamLimits {
        lookahead_bytes_max: lookahead_max,
        ..StreamLimits::node_defaults()
    };
    let mut assembler =
        Assembler::with_cache(Arc::clone(plan), &limits, Arc::clone(&metrics), &cache).unwrap();
    let mut batches = Vec::new();
    let mut error = None;
    for step in 0..plan.steps {
        let mut slot = vec![0xAAu8; plan.slot_bytes];
        match assembler.fill(step, &mut slot) {
            Ok(report) => batches.push((slot, report.replaced)),
            Err(e) => {
                error = Some((step, e.to_string()));
                break;
            }
        }
    }
    drop(assembler);
    Delivered {
        batches,
        error,
        counts: metrics.block_cache().snapshot(),
    }
}

/// Checks `tok` of each batch against the source rows in the plan's order.
fn check_tokens(plan: &StreamPlan, batches: &[(Vec<u8>, u32)]) {
    let row_bytes = ROW * 4;
    for (step, (slot, _)) in batches.iter().enumerate() {
        for (row, sample) in plan.batch_samples(step as u64).enumerate() {
            let sample = sample as usize;
            let expected = common::i32_bytes(ROW, |i| {
                (((sample * ROW + i) / 3) % 500 + (sample * ROW + i) / ROW) as i32
            });
            assert_eq!(
                &slot[row * row_bytes..(row + 1) * row_bytes],
                &expected[..],
                "step {step} row {row} (sample {sample})"
            );
        }
    }
}

#[test]
fn every_order_is_delivered_as_without_the_lookahead() {
    let dir = tempfile::tempdir().unwrap();
    let dataset = dataset(dir.path(), "ahead");
    // 4 MiB of tokens decoded, a cache of a quarter of it; a look-ahead of 1 MiB (plenty for 256
    // rows ahead) and of 40 KiB (about 40 rows: full most of the time).
    let cache = 1 << 20;
    let mut streams = Vec::new();
    for shuffle in [Shuffle::None, Shuffle::Window(2), Shuffle::Full] {
        for batch in [1, 7, 64, 1000] {
            streams.push(Stream::new(shuffle, batch));
        }
        let mut ranked = Stream::new(shuffle, 48);
        ranked.world_size = 3;
        ranked.rank = 2;
        ranked.emb_as_f32 = true;
        streams.push(ranked);
        let mut resumed = Stream::new(shuffle, 100);
        resumed.start_cursor = 1700;
        streams.push(resumed);
    }
    for stream in &streams {
        let plan = stream.plan(&dataset, "ahead");
        let without = deliver(&plan, cache, 0);
        assert!(without.error.is_none(), "{:?}", without.error);
        check_tokens(&plan, &without.batches);
        assert_eq!(without.counts.lookahead_rows_kept, 0);
        for lookahead in [1 << 20, 40 << 10] {
            let with = deliver(&plan, cache, lookahead);
            let what = format!(
                "{:?} batch {} rank {}/{} from {}, look-ahead {lookahead}",
                stream.shuffle, stream.batch, stream.rank, stream.world_size, stream.start_cursor
            );
            assert!(with.error.is_none(), "{what}: {:?}", with.error);
            assert_eq!(with.batches.len(), without.batches.len(), "{what}");
            for (step, (a, b)) in with.batches.iter().zip(&without.batches).enumerate() {
                assert!(a == b, "{what}: step {step} differs");
            }
            if !matches!(stream.shuffle, Shuffle::None)
                && lookahead_bytes(&plan, &limits(lookahead)) > 0
            {
                assert!(
                    with.counts.lookahead_rows_served > 0,
                    "{what}: {:?}",
                    with.counts
                );
            }
            // Every row delivered was needed once: the same figure either way.
            assert_eq!(
                with.counts.needed_raw_bytes,
                without.counts.needed_raw_bytes
            );
        }
    }
}

fn limits(lookahead_bytes_max: u64) -> StreamLimits {
    StreamLimits {
        lookahead_bytes_max,
        ..StreamLimits::node_defaults()
    }
}

#[test]
fn a_shuffled_epoch_decodes_fewer_bytes_with_the_lookahead() {
    let dir = tempfile::tempdir().unwrap();
    let dataset = dataset(dir.path(), "fewer");
    let plan = Stream::new(Shuffle::Full, 256).plan(&dataset, "fewer");
    // A cache of a quarter of the tokens against a look-ahead of the same quarter.
    let without = deliver(&plan, 1 << 20, 0);
    let with = deliver(&plan, 1 << 20, 1 << 20);
    let (a, b) = (
        with.counts.decode_amplification().unwrap(),
        without.counts.decode_amplification().unwrap(),
    );
    assert!(
        a < b,
        "decoded per byte needed: {a} with the look-ahead, {b} without"
    );
    assert!(a >= 1.0, "every block decoded at least once: {a}");
    // Rows kept ahead may give way to rows needed sooner: served at most as many as kept.
    let counts = with.counts;
    assert!(
        counts.lookahead_rows_served > 0
            && counts.lookahead_rows_served <= counts.lookahead_rows_kept,
        "{counts:?}"
    );
}

/// Flips a byte of block 3 of field `tok` in shard 1 (rows 1036..1040).
fn corrupt_a_block(dataset: &Dataset) {
    let shard = &dataset.shards[1];
    let field = dataset.field_index("tok").unwrap();
    let block = shard.metadata.field_blocks(field)[3];
    let mut bytes = std::fs::read(&shard.path).unwrap();
    bytes[block.stored_offset as usize + 5] ^= 0x40;
    std::fs::write(&shard.path, bytes).unwrap();
}

#[test]
fn a_corrupt_block_fails_or_is_replaced_as_without_the_lookahead() {
    let dir = tempfile::tempdir().unwrap();
    let clean = dataset(dir.path(), "corrupt");
    corrupt_a_block(&clean);
    let dataset = Arc::new(Dataset::open(&dir.path().join("corrupt")).unwrap());
    for shuffle in [Shuffle::None, Shuffle::Window(2), Shuffle::Full] {
        for policy in [CorruptPolicy::Fail, CorruptPolicy::Replace] {
            let mut stream = Stream::new(shuffle, 64);
            stream.on_corrupt = policy;
            let plan = stream.plan(&dataset, "corrupt");
            let without = deliver(&plan, 1 << 20, 0);
            let with = deliver(&plan, 1 << 20, 1 << 20);
            let what = format!("{shuffle:?} {policy:?}");
            match policy {
                CorruptPolicy::Fail => {
                    let (step, message) = with.error.clone().expect("the stream fails");
                    assert_eq!(Some((step, message.clone())), without.error, "{what}");
                    assert!(
                        message.contains("field 'tok'") && message.contains("block 3"),
                        "{what}: {message}"
                    );
                }
                CorruptPolicy::Replace => {
                    assert!(with.error.is_none() && without.error.is_none(), "{what}");
                    let replaced: u32 = with.batches.iter().map(|(_, r)| r).sum();
                    assert_eq!(replaced, 4, "{what}: the block's four rows");
                    for (step, (a, b)) in with.batches.iter().zip(&without.batches).enumerate() {
                        assert!(a == b, "{what}: step {step} differs");
                    }
                }
            }
        }
    }
}

/// Value of the `/metrics` line `name` (a series without labels).
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("{name} missing from /metrics"))
        .trim()
        .parse::<f64>()
        .unwrap() as u64
}

/// Through the daemon: a fully shuffled stream of the LZ4 dataset reserves its look-ahead in
/// `--slot-memory-max` when the budget holds it (its rows then show in `/metrics`), and opens
/// without one when the budget holds only its slots and working set; either way every batch is the
/// in-process assembler's without a look-ahead, and the decode counters say what was decoded.
#[test]
fn the_daemon_reserves_the_lookahead_or_opens_the_stream_without_it() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let dataset = dataset(&data, "ahead");
    let stream = Stream::new(Shuffle::Full, 64);
    let plan = stream.plan(&dataset, "ahead");
    let expected = deliver(&plan, 1 << 20, 0);
    let tok = &plan.fields[0];
    // Slots (64 of 66 KiB) and the 4 MiB working set fit 10 MiB; with the look-ahead of every row
    // of the epoch (4 MiB) they do not.
    for (budget, with_lookahead) in [("1G", true), ("10M", false)] {
        let daemon = common::daemon::start(
            common::daemon::serve_command(&data, &["--slot-memory-max", budget]),
            &root.path().join("logs"),
        );
        let mut spec = StreamSpec::new("ahead", 64);
        spec.shuffle = Shuffle::Full;
        spec.seed = 5;
        spec.fields = vec![
            FieldRequest {
                name: "tok".into(),
                dtype: None,
            },
            FieldRequest {
                name: "emb".into(),
                dtype: None,
            },
        ];
        let mut consumer = gpufeed_client::consumer::Client::connect(data.join("api-test.sock"))
            .unwrap()
            .open_stream(spec)
            .unwrap();
        let mut steps = 0;
        for batch in consumer.by_ref() {
            let batch = batch.unwrap();
            let (slot, _) = &expected.batches[batch.step() as usize];
            let bytes = tok.sample_bytes_out * 64;
            assert!(
                batch.field("tok").unwrap().host_bytes().unwrap()
                    == &slot[tok.offset..tok.offset + bytes],
                "budget {budget}: step {} differs",
                batch.step()
            );
            steps += 1;
        }
        assert_eq!(steps, plan.steps, "budget {budget}");
        drop(consumer);
        let metrics = common::http::get(daemon.address(), "/metrics", None);
        let text = String::from_utf8_lossy(&metrics.body);
        let served = metric(&text, "gpufeed_host_lookahead_rows_served_total");
        assert_eq!(
            served > 0,
            with_lookahead,
            "budget {budget}: {served} rows served ahead"
        );
        let needed = metric(&text, "gpufeed_host_needed_raw_bytes_total");
        assert_eq!(
            needed,
            SAMPLES as u64 * (ROW as u64 * 4 + 16),
            "budget {budget}"
        );
        assert!(metric(&text, "gpufeed_host_decoded_bytes_total") >= needed);
    }
}
