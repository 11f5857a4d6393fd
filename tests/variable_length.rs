//! Variable-length fields (format version 2): packed from offsets and values, read back exactly,
//! served by the CPU backend in every order and both batch forms (padded with lengths, packed with
//! `cu_seqlens`), truncated to a cap, resumed mid-epoch; malformed offsets refused naming the file,
//! field and sample; streams that cannot hold them refused with a clear error; a version 1 dataset
//! still written and served as version 1.

mod common;

use std::path::Path;
use std::sync::Arc;

use gpufeed::format::{encode_shard_metadata, Dataset, Manifest};
use gpufeed::input::FieldSource;
use gpufeed::metrics::Metrics;
use gpufeed::pack::CodecChoice;
use gpufeed::pipeline::varlen::{VariableForm, VariableSelection};
use gpufeed::pipeline::{Assembler, StreamDevice, StreamLimits, StreamPlan, StreamRequest};
use gpufeed_client::protocol::{Shuffle, StreamSpec};
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

fn request(
    batch: u32,
    shuffle: Shuffle,
    form: VariableForm,
    cap: Option<u32>,
    cursor: u64,
) -> StreamRequest {
    let mut spec = StreamSpec::new("docs", batch);
    spec.shuffle = shuffle;
    spec.seed = 5;
    spec.start_cursor = cursor;
    let mut request = StreamRequest::from(&spec);
    request.variable = vec![VariableSelection {
        name: "tokens".into(),
        form,
        cap,
    }];
    request
}

