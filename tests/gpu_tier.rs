//! The device-memory tier (`--device-cache`) end to end on the GPU backend: `gpufeed serve --device
//! cuda:0` as a child process with its control API on, consumers as separate processes (the
//! `consume` example). Covers batches bit-exact against the CPU backend in every order, from the
//! stream that fills the tier and from streams that find it whole; a dataset evicted through the API
//! while a stream reads it; a dataset larger than the budget served as without the tier; two
//! consumer processes reading one copy; device memory back to its baseline once the tier lets a
//! dataset go.
//!
//! Run on a CUDA machine: `cargo test --release --test gpu_tier -- --include-ignored`. Where the
//! test binary runs away from its build tree, `GPUFEED_BIN` and `GPUFEED_CONSUME_BIN` name the
//! `gpufeed` binary and the `consume` example.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::consumers::{consume_bin, copy_dataset, gpufeed_bin, npy_payload, wait_for_no_streams};
use common::daemon::Daemon;
use gpufeed::device::Device;
use gpufeed::format::Dataset;
use gpufeed_client::DType;

const SAMPLES: u64 = 6000;
const EMB_DIM: u64 = 256;
const TOK_LEN: u64 = 64;

/// A dataset `name` under `root`: a raw fp16 embedding field (the tier serves streams of raw
/// fields) and an LZ4 token field (held in the tier as stored, not read by these streams), in
/// shards of 1000 samples.
fn pack(root: &Path, name: &str, samples: u64, seed: u64) -> PathBuf {
    let dir = root.join(name);
    let emb = gpufeed::synth::embedding_f16((samples * EMB_DIM) as usize, seed);
    let tok = common::i32_bytes((samples * TOK_LEN) as usize, |i| (i % 97) as i32);
    let fields = vec![
        common::field("emb", DType::F16, &[EMB_DIM], emb),
        common::field("tok", DType::I32, &[TOK_LEN], tok),
    ];
    common::pack_fields(&dir, &fields, &common::options(name, 64 << 10, Some(1000)));
    dir
}

/// Bytes of the dataset's shard files: what the tier holds of it.
fn shard_bytes(dir: &Path) -> u64 {
    let dataset = Dataset::open(dir).unwrap();
    dataset
        .shards
        .iter()
        .map(|s| std::fs::metadata(&s.path).unwrap().len())
        .sum()
}

/// A GPU daemon on `root` with its API on a free loopback port, windows of 256 KiB (several per
/// shard, so that a filling stream reads some windows from the tier and others in place) and
/// `extra` flags.
fn start_gpu(root: &Path, extra: &[&str]) -> Daemon {
    let mut command = Command::new(gpufeed_bin());
    command
        .args(["serve", "--data-root"])
        .arg(root)
        .arg("--socket")
        .arg(root.join("gpu.sock"))
        .args(["--device", "cuda:0", "--http", "127.0.0.1:0"])
        .args(["--registered-window", "256K"])
        .args(extra)
        .env_remove("GPUFEED_API_TOKEN")
        .env_remove("GPUFEED_CONFIG")
        .env_remove("GPUFEED_DECODE_WHOLE")
        .env("GPUFEED_DEVICE_POOL_IDLE_S", "3600");
    common::daemon::start(command, &root.join("logs"))
}

fn start_cpu(root: &Path) -> Daemon {
    common::daemon::start_daemon(
        &gpufeed_bin(),
        root,
        root.join("cpu.sock"),
        "cpu",
        &[],
        Stdio::inherit(),
    )
}

