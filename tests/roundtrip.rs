//! Round trips through the whole offline path: in-memory fields are packed with the library API into a
//! dataset directory on disk, opened with `Dataset::open`, checked with `tools::verify` and decoded with
//! `tools::unpack` into `.npy` files, which must hold exactly the source bytes. Property tests cover all
//! twelve dtypes, per-sample shapes of 0 to 3 dimensions, random and compressible data, every block size,
//! shard split, codec and shuffle policy, one or two fields, and the exact f16/bf16 to f32 conversion
//! (subnormals, infinities, signed zeros and NaN payloads included); deterministic tests pin down the
//! `auto` codec decision and the CLI's `unpack --dtype f32`.

mod common;

use std::path::Path;

use common::{assert_fails, assert_line_with, assert_succeeds, field, gpufeed, read_npy};
use gpufeed::format::{Codec, Dataset, Filter};
use gpufeed::pack::{CodecChoice, ShuffleChoice};
use gpufeed::tools::{self, NoProgress};
use gpufeed_client::{DType, ALL_DTYPES};
use half::{bf16, f16};
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

/// Upper bound on the raw bytes of one generated dataset, to keep the debug-build run short.
const MAX_RAW_BYTES: u64 = 2 << 20;
/// Upper bound on shards per generated dataset: every shard costs an fsync.
const MAX_SHARDS: u64 = 48;

/// How a field's bytes are generated.
#[derive(Clone, Copy, Debug)]
enum Pattern {
    /// Uniformly random bytes: incompressible, all float bit patterns.
    Random,
    /// Elements drawn from `0..range`, little-endian in the element width: zero high bytes.
    SmallRange(u32),
    /// Runs of one repeated random element.
    Runs,
    /// Alternating segments of the three patterns above.
    Mixed,
}

#[derive(Clone, Debug)]
struct FieldSpec {
    dtype: DType,
    shape: Vec<u64>,
    pattern: Pattern,
    seed: u64,
}

#[derive(Clone, Debug)]
struct Case {
    fields: Vec<FieldSpec>,
    count: u64,
    block_bytes: u32,
    /// Reduced modulo the sample count when the case is realised.
    samples_per_shard: Option<u64>,
    codec: CodecChoice,
    shuffle: ShuffleChoice,
}

fn pattern() -> impl Strategy<Value = Pattern> {
    prop_oneof![
        Just(Pattern::Random),
        prop::sample::select(vec![2u32, 16, 256, 1000]).prop_map(Pattern::SmallRange),
        Just(Pattern::Runs),
        Just(Pattern::Mixed),
    ]
}

fn field_spec() -> impl Strategy<Value = FieldSpec> {
    (
        prop::sample::select(ALL_DTYPES.to_vec()),
        prop::collection::vec(1u64..=40, 0..=3),
        pattern(),
        any::<u64>(),
    )
        .prop_map(|(dtype, shape, pattern, seed)| FieldSpec {
            dtype,
            shape,
            pattern,
            seed,
        })
}

fn codec() -> impl Strategy<Value = CodecChoice> {
    prop::sample::select(vec![CodecChoice::Auto, CodecChoice::Lz4, CodecChoice::Raw])
}

fn shuffle() -> impl Strategy<Value = ShuffleChoice> {
    prop::sample::select(vec![
        ShuffleChoice::Auto,
        ShuffleChoice::On,
        ShuffleChoice::Off,
    ])
}

fn block_bytes() -> impl Strategy<Value = u32> {
    prop::sample::select(vec![4096u32, 8192, 65536])
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(field_spec(), 1..=2),
        1u64..=3000,
        block_bytes(),
        prop::option::of(any::<u64>()),
        codec(),
        shuffle(),
    )
        .prop_map(
            |(fields, count, block_bytes, samples_per_shard, codec, shuffle)| Case {
                fields,
                count,
                block_bytes,
                samples_per_shard,
                codec,
                shuffle,
            },
        )
}

fn sample_bytes(dtype: DType, shape: &[u64]) -> u64 {
    shape.iter().product::<u64>() * dtype.size_bytes() as u64
}

