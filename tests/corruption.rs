//! Damaged datasets on disk: a clean three-shard, two-field dataset (LZ4 and raw blocks) is copied and
//! damaged one way at a time (flipped bits in the header, the field table, the block table and a block
//! payload; truncated and missing shards; an unsupported version; a bad manifest; an LZ4 payload replaced
//! by garbage under consistent checksums). `gpufeed verify` (and `gpufeed unpack`) must exit non-zero
//! without panicking and name the exact shard, field and block; `Dataset::open` must refuse damaged
//! metadata. Library-level sweeps flip every bit of a shard's metadata prefix and every byte of an LZ4
//! payload and require an error, never a panic.

mod common;

use std::fs;
use std::os::unix::fs::FileExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use common::{assert_fails, assert_line_with, assert_succeeds, field, gpufeed, stderr, stdout};
use gpufeed::decode::{decode_block, BlockRef};
use gpufeed::format::{
    checksum, BlockEntry, Codec, Dataset, FormatError, BLOCK_ENTRY_BYTES, FIELD_ENTRY_BYTES,
    HEADER_BYTES, MANIFEST_FILE_NAME,
};
use gpufeed::pack::{CodecChoice, ShuffleChoice};
use gpufeed::tools::{self, NoProgress};
use gpufeed_client::DType;

const SAMPLES: u64 = 600;
const SAMPLES_PER_SHARD: u64 = 256;
const TOKENS: usize = 0;
const EMB: usize = 1;

/// Packs the reference dataset into `dir`: 600 samples in shards of 256, 256 and 88; field `tokens`
/// (i32 x 16, small ids: LZ4 blocks) and field `emb` (f16 x 32, random bits: raw blocks), 4 KiB blocks.
fn build(dir: &Path) -> PathBuf {
    let tokens = common::i32_bytes((SAMPLES * 16) as usize, |i| (i as i32 * 7919) % 300);
    let emb = common::noise((SAMPLES * 32 * 2) as usize, 1);
    let out = dir.join("clean");
    common::pack_fields(
        &out,
        &[
            field("tokens", DType::I32, &[16], tokens),
            field("emb", DType::F16, &[32], emb),
        ],
        &common::options("clean", 4096, Some(SAMPLES_PER_SHARD)),
    );
    let dataset = Dataset::open(&out).unwrap();
    assert_eq!(dataset.shards.len(), 3);
    for shard in &dataset.shards {
        let tokens = shard.metadata.field_blocks(TOKENS);
        let emb = shard.metadata.field_blocks(EMB);
        assert!(tokens.len() >= 2 && emb.len() >= 2);
        assert!(tokens.iter().all(|b| b.codec == Codec::Lz4), "{tokens:?}");
        assert!(emb.iter().all(|b| b.codec == Codec::Raw), "{emb:?}");
    }
    out
}

/// Copies a dataset directory (flat: manifest and shard files) to `dir/name`.
fn copy_dataset(src: &Path, dir: &Path, name: &str) -> PathBuf {
    let dst = dir.join(name);
    fs::create_dir(&dst).unwrap();
    for entry in fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
    dst
}

fn shard_file(index: usize) -> String {
    format!("shard-{index:06}.gfs")
}

fn shard_path(dataset: &Path, index: usize) -> PathBuf {
    dataset.join(shard_file(index))
}

fn flip_bit(path: &Path, byte: u64, bit: u8) {
    let file = fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(path)
        .unwrap();
    let mut value = [0u8];
    file.read_exact_at(&mut value, byte).unwrap();
    value[0] ^= 1 << bit;
    file.write_all_at(&value, byte).unwrap();
}

fn truncate_by(path: &Path, bytes: u64) -> u64 {
    let file = fs::OpenOptions::new().write(true).open(path).unwrap();
    let len = file.metadata().unwrap().len();
    file.set_len(len - bytes).unwrap();
    len
}

fn verify_cli(dataset: &Path) -> std::process::Output {
    gpufeed(["verify".as_ref(), dataset.as_os_str(), "--quiet".as_ref()])
}