/// `consume` arguments: the raw embedding field as f32, batches of 96, `shuffle` (windows of two
/// shards), seed 7.
fn emb_args(shuffle: &'static str) -> Vec<&'static str> {
    vec![
        "--batch-size",
        "96",
        "--field",
        "emb",
        "--dtype",
        "f32",
        "--shuffle",
        shuffle,
        "--window-shards",
        "2",
        "--seed",
        "7",
    ]
}

fn consume(socket: &Path, dataset: &str, device: &str, args: &[&str], dump: &Path) -> Child {
    Command::new(consume_bin())
        .arg("--socket")
        .arg(socket)
        .args(["--dataset", dataset, "--device", device])
        .args(args)
        .arg("--dump")
        .arg(dump)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the consume example")
}

fn finish(mut child: Child) {
    drop(child.stdin.take());
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "consume failed: {output:?}");
}

/// Waits for a `--hold-after` consumer to say it holds its batches.
fn wait_holding(child: &mut Child) -> BufReader<std::process::ChildStdout> {
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert!(line.starts_with("holding"), "consumer said {line:?}");
    stdout
}

fn tier(address: SocketAddr) -> serde_json::Value {
    let response = common::http::get(address, "/v1/devices/cuda:0/cache", None);
    assert_eq!(
        response.status,
        200,
        "{}",
        String::from_utf8_lossy(&response.body)
    );
    response.json()
}

fn evict(address: SocketAddr, dataset: &str) -> serde_json::Value {
    let response = common::http::request(
        address,
        "DELETE",
        &format!("/v1/devices/cuda:0/cache/{dataset}"),
        &[],
        None,
    );
    assert_eq!(
        response.status,
        200,
        "{}",
        String::from_utf8_lossy(&response.body)
    );
    response.json()
}

/// The CPU backend's batches for `args` on `dataset`, dumped once per request.
fn cpu_dump(cpu: &Daemon, dumps: &Path, dataset: &str, name: &str, args: &[&str]) -> Vec<u8> {
    let path = dumps.join(format!("{dataset}-{name}-cpu.npy"));
    if !path.exists() {
        finish(consume(&cpu.socket, dataset, "cpu", args, &path));
    }
    npy_payload(&path)
}

/// [`lz4_args`] for a consumer that holds its batches after 3 (its stream stays open): a full
/// shuffle in batches of 16, more steps than the stream has slots (with fewer, its pipeline
/// finishes the epoch and closes at once).
fn lz4_holding_args(seed: &'static str) -> Vec<&'static str> {
    let mut args = lz4_args("full", seed);
    args[1] = "16";
    args.extend(["--hold-after", "3"]);
    args
}

/// A consumer's arguments for the `lz` dataset: batches of 96, both fields (emb as f32), corrupt
/// rows replaced, order `shuffle` (windows of 2 shards), seed `seed`.
fn lz4_args(shuffle: &'static str, seed: &'static str) -> Vec<&'static str> {
    vec![
        "--batch-size",
        "96",
        "--field",
        "tok",
        "--field",
        "emb",
        "--dtype",
        "f32",
        "--on-corrupt",
        "replace",
        "--shuffle",
        shuffle,
        "--window-shards",
        "2",
        "--seed",
        seed,
    ]
}

/// Packs the dataset `lz` under `root`: fp16 `emb` (from `seed`) and int32 `tok` (`tok(i)` for
/// element `i`), both LZ4 with the byte shuffle, 1000 samples a shard; then flips a byte in the
/// middle of compressed token block 1 of shard `corrupt_shard`. Returns the dataset's directory,
/// the dataset and the corrupted shard's path.
fn pack_lz4_with_a_corrupt_block(
    root: &Path,
    seed: u64,
    corrupt_shard: usize,
    tok: impl Fn(usize) -> i32,
) -> (PathBuf, Dataset, PathBuf) {
    let dir = root.join("lz");
    let emb = gpufeed::synth::embedding_f16((SAMPLES * EMB_DIM) as usize, seed);
    let tok = common::i32_bytes((SAMPLES * TOK_LEN) as usize, tok);
    let fields = vec![
        common::field("emb", DType::F16, &[EMB_DIM], emb),
        common::field("tok", DType::I32, &[TOK_LEN], tok),
    ];
    let mut options = common::options("lz", 64 << 10, Some(1000));
    options.codec = gpufeed::pack::CodecChoice::Lz4;
    options.shuffle = gpufeed::pack::ShuffleChoice::On;
    common::pack_fields(&dir, &fields, &options);
    let dataset = Dataset::open(&dir).unwrap();
    let shard = &dataset.shards[corrupt_shard];
    let tok_block = shard
        .metadata
        .field_blocks(dataset.field_index("tok").unwrap())[1];
    assert_eq!(tok_block.codec, gpufeed::format::Codec::Lz4);
    let mut bytes = std::fs::read(&shard.path).unwrap();
    bytes[(tok_block.stored_offset + tok_block.stored_bytes as u64 / 2) as usize] ^= 0x5A;
    std::fs::write(&shard.path, bytes).unwrap();
    let path = shard.path.clone();
    (dir, dataset, path)
}