/// One element of `width` bytes holding `value` little-endian (truncated to the width).
fn element(value: u64, width: usize) -> Vec<u8> {
    value.to_le_bytes()[..width].to_vec()
}

/// Generates `elements` elements of `width` bytes following `pattern`.
fn generate(pattern: Pattern, width: usize, elements: usize, rng: &mut StdRng) -> Vec<u8> {
    let mut out = Vec::with_capacity(elements * width);
    match pattern {
        Pattern::Random => {
            out.resize(elements * width, 0);
            rng.fill_bytes(&mut out);
        }
        Pattern::SmallRange(range) => {
            for _ in 0..elements {
                out.extend(element(rng.gen_range(0..range) as u64, width));
            }
        }
        Pattern::Runs => {
            while out.len() < elements * width {
                let value = element(rng.next_u64(), width);
                for _ in 0..rng.gen_range(1..64) {
                    out.extend_from_slice(&value);
                }
            }
            out.truncate(elements * width);
        }
        Pattern::Mixed => {
            while out.len() < elements * width {
                let left = elements - out.len() / width;
                let segment = rng.gen_range(1..=left.min(3000));
                let inner = match rng.gen_range(0..3) {
                    0 => Pattern::Random,
                    1 => Pattern::SmallRange(100),
                    _ => Pattern::Runs,
                };
                out.extend(generate(inner, width, segment, rng));
            }
        }
    }
    out
}

fn field_data(spec: &FieldSpec, count: u64) -> Vec<u8> {
    let width = spec.dtype.size_bytes();
    let elements = (sample_bytes(spec.dtype, &spec.shape) * count) as usize / width;
    generate(
        spec.pattern,
        width,
        elements,
        &mut StdRng::seed_from_u64(spec.seed),
    )
}

fn bf16_to_f32_bytes(bytes: &[u8]) -> Vec<u8> {
    bytes
        .chunks_exact(2)
        .flat_map(|b| {
            bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))
                .to_f32()
                .to_bits()
                .to_le_bytes()
        })
        .collect()
}

fn f16_to_f32_bytes(bytes: &[u8]) -> Vec<u8> {
    bytes
        .chunks_exact(2)
        .flat_map(|b| {
            f16::from_bits(u16::from_le_bytes([b[0], b[1]]))
                .to_f32()
                .to_bits()
                .to_le_bytes()
        })
        .collect()
}

/// Checks that every block obeys the codec and shuffle policy the dataset was packed with.
fn check_codec_policy(
    dataset: &Dataset,
    codec: CodecChoice,
    shuffle: ShuffleChoice,
) -> Result<(), TestCaseError> {
    for shard in &dataset.shards {
        for (field_index, field) in shard.metadata.fields.iter().enumerate() {
            let width = field.dtype.size_bytes();
            for (index, block) in shard.metadata.field_blocks(field_index).iter().enumerate() {
                let place = format!(
                    "{} field {} block {index}",
                    shard.path.display(),
                    field.name
                );
                match codec {
                    CodecChoice::Raw => prop_assert_eq!(block.codec, Codec::Raw, "{}", place),
                    CodecChoice::Lz4 => prop_assert_eq!(block.codec, Codec::Lz4, "{}", place),
                    CodecChoice::Auto => {
                        // Auto decides per field: every block of a field has the codec of the
                        // field's first block, in every shard.
                        let first = dataset.shards[0].metadata.field_blocks(field_index)[0].codec;
                        prop_assert_eq!(block.codec, first, "{} (auto mixed codecs)", place);
                    }
                }
                if block.codec == Codec::Raw {
                    prop_assert_eq!(block.stored_bytes, block.raw_bytes, "{}", place);
                    prop_assert_eq!(block.filter, Filter::None, "{}", place);
                    continue;
                }
                let expected_filter = match (shuffle, width > 1) {
                    (_, false) | (ShuffleChoice::Off, _) => Some(Filter::None),
                    (ShuffleChoice::On, true) => Some(Filter::ByteShuffle),
                    (ShuffleChoice::Auto, true) => None,
                };
                if let Some(filter) = expected_filter {
                    prop_assert_eq!(block.filter, filter, "{}", place);
                }
            }
        }
    }
    Ok(())
}