fn i32s(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// One batch as the consumer reads it: per row the sample index (field `id`) and its tokens.
fn read_batch(plan: &StreamPlan, slot: &[u8], samples: usize) -> Vec<(u32, Vec<i32>)> {
    let id = &plan.fields[1];
    let tokens = &plan.fields[0];
    let variable = tokens.variable.as_ref().unwrap();
    let ids: Vec<u32> = slot[id.offset..id.offset + 4 * samples]
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let index = i32s(&slot[variable.index_offset..][..4 * variable.index_elements(samples)]);
    let rows: Vec<Vec<i32>> = match variable.form {
        VariableForm::Padded => {
            let longest = *index.iter().max().unwrap_or(&0) as usize;
            let values = i32s(&slot[tokens.offset..][..4 * samples * longest]);
            (0..samples)
                .map(|row| {
                    let padded = &values[row * longest..(row + 1) * longest];
                    let length = index[row] as usize;
                    assert!(
                        padded[length..].iter().all(|&v| v == 0),
                        "row {row} is padded with zeros"
                    );
                    padded[..length].to_vec()
                })
                .collect()
        }
        VariableForm::Packed => {
            assert_eq!(index[0], 0, "cu_seqlens starts at 0");
            let total = index[samples] as usize;
            let values = i32s(&slot[tokens.offset..][..4 * total]);
            (0..samples)
                .map(|row| values[index[row] as usize..index[row + 1] as usize].to_vec())
                .collect()
        }
    };
    ids.into_iter().zip(rows).collect()
}

/// Serves every step of `request` and checks each row against the source sample the plan's order
/// puts there (truncated to the cap); returns the batches.
fn serve_and_check(
    dataset: &Arc<Dataset>,
    request: &StreamRequest,
    ends: &[u64],
    values: &[i32],
) -> Vec<Vec<(u32, Vec<i32>)>> {
    let plan = Arc::new(
        StreamPlan::new(Arc::clone(dataset), request, &StreamLimits::node_defaults()).unwrap(),
    );
    let cap = request.variable[0].cap.map_or(usize::MAX, |c| c as usize);
    let mut assembler = Assembler::new(
        Arc::clone(&plan),
        &StreamLimits::node_defaults(),
        Arc::new(Metrics::new()),
    )
    .unwrap();
    let mut slot = vec![0xAAu8; plan.slot_bytes];
    let mut batches = Vec::new();
    for step in 0..plan.steps {
        let report = assembler.fill(step, &mut slot).unwrap();
        let rows = read_batch(&plan, &slot, report.samples as usize);
        for (row, sample) in plan.batch_samples(step).enumerate() {
            let mut expected = sample_values(ends, values, sample as usize);
            expected.truncate(cap);
            assert_eq!(rows[row].0 as u64, sample, "step {step} row {row}");
            assert_eq!(
                rows[row].1, expected,
                "step {step} row {row} (sample {sample})"
            );
        }
        batches.push(rows);
    }
    batches
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

#[test]
fn every_order_and_both_forms_are_exact() {
    let dir = tempfile::tempdir().unwrap();
    for codec in [CodecChoice::Raw, CodecChoice::Lz4] {
        let name = format!("docs-{codec:?}");
        let (dataset, ends, values) = pack_documents(dir.path(), &name, 1000, 40, codec);
        for shuffle in [Shuffle::None, Shuffle::Window(2), Shuffle::Full] {
            for form in [VariableForm::Padded, VariableForm::Packed] {
                for cap in [None, Some(7)] {
                    let request = request(33, shuffle, form, cap, 0);
                    let batches = serve_and_check(&dataset, &request, &ends, &values);
                    assert_eq!(batches.len(), 1000 / 33);
                }
            }
        }
    }
}

#[test]
fn a_stream_resumed_mid_epoch_serves_the_rest_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (dataset, ends, values) = pack_documents(dir.path(), "docs", 1000, 40, CodecChoice::Lz4);
    for form in [VariableForm::Padded, VariableForm::Packed] {
        let whole = serve_and_check(
            &dataset,
            &request(20, Shuffle::Full, form, None, 0),
            &ends,
            &values,
        );
        // The cursor after step 17 of the uninterrupted stream.
        let resumed = serve_and_check(
            &dataset,
            &request(20, Shuffle::Full, form, None, 18 * 20),
            &ends,
            &values,
        );
        assert_eq!(resumed[..], whole[18..]);
    }
}

#[test]
fn streams_beyond_the_slot_limit_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let (dataset, _, _) = pack_documents(dir.path(), "docs", 1000, 40, CodecChoice::Raw);
    let mut limits = StreamLimits::node_defaults();
    limits.slot_bytes_max = 64 << 10;
    let refused = StreamPlan::new(
        Arc::clone(&dataset),
        &request(1000, Shuffle::None, VariableForm::Padded, None, 0),
        &limits,
    )
    .unwrap_err()
    .to_string();
    assert!(
        refused.contains("'tokens' is variable-length") && refused.contains("slot limit"),
        "{refused}"
    );
    // A cap brings it within the limit.
    StreamPlan::new(
        Arc::clone(&dataset),
        &request(1000, Shuffle::None, VariableForm::Padded, Some(8), 0),
        &limits,
    )
    .unwrap();
    // A stream on a GPU is planned as on the host (the GPU backend gathers such fields).
    let mut on_gpu = request(10, Shuffle::None, VariableForm::Packed, None, 0);
    on_gpu.device = StreamDevice::Cuda(0);
    StreamPlan::new(
        Arc::clone(&dataset),
        &on_gpu,
        &StreamLimits::node_defaults(),
    )
    .unwrap();
    let mut on_fixed = request(10, Shuffle::None, VariableForm::Packed, None, 0);
    on_fixed.variable[0].name = "id".into();
    let refused = StreamPlan::new(
        Arc::clone(&dataset),
        &on_fixed,
        &StreamLimits::node_defaults(),
    )
    .unwrap_err()
    .to_string();
    assert!(refused.contains("fixed shape"), "{refused}");
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
        let dataset = Arc::new(Dataset::open(&path).expect("the tables are sound"));
        let error = StreamPlan::new(
            dataset,
            &request(10, Shuffle::None, VariableForm::Padded, None, 0),
            &StreamLimits::node_defaults(),
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("shard-000001.gfs"), "{error}");
        assert!(error.contains("field 'tokens'"), "{error}");
        assert!(error.contains(sample), "{error}");
        assert!(error.contains(expected), "{error}");
        // `gpufeed verify` finds it too, though every checksum matches.
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

/// Through the daemon and the client: a padded and a packed stream of the same epoch give each
/// sample's tokens, shaped per batch from the index tensors; a stream that names no form gets the
/// padded one.
#[test]
fn the_daemon_serves_both_forms_to_the_client() {
    use gpufeed_client::consumer::Client;
    use gpufeed_client::protocol::{BatchForm, VariableRequest};

    let root = tempfile::tempdir().unwrap();
    let (_, ends, values) = pack_documents(root.path(), "docs", 1000, 40, CodecChoice::Lz4);
    let daemon = common::daemon::start_daemon(
        Path::new(env!("CARGO_BIN_EXE_gpufeed")),
        root.path(),
        root.path().join("gpufeed.sock"),
        "cpu",
        &[],
        std::process::Stdio::null(),
    );
    let forms = [
        Some((BatchForm::Padded, None)),
        Some((BatchForm::Packed, Some(9))),
        None,
    ];
    for form in forms {
        let mut spec = StreamSpec::new("docs", 64);
        spec.shuffle = Shuffle::Full;
        spec.seed = 3;
        if let Some((form, cap)) = form {
            spec.variable = vec![VariableRequest {
                name: "tokens".into(),
                form,
                cap,
            }];
        }
        let cap = form
            .and_then(|(_, cap)| cap)
            .map_or(usize::MAX, |c| c as usize);
        let packed = matches!(form, Some((BatchForm::Packed, _)));
        let mut stream = Client::connect(&daemon.socket)
            .unwrap()
            .open_stream(spec)
            .unwrap();
        let mut seen = 0;
        for batch in stream.by_ref() {
            let batch = batch.unwrap();
            let samples = batch.samples() as usize;
            let ids: Vec<u32> = batch
                .field("id")
                .unwrap()
                .host_bytes()
                .unwrap()
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let tokens = batch.field("tokens").unwrap();
            let index_name = if packed {
                "tokens.cu_seqlens"
            } else {
                "tokens.lengths"
            };
            let index = batch.field(index_name).unwrap();
            assert_eq!(index.dtype, DType::I32);
            let index = i32s(index.host_bytes().unwrap());
            let served = i32s(tokens.host_bytes().unwrap());
            for (row, &sample) in ids.iter().enumerate() {
                let mut expected = sample_values(&ends, &values, sample as usize);
                expected.truncate(cap);
                let got = if packed {
                    assert_eq!(index.len(), samples + 1);
                    served[index[row] as usize..index[row + 1] as usize].to_vec()
                } else {
                    let longest = tokens.shape[1] as usize;
                    assert_eq!(tokens.shape, &[samples as u64, longest as u64]);
                    assert_eq!(longest as i32, *index.iter().max().unwrap());
                    served[row * longest..row * longest + index[row] as usize].to_vec()
                };
                assert_eq!(got, expected, "sample {sample}");
            }
            if packed {
                assert_eq!(tokens.shape, &[index[samples] as u64]);
            }
            seen += samples;
        }
        assert_eq!(seen, 1000 / 64 * 64);
    }
}

/// The streams of one dataset share its offsets (one copy for a node's ranks, not one each), and
/// the copy goes with the last stream holding it.
#[test]
fn streams_of_a_dataset_share_its_offsets() {
    let dir = tempfile::tempdir().unwrap();
    let (dataset, _, _) = pack_documents(dir.path(), "docs", 1000, 40, CodecChoice::Lz4);
    let open = |form| {
        StreamPlan::new(
            Arc::clone(&dataset),
            &request(10, Shuffle::Full, form, None, 0),
            &StreamLimits::node_defaults(),
        )
        .unwrap()
    };
    let ends = |plan: &StreamPlan| Arc::clone(&plan.fields[0].variable.as_ref().unwrap().ends);
    let first = open(VariableForm::Padded);
    let second = open(VariableForm::Packed);
    assert!(Arc::ptr_eq(&ends(&first), &ends(&second)));
    let weak = Arc::downgrade(&ends(&first));
    drop((first, second));
    assert_eq!(weak.strong_count(), 0, "the offsets went with the streams");
    let third = open(VariableForm::Padded);
    assert_eq!(ends(&third).len(), dataset.shards.len());
}

/// Samples larger than a block (f16 pairs, up to 3000 of them in 4 KiB blocks), converted to f32,
/// packed, over two ranks with the tail padded: each rank's rows are the source samples the order
/// gives it, every element converted as `decode::convert` does.
#[test]
fn long_samples_of_element_shapes_convert_across_blocks_and_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let samples = 150usize;
    let mut ends = Vec::new();
    let mut values: Vec<u8> = Vec::new();
    for sample in 0..samples {
        let pairs = (sample * 397 + 11) % 3001;
        for i in 0..pairs {
            for half in [sample as f32 + i as f32 / 4.0, -(i as f32)] {
                values.extend_from_slice(&half::f16::from_f32(half).to_le_bytes());
            }
        }
        ends.push(values.len() as u64 / 4);
    }
    let field = FieldSource::variable(
        common::field("pairs", DType::F16, &[2], values.clone()),
        ends.clone(),
    )
    .unwrap();
    let ids: Vec<u8> = (0..samples as u32).flat_map(|v| v.to_le_bytes()).collect();
    let out = dir.path().join("pairs");
    let mut options = common::options("pairs", 4096, Some(40));
    options.codec = CodecChoice::Lz4;
    common::pack_fields(
        &out,
        &[field, common::field("id", DType::U32, &[], ids)],
        &options,
    );
    let dataset = Arc::new(Dataset::open(&out).unwrap());
    for rank in 0..2 {
        let mut spec = StreamSpec::new("pairs", 7);
        spec.shuffle = Shuffle::Full;
        spec.seed = 1;
        spec.rank = rank;
        spec.world_size = 2;
        spec.tail = gpufeed_client::protocol::Tail::Pad;
        spec.fields = vec![
            gpufeed_client::protocol::FieldRequest {
                name: "pairs".into(),
                dtype: Some(DType::F32),
            },
            gpufeed_client::protocol::FieldRequest {
                name: "id".into(),
                dtype: None,
            },
        ];
        let mut request = StreamRequest::from(&spec);
        request.variable = vec![VariableSelection {
            name: "pairs".into(),
            form: VariableForm::Packed,
            cap: None,
        }];
        let plan = Arc::new(
            StreamPlan::new(
                Arc::clone(&dataset),
                &request,
                &StreamLimits::node_defaults(),
            )
            .unwrap(),
        );
        assert_eq!(plan.steps, (samples as u64).div_ceil(14));
        let mut assembler = Assembler::new(
            Arc::clone(&plan),
            &StreamLimits::node_defaults(),
            Arc::new(Metrics::new()),
        )
        .unwrap();
        let mut slot = vec![0u8; plan.slot_bytes];
        let (pairs, id) = (&plan.fields[0], &plan.fields[1]);
        let index_at = pairs.variable.as_ref().unwrap().index_offset;
        for step in 0..plan.steps {
            let report = assembler.fill(step, &mut slot).unwrap();
            let cu = i32s(&slot[index_at..][..4 * (report.samples as usize + 1)]);
            for (row, sample) in plan.batch_samples(step).enumerate() {
                let got_id =
                    u32::from_le_bytes(slot[id.offset + 4 * row..][..4].try_into().unwrap());
                assert_eq!(got_id as u64, sample);
                let sample = sample as usize;
                let start = if sample == 0 { 0 } else { ends[sample - 1] } as usize;
                let source = &values[start * 4..ends[sample] as usize * 4];
                let mut expected = vec![0u8; source.len() * 2];
                gpufeed::decode::convert(DType::F16, source, DType::F32, &mut expected).unwrap();
                let got = &slot
                    [pairs.offset + 8 * cu[row] as usize..pairs.offset + 8 * cu[row + 1] as usize];
                assert!(
                    got == &expected[..],
                    "rank {rank} step {step} row {row} (sample {sample})"
                );
            }
        }
    }
}