/// In every order, a fresh daemon's first stream fills the tier (some windows read in place, the
/// others from the tier as their copies complete) and its second stream finds the dataset whole:
/// both bit-exact against the CPU backend, and the tier counts one admission and one hit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn tier_batches_equal_the_cpu_backend_in_every_order() {
    let root = tempfile::tempdir().unwrap();
    let dir = pack(root.path(), "emb", SAMPLES, 11);
    let bytes = shard_bytes(&dir);
    let cpu_root = root.path().join("cpu-root");
    copy_dataset(&dir, &cpu_root.join("emb"));
    let cpu = start_cpu(&cpu_root);
    let dumps = root.path().join("dumps");
    std::fs::create_dir_all(&dumps).unwrap();
    // Whether a stream that opened while the tier filled went on with the order on the device
    // once the fill completed (timing decides at which step, and whether before its last).
    let mut switched = false;
    for shuffle in ["none", "window", "full"] {
        let gpu = start_gpu(root.path(), &["--device-cache", "64M"]);
        let expected = cpu_dump(&cpu, &dumps, "emb", shuffle, &emb_args(shuffle));
        assert!(!expected.is_empty());
        for stream in ["filling", "whole"] {
            let path = dumps.join(format!("emb-{shuffle}-{stream}-gpu.npy"));
            finish(consume(
                &gpu.socket,
                "emb",
                "cuda:0",
                &emb_args(shuffle),
                &path,
            ));
            assert!(
                npy_payload(&path) == expected,
                "{shuffle}, {stream} stream: the tier's batches differ from the CPU backend's"
            );
            wait_for_no_streams(&gpu.socket);
        }
        let view = tier(gpu.address());
        assert_eq!(view["admissions"], 1, "{view}");
        assert_eq!(view["hits"], 1, "{view}");
        assert_eq!(view["held_bytes"], bytes, "{view}");
        assert_eq!(view["datasets"][0]["name"], "emb", "{view}");
        assert_eq!(view["datasets"][0]["state"], "resident", "{view}");
        // Rank 1 of 3 resuming mid-epoch with the tail padded: positions that wrap at the epoch's
        // end, a cursor and a rank, on the order computed on the device.
        let mut elastic = emb_args(shuffle);
        elastic.extend([
            "--world-size",
            "3",
            "--rank",
            "1",
            "--resume-cursor",
            "1234",
            "--tail",
            "pad",
        ]);
        let expected = cpu_dump(&cpu, &dumps, "emb", &format!("{shuffle}-elastic"), &elastic);
        let path = dumps.join(format!("emb-{shuffle}-elastic-gpu.npy"));
        finish(consume(&gpu.socket, "emb", "cuda:0", &elastic, &path));
        assert!(
            npy_payload(&path) == expected,
            "{shuffle}, rank 1 of 3 from cursor 1234: the tier's batches differ from the CPU backend's"
        );
        wait_for_no_streams(&gpu.socket);
        // Batches of more rows than the ordered gather has thread blocks: each block moves several
        // rows at once (its fast path for one 2-byte float field).
        let mut large = emb_args(shuffle);
        large[1] = "2500";
        let expected = cpu_dump(&cpu, &dumps, "emb", &format!("{shuffle}-large"), &large);
        let path = dumps.join(format!("emb-{shuffle}-large-gpu.npy"));
        finish(consume(&gpu.socket, "emb", "cuda:0", &large, &path));
        assert!(
            npy_payload(&path) == expected,
            "{shuffle}, batches of 2500: the tier's batches differ from the CPU backend's"
        );
        wait_for_no_streams(&gpu.socket);
        let log = gpu.log();
        switched |= log.contains("stream reads the device-memory tier whole from step");
        assert!(log.contains("stream fills the device-memory tier"), "{log}");
        assert!(
            log.contains("stream reads 6 shards from the device-memory tier"),
            "{log}"
        );
        assert!(
            log.contains("stream computes its order on the device"),
            "{log}"
        );
    }
    assert!(
        switched,
        "no stream filling the tier went on with the order on the device once the fill completed"
    );
}

