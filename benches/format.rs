//! CPU throughput of the shard format: block encoding, whole packs, block decoding and dtype
//! conversion, on incompressible fp16 (`synth::embedding_f16`) and compressible int32
//! (`synth::zipf_tokens_i32`) data.
//!
//! Run with `cargo bench --bench format`. Every benchmark processes one whole input (32 MiB of raw
//! bytes cut into 64 KiB blocks) per iteration and reports throughput in raw bytes per second
//! (decimal GB/s). Results are recorded in `docs/benchmarks/`.
//!
//! Besides our own paths, two "peer" references are measured on the same blocks in the same run, so
//! that the overhead of our decode path is visible: plain `lz4_flex::block::decompress_into` of the
//! LZ4 blocks (a raw block is copied) without checksum or unshuffle, and a plain memcpy of the raw
//! bytes. `checksum` (xxh3-64 of the stored bytes alone) shows how much of the decode time the
//! checksum takes.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, SamplingMode, Throughput};
use gpufeed::decode::{self, BlockRef};
use gpufeed::format::{checksum, BlockEntry, Codec, Filter, BLOCK_BYTES_DEFAULT};
use gpufeed::input::FieldSource;
use gpufeed::pack::{
    self, encode_block, CodecChoice, EncodedBlock, OnExisting, PackOptions, Quiet, ShuffleChoice,
};
use gpufeed::synth;
use gpufeed_client::DType;

/// Raw bytes of each input.
const INPUT_BYTES: usize = 32 << 20;
/// Block size: the format's default (64 KiB).
const BLOCK: usize = BLOCK_BYTES_DEFAULT as usize;

/// One data kind with its blocks encoded once, up front, with the packer's auto policies.
struct Input {
    /// Short name used in benchmark ids.
    name: &'static str,
    dtype: DType,
    /// Elements per sample for the pack benchmark (samples of 2 KiB or 8 KiB fill 64 KiB blocks).
    sample_elements: u64,
    raw: Vec<u8>,
    encoded: Vec<EncodedBlock>,
    entries: Vec<BlockEntry>,
}

impl Input {
    fn new(name: &'static str, dtype: DType, sample_elements: u64, raw: Vec<u8>) -> Input {
        assert_eq!(raw.len(), INPUT_BYTES);
        let width = dtype.size_bytes();
        let encoded: Vec<EncodedBlock> = raw
            .chunks(BLOCK)
            .map(|b| encode_block(b, width, CodecChoice::Auto, ShuffleChoice::Auto))
            .collect();
        let mut raw_offset = 0u64;
        let entries = raw
            .chunks(BLOCK)
            .zip(&encoded)
            .map(|(r, e)| {
                let entry = BlockEntry {
                    stored_offset: 0,
                    stored_bytes: e.stored.len() as u32,
                    raw_bytes: r.len() as u32,
                    codec: e.codec,
                    filter: e.filter,
                    field: 0,
                    raw_offset,
                    first_sample: 0,
                    checksum: checksum(&e.stored),
                };
                raw_offset += r.len() as u64;
                entry
            })
            .collect();
        let input = Input {
            name,
            dtype,
            sample_elements,
            raw,
            encoded,
            entries,
        };
        let stored: usize = input.encoded.iter().map(|e| e.stored.len()).sum();
        let count = |codec, filter| {
            input
                .encoded
                .iter()
                .filter(|e| e.codec == codec && e.filter == filter)
                .count()
        };
        eprintln!(
            "input {name}: {} raw bytes in {} blocks of {BLOCK}; stored {stored} bytes, ratio {:.3}; \
             blocks raw {}, lz4 {}, lz4+shuffle {}",
            INPUT_BYTES,
            input.encoded.len(),
            INPUT_BYTES as f64 / stored as f64,
            count(Codec::Raw, Filter::None),
            count(Codec::Lz4, Filter::None),
            count(Codec::Lz4, Filter::ByteShuffle),
        );
        input
    }
}

fn at() -> BlockRef {
    BlockRef {
        shard: PathBuf::from("bench.gfs"),
        field: "f".into(),
        block: 0,
        stored_offset: 0,
    }
}

/// Where pack benchmarks write: tmpfs when there is one, so the figure is CPU, not disk.
fn scratch_dir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        tempfile::tempdir_in(shm)
    } else {
        tempfile::tempdir()
    }
    .expect("temporary directory");
    eprintln!("pack benchmarks write to {}", dir.path().display());
    dir
}

fn configure<'a>(
    c: &'a mut Criterion,
    group: &str,
) -> criterion::BenchmarkGroup<'a, criterion::measurement::WallTime> {
    let mut g = c.benchmark_group(group);
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sampling_mode(SamplingMode::Flat)
        .throughput(Throughput::BytesDecimal(INPUT_BYTES as u64));
    g
}

