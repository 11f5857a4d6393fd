//! Variable-length fields (format version 2): packed from offsets and values, read back exactly;
//! malformed offsets refused naming the file, field and sample; a version 1 dataset still written
//! and served as version 1.

mod common;

use std::path::Path;
use std::sync::Arc;

use gpufeed::format::{encode_shard_metadata, Dataset, Manifest};
use gpufeed::input::FieldSource;
use gpufeed::metrics::Metrics;
use gpufeed::pack::CodecChoice;
use gpufeed::pipeline::{Assembler, StreamLimits, StreamPlan, StreamRequest};
use gpufeed_client::protocol::StreamSpec;
use gpufeed_client::DType;

/// Documents of 0 to `max` int32 tokens (deterministic lengths and values), as (ends, values).
fn documents(samples: usize, max: u64) -> (Vec<u64>, Vec<i32>) {
    let mut ends = Vec::with_capacity(samples);
    let mut values = Vec::new();
    for sample in 0..samples {
        // Lengths spread over 0..=max, with some empty samples.
        let length = (sample as u64 * 7919 + 13) % (max + 1);
        for i in 0..length {
            values.push((sample as i32) * 1000 + i as i32);
        }
        ends.push(values.len() as u64);
    }
    (ends, values)
}

fn sample_values(ends: &[u64], values: &[i32], sample: usize) -> Vec<i32> {
    let start = if sample == 0 { 0 } else { ends[sample - 1] } as usize;
    values[start..ends[sample] as usize].to_vec()
}

/// Packs `samples` documents (field `tokens`, variable-length int32) beside a fixed field `id`
/// (the sample's index as u32).
fn pack_documents(
    dir: &Path,
    name: &str,
    samples: usize,
    max: u64,
    codec: CodecChoice,
) -> (Arc<Dataset>, Vec<u64>, Vec<i32>) {
    let (ends, values) = documents(samples, max);
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let tokens = FieldSource::variable(
        common::field("tokens", DType::I32, &[], bytes),
        ends.clone(),
    )
    .unwrap();
    let ids: Vec<u8> = (0..samples as u32).flat_map(|v| v.to_le_bytes()).collect();
    let id = common::field("id", DType::U32, &[], ids);
    let mut options = common::options(name, 4096, Some(300));
    options.codec = codec;
    let out = dir.join(name);
    common::pack_fields(&out, &[tokens, id], &options);
    (Arc::new(Dataset::open(&out).unwrap()), ends, values)
}

#[test]
fn a_variable_length_field_round_trips_through_the_format() {
    let dir = tempfile::tempdir().unwrap();
    let (dataset, ends, values) = pack_documents(dir.path(), "docs", 1000, 40, CodecChoice::Lz4);
    let manifest = &dataset.manifest;
    assert_eq!(manifest.format_version(), 2);
    let field = &manifest.fields[0];
    assert!(field.is_variable());
    let longest = (0..ends.len())
        .map(|s| sample_values(&ends, &values, s).len() as u64)
        .max()
        .unwrap();
    assert_eq!(field.length_max, Some(longest));
    assert!(!manifest.fields[1].is_variable());
    let text = std::fs::read_to_string(dir.path().join("docs/manifest.json")).unwrap();
    assert!(text.contains("\"format_version\": 2"), "{text}");
    assert!(text.contains("\"variable_length\": true"), "{text}");
    // The offsets as read back, shard by shard, are the input's, relative to each shard.
    let read = gpufeed::pipeline::varlen::read_offsets(&dataset, 0).unwrap();
    assert_eq!(read.len(), 4);
    for (shard, shard_ends) in dataset.shards.iter().zip(&read) {
        let first = shard.metadata.header.first_sample as usize;
        let base = if first == 0 { 0 } else { ends[first - 1] };
        let expected: Vec<u64> = ends[first..first + shard_ends.len()]
            .iter()
            .map(|e| e - base)
            .collect();
        assert_eq!(shard_ends, &expected);
        assert_eq!(shard.metadata.header.version, 2);
    }
}