/// A dataset larger than the budget is served as without the tier, bit-exact. Two consumer
/// processes read one copy at once; evicted through the API while they read it, they go on,
/// bit-exact, the tier shows it retiring until they close, then frees it. A dataset evicted with no
/// stream reading it is freed at once: device free memory back to what it was before the tier held
/// it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn eviction_budget_and_sharing() {
    let root = tempfile::tempdir().unwrap();
    // 250 batches of 96 in an epoch of the small dataset: more than a ring's slots, so that a
    // consumer holding batches keeps its stream (and its hold on the tier) open.
    let small = pack(root.path(), "small", 4 * SAMPLES, 21);
    let large = pack(root.path(), "large", 12 * SAMPLES, 22);
    let small_bytes = shard_bytes(&small);
    assert!(shard_bytes(&large) > 2 * small_bytes);
    let cpu_root = root.path().join("cpu-root");
    copy_dataset(&small, &cpu_root.join("small"));
    copy_dataset(&large, &cpu_root.join("large"));
    let cpu = start_cpu(&cpu_root);
    let dumps = root.path().join("dumps");
    std::fs::create_dir_all(&dumps).unwrap();
    // Room for the small dataset, not for the large one.
    let budget = format!("{}", small_bytes + (1 << 20));
    let gpu = start_gpu(root.path(), &["--device-cache", &budget]);
    let device = Device::open(0).unwrap();
    let args = emb_args("full");

    // Larger than the budget: served as without the tier.
    let path = dumps.join("large-gpu.npy");
    finish(consume(&gpu.socket, "large", "cuda:0", &args, &path));
    assert!(npy_payload(&path) == cpu_dump(&cpu, &dumps, "large", "full", &args));
    wait_for_no_streams(&gpu.socket);
    let view = tier(gpu.address());
    assert_eq!(
        (view["admissions"].as_u64(), view["held_bytes"].as_u64()),
        (Some(0), Some(0))
    );

    // The small dataset fills the tier.
    let expected = cpu_dump(&cpu, &dumps, "small", "full", &args);
    let path = dumps.join("small-fill-gpu.npy");
    finish(consume(&gpu.socket, "small", "cuda:0", &args, &path));
    assert!(npy_payload(&path) == expected);
    wait_for_no_streams(&gpu.socket);
    assert_eq!(tier(gpu.address())["held_bytes"], small_bytes);

    // Two consumer processes read it at once from one copy.
    let mut readers: Vec<(Child, PathBuf)> = (0..2)
        .map(|i| {
            let path = dumps.join(format!("small-shared-{i}-gpu.npy"));
            let mut with_hold = args.clone();
            with_hold.extend(["--hold-after", "3"]);
            (
                consume(&gpu.socket, "small", "cuda:0", &with_hold, &path),
                path,
            )
        })
        .collect();
    let _outs: Vec<_> = readers.iter_mut().map(|(c, _)| wait_holding(c)).collect();
    let view = tier(gpu.address());
    assert_eq!(view["datasets"].as_array().unwrap().len(), 1, "{view}");
    assert_eq!(view["datasets"][0]["streams"], 2, "{view}");
    assert_eq!(
        view["held_bytes"], small_bytes,
        "one copy for two streams: {view}"
    );

    // Evicted while both read it: they go on; it is retiring until they close, then freed.
    let view = evict(gpu.address(), "small");
    assert_eq!(view["datasets"][0]["state"], "retiring", "{view}");
    assert_eq!(view["held_bytes"], small_bytes, "{view}");
    for (child, path) in readers {
        finish(child);
        assert!(
            npy_payload(&path) == expected,
            "a stream of an evicted dataset differs"
        );
    }
    wait_for_no_streams(&gpu.socket);
    let view = tier(gpu.address());
    assert_eq!(view["held_bytes"], 0, "{view}");
    assert!(view["datasets"].as_array().unwrap().is_empty(), "{view}");
    // The device's memory now, the two streams' buffers kept for later streams (see
    // `shard_pool`), is the baseline.
    let (baseline, _) = device.memory_info().unwrap();

    // Admitted and filled again: the tier holds it, and its memory is freed when it is evicted
    // with no stream reading it: free memory back to the baseline.
    let path = dumps.join("small-refill-gpu.npy");
    finish(consume(&gpu.socket, "small", "cuda:0", &args, &path));
    assert!(npy_payload(&path) == expected);
    wait_for_no_streams(&gpu.socket);
    assert_eq!(tier(gpu.address())["datasets"][0]["state"], "resident");
    let (held, _) = device.memory_info().unwrap();
    assert!(
        baseline - held >= small_bytes as usize,
        "the tier holds {small_bytes} bytes but free memory fell by {}",
        baseline - held
    );
    let view = evict(gpu.address(), "small");
    assert_eq!(view["held_bytes"], 0, "{view}");
    let (after, _) = device.memory_info().unwrap();
    eprintln!("device free bytes: baseline {baseline}, tier holding {held}, released {after}");
    assert_eq!(
        after, baseline,
        "device memory did not return to its baseline once the tier let the dataset go"
    );

    // Pinning: the API names what it pins, and a dataset unknown to the registry is a 404.
    let pin = common::http::request(
        gpu.address(),
        "PUT",
        "/v1/devices/cuda:0/cache/small/pin",
        &[],
        None,
    );
    assert_eq!(pin.status, 200);
    assert_eq!(pin.json()["datasets"][0]["state"], "pinned");
    common::http::request(
        gpu.address(),
        "PUT",
        "/v1/devices/cuda:0/cache/nothing/pin",
        &[],
        None,
    )
    .assert_error(404, "not_found");
}

