//! Helpers shared by the integration tests: packing in-memory fields, running the `gpufeed` binary
//! (once, or as a daemon: [`daemon`]), an HTTP client for its control API ([`http`]), reading and
//! writing `.npy` files through the crate's own input module, and the setup of the GPU tests
//! (device, fresh seeds, input scale).

// Each test crate uses a different subset of these helpers.
#![allow(dead_code)]

pub mod consumers;
pub mod daemon;
pub mod http;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gpufeed::device::Device;
use gpufeed::input::{self, FieldSource};
use gpufeed::pack::{
    self, CodecChoice, OnExisting, PackOptions, PackSummary, Quiet, ShuffleChoice,
};
use gpufeed_client::DType;
use rand::rngs::StdRng;
use rand::SeedableRng;

/// Pack options with small blocks, one shard per `samples_per_shard` and one thread.
pub fn options(name: &str, block_bytes: u32, samples_per_shard: Option<u64>) -> PackOptions {
    PackOptions {
        name: name.to_string(),
        block_bytes,
        samples_per_shard,
        codec: CodecChoice::Auto,
        shuffle: ShuffleChoice::Auto,
        on_existing: OnExisting::Refuse,
        threads: 2,
    }
}

/// Packs in-memory fields into `out`, panicking on failure.
pub fn pack_fields(out: &Path, fields: &[FieldSource], options: &PackOptions) -> PackSummary {
    pack::pack(out, fields, options, &Quiet).expect("pack succeeds")
}

/// An in-memory field, panicking if the bytes are not whole samples.
pub fn field(name: &str, dtype: DType, shape: &[u64], bytes: Vec<u8>) -> FieldSource {
    FieldSource::from_bytes(name, dtype, shape.to_vec(), bytes).expect("whole samples")
}

/// Runs the `gpufeed` binary with `args`.
pub fn gpufeed<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    Command::new(env!("CARGO_BIN_EXE_gpufeed"))
        .args(args)
        .output()
        .expect("the gpufeed binary runs")
}

/// Standard error of a finished process as text.
pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Standard output of a finished process as text.
pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Asserts the command failed with a non-zero exit code and did not panic; returns its stderr.
pub fn assert_fails(output: &Output) -> String {
    let err = stderr(output);
    assert!(
        !output.status.success(),
        "expected failure, got {:?}\nstdout: {}\nstderr: {err}",
        output.status,
        stdout(output)
    );
    assert!(
        output.status.code().is_some(),
        "killed by a signal: {:?}\nstderr: {err}",
        output.status
    );
    assert!(!err.contains("panicked"), "panicked:\n{err}");
    err
}

/// Asserts the command succeeded; returns its stdout.
pub fn assert_succeeds(output: &Output) -> String {
    assert!(
        output.status.success(),
        "expected success, got {:?}\nstdout: {}\nstderr: {}",
        output.status,
        stdout(output),
        stderr(output)
    );
    stdout(output)
}

/// Asserts some single line of `text` contains every one of `needles`.
pub fn assert_line_with(text: &str, needles: &[&str]) {
    assert!(
        text.lines()
            .any(|line| needles.iter().all(|n| line.contains(n))),
        "no line contains all of {needles:?} in:\n{text}"
    );
}

/// A `.npy` file read back: dtype, full shape (samples first) and data bytes.
#[derive(Debug, PartialEq, Eq)]
pub struct NpyData {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub bytes: Vec<u8>,
}

/// Reads a `.npy` file with the crate's input reader.
pub fn read_npy(path: &Path) -> NpyData {
    let field = input::open_npy_field("x", &[path.to_path_buf()]).expect("valid .npy");
    let mut bytes = Vec::new();
    field
        .copy_samples(0, field.sample_count(), &mut bytes)
        .unwrap();
    let mut shape = vec![field.sample_count()];
    shape.extend_from_slice(&field.sample_shape);
    NpyData {
        dtype: field.dtype,
        shape,
        bytes,
    }
}

/// Writes a `.npy` file with the crate's writer.
pub fn write_npy(path: &Path, dtype: DType, shape: &[u64], bytes: &[u8]) -> PathBuf {
    let mut writer = input::write_npy(path, dtype, shape).expect("create .npy");
    writer.write_all(bytes).expect("write .npy data");
    writer.finish().expect("finish .npy");
    path.to_path_buf()
}

/// Deterministic pseudo-random bytes (xorshift64*), for data that must not depend on a rand version.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Little-endian i32 values `v(i)` for `i in 0..count`.
/// A loopback TCP port free now (bound and released), for a server a test starts.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn i32_bytes(count: usize, mut v: impl FnMut(usize) -> i32) -> Vec<u8> {
    (0..count).flat_map(|i| v(i).to_le_bytes()).collect()
}

/// A generator seeded afresh every run (from the clock), or from `GPUFEED_TEST_SEED` to replay a run;
/// the seed is printed under the test's name.
pub fn fresh_rng(test: &str) -> StdRng {
    let seed = std::env::var("GPUFEED_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("{test}: GPUFEED_TEST_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

/// Smaller inputs under compute-sanitizer, which slows kernels down a hundredfold.
pub fn small() -> bool {
    std::env::var("GPUFEED_TEST_SCALE").is_ok_and(|s| s == "small")
}

/// CUDA device 0, which the GPU tests need.
pub fn device() -> Device {
    Device::open(0).expect("the GPU tests need CUDA device 0")
}

/// Writes an `.npy` of `samples` i32 samples of 16 values, sample i holding i..i+16.
pub fn write_tokens_npy(path: &Path, samples: u64) {
    let mut writer = input::write_npy(path, DType::I32, &[samples, 16]).unwrap();
    let mut chunk = Vec::with_capacity(1 << 20);
    for i in 0..samples {
        for j in 0..16u64 {
            chunk.extend_from_slice(&((i + j) as i32).to_le_bytes());
        }
        if chunk.len() >= 1 << 20 {
            writer.write_all(&chunk).unwrap();
            chunk.clear();
        }
    }
    writer.write_all(&chunk).unwrap();
    writer.finish().unwrap();
}

/// Staging directories a pack of `name` left in `root`.
pub fn staging_dirs(root: &Path, name: &str) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!(".{name}.partial-"))
        })
        .map(|e| e.path())
        .collect()
}
