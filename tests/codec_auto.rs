//! `--codec auto` decides per field, from sampled blocks, and stores LZ4 only where a field
//! compresses about 2x or more.
//!
//! The bug this guards against: auto used to keep LZ4 for any block that saved 12.5 %, so fp16 data
//! that LZ4 shrinks by 21 % (1.26x) was stored LZ4 and served at a tenth of the same data stored raw,
//! because decoding it costs more than the few bytes saved win on a fast link. Such data must now
//! pack raw, tokens (int32, ~2.5x byte-shuffled) still LZ4, and `--codec lz4` still forces LZ4.

mod common;

use common::{field, options, pack_fields};
use gpufeed::format::{Codec, Dataset, Filter};
use gpufeed::pack::{encode_block, field_codec, CodecChoice, ShuffleChoice};
use gpufeed_client::DType;
use half::f16;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

const SAMPLES: usize = 4096;
const ROW: usize = 256;

/// fp16 rows whose first [`DENSE`] columns are N(0, 1) (incompressible to LZ4) and the rest zero
/// padding: LZ4 saves about the padding's share, 1.26x, as fp16 data with some structure does.
fn fp16_like() -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let normal = Normal::new(0.0f32, 1.0).unwrap();
    let mut bytes = Vec::with_capacity(SAMPLES * ROW * 2);
    for _ in 0..SAMPLES {
        for column in 0..ROW {
            let value = if column < DENSE {
                f16::from_f32(normal.sample(&mut rng))
            } else {
                f16::ZERO
            };
            bytes.extend_from_slice(&value.to_bits().to_le_bytes());
        }
    }
    bytes
}

/// Columns of [`fp16_like`] that hold values; 256 / 203 = 1.26.
const DENSE: usize = 203;

/// Zipf(1.1) int32 token ids over a GPT-2-sized vocabulary, as the demo generates them.
fn zipf_tokens() -> Vec<u8> {
    gpufeed::synth::zipf_tokens_i32(SAMPLES * ROW, 11)
}

/// Compression ratio of `bytes` in 64 KiB LZ4 blocks, each the smaller of plain and shuffled.
fn lz4_ratio(bytes: &[u8], width: usize) -> f64 {
    let stored: usize = bytes
        .chunks(64 << 10)
        .map(|b| {
            encode_block(b, width, CodecChoice::Lz4, ShuffleChoice::Auto)
                .stored
                .len()
        })
        .sum();
    bytes.len() as f64 / stored as f64
}

fn codecs_of(dataset: &Dataset, field_index: usize) -> Vec<(Codec, Filter)> {
    dataset
        .shards
        .iter()
        .flat_map(|s| s.metadata.field_blocks(field_index).iter())
        .map(|b| (b.codec, b.filter))
        .collect()
}

#[test]
fn fp16_data_at_1_26x_packs_raw_and_tokens_pack_lz4_shuffled_under_auto() {
    let fp16 = fp16_like();
    let tokens = zipf_tokens();
    let fp16_ratio = lz4_ratio(&fp16, 2);
    let token_ratio = lz4_ratio(&tokens, 4);
    assert!(
        (1.15..1.45).contains(&fp16_ratio),
        "the fp16 input should compress about 1.26x, got {fp16_ratio:.3}"
    );
    assert!(
        token_ratio >= 2.2,
        "the token input should compress about 2.5x, got {token_ratio:.3}"
    );

    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("mixed");
    let fields = [
        field("emb", DType::F16, &[ROW as u64], fp16),
        field("tokens", DType::I32, &[ROW as u64], tokens),
    ];
    // 64 KiB blocks and several shards: the decision holds over the whole field, not per shard.
    let opts = options("mixed", 64 << 10, Some(1000));
    assert_eq!(field_codec(&fields[0], &opts).unwrap(), CodecChoice::Raw);
    assert_eq!(field_codec(&fields[1], &opts).unwrap(), CodecChoice::Lz4);
    pack_fields(&out, &fields, &opts);
    let dataset = Dataset::open(&out).unwrap();
    assert!(dataset.shards.len() > 1);
    let emb = codecs_of(&dataset, 0);
    assert!(
        emb.iter().all(|&c| c == (Codec::Raw, Filter::None)),
        "{emb:?}"
    );
    let toks = codecs_of(&dataset, 1);
    assert!(
        toks.iter().all(|&c| c == (Codec::Lz4, Filter::ByteShuffle)),
        "{toks:?}"
    );
}

#[test]
fn codec_lz4_still_forces_lz4_on_data_auto_stores_raw() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("forced");
    let fields = [field("emb", DType::F16, &[ROW as u64], fp16_like())];
    let mut opts = options("forced", 64 << 10, None);
    opts.codec = CodecChoice::Lz4;
    pack_fields(&out, &fields, &opts);
    let dataset = Dataset::open(&out).unwrap();
    let emb = codecs_of(&dataset, 0);
    assert!(!emb.is_empty());
    assert!(emb.iter().all(|&(codec, _)| codec == Codec::Lz4), "{emb:?}");
}

#[test]
fn a_lone_block_under_auto_needs_the_same_2x() {
    // Half the block one repeated value, half incompressible: about 2x is kept, a little less not.
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut noisy = |zeros: usize| -> Vec<u8> {
        let mut v = vec![0u8; zeros];
        v.extend((zeros..65536).map(|_| rng.gen::<u8>()));
        v
    };
    let compressible = noisy(40_000);
    let barely = noisy(20_000);
    let auto = |b: &[u8]| encode_block(b, 1, CodecChoice::Auto, ShuffleChoice::Off).codec;
    assert_eq!(auto(&compressible), Codec::Lz4);
    assert_eq!(auto(&barely), Codec::Raw);
}