/// A dataset whose fields are stored LZ4 (byte-shuffled int32 tokens, fp16 embeddings) is decoded
/// once into the tier by its first stream and then read from there by every stream, in every
/// order: bit-exact against the CPU backend, a corrupt token block zeroed like the CPU backend
/// zeroes it (policy `replace`) or ending the stream naming its shard (`fail`); the tier holds the
/// decoded bytes once (one admission, every later stream a hit).
#[test]
#[ignore = "needs a CUDA GPU"]
fn lz4_datasets_are_decoded_once_into_the_tier() {
    let root = tempfile::tempdir().unwrap();
    // A flipped byte in the middle of a compressed token block of shard 3.
    let (dir, dataset, shard) =
        pack_lz4_with_a_corrupt_block(root.path(), 31, 3, |i| ((i * 7) % 1013) as i32);
    let cpu_root = root.path().join("cpu-root");
    copy_dataset(&dir, &cpu_root.join("lz"));
    let cpu = start_cpu(&cpu_root);
    let dumps = root.path().join("dumps");
    std::fs::create_dir_all(&dumps).unwrap();
    let gpu = start_gpu(root.path(), &["--device-cache", "64M"]);
    let args = |shuffle: &'static str| lz4_args(shuffle, "5");
    let mut streams = 0;
    for shuffle in ["none", "window", "full"] {
        let expected = cpu_dump(&cpu, &dumps, "lz", shuffle, &args(shuffle));
        assert!(!expected.is_empty());
        for stream in ["first", "second"] {
            let path = dumps.join(format!("lz-{shuffle}-{stream}-gpu.npy"));
            finish(consume(&gpu.socket, "lz", "cuda:0", &args(shuffle), &path));
            streams += 1;
            assert!(
                npy_payload(&path) == expected,
                "{shuffle}, {stream} stream: the decoded tier's batches differ from the CPU backend's"
            );
            wait_for_no_streams(&gpu.socket);
        }
    }
    let view = tier(gpu.address());
    assert_eq!(view["admissions"], 1, "{view}");
    assert_eq!(view["hits"], streams - 1, "{view}");
    assert_eq!(view["datasets"][0]["name"], "lz", "{view}");
    assert_eq!(view["datasets"][0]["decoded"], true, "{view}");
    assert_eq!(view["datasets"][0]["state"], "resident", "{view}");
    let decoded: u64 = dataset
        .manifest
        .shards
        .iter()
        .map(|s| s.sample_count)
        .sum::<u64>()
        * (EMB_DIM * 2 + TOK_LEN * 4);
    let held = view["held_bytes"].as_u64().unwrap();
    assert!(
        held >= decoded && held < decoded + (1 << 20),
        "the tier holds {held} bytes for {decoded} decoded: {view}"
    );
    let log = gpu.log();
    assert!(
        log.contains("into") && log.contains("of the device-memory tier in"),
        "{log}"
    );
    assert!(log.contains("MiB, decoded,"), "{log}");

    // With `fail`, the stream ends with an error naming the shard.
    let output = Command::new(consume_bin())
        .arg("--socket")
        .arg(&gpu.socket)
        .args([
            "--dataset",
            "lz",
            "--device",
            "cuda:0",
            "--batch-size",
            "100",
        ])
        .args(["--field", "tok", "--on-corrupt", "fail"])
        .output()
        .unwrap();
    assert!(!output.status.success(), "a corrupt block with policy fail");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let shard_name = shard.file_name().unwrap().to_string_lossy();
    assert!(stderr.contains(&*shard_name), "{stderr}");
}