fn benches(c: &mut Criterion) {
    let inputs = [
        Input::new(
            "fp16",
            DType::F16,
            1024,
            synth::embedding_f16(INPUT_BYTES / 2, 1),
        ),
        Input::new(
            "int32",
            DType::I32,
            2048,
            synth::zipf_tokens_i32(INPUT_BYTES / 4, 2),
        ),
    ];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    eprintln!("pack threads: {threads}");
    let tmp = scratch_dir();

    // Encoding one block at a time on one thread, auto codec and auto shuffle (both compressions are
    // tried for a multi-byte dtype, as the packer does).
    let mut g = configure(c, "encode_block");
    for input in &inputs {
        let width = input.dtype.size_bytes();
        g.bench_function(input.name, |b| {
            b.iter(|| {
                for block in input.raw.chunks(BLOCK) {
                    black_box(encode_block(
                        black_box(block),
                        width,
                        CodecChoice::Auto,
                        ShuffleChoice::Auto,
                    ));
                }
            })
        });
    }
    g.finish();

    // A whole pack (one shard, manifest, fsyncs) from an in-memory field.
    let mut g = configure(c, "pack");
    for input in &inputs {
        let field = FieldSource::from_bytes(
            input.name,
            input.dtype,
            vec![input.sample_elements],
            input.raw.clone(),
        )
        .expect("whole samples");
        let options = PackOptions {
            name: "bench".into(),
            block_bytes: BLOCK_BYTES_DEFAULT,
            samples_per_shard: None,
            codec: CodecChoice::Auto,
            shuffle: ShuffleChoice::Auto,
            on_existing: OnExisting::Refuse,
            threads,
        };
        let out = tmp.path().join(input.name);
        g.bench_function(input.name, |b| {
            b.iter_batched(
                || {
                    let _ = std::fs::remove_dir_all(&out);
                },
                |()| {
                    pack::pack(&out, std::slice::from_ref(&field), &options, &Quiet).expect("pack")
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();

    // The CPU decode path over pre-encoded blocks: checksum, LZ4, unshuffle, into one output buffer.
    let mut g = configure(c, "decode_block");
    for input in &inputs {
        let width = input.dtype.size_bytes();
        let mut out = vec![0u8; INPUT_BYTES];
        let mut scratch = Vec::new();
        g.bench_function(input.name, |b| {
            b.iter(|| {
                for ((e, entry), dst) in input
                    .encoded
                    .iter()
                    .zip(&input.entries)
                    .zip(out.chunks_mut(BLOCK))
                {
                    decode::decode_block(&e.stored, entry, width, &mut scratch, dst, at)
                        .expect("decodes");
                }
                black_box(&out);
            })
        });
        assert!(out == input.raw, "decode_block output differs");
    }
    g.finish();

    // Peer: lz4_flex alone on the LZ4 blocks (raw blocks copied), no checksum, no unshuffle. For
    // shuffled blocks the output is still shuffled; only the time matters here.
    let mut g = configure(c, "peer_lz4_decompress");
    for input in &inputs {
        let mut out = vec![0u8; INPUT_BYTES];
        g.bench_function(input.name, |b| {
            b.iter(|| {
                for (e, dst) in input.encoded.iter().zip(out.chunks_mut(BLOCK)) {
                    match e.codec {
                        Codec::Raw => dst.copy_from_slice(&e.stored),
                        Codec::Lz4 => {
                            let n = lz4_flex::block::decompress_into(&e.stored, dst)
                                .expect("decompresses");
                            assert_eq!(n, dst.len());
                        }
                    }
                }
                black_box(&out);
            })
        });
    }
    g.finish();

    // The checksum alone (xxh3-64 over the stored bytes of every block).
    let mut g = configure(c, "checksum");
    for input in &inputs {
        g.bench_function(input.name, |b| {
            b.iter(|| {
                let mut x = 0u64;
                for e in &input.encoded {
                    x ^= checksum(black_box(&e.stored));
                }
                black_box(x)
            })
        });
    }
    g.finish();

    // Peer: a plain memcpy of the raw bytes.
    let mut g = configure(c, "peer_memcpy");
    for input in &inputs {
        let mut out = vec![0u8; INPUT_BYTES];
        g.bench_function(input.name, |b| {
            b.iter(|| {
                out.copy_from_slice(black_box(&input.raw));
                black_box(&out);
            })
        });
    }
    g.finish();

    // dtype conversion of the fp16 input's bytes (read as f16, then as bf16) to f32. Throughput is
    // counted in input bytes (the output is twice as large).
    let mut g = configure(c, "convert");
    let src = &inputs[0].raw;
    let mut dst = vec![0u8; INPUT_BYTES * 2];
    for (name, from) in [("f16_to_f32", DType::F16), ("bf16_to_f32", DType::BF16)] {
        g.bench_function(name, |b| {
            b.iter(|| {
                decode::convert(from, black_box(src), DType::F32, &mut dst).expect("supported");
                black_box(&dst);
            })
        });
    }
    g.finish();
}

criterion_group!(format_benches, benches);
criterion_main!(format_benches);