/// Packs `case`, then verifies and unpacks every field and compares with the source bytes.
fn round_trip(case: &Case) -> Result<(), TestCaseError> {
    let row_bytes: u64 = case
        .fields
        .iter()
        .map(|f| sample_bytes(f.dtype, &f.shape))
        .sum();
    let count = case.count.min((MAX_RAW_BYTES / row_bytes).max(1));
    let samples_per_shard = case
        .samples_per_shard
        .map(|n| (1 + n % count).max(count.div_ceil(MAX_SHARDS)));
    // Two fields must have distinct names; the names also exercise the allowed character set.
    let names = ["f0.a-b", "f_1"];
    let sources: Vec<(String, &FieldSpec, Vec<u8>)> = case
        .fields
        .iter()
        .zip(names)
        .map(|(spec, name)| (name.to_string(), spec, field_data(spec, count)))
        .collect();
    let fields: Vec<_> = sources
        .iter()
        .map(|(name, spec, bytes)| field(name, spec.dtype, &spec.shape, bytes.clone()))
        .collect();

    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds");
    let mut options = common::options("roundtrip", case.block_bytes, samples_per_shard);
    options.codec = case.codec;
    options.shuffle = case.shuffle;
    let summary = common::pack_fields(&out, &fields, &options);
    prop_assert_eq!(summary.sample_count, count);
    prop_assert_eq!(summary.raw_bytes, row_bytes * count);

    let dataset = Dataset::open(&out).unwrap();
    prop_assert_eq!(dataset.manifest.sample_count, count);
    let expected_shards = samples_per_shard.map_or(1, |n| count.div_ceil(n));
    prop_assert_eq!(dataset.shards.len() as u64, expected_shards);
    prop_assert_eq!(summary.shard_count as u64, expected_shards);
    check_codec_policy(&dataset, case.codec, case.shuffle)?;

    let report = tools::verify(&out, &NoProgress).unwrap();
    prop_assert!(report.problems.is_empty(), "{:?}", report.problems);
    prop_assert_eq!(report.shards_ok, dataset.shards.len());
    let total_blocks: usize = dataset.shards.iter().map(|s| s.metadata.blocks.len()).sum();
    prop_assert_eq!(report.blocks_ok, total_blocks as u64);

    for (name, spec, bytes) in &sources {
        let npy = tmp.path().join(format!("{name}.npy"));
        let mut shape = vec![count];
        shape.extend_from_slice(&spec.shape);
        if spec.dtype == DType::BF16 {
            tools::unpack(&dataset, name, &npy, Some(DType::F32), &NoProgress).unwrap();
            let back = read_npy(&npy);
            prop_assert_eq!(back.dtype, DType::F32);
            prop_assert_eq!(&back.shape, &shape);
            prop_assert!(back.bytes == bf16_to_f32_bytes(bytes), "field {}", name);
        } else {
            let written = tools::unpack(&dataset, name, &npy, None, &NoProgress).unwrap();
            prop_assert_eq!(written, bytes.len() as u64);
            let back = read_npy(&npy);
            prop_assert_eq!(back.dtype, spec.dtype);
            prop_assert_eq!(&back.shape, &shape);
            // Not prop_assert_eq: a failure would print megabytes.
            prop_assert!(back.bytes == *bytes, "field {} differs", name);
        }
    }
    Ok(())
}

/// f16 bit patterns that conversions get wrong most often.
const F16_SPECIALS: [u16; 14] = [
    0x0000, 0x8000, // ±0
    0x0001, 0x03ff, 0x8001, 0x83ff, // smallest and largest subnormals
    0x7c00, 0xfc00, // ±inf
    0x7e00, 0xfe00, // quiet NaNs
    0x7c01, 0x7d55, 0xfdff, // signalling NaNs with payloads
    0x7fff, // quiet NaN with a full payload
];

