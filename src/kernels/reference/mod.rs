//! CPU models of the kernels, for tests.
//!
//! Two kinds live here. The *reference* ([`gather_reference`]) is built on the CPU decode path
//! (`crate::decode::convert`, hence `half`): the GPU must agree with it bit for bit. The *transcriptions*
//! ([`lz4_decode_transcribed`], [`f16_to_f32_bits`], [`xxh3_64_transcribed`], ...) copy the kernels' own
//! algorithms line for line into Rust, so that CI, which has no GPU, checks those algorithms against the
//! reference on every input it can afford (all 65 536 half patterns, adversarial LZ4 blocks, every xxh3
//! length class). The GPU tests then check the kernels against the reference directly.
//!
//! One file per kernel: [`lz4`] (both decoders), [`convert`] (the gather kernel's element rules and
//! its reference), [`xxh3`] (the checksum). They are test and benchmark support, hidden from the
//! crate's documentation.

mod convert;
mod lz4;
mod xxh3;

pub use convert::*;
pub use lz4::*;
pub use xxh3::*;

#[cfg(test)]
mod tests;