/// Runs `gpufeed verify`, asserts it fails cleanly, and returns the problem lines it printed
/// (`missing: `, `unreadable: ` or `corrupt: `).
fn verify_problems(dataset: &Path) -> Vec<String> {
    let output = verify_cli(dataset);
    let err = assert_fails(&output);
    err.lines()
        .filter(|l| {
            ["missing: ", "unreadable: ", "corrupt: "]
                .iter()
                .any(|k| l.starts_with(k))
        })
        .map(str::to_string)
        .collect()
}

/// Asserts `Dataset::open` fails with an error for `shard` matching `check`.
fn assert_open_fails(dataset: &Path, shard: &Path, check: impl Fn(&FormatError) -> bool) {
    let error = Dataset::open(dataset).expect_err("damaged dataset must not open");
    assert!(check(&error), "unexpected error: {error:?}");
    let text = error.to_string();
    assert!(
        text.starts_with(&shard.display().to_string()),
        "error does not name {}: {text}",
        shard.display()
    );
}

/// (field index, field name, shard index, block index within the field) of the blocks damaged below.
const DAMAGED_BLOCKS: [(usize, &str, usize, usize); 3] = [
    (EMB, "emb", 1, 2),
    (TOKENS, "tokens", 2, 1),
    (TOKENS, "tokens", 0, 3),
];

fn block_entry(dataset: &Path, field: usize, shard: usize, block: usize) -> BlockEntry {
    Dataset::open(dataset).unwrap().shards[shard]
        .metadata
        .field_blocks(field)[block]
}

#[test]
fn clean_dataset_verifies_and_unpacks() {
    let tmp = tempfile::tempdir().unwrap();
    let clean = build(tmp.path());
    let output = verify_cli(&clean);
    let out = assert_succeeds(&output);
    assert!(!stderr(&output).contains("corrupt"), "{}", stderr(&output));
    let blocks: usize = Dataset::open(&clean)
        .unwrap()
        .shards
        .iter()
        .map(|s| s.metadata.blocks.len())
        .sum();
    assert_line_with(
        &out,
        &[&format!(
            "3/3 shards readable, {blocks} blocks intact, 0 problems"
        )],
    );
    let npy = tmp.path().join("tokens.npy");
    assert_succeeds(&gpufeed([
        "unpack".as_ref(),
        clean.as_os_str(),
        "--field".as_ref(),
        "tokens".as_ref(),
        "--out".as_ref(),
        npy.as_os_str(),
        "--quiet".as_ref(),
    ]));
    assert_eq!(common::read_npy(&npy).shape, vec![SAMPLES, 16]);
}

#[test]
fn flipped_header_bit_names_the_shard_and_header_checksum() {
    let tmp = tempfile::tempdir().unwrap();
    let clean = build(tmp.path());
    // Bytes 16.. hold first_sample, sample_count, counts, block_bytes and payload_offset.
    for (byte, bit) in [(20u64, 3u8), (37, 0), (60, 7)] {
        let damaged = copy_dataset(&clean, tmp.path(), &format!("header-{byte}"));
        let shard = shard_path(&damaged, 1);
        flip_bit(&shard, byte, bit);
        let problems = verify_problems(&damaged);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_line_with(&problems[0], &[&shard_file(1), "header checksum mismatch"]);
        assert_open_fails(&damaged, &shard, |e| {
            matches!(e, FormatError::HeaderChecksum { .. })
        });
    }
}

#[test]
fn flipped_table_bits_name_the_shard_and_table_checksum() {
    let tmp = tempfile::tempdir().unwrap();
    let clean = build(tmp.path());
    let fields_end = (HEADER_BYTES + 2 * FIELD_ENTRY_BYTES) as u64;
    let places = [
        ("field-name", HEADER_BYTES as u64 + 2, 1u8),
        (
            "field-shape",
            (HEADER_BYTES + FIELD_ENTRY_BYTES + 80) as u64,
            0,
        ),
        (
            "block-stored-bytes",
            fields_end + 3 * BLOCK_ENTRY_BYTES as u64 + 8,
            2,
        ),
        (
            "block-checksum",
            fields_end + 5 * BLOCK_ENTRY_BYTES as u64 + 40,
            6,
        ),
    ];
    for (what, byte, bit) in places {
        let damaged = copy_dataset(&clean, tmp.path(), what);
        let shard = shard_path(&damaged, 1);
        flip_bit(&shard, byte, bit);
        let problems = verify_problems(&damaged);
        assert_eq!(problems.len(), 1, "{what}: {problems:?}");
        assert_line_with(&problems[0], &[&shard_file(1), "table checksum mismatch"]);
        assert_open_fails(&damaged, &shard, |e| {
            matches!(e, FormatError::TableChecksum { .. })
        });
    }
}