/// An LZ4 dataset (a corrupt compressed block in it) that the tier does not take (here a tier of
/// 1 MiB; the same with the tier off) is decoded whole into device memory for the streams reading
/// it: bit-exact against the CPU backend in every order, the corrupt block's rows zeros under
/// `replace`; two streams at once read one copy (the API lists it under `decoded_for_streams`,
/// not in the tier), and it is freed 2 s after the last of them closed.
#[test]
#[ignore = "needs a CUDA GPU"]
fn lz4_datasets_the_tier_does_not_take_are_decoded_for_their_streams() {
    let root = tempfile::tempdir().unwrap();
    let (dir, _, _) =
        pack_lz4_with_a_corrupt_block(root.path(), 37, 2, |i| ((i * 11) % 997) as i32);
    let cpu_root = root.path().join("cpu-root");
    copy_dataset(&dir, &cpu_root.join("lz"));
    let cpu = start_cpu(&cpu_root);
    let dumps = root.path().join("dumps");
    std::fs::create_dir_all(&dumps).unwrap();
    let gpu = start_gpu(root.path(), &["--device-cache", "1M"]);
    let args = |shuffle: &'static str| lz4_args(shuffle, "3");
    for shuffle in ["none", "window", "full"] {
        let expected = cpu_dump(&cpu, &dumps, "lz", shuffle, &args(shuffle));
        assert!(!expected.is_empty());
        let path = dumps.join(format!("lz-held-{shuffle}-gpu.npy"));
        finish(consume(&gpu.socket, "lz", "cuda:0", &args(shuffle), &path));
        assert!(
            npy_payload(&path) == expected,
            "{shuffle}: the batches decoded for the stream differ from the CPU backend's"
        );
        wait_for_no_streams(&gpu.socket);
        wait_held_freed(gpu.address(), "decoded_for_streams", shuffle);
    }
    // Two streams at once: one copy, listed with both readers, not in the tier.
    let mut readers: Vec<(Child, PathBuf)> = (0..2)
        .map(|i| {
            let path = dumps.join(format!("lz-held-shared-{i}-gpu.npy"));
            (
                consume(&gpu.socket, "lz", "cuda:0", &lz4_holding_args("3"), &path),
                path,
            )
        })
        .collect();
    let _outs: Vec<_> = readers.iter_mut().map(|(c, _)| wait_holding(c)).collect();
    let view = tier(gpu.address());
    assert_eq!(view["datasets"].as_array().map(Vec::len), Some(0), "{view}");
    let held = view["decoded_for_streams"].as_array().unwrap();
    let log = gpu.log();
    assert_eq!(
        held.len(),
        1,
        "one decoded copy for two streams: {view}\n{log}"
    );
    assert_eq!(held[0]["name"], "lz", "{view}");
    assert_eq!(held[0]["streams"], 2, "{view}\n{log}");
    let mut small_batches = args("full");
    small_batches[1] = "16";
    let expected = cpu_dump(&cpu, &dumps, "lz", "full-16", &small_batches);
    for (child, path) in readers {
        finish(child);
        assert!(npy_payload(&path) == expected, "a shared stream differs");
    }
    wait_for_no_streams(&gpu.socket);
    wait_held_freed(gpu.address(), "decoded_for_streams", "two streams");
    let log = gpu.log();
    assert!(
        log.contains("of device memory held while streams read it in"),
        "{log}"
    );
    assert!(log.contains("is freed: no stream read it for"), "{log}");
}

