//! Packing on several threads writes the same bytes as on one.
//!
//! The packer cuts a pack into steps (runs of whole blocks of one field of one shard, at most
//! 4 MiB or 256 blocks), which its threads read, encode and write at once, several shards at a
//! time, each step placed after the one before it in its shard. These tests pin what must not depend on that
//! schedule: every file of the dataset byte for byte (block order, offsets, padding, checksums,
//! metadata, manifest), for every codec, with fields whose samples are smaller than a block, not a
//! divisor of it, and larger than one, shards holding several steps of a field, and more threads
//! than shards; and that progress only rises, to the total, and a cancel stops the pack cleanly.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use common::{field, noise, options, staging_dirs};
use gpufeed::format::Dataset;
use gpufeed::input::FieldSource;
use gpufeed::pack::{self, CodecChoice, PackError, PackObserver, ShuffleChoice};
use gpufeed::tools::{self, NoProgress};
use gpufeed_client::DType;

/// Samples of the dataset: three shards of [`SAMPLES_PER_SHARD`], the last one short.
const SAMPLES: u64 = 1500;
const SAMPLES_PER_SHARD: u64 = 600;
/// Elements of the wide field's samples: 8194 bytes of i16, more than a 4 KiB block, so that its
/// samples span blocks, and 600 of them (4.7 MiB) take five steps per shard.
const WIDE: u64 = 4097;

/// Fields of several shapes: 3-byte samples (not a divisor of a block), f32 rows, compressible
/// token-like i32s, and wide i16 rows with a few values (LZ4 shrinks them, more so shuffled).
fn fields() -> Vec<FieldSource> {
    let n = SAMPLES as usize;
    let small: Vec<u8> = noise(n * 3, 1).iter().map(|b| b % 4).collect();
    let rows = noise(n * 5 * 4, 2);
    let tokens: Vec<u8> = (0..n)
        .map(|i| ((i * 7919) % 50_000) as i32 / 13)
        .flat_map(i32::to_le_bytes)
        .collect();
    let wide: Vec<u8> = noise(n * WIDE as usize, 3)
        .iter()
        .flat_map(|b| i16::from(b % 16).to_le_bytes())
        .collect();
    vec![
        field("small", DType::U8, &[3], small),
        field("rows", DType::F32, &[5], rows),
        field("tokens", DType::I32, &[], tokens),
        field("wide", DType::I16, &[WIDE], wide),
    ]
}

/// Every file of the dataset at `dir`, by name, in name order.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let bytes = std::fs::read(dir.join(&name)).unwrap();
            (name, bytes)
        })
        .collect()
}

#[test]
fn the_bytes_written_do_not_depend_on_the_thread_count() {
    let fields = fields();
    let tmp = tempfile::tempdir().unwrap();
    for (codec, shuffle) in [
        (CodecChoice::Auto, ShuffleChoice::Auto),
        (CodecChoice::Lz4, ShuffleChoice::Auto),
        (CodecChoice::Lz4, ShuffleChoice::Off),
        (CodecChoice::Raw, ShuffleChoice::Auto),
    ] {
        let mut reference = None;
        for threads in [1, 3, 16] {
            let parent = tmp.path().join(format!("{codec:?}-{shuffle:?}-{threads}"));
            std::fs::create_dir(&parent).unwrap();
            // One dataset name for all, since the manifest holds it.
            let out = parent.join("ds");
            let mut options = options("ds", 4096, Some(SAMPLES_PER_SHARD));
            options.codec = codec;
            options.shuffle = shuffle;
            options.threads = threads;
            let summary = pack::pack(&out, &fields, &options, &pack::Quiet).unwrap();
            assert_eq!(summary.shard_count, 3);
            let written = files(&out);
            assert_eq!(written.len(), 4, "three shards and the manifest");
            match &reference {
                None => {
                    let report = tools::verify(&out, &NoProgress).unwrap();
                    assert!(report.problems.is_empty(), "{:?}", report.problems);
                    assert_eq!(report.shards_ok, 3);
                    // The fields read back as given.
                    let dataset = Dataset::open(&out).unwrap();
                    for source in &fields {
                        let npy = parent.join(format!("{}.npy", source.name));
                        tools::unpack(&dataset, &source.name, &npy, None, &NoProgress).unwrap();
                        let back = common::read_npy(&npy);
                        let mut expected = Vec::new();
                        source.copy_samples(0, SAMPLES, &mut expected).unwrap();
                        assert!(
                            back.bytes == expected,
                            "field {} reads back other bytes ({codec:?}, {shuffle:?})",
                            source.name
                        );
                    }
                    reference = Some(written);
                }
                Some(reference) => {
                    for ((name, bytes), (reference_name, reference_bytes)) in
                        written.iter().zip(reference)
                    {
                        assert_eq!(name, reference_name);
                        assert!(
                            bytes == reference_bytes,
                            "{name} differs on {threads} threads from 1 thread ({codec:?}, {shuffle:?})"
                        );
                    }
                }
            }
        }
    }
}

/// Records what a pack reports, and cancels once `cancel_after` raw bytes are done.
struct Recorder {
    total: AtomicU64,
    seen: Mutex<Vec<u64>>,
    cancel_after: u64,
}

impl PackObserver for Recorder {
    fn started(&self, raw_bytes_total: u64) {
        self.total.store(raw_bytes_total, Ordering::SeqCst);
    }
    fn progress(&self, raw_bytes_done: u64) {
        self.seen.lock().unwrap().push(raw_bytes_done);
    }
    fn cancelled(&self) -> bool {
        self.seen
            .lock()
            .unwrap()
            .last()
            .is_some_and(|&done| done >= self.cancel_after)
    }
}

#[test]
fn progress_rises_to_the_total_on_many_threads() {
    let fields = fields();
    let tmp = tempfile::tempdir().unwrap();
    let mut options = options("ds", 4096, Some(SAMPLES_PER_SHARD));
    options.codec = CodecChoice::Raw;
    options.threads = 8;
    let recorder = Recorder {
        total: AtomicU64::new(0),
        seen: Mutex::new(Vec::new()),
        cancel_after: u64::MAX,
    };
    let summary = pack::pack(&tmp.path().join("ds"), &fields, &options, &recorder).unwrap();
    let seen = recorder.seen.into_inner().unwrap();
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "progress went back: {seen:?}"
    );
    assert_eq!(seen.last(), Some(&summary.raw_bytes));
    assert_eq!(recorder.total.load(Ordering::SeqCst), summary.raw_bytes);
}

#[test]
fn a_cancel_on_many_threads_stops_the_pack_and_leaves_nothing() {
    let fields = fields();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds");
    let mut options = options("ds", 4096, Some(SAMPLES_PER_SHARD));
    options.codec = CodecChoice::Raw;
    options.threads = 8;
    let recorder = Recorder {
        total: AtomicU64::new(0),
        seen: Mutex::new(Vec::new()),
        cancel_after: 1,
    };
    let error = pack::pack(&out, &fields, &options, &recorder).unwrap_err();
    assert!(matches!(error, PackError::Cancelled), "{error}");
    assert!(!out.exists(), "a cancelled pack installed its dataset");
    assert_eq!(
        staging_dirs(tmp.path(), "ds"),
        Vec::<std::path::PathBuf>::new()
    );
    let seen = recorder.seen.into_inner().unwrap();
    let total: u64 = fields.iter().map(FieldSource::total_bytes).sum();
    assert!(
        *seen.last().unwrap() < total,
        "the pack ran to the end: {seen:?}"
    );
}