/// A corrupt values block under the replace policy: the rows reading it are zeros of their length
/// (their lengths and offsets intact, so the batch's shape does not depend on the corruption), the
/// others exact, and the replacements counted; under the fail policy the stream fails naming the
/// block.
#[test]
fn a_corrupt_values_block_is_replaced_by_zeros_or_fails_the_stream() {
    let dir = tempfile::tempdir().unwrap();
    let (dataset, ends, values) = pack_documents(dir.path(), "docs", 1000, 40, CodecChoice::Raw);
    // The first values block of shard 0, one byte flipped.
    let shard = &dataset.shards[0];
    let field = &shard.metadata.fields[0];
    let block = shard.metadata.field_blocks(0)[field.offset_blocks.unwrap() as usize];
    let mut bytes = std::fs::read(&shard.path).unwrap();
    bytes[block.stored_offset as usize + 5] ^= 0x40;
    std::fs::write(&shard.path, &bytes).unwrap();
    let dataset = Arc::new(Dataset::open(&dir.path().join("docs")).unwrap());
    for policy in [
        gpufeed::pipeline::CorruptPolicy::Replace,
        gpufeed::pipeline::CorruptPolicy::Fail,
    ] {
        let mut request = request(100, Shuffle::None, VariableForm::Padded, None, 0);
        request.on_corrupt = policy;
        let plan = Arc::new(
            StreamPlan::new(
                Arc::clone(&dataset),
                &request,
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
        let filled = assembler.fill(0, &mut slot);
        if policy == gpufeed::pipeline::CorruptPolicy::Fail {
            let error = filled.unwrap_err().to_string();
            assert!(
                error.contains("shard-000000.gfs") && error.contains("'tokens'"),
                "{error}"
            );
            continue;
        }
        let report = filled.unwrap();
        assert!(report.replaced > 0);
        let rows = read_batch(&plan, &slot, 100);
        let mut zeroed = 0;
        for (sample, (id, got)) in rows.iter().enumerate() {
            let expected = sample_values(&ends, &values, sample);
            assert_eq!(
                got.len(),
                expected.len(),
                "sample {sample} keeps its length"
            );
            if *got != expected {
                // A replaced row is zeros in every field.
                assert!(got.iter().all(|&v| v == 0) && *id == 0, "sample {sample}");
                zeroed += 1;
            } else if *id != 0 {
                assert_eq!(*id as usize, sample);
            }
        }
        assert!(zeroed > 0 && zeroed <= report.replaced as usize);
    }
}

/// `unpack` of a variable-length field writes its values (every sample's elements one after the
/// other) and int64 offsets of `samples + 1` entries beside them, which split the values back into
/// the documents packed, over shards and codecs, converted when asked; malformed offsets are
/// refused naming the file, field and sample, and leave no file behind.
#[test]
fn unpack_writes_values_and_offsets_that_split_into_the_documents() {
    use gpufeed::pack::OnExisting;
    use gpufeed::tools::{offsets_path, unpack_to, NoProgress};
    let dir = tempfile::tempdir().unwrap();
    for codec in [CodecChoice::Raw, CodecChoice::Lz4] {
        let name = format!("docs-{codec:?}");
        let (dataset, ends, values) = pack_documents(dir.path(), &name, 1000, 700, codec);
        let out = dir.path().join(format!("{name}.npy"));
        let bytes = unpack_to(
            &dataset,
            "tokens",
            &out,
            None,
            OnExisting::Refuse,
            &NoProgress,
        )
        .unwrap();
        assert_eq!(bytes, values.len() as u64 * 4);
        let got_values = common::read_npy(&out);
        assert_eq!(got_values.shape, vec![values.len() as u64]);
        assert_eq!(i32s(&got_values.bytes), values);
        let offsets_file = offsets_path(&out);
        assert_eq!(offsets_file, dir.path().join(format!("{name}.offsets.npy")));
        let offsets = common::read_npy(&offsets_file);
        assert_eq!(offsets.shape, vec![1001]);
        let offsets: Vec<i64> = offsets
            .bytes
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(offsets[0], 0);
        for sample in 0..1000 {
            let (start, end) = (offsets[sample] as usize, offsets[sample + 1] as usize);
            assert_eq!(
                i32s(&got_values.bytes[start * 4..end * 4]),
                sample_values(&ends, &values, sample),
                "{name} sample {sample}"
            );
        }
        // Converted: int32 widened to int64, the offsets unchanged.
        let wide = dir.path().join(format!("{name}-i64.npy"));
        unpack_to(
            &dataset,
            "tokens",
            &wide,
            Some(DType::I64),
            OnExisting::Refuse,
            &NoProgress,
        )
        .unwrap();
        let wide_values = common::read_npy(&wide);
        let widened: Vec<i32> = wide_values
            .bytes
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as i32)
            .collect();
        assert_eq!(widened, values);
        // An existing output is refused without --force.
        let again = unpack_to(
            &dataset,
            "tokens",
            &out,
            None,
            OnExisting::Refuse,
            &NoProgress,
        );
        assert!(again.is_err());
    }
    // Offsets going back in shard 1: refused naming file, field and sample; nothing written.
    let (dataset, _, _) = pack_documents(dir.path(), "bad", 1000, 700, CodecChoice::Raw);
    corrupt_offsets(&dataset.dir, |ends| {
        ends[5] = ends[4].saturating_sub(1).min(ends[4])
    });
    let dataset = Dataset::open(&dataset.dir).unwrap();
    let out = dir.path().join("bad.npy");
    let error = unpack_to(
        &dataset,
        "tokens",
        &out,
        None,
        OnExisting::Refuse,
        &NoProgress,
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("tokens") && error.contains("sample 305") && error.contains("shard"),
        "{error}"
    );
    assert!(!out.exists() && !offsets_path(&out).exists());
}

/// `pack --offsets NAME=FILE.npy` makes a `.npy` field variable-length, from the files `unpack`
/// writes for one: unpacking a variable-length field and packing its two files again gives the same
/// documents. Offsets that do not start at 0, run past the values or name no field are refused,
/// naming the argument.
#[test]
fn pack_takes_the_values_and_offsets_unpack_writes() {
    let dir = tempfile::tempdir().unwrap();
    let (dataset, ends, values) = pack_documents(dir.path(), "docs", 700, 300, CodecChoice::Lz4);
    let out = dir.path().join("tokens.npy");
    let path = |p: &Path| p.to_string_lossy().into_owned();
    common::assert_succeeds(&common::gpufeed([
        "unpack",
        &path(&dataset.dir),
        "--field",
        "tokens",
        "--out",
        &path(&out),
    ]));
    let offsets = dir.path().join("tokens.offsets.npy");
    let again = dir.path().join("again");
    common::assert_succeeds(&common::gpufeed([
        "pack",
        "--quiet",
        "--out",
        &path(&again),
        "--field",
        &format!("tokens={}", path(&out)),
        "--offsets",
        &format!("tokens={}", path(&offsets)),
    ]));
    let repacked = Dataset::open(&again).unwrap();
    let field = repacked.field_index("tokens").unwrap();
    assert!(repacked.manifest.fields[field].is_variable());
    assert_eq!(repacked.manifest.sample_count, 700);
    let round = dir.path().join("round.npy");
    common::assert_succeeds(&common::gpufeed([
        "unpack",
        &path(&again),
        "--field",
        "tokens",
        "--out",
        &path(&round),
    ]));
    assert_eq!(i32s(&common::read_npy(&round).bytes), values);
    assert_eq!(
        common::read_npy(&dir.path().join("round.offsets.npy")).bytes,
        common::read_npy(&offsets).bytes
    );
    assert_eq!(*ends.last().unwrap() as usize, values.len());
    // Refusals.
    let bad = |offsets: &[i64], name: &str| -> String {
        let file = dir.path().join(format!("bad-{name}.npy"));
        let bytes: Vec<u8> = offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
        common::write_npy(&file, DType::I64, &[offsets.len() as u64], &bytes);
        common::assert_fails(&common::gpufeed([
            "pack",
            "--quiet",
            "--out",
            &path(&dir.path().join(format!("out-{name}"))),
            "--field",
            &format!("tokens={}", path(&out)),
            "--offsets",
            &format!("{name}={}", path(&file)),
        ]))
    };
    let total = values.len() as i64;
    let error = bad(&[1, total], "tokens");
    assert!(
        error.contains("--offsets") && error.contains("not 0"),
        "{error}"
    );
    let error = bad(&[0, total + 5], "tokens");
    assert!(
        error.contains("--offsets") && error.contains("rows"),
        "{error}"
    );
    let error = bad(&[0, total], "nope");
    assert!(error.contains("no field 'nope'"), "{error}");
}