#[test]
fn flipped_payload_bit_names_shard_field_and_block() {
    let tmp = tempfile::tempdir().unwrap();
    let clean = build(tmp.path());
    for (field_index, name, shard_index, block) in DAMAGED_BLOCKS {
        let damaged = copy_dataset(&clean, tmp.path(), &format!("{name}-{shard_index}-{block}"));
        let entry = block_entry(&damaged, field_index, shard_index, block);
        let shard = shard_path(&damaged, shard_index);
        flip_bit(
            &shard,
            entry.stored_offset + entry.stored_bytes as u64 / 2,
            4,
        );
        let place = [
            format!("shard {}", shard.display()),
            format!("field '{name}'"),
            format!("block {block} (payload at byte {})", entry.stored_offset),
        ];
        let problems = verify_problems(&damaged);
        assert_eq!(problems.len(), 1, "{problems:?}");
        let mut needles: Vec<&str> = place.iter().map(String::as_str).collect();
        needles.push("checksum mismatch");
        assert_line_with(&problems[0], &needles);

        // Metadata is intact, so the dataset opens; decoding the field fails at that block.
        Dataset::open(&damaged).expect("payload damage does not affect metadata");
        let npy = tmp.path().join(format!("{name}-{shard_index}.npy"));
        let output = gpufeed([
            "unpack".as_ref(),
            damaged.as_os_str(),
            "--field".as_ref(),
            name.as_ref(),
            "--out".as_ref(),
            npy.as_os_str(),
            "--quiet".as_ref(),
        ]);
        let err = assert_fails(&output);
        assert_line_with(&err, &needles);
    }
}

#[test]
fn truncated_shard_names_the_shard_and_its_length() {
    let tmp = tempfile::tempdir().unwrap();
    let clean = build(tmp.path());
    for cut in [4096u64, 1] {
        let damaged = copy_dataset(&clean, tmp.path(), &format!("cut-{cut}"));
        let shard = shard_path(&damaged, 1);
        let len = truncate_by(&shard, cut);
        let problems = verify_problems(&damaged);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_line_with(
            &problems[0],
            &[
                &shard_file(1),
                &format!("file is {} bytes but its metadata says {len}", len - cut),
            ],
        );
        assert_open_fails(&damaged, &shard, |e| {
            matches!(e, FormatError::Length { expected_bytes, actual_bytes, .. }
                if *expected_bytes == len && *actual_bytes == len - cut)
        });
    }
}

#[test]
fn missing_shard_is_reported_as_missing() {
    let tmp = tempfile::tempdir().unwrap();
    let clean = build(tmp.path());
    let damaged = copy_dataset(&clean, tmp.path(), "missing");
    let shard = shard_path(&damaged, 2);
    fs::remove_file(&shard).unwrap();
    let output = verify_cli(&damaged);
    assert_fails(&output);
    assert_line_with(&stdout(&output), &["2/3 shards readable"]);
    let problems = verify_problems(&damaged);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_line_with(&problems[0], &[&shard_file(2), "shard file is missing"]);
    // A missing file is not damage: the line says which it is.
    assert!(problems[0].starts_with("missing: "), "{problems:?}");
    assert_open_fails(&damaged, &shard, |e| {
        matches!(e, FormatError::MissingShard { .. })
    });
    // Nor is a file that cannot be read (here a directory where the shard should be).
    fs::create_dir(&shard).unwrap();
    let problems = verify_problems(&damaged);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].starts_with("unreadable: "), "{problems:?}");
}