/// bf16 bit patterns that conversions get wrong most often.
const BF16_SPECIALS: [u16; 14] = [
    0x0000, 0x8000, // ±0
    0x0001, 0x007f, 0x8001, 0x807f, // smallest and largest subnormals
    0x7f80, 0xff80, // ±inf
    0x7fc0, 0xffc0, // quiet NaNs
    0x7f81, 0x7fa5, 0xffbf, // signalling NaNs with payloads
    0x7fff, // quiet NaN with a full payload
];

/// Random 16-bit floats with special values injected at about `special_per_mille` / 1000 of the
/// positions; runs of repeated values make some blocks compressible.
fn halves_with_specials(
    dtype: DType,
    elements: usize,
    special_per_mille: u32,
    seed: u64,
) -> Vec<u8> {
    let specials = if dtype == DType::F16 {
        &F16_SPECIALS
    } else {
        &BF16_SPECIALS
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(elements * 2);
    while out.len() < elements * 2 {
        let value = if rng.gen_range(0..1000) < special_per_mille {
            specials[rng.gen_range(0..specials.len())]
        } else {
            rng.gen::<u16>()
        };
        for _ in 0..rng.gen_range(1..=4u32).pow(2) {
            out.extend_from_slice(&value.to_le_bytes());
        }
    }
    out.truncate(elements * 2);
    out
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Any dtype, shape, data, block size, shard split, codec and shuffle policy round-trips exactly.
    #[test]
    fn packed_fields_unpack_to_their_source_bytes(case in case()) {
        round_trip(&case)?;
    }

    /// f16 and bf16 fields unpacked with dtype f32 equal the `half` crate's conversion bit for bit.
    #[test]
    fn half_floats_unpack_to_f32_exactly_as_half_converts(
        dtype in prop::sample::select(vec![DType::F16, DType::BF16]),
        samples in 1u64..=1500,
        width in 1u64..=24,
        special_per_mille in 0u32..=1000,
        seed in any::<u64>(),
        block_bytes in block_bytes(),
        codec in codec(),
        shuffle in shuffle(),
    ) {
        let source = halves_with_specials(dtype, (samples * width) as usize, special_per_mille, seed);
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("halves");
        let mut options = common::options("halves", block_bytes, Some(samples.div_ceil(3)));
        options.codec = codec;
        options.shuffle = shuffle;
        common::pack_fields(&out, &[field("h", dtype, &[width], source.clone())], &options);
        let dataset = Dataset::open(&out).unwrap();
        let npy = tmp.path().join("h.npy");
        tools::unpack(&dataset, "h", &npy, Some(DType::F32), &NoProgress).unwrap();
        let back = read_npy(&npy);
        prop_assert_eq!(back.dtype, DType::F32);
        prop_assert_eq!(back.shape, vec![samples, width]);
        let expected = if dtype == DType::F16 {
            f16_to_f32_bytes(&source)
        } else {
            bf16_to_f32_bytes(&source)
        };
        for (index, (got, want)) in back.bytes.chunks_exact(4).zip(expected.chunks_exact(4)).enumerate() {
            prop_assert_eq!(
                got, want,
                "{} element {} (bits {:#06x})", dtype, index,
                u16::from_le_bytes([source[index * 2], source[index * 2 + 1]])
            );
        }
    }
}

/// Codec counts of field `index` in the `inspect` summary: (raw, lz4, lz4_shuffled, blocks).
fn codec_counts(summary: &serde_json::Value, index: usize) -> (u64, u64, u64, u64) {
    let field = &summary["fields"][index];
    let get = |v: &serde_json::Value| v.as_u64().expect("count");
    (
        get(&field["codecs"]["raw"]),
        get(&field["codecs"]["lz4"]),
        get(&field["codecs"]["lz4_shuffled"]),
        get(&field["blocks"]),
    )
}

#[test]
fn auto_codec_stores_random_fp16_raw_and_small_int32_as_lz4() {
    let samples = 4096u64;
    // Embedding-like fp16: normally distributed values at full mantissa precision.
    let mut rng = StdRng::seed_from_u64(7);
    let normal = rand_distr::Normal::new(0.0f32, 1.0).unwrap();
    let emb: Vec<u8> = (0..samples * 64)
        .flat_map(|_| f16::from_f32(rng.sample(normal)).to_bits().to_le_bytes())
        .collect();
    // Token-like int32: Zipf-distributed ids, about 2.5x byte-shuffled. (Ids drawn uniformly below
    // 50 000 compress under 2x, which auto now stores raw: only the two high bytes repeat.)
    let tokens = gpufeed::synth::zipf_tokens_i32((samples * 16) as usize, 7);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("auto");
    let options = common::options("auto", 65536, Some(1500));
    common::pack_fields(
        &out,
        &[
            field("emb", DType::F16, &[64], emb),
            field("tokens", DType::I32, &[16], tokens),
        ],
        &options,
    );
    let summary = tools::inspect(&Dataset::open(&out).unwrap());
    assert_eq!(summary["fields"][0]["name"], "emb");
    let (raw, lz4, shuffled, blocks) = codec_counts(&summary, 0);
    assert!(blocks >= 3, "{summary}");
    assert_eq!((raw, lz4, shuffled), (blocks, 0, 0), "{summary}");
    assert_eq!(summary["fields"][0]["ratio"], 1.0);

    assert_eq!(summary["fields"][1]["name"], "tokens");
    let (raw, lz4, shuffled, blocks) = codec_counts(&summary, 1);
    assert!(blocks >= 3, "{summary}");
    assert_eq!(raw, 0, "{summary}");
    assert_eq!(lz4 + shuffled, blocks, "{summary}");
    assert!(summary["fields"][1]["ratio"].as_f64().unwrap() >= 2.0);
}

/// Packs all 65 536 bit patterns of a 16-bit float dtype as 256 samples of 256 elements.
fn pack_all_patterns(dir: &Path, dtype: DType) -> Vec<u8> {
    let source: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
    let mut options = common::options("patterns", 4096, Some(100));
    options.codec = CodecChoice::Lz4;
    options.shuffle = ShuffleChoice::On;
    common::pack_fields(dir, &[field("h", dtype, &[256], source.clone())], &options);
    source
}

#[test]
fn cli_unpack_dtype_f32_converts_every_f16_and_bf16_bit_pattern() {
    let tmp = tempfile::tempdir().unwrap();
    for dtype in [DType::F16, DType::BF16] {
        let dir = tmp.path().join(dtype.name());
        let source = pack_all_patterns(&dir, dtype);
        let npy = tmp.path().join(format!("{dtype}.npy"));
        let output = gpufeed([
            "unpack".as_ref(),
            dir.as_os_str(),
            "--field".as_ref(),
            "h".as_ref(),
            "--out".as_ref(),
            npy.as_os_str(),
            "--dtype".as_ref(),
            "f32".as_ref(),
            "--quiet".as_ref(),
        ]);
        assert_succeeds(&output);
        let back = read_npy(&npy);
        assert_eq!(back.dtype, DType::F32);
        assert_eq!(back.shape, vec![256, 256]);
        for (bits, got) in (0..=u16::MAX).zip(back.bytes.chunks_exact(4)) {
            let got = u32::from_le_bytes(got.try_into().unwrap());
            let want = if dtype == DType::F16 {
                f16::from_bits(bits).to_f32().to_bits()
            } else {
                bf16::from_bits(bits).to_f32().to_bits()
            };
            assert_eq!(got, want, "{dtype} bits {bits:#06x}");
        }
        // Without --dtype, f16 unpacks to its own bytes; bf16 has no .npy type and is refused.
        let npy = tmp.path().join(format!("{dtype}-stored.npy"));
        let output = gpufeed([
            "unpack".as_ref(),
            dir.as_os_str(),
            "--field".as_ref(),
            "h".as_ref(),
            "--out".as_ref(),
            npy.as_os_str(),
            "--quiet".as_ref(),
        ]);
        if dtype == DType::F16 {
            assert_succeeds(&output);
            let back = read_npy(&npy);
            assert_eq!(back.dtype, DType::F16);
            assert!(back.bytes == source);
        } else {
            let err = assert_fails(&output);
            assert_line_with(&err, &["field 'h' is bf16", "pass --dtype f32"]);
        }
    }
}