/// An LZ4 dataset (a corrupt compressed block in it) whose decoded size (4.6 MB) is larger than
/// the device memory for such copies (`--device-shard-memory 2M`) is decoded into page-locked host
/// memory instead (`--host-decoded-memory`): bit-exact against the CPU backend in every order, the
/// corrupt block's rows zeros under `replace`, listed by the API under `decoded_in_host_memory`
/// while a stream reads it, and freed 2 s after the last stream closed. With no host memory for it
/// (`--host-decoded-memory 0`) the streams read it round by round, bit-exact too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn lz4_datasets_larger_than_the_device_shard_memory_are_decoded_into_host_memory() {
    let root = tempfile::tempdir().unwrap();
    let (dir, _, _) =
        pack_lz4_with_a_corrupt_block(root.path(), 43, 1, |i| ((i * 13) % 991) as i32);
    let cpu_root = root.path().join("cpu-root");
    copy_dataset(&dir, &cpu_root.join("lz"));
    let cpu = start_cpu(&cpu_root);
    let dumps = root.path().join("dumps");
    std::fs::create_dir_all(&dumps).unwrap();
    let args = |shuffle: &'static str| lz4_args(shuffle, "5");
    // Without host memory first: the daemons of this test share one log.
    for host in ["0", "64M"] {
        let gpu = start_gpu(
            root.path(),
            &["--device-shard-memory", "2M", "--host-decoded-memory", host],
        );
        for shuffle in ["none", "window", "full"] {
            let expected = cpu_dump(&cpu, &dumps, "lz", shuffle, &args(shuffle));
            let path = dumps.join(format!("lz-host-{host}-{shuffle}-gpu.npy"));
            finish(consume(&gpu.socket, "lz", "cuda:0", &args(shuffle), &path));
            assert!(
                npy_payload(&path) == expected,
                "host memory {host}, {shuffle}: the batches differ from the CPU backend's"
            );
            wait_for_no_streams(&gpu.socket);
        }
        let log = gpu.log();
        if host == "0" {
            assert!(log.contains("round by round"), "{log}");
            assert!(!log.contains("page-locked host memory held"), "{log}");
            continue;
        }
        // A stream holding its batches keeps the copy: listed in host memory, not on the device.
        let path = dumps.join("lz-host-held-gpu.npy");
        let mut reader = consume(&gpu.socket, "lz", "cuda:0", &lz4_holding_args("5"), &path);
        let _out = wait_holding(&mut reader);
        let view = tier(gpu.address());
        assert_eq!(
            view["decoded_for_streams"].as_array().map(Vec::len),
            Some(0),
            "{view}"
        );
        let in_host = view["decoded_in_host_memory"].as_array().unwrap();
        assert_eq!(in_host.len(), 1, "{view}");
        assert_eq!(in_host[0]["name"], "lz", "{view}");
        assert_eq!(in_host[0]["streams"], 1, "{view}");
        assert_eq!(view["decoded_in_host_memory_bytes_max"], 64 << 20, "{view}");
        finish(reader);
        wait_for_no_streams(&gpu.socket);
        wait_held_freed(gpu.address(), "decoded_in_host_memory", "host memory");
        let log = gpu.log();
        assert!(
            log.contains("of page-locked host memory held while streams read it in"),
            "{log}"
        );
        assert!(log.contains("is freed: no stream read it for"), "{log}");
    }
}