#[test]
fn unsupported_version_is_named_not_reported_as_corruption() {
    let tmp = tempfile::tempdir().unwrap();
    let clean = build(tmp.path());
    let damaged = copy_dataset(&clean, tmp.path(), "version");
    let shard = shard_path(&damaged, 0);
    // Only the version changes: the header checksum is now wrong too, but the version is read first.
    let file = fs::OpenOptions::new().write(true).open(&shard).unwrap();
    file.write_all_at(&3u32.to_le_bytes(), 8).unwrap();
    let problems = verify_problems(&damaged);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_line_with(
        &problems[0],
        &[&shard_file(0), "shard format version 3 is not supported"],
    );
    assert_open_fails(&damaged, &shard, |e| {
        matches!(
            e,
            FormatError::UnsupportedVersion {
                found: 3,
                supported: 2,
                ..
            }
        )
    });
}

#[test]
fn bad_manifest_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let clean = build(tmp.path());
    let text = fs::read_to_string(clean.join(MANIFEST_FILE_NAME)).unwrap();
    let sample_count = format!("\"sample_count\": {SAMPLES},");
    assert!(text.contains(&sample_count), "{text}");
    // The checksum as FORMAT.md spells it (lowercase), then in capitals: one checksum, one spelling.
    let key = "\"table_checksum\": \"";
    let at = text.find(key).expect("a table checksum") + key.len();
    let lowercase = &text[at..at + 16];
    assert!(
        lowercase.bytes().any(|b| b.is_ascii_lowercase()),
        "{lowercase}"
    );
    let edits = [
        (
            "uppercase-checksum",
            text.replacen(lowercase, &lowercase.to_ascii_uppercase(), 1),
            "is not 16 lowercase hex digits",
        ),
        (
            "count",
            text.replacen(
                &sample_count,
                &format!("\"sample_count\": {},", SAMPLES + 1),
                1,
            ),
            "\"sample_count\" is 601 but the shards hold 600",
        ),
        (
            "unknown-key",
            text.replacen('{', "{\n  \"compression\": \"zstd\",", 1),
            "unknown field `compression`",
        ),
        (
            "not-json",
            text[..text.len() / 2].to_string(),
            "invalid manifest",
        ),
    ];
    for (what, manifest, reason) in edits {
        let damaged = copy_dataset(&clean, tmp.path(), what);
        let manifest_path = damaged.join(MANIFEST_FILE_NAME);
        fs::write(&manifest_path, manifest).unwrap();
        let err = assert_fails(&verify_cli(&damaged));
        assert_line_with(
            &err,
            &[
                &format!("{}: invalid manifest", manifest_path.display()),
                reason,
            ],
        );
        let error = Dataset::open(&damaged).unwrap_err();
        assert!(
            matches!(&error, FormatError::Manifest { path, .. } if *path == manifest_path),
            "{what}: {error:?}"
        );
    }
}

/// Rewrites shard `index`'s tables with `edit`, then recomputes the table checksum and the manifest's
/// copy of it, so that the metadata is consistent again.
fn rewrite_tables(dataset: &Path, index: usize, edit: impl FnOnce(&mut [u8], usize)) {
    let path = shard_path(dataset, index);
    let mut bytes = fs::read(&path).unwrap();
    let field_count = u32::from_le_bytes(bytes[32..36].try_into().unwrap()) as usize;
    let block_count = u32::from_le_bytes(bytes[36..40].try_into().unwrap()) as usize;
    let fields_end = HEADER_BYTES + field_count * FIELD_ENTRY_BYTES;
    let blocks_end = fields_end + block_count * BLOCK_ENTRY_BYTES;
    edit(&mut bytes, fields_end);
    let table_checksum = checksum(&bytes[HEADER_BYTES..blocks_end]);
    bytes[blocks_end..blocks_end + 8].copy_from_slice(&table_checksum.to_le_bytes());
    fs::write(&path, &bytes).unwrap();

    let manifest_path = dataset.join(MANIFEST_FILE_NAME);
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&fs::read(&manifest_path).unwrap()).unwrap();
    manifest["shards"][index]["table_checksum"] = format!("{table_checksum:016x}").into();
    fs::write(
        &manifest_path,
        serde_json::to_vec_pretty(&manifest).unwrap(),
    )
    .unwrap();
}

