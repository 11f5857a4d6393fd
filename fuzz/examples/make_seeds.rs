//! Writes seed corpora for the fuzz targets from real packer output.
//!
//! `cargo run --release --example make_seeds -- corpus` (from `fuzz/`) fills
//! `corpus/{shard_metadata,block_decode,manifest,npy_header}/`. It packs small synthetic datasets
//! (fp16 embeddings, zipf int32 tokens, a u8 field) with `gpufeed::pack::pack` into a temporary
//! directory, then cuts inputs in each target's input layout (see the targets' doc comments).

use std::fs;
use std::path::{Path, PathBuf};

use gpufeed::format::{Dataset, BLOCK_BYTES_DEFAULT, BLOCK_BYTES_MIN};
use gpufeed::input::{npy, FieldSource};
use gpufeed::pack::{self, CodecChoice, OnExisting, PackOptions, Quiet, ShuffleChoice};
use gpufeed::synth;
use gpufeed_client::DType;
// Linked for its sanitizer-coverage callbacks: `smoke.sh` builds this example with the fuzz
// targets' instrumentation, which every instrumented crate calls into.
use libfuzzer_sys as _;

fn main() {
    let out = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "corpus".into()));
    let dirs = ["shard_metadata", "block_decode", "manifest", "npy_header"];
    for d in dirs {
        fs::create_dir_all(out.join(d)).unwrap();
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut counts = [0usize; 4];

    let configs: [(u64, u32, u64, CodecChoice, ShuffleChoice); 4] = [
        (
            64,
            BLOCK_BYTES_MIN,
            16,
            CodecChoice::Auto,
            ShuffleChoice::Auto,
        ),
        (3, BLOCK_BYTES_MIN, 3, CodecChoice::Lz4, ShuffleChoice::On),
        (
            200,
            BLOCK_BYTES_DEFAULT,
            100,
            CodecChoice::Auto,
            ShuffleChoice::Auto,
        ),
        (5, BLOCK_BYTES_MIN, 2, CodecChoice::Raw, ShuffleChoice::Off),
    ];
    for (n, &(samples, block_bytes, per_shard, codec, shuffle)) in configs.iter().enumerate() {
        let fields = vec![
            FieldSource::from_bytes(
                "embedding",
                DType::F16,
                vec![64],
                synth::embedding_f16(samples as usize * 64, n as u64),
            )
            .unwrap(),
            FieldSource::from_bytes(
                "tokens",
                DType::I32,
                vec![32],
                synth::zipf_tokens_i32(samples as usize * 32, n as u64 + 10),
            )
            .unwrap(),
            FieldSource::from_bytes(
                "label",
                DType::U8,
                vec![],
                (0..samples).map(|i| (i % 7) as u8).collect(),
            )
            .unwrap(),
        ];
        let dir = tmp.path().join(format!("ds{n}"));
        let options = PackOptions {
            name: format!("seed{n}"),
            block_bytes,
            samples_per_shard: Some(per_shard),
            codec,
            shuffle,
            on_existing: OnExisting::Refuse,
            threads: 1,
        };
        pack::pack(&dir, &fields, &options, &Quiet).unwrap();
        let manifest = fs::read(dir.join("manifest.json")).unwrap();
        write(
            &out,
            "manifest",
            &format!("ds{n}.json"),
            &manifest,
            &mut counts[2],
        );

        let dataset = Dataset::open(&dir).unwrap();
        for (s, shard) in dataset.shards.iter().enumerate().take(2) {
            let file = fs::read(&shard.path).unwrap();
            let meta = &shard.metadata;
            let prefix = &file[..meta.header.payload_offset as usize];
            // Mode 0: the bytes are the file (whole when small, else the first 8 KiB).
            let whole = if file.len() <= 64 << 10 {
                &file[..]
            } else {
                &file[..8192]
            };
            write(
                &out,
                "shard_metadata",
                &format!("ds{n}-s{s}-file"),
                &[&[0u8][..], whole].concat(),
                &mut counts[0],
            );
            // Modes 1 and 3: explicit file length, metadata prefix only (checksums fixed in mode 3).
            for flags in [1u8, 3] {
                let input = [&[flags][..], &(file.len() as u64).to_le_bytes(), prefix].concat();
                write(
                    &out,
                    "shard_metadata",
                    &format!("ds{n}-s{s}-meta{flags}"),
                    &input,
                    &mut counts[0],
                );
            }

            for (f, field) in meta.fields.iter().enumerate() {
                let width = field.dtype.size_bytes();
                let width_bits = (width.trailing_zeros() as u8) << 1;
                for (b, block) in meta.field_blocks(f).iter().enumerate().take(3) {
                    let stored =
                        &file[block.stored_offset as usize..][..block.stored_bytes as usize];
                    let (codec_bit, filter_bit) = (
                        if block.codec == gpufeed::format::Codec::Lz4 {
                            8
                        } else {
                            0
                        },
                        if block.filter == gpufeed::format::Filter::ByteShuffle {
                            0x20
                        } else {
                            0
                        },
                    );
                    let v = (block.raw_bytes as usize / width - 1) as u32;
                    let input = [
                        &[width_bits | codec_bit | filter_bit][..],
                        &v.to_le_bytes(),
                        stored,
                    ]
                    .concat();
                    write(
                        &out,
                        "block_decode",
                        &format!("ds{n}-s{s}-{}-b{b}-stored", field.name),
                        &input,
                        &mut counts[1],
                    );
                    // Round-trip mode: the decoded raw bytes, auto policies.
                    let mut raw = vec![0; block.raw_bytes as usize];
                    gpufeed::decode::decode_block(
                        stored,
                        block,
                        width,
                        &mut Vec::new(),
                        &mut raw,
                        || -> gpufeed::decode::BlockRef { unreachable!() },
                    )
                    .unwrap();
                    let input = [&[1 | width_bits][..], &0u32.to_le_bytes(), &raw[..]].concat();
                    write(
                        &out,
                        "block_decode",
                        &format!("ds{n}-s{s}-{}-b{b}-raw", field.name),
                        &input,
                        &mut counts[1],
                    );
                }
            }
        }
    }

    // npy headers: what our writer emits, plus hand-written v2/v3 and Python-2 style headers.
    for (i, (dtype, shape)) in [
        (DType::F16, vec![10, 64]),
        (DType::I32, vec![3]),
        (DType::U8, vec![]),
        (DType::F64, vec![2, 3, 4, 5]),
        (DType::I64, vec![0, 7]),
    ]
    .into_iter()
    .enumerate()
    {
        let path = tmp.path().join(format!("a{i}.npy"));
        let mut w = npy::write_npy(&path, dtype, &shape).unwrap();
        let bytes = shape.iter().product::<u64>() as usize * dtype.size_bytes();
        w.write_all(&vec![0u8; bytes]).unwrap();
        w.finish().unwrap();
        let data = fs::read(&path).unwrap();
        write(
            &out,
            "npy_header",
            &format!("writer{i}"),
            &data[..data.len().min(256)],
            &mut counts[3],
        );
    }
    for (i, (major, dict)) in [
        (
            2u8,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
        ),
        (
            3,
            "{'descr': '<u2', 'fortran_order': False, 'shape': (4,), 'ñ': None}",
        ),
        (
            1,
            "{u'descr': u'<i8', u'fortran_order': False, u'shape': (3L, 2L)}",
        ),
        (
            1,
            "{\"descr\": \"|u1\", \"fortran_order\": True, \"shape\": [1, [2]], }",
        ),
        (
            1,
            "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': ()}",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let mut data = b"\x93NUMPY".to_vec();
        data.extend_from_slice(&[major, 0]);
        let len = dict.len() + 1;
        if major == 1 {
            data.extend_from_slice(&(len as u16).to_le_bytes());
        } else {
            data.extend_from_slice(&(len as u32).to_le_bytes());
        }
        data.extend_from_slice(dict.as_bytes());
        data.push(b'\n');
        write(
            &out,
            "npy_header",
            &format!("hand{i}"),
            &data,
            &mut counts[3],
        );
    }
    for (d, c) in dirs.iter().zip(counts) {
        println!("{}: {c} seeds", out.join(d).display());
    }
}

fn write(out: &Path, target: &str, name: &str, bytes: &[u8], count: &mut usize) {
    fs::write(out.join(target).join(name), bytes).unwrap();
    *count += 1;
}