/// Waits (10 s at most) for the device to hold no dataset decoded for its streams in the API's list
/// `list` (`decoded_for_streams`, `decoded_in_host_memory`): each is freed `HELD_GRACE` (2 s) after
/// the last stream reading it closed.
fn wait_held_freed(address: SocketAddr, list: &str, after: &str) {
    let started = std::time::Instant::now();
    loop {
        let view = tier(address);
        if view[list].as_array().map(Vec::len) == Some(0) {
            return;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{after}: the decoded copy was not freed: {view}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A raw dataset larger than the registration budget maps no windows to fill the tier from: its
/// first stream copies it into the tier through its reader before its first batch (as a
/// compressed dataset is decoded), and every stream reads it there, bit-exact against the CPU
/// backend. (Before, such a dataset was admitted by the raw tier and never filled: its memory held
/// and no stream served from it.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn raw_datasets_beyond_the_registration_budget_fill_the_tier() {
    let root = tempfile::tempdir().unwrap();
    let dir = pack(root.path(), "emb", SAMPLES, 41);
    // A budget of one 256 KiB window, far below the dataset's shard files.
    assert!(shard_bytes(&dir) > 1 << 20);
    let cpu_root = root.path().join("cpu-root");
    copy_dataset(&dir, &cpu_root.join("emb"));
    let cpu = start_cpu(&cpu_root);
    let dumps = root.path().join("dumps");
    std::fs::create_dir_all(&dumps).unwrap();
    let gpu = start_gpu(
        root.path(),
        &["--device-cache", "64M", "--registered-memory-max", "256K"],
    );
    for shuffle in ["full", "none"] {
        let expected = cpu_dump(&cpu, &dumps, "emb", shuffle, &emb_args(shuffle));
        let path = dumps.join(format!("emb-{shuffle}-beyond-gpu.npy"));
        finish(consume(
            &gpu.socket,
            "emb",
            "cuda:0",
            &emb_args(shuffle),
            &path,
        ));
        assert!(
            npy_payload(&path) == expected,
            "{shuffle}: the tier's batches differ from the CPU backend's"
        );
        wait_for_no_streams(&gpu.socket);
    }
    let view = tier(gpu.address());
    assert_eq!(view["admissions"], 1, "{view}");
    assert_eq!(view["hits"], 1, "{view}");
    assert_eq!(view["datasets"][0]["state"], "resident", "{view}");
    assert_eq!(view["datasets"][0]["decoded"], true, "{view}");
    let log = gpu.log();
    assert!(log.contains("of the device-memory tier in"), "{log}");
    assert!(
        log.contains("stream computes its order on the device"),
        "{log}"
    );
}