/// Rewrites the offsets of shard 1 (raw blocks) with `edit`, fixing every checksum so that only the
/// offsets are wrong.
fn corrupt_offsets(dir: &Path, edit: impl Fn(&mut [u64])) {
    let dataset = Dataset::open(dir).unwrap();
    let shard = &dataset.shards[1];
    let mut file = std::fs::read(&shard.path).unwrap();
    let mut metadata = shard.metadata.clone();
    let offset_blocks = metadata.fields[0].offset_blocks.unwrap() as usize;
    let first = metadata.fields[0].first_block as usize;
    let mut ends: Vec<u64> = Vec::new();
    for block in &metadata.blocks[first..first + offset_blocks] {
        let at = block.stored_offset as usize;
        ends.extend(
            file[at..at + block.raw_bytes as usize]
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap())),
        );
    }
    edit(&mut ends);
    let mut next = 0usize;
    for block in &mut metadata.blocks[first..first + offset_blocks] {
        let at = block.stored_offset as usize;
        let count = block.raw_bytes as usize / 8;
        for (i, end) in ends[next..next + count].iter().enumerate() {
            file[at + 8 * i..at + 8 * i + 8].copy_from_slice(&end.to_le_bytes());
        }
        next += count;
        block.checksum = gpufeed::format::checksum(&file[at..at + block.raw_bytes as usize]);
    }
    let header = &metadata.header;
    let encoded = encode_shard_metadata(
        header.first_sample,
        header.sample_count,
        header.block_bytes,
        &metadata.fields,
        &metadata.blocks,
    );
    file[..encoded.len()].copy_from_slice(&encoded);
    std::fs::write(&shard.path, &file).unwrap();
    let reparsed =
        gpufeed::format::parse_shard_metadata(&shard.path, &file, file.len() as u64).unwrap();
    let mut manifest: Manifest = dataset.manifest.clone();
    manifest.shards[1].table_checksum = reparsed.table_checksum;
    std::fs::write(dir.join("manifest.json"), manifest.to_json()).unwrap();
}

#[test]
fn malformed_offsets_are_refused_naming_file_field_and_sample() {
    let dir = tempfile::tempdir().unwrap();
    // Shard 1 holds samples 300..600.
    type Edit = fn(&mut [u64]);
    let cases: [(&str, Edit, &str, &str); 2] = [
        (
            "back",
            |ends| ends[5] = ends[3].saturating_sub(1),
            "sample 305",
            "go back",
        ),
        (
            "over",
            |ends| *ends.last_mut().unwrap() += 1000,
            "sample 599",
            "out of range",
        ),
    ];
    for (name, edit, sample, expected) in cases {
        pack_documents(dir.path(), name, 1000, 40, CodecChoice::Raw);
        let path = dir.path().join(name);
        corrupt_offsets(&path, edit);
        Dataset::open(&path).expect("the tables are sound");
        // `gpufeed verify` finds it, though every checksum matches.
        let report = gpufeed::tools::verify(&path, &gpufeed::tools::NoProgress).unwrap();
        assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
        assert!(
            report.problems[0].contains(sample) && report.problems[0].contains(expected),
            "{:?}",
            report.problems
        );
    }
    // A sound dataset verifies clean, offsets included.
    let report = gpufeed::tools::verify(&dir.path().join("back"), &gpufeed::tools::NoProgress);
    assert!(!report.unwrap().problems.is_empty());
    pack_documents(dir.path(), "sound", 1000, 40, CodecChoice::Lz4);
    let report = gpufeed::tools::verify(&dir.path().join("sound"), &gpufeed::tools::NoProgress);
    assert!(report.unwrap().problems.is_empty());
}

#[test]
fn a_dataset_without_variable_length_fields_is_still_version_1() {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u8> = (0..100u32).flat_map(|v| v.to_le_bytes()).collect();
    let out = dir.path().join("fixed");
    common::pack_fields(
        &out,
        &[common::field("id", DType::U32, &[], ids.clone())],
        &common::options("fixed", 4096, None),
    );
    let text = std::fs::read_to_string(out.join("manifest.json")).unwrap();
    assert!(text.contains("\"format_version\": 1"), "{text}");
    assert!(!text.contains("variable_length"), "{text}");
    let dataset = Arc::new(Dataset::open(&out).unwrap());
    assert_eq!(dataset.shards[0].metadata.header.version, 1);
    let spec = StreamSpec::new("fixed", 10);
    let plan = Arc::new(
        StreamPlan::new(
            dataset,
            &StreamRequest::from(&spec),
            &StreamLimits::node_defaults(),
        )
        .unwrap(),
    );
    let mut assembler = Assembler::new(
        Arc::clone(&plan),
        &StreamLimits::node_defaults(),
        Arc::new(Metrics::new()),
    )
    .unwrap();
    let mut slot = vec![0u8; plan.slot_bytes];
    assembler.fill(3, &mut slot).unwrap();
    assert_eq!(&slot[..40], &ids[120..160]);
}