#[test]
fn garbage_lz4_payload_under_consistent_checksums_is_a_decode_error() {
    let tmp = tempfile::tempdir().unwrap();
    let clean = build(tmp.path());
    let (shard_index, block) = (0usize, 1usize);
    for what in ["ones", "zeros", "noise"] {
        let damaged = copy_dataset(&clean, tmp.path(), what);
        let dataset = Dataset::open(&damaged).unwrap();
        let metadata = &dataset.shards[shard_index].metadata;
        let entry = metadata.field_blocks(TOKENS)[block];
        assert_eq!(entry.codec, Codec::Lz4);
        let table_index = metadata.fields[TOKENS].first_block as usize + block;
        let len = entry.stored_bytes as usize;
        let garbage = match what {
            "ones" => vec![0xff; len],
            "zeros" => vec![0; len],
            _ => common::noise(len, 99),
        };
        let shard = shard_path(&damaged, shard_index);
        let file = fs::OpenOptions::new().write(true).open(&shard).unwrap();
        file.write_all_at(&garbage, entry.stored_offset).unwrap();
        drop(file);
        rewrite_tables(&damaged, shard_index, |bytes, fields_end| {
            let at = fields_end + table_index * BLOCK_ENTRY_BYTES + 40;
            bytes[at..at + 8].copy_from_slice(&checksum(&garbage).to_le_bytes());
        });
        // The metadata is consistent again: only decoding can find the damage.
        Dataset::open(&damaged).expect("checksums were recomputed");
        let problems = verify_problems(&damaged);
        assert_eq!(problems.len(), 1, "{what}: {problems:?}");
        let place = format!("field 'tokens', block {block} (payload at byte");
        assert_line_with(&problems[0], &[&shard.display().to_string(), &place]);
        assert!(
            problems[0].contains("corrupt LZ4 block") || problems[0].contains("decoded to"),
            "{what}: {}",
            problems[0]
        );
        assert!(
            !problems[0].contains("checksum mismatch"),
            "{}",
            problems[0]
        );
    }
}

/// A one-shard dataset of a single `u16` field in several blocks; returns its directory.
fn build_small(dir: &Path, codec: CodecChoice) -> PathBuf {
    let values: Vec<u8> = (0..6000u16).flat_map(|v| (v / 5).to_le_bytes()).collect();
    let out = dir.join("small");
    let mut options = common::options("small", 4096, None);
    options.codec = codec;
    options.shuffle = ShuffleChoice::On;
    common::pack_fields(&out, &[field("v", DType::U16, &[3], values)], &options);
    out
}

#[test]
fn every_metadata_bit_flip_makes_open_fail() {
    let tmp = tempfile::tempdir().unwrap();
    let dataset = build_small(tmp.path(), CodecChoice::Lz4);
    let shard = shard_path(&dataset, 0);
    let metadata = Dataset::open(&dataset).unwrap().shards[0].metadata.clone();
    assert!(metadata.blocks.len() >= 3);
    let tables_end = HEADER_BYTES
        + metadata.fields.len() * FIELD_ENTRY_BYTES
        + metadata.blocks.len() * BLOCK_ENTRY_BYTES
        + 8;
    let payload_offset = metadata.header.payload_offset as usize;
    // Every bit of the header, tables and table checksum; a sample of the zero padding after them.
    let bits: Vec<usize> = (0..tables_end * 8)
        .chain((tables_end * 8..payload_offset * 8).step_by(97))
        .collect();
    assert!(bits.len() > tables_end * 8, "{}", bits.len());
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&shard)
        .unwrap();
    let mut original = vec![0u8; payload_offset];
    file.read_exact_at(&mut original, 0).unwrap();
    for bit in bits {
        let byte = bit / 8;
        file.write_all_at(&[original[byte] ^ (1 << (bit % 8))], byte as u64)
            .unwrap();
        let result = catch_unwind(AssertUnwindSafe(|| Dataset::open(&dataset)));
        let error = match result {
            Ok(Ok(_)) => panic!("bit {bit} (byte {byte}) flipped, yet the dataset opened"),
            Ok(Err(error)) => error,
            Err(_) => panic!("Dataset::open panicked with bit {bit} (byte {byte}) flipped"),
        };
        assert!(
            error.to_string().contains(&shard_file(0)),
            "bit {bit}: error does not name the shard: {error}"
        );
        file.write_all_at(&original[byte..byte + 1], byte as u64)
            .unwrap();
    }
    Dataset::open(&dataset).expect("restored");
}

