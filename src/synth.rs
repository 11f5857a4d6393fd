//! Synthetic datasets with the statistics of real training data, for the demo, tests and benchmarks.
//!
//! Two kinds matter because they pull the format in opposite directions: embedding-like fp16 values,
//! which LZ4 cannot shrink (real fp16 weights compress 1.00x), and zipf-distributed int32 tokens, which
//! compress about 2x, more after a byte shuffle. Generation is deterministic for a given seed.

use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal, Zipf};

/// `count` fp16 values drawn from N(0, 0.02), like trained embedding or weight rows, little-endian.
pub fn embedding_f16(count: usize, seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let normal = Normal::new(0.0f32, 0.02).expect("valid normal");
    let mut out = Vec::with_capacity(count * 2);
    for _ in 0..count {
        out.extend_from_slice(&f16::from_f32(normal.sample(&mut rng)).to_le_bytes());
    }
    out
}

/// `count` int32 token ids drawn from a Zipf(1.1) law over a 50 257-entry vocabulary, little-endian.
pub fn zipf_tokens_i32(count: usize, seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let zipf = Zipf::new(50_257, 1.1).expect("valid zipf");
    let mut out = Vec::with_capacity(count * 4);
    for _ in 0..count {
        let token = zipf.sample(&mut rng) as i32 - 1;
        out.extend_from_slice(&token.to_le_bytes());
    }
    out
}

/// `count` bytes of uniform noise.
pub fn random_bytes(count: usize, seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = vec![0u8; count];
    rng.fill(&mut out[..]);
    out
}