#[test]
fn every_lz4_payload_byte_flip_is_reported_and_never_panics_the_decoder() {
    let tmp = tempfile::tempdir().unwrap();
    let dataset = build_small(tmp.path(), CodecChoice::Lz4);
    let shard = shard_path(&dataset, 0);
    let metadata = Dataset::open(&dataset).unwrap().shards[0].metadata.clone();
    let (block_index, entry) = metadata
        .blocks
        .iter()
        .enumerate()
        .min_by_key(|(_, b)| b.stored_bytes)
        .map(|(i, b)| (i, *b))
        .unwrap();
    assert_eq!(entry.codec, Codec::Lz4);
    assert!(entry.stored_bytes < entry.raw_bytes / 2, "{entry:?}");
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&shard)
        .unwrap();
    let mut stored = vec![0u8; entry.stored_bytes as usize];
    file.read_exact_at(&mut stored, entry.stored_offset)
        .unwrap();
    let place = format!("field 'v', block {block_index} (payload at byte");
    let at = || BlockRef {
        shard: shard.clone(),
        field: "v".into(),
        block: block_index as u32,
        stored_offset: entry.stored_offset,
    };
    let (mut scratch, mut out) = (Vec::new(), vec![0u8; entry.raw_bytes as usize]);
    for offset in 0..stored.len() {
        let offset_in_file = entry.stored_offset + offset as u64;
        file.write_all_at(&[stored[offset] ^ 0xff], offset_in_file)
            .unwrap();
        let report = tools::verify(&dataset, &NoProgress).unwrap();
        assert_eq!(
            report.problems.len(),
            1,
            "byte {offset}: {:?}",
            report.problems
        );
        assert_line_with(&report.problems[0], &[&place, "checksum mismatch"]);
        file.write_all_at(&stored[offset..offset + 1], offset_in_file)
            .unwrap();

        // The same damage with a matching checksum reaches the LZ4 decoder and the unshuffle: it may
        // decode to other bytes or fail, but must not panic or write past the block.
        for mask in [0x01u8, 0x80, 0xff] {
            let mut damaged = stored.clone();
            damaged[offset] ^= mask;
            let forged = BlockEntry {
                checksum: checksum(&damaged),
                ..entry
            };
            let result = catch_unwind(AssertUnwindSafe(|| {
                decode_block(&damaged, &forged, 2, &mut scratch, &mut out, at)
            }));
            assert!(
                result.is_ok(),
                "decoder panicked: byte {offset} ^ {mask:#04x}"
            );
            if let Ok(Err(error)) = result {
                assert!(error.to_string().contains(&place), "{error}");
            }
        }
    }
    let report = tools::verify(&dataset, &NoProgress).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

/// Regression: a block entry whose `stored_offset + stored_bytes` overflowed u64 panicked in debug
/// builds and wrapped in release builds, where the shard was then accepted with a block far outside the
/// file. The extent is now computed with a checked addition and LZ4 payload sizes are bounded.
#[test]
fn forged_payload_extent_near_u64_max_is_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let dataset = build_small(tmp.path(), CodecChoice::Lz4);
    let shard = shard_path(&dataset, 0);
    assert_eq!(
        Dataset::open(&dataset).unwrap().shards[0]
            .metadata
            .blocks
            .len(),
        3
    );
    // Block 1 claims 8 KiB at the last aligned offset below 2^64; its end wraps around to 4096, which
    // block 2 starts after. The checksums are made consistent, so only the extent check can catch it.
    rewrite_tables(&dataset, 0, |bytes, fields_end| {
        let at = fields_end + BLOCK_ENTRY_BYTES;
        bytes[at..at + 8].copy_from_slice(&(u64::MAX - 4095).to_le_bytes());
        bytes[at + 8..at + 12].copy_from_slice(&8192u32.to_le_bytes());
    });
    let result = catch_unwind(AssertUnwindSafe(|| Dataset::open(&dataset)));
    let error = result
        .expect("Dataset::open must not panic")
        .expect_err("a payload extent past the end of the file must be refused");
    assert!(
        error.to_string().starts_with(&shard.display().to_string()),
        "{error}"
    );
    let problems = verify_problems(&dataset);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_line_with(&problems[0], &[&shard_file(0)]);
}
