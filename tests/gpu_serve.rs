//! The daemon end to end on the GPU backend: `gpufeed serve --device cuda:0` as a child process,
//! consumers as separate processes (the `consume` example) that map the device slots the daemon
//! exports. Covers bit-exact values in device memory (against the source and against the CPU backend,
//! for two concurrent consumers, in dataset order and shuffled, compressed and raw fields), the
//! corrupt-block policies, and device memory returning to its baseline after 100 consumers were killed
//! while holding slots.
//!
//! Run on a CUDA machine: `cargo test --release --test gpu_serve -- --include-ignored`. Where the test
//! binary runs away from its build tree, `GPUFEED_BIN` and `GPUFEED_CONSUME_BIN` name the `gpufeed`
//! binary and the `consume` example.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::consumers::{consume_bin, copy_dataset, gpufeed_bin, npy_payload, wait_for_no_streams};
use common::daemon::Daemon;
use gpufeed::device::Device;
use gpufeed::format::Dataset;
use gpufeed::pipeline::gpu::tier::HELD_GRACE;
use gpufeed_client::DType;

const SAMPLES: u64 = 6000;
const EMB_DIM: u64 = 256;
const TOK_LEN: u64 = 128;

fn start_daemon(root: &Path, device: &str) -> Daemon {
    start_daemon_with(root, device, &[])
}

fn start_daemon_with(root: &Path, device: &str, extra: &[&str]) -> Daemon {
    start_daemon_logged(root, device, extra, None)
}

/// [`start_daemon_with`], its log going to `log` when given.
fn start_daemon_logged(root: &Path, device: &str, extra: &[&str], log: Option<&Path>) -> Daemon {
    start_daemon_logged_env(root, device, extra, log, &[])
}

/// [`start_daemon_logged`] with the variables `env` in the daemon's environment.
fn start_daemon_logged_env(
    root: &Path,
    device: &str,
    extra: &[&str],
    log: Option<&Path>,
    env: &[(&str, &str)],
) -> Daemon {
    let socket = root.join(format!("gpufeed-{}.sock", device.replace(':', "")));
    let stderr = match log {
        Some(path) => Stdio::from(std::fs::File::create(path).unwrap()),
        None => Stdio::inherit(),
    };
    common::daemon::start_daemon_env(&gpufeed_bin(), root, socket, device, extra, stderr, env)
}

/// Token field: zipf-like small integers (compressible: LZ4 blocks, byte-shuffled where it pays),
/// with sample i's first element equal to i so that order can be checked.
fn token_bytes() -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut out = Vec::with_capacity((SAMPLES * TOK_LEN * 4) as usize);
    for i in 0..SAMPLES {
        for j in 0..TOK_LEN {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let value = if j == 0 {
                i as i32
            } else {
                // Heavy-tailed: mostly small ids.
                let u = ((state >> 33) as f64 + 1.0) / (1u64 << 31) as f64;
                (1.0 / u.powf(0.8)) as i32 % 50_000
            };
            out.extend_from_slice(&value.to_le_bytes());
        }
    }
    out
}

fn embedding_bytes() -> Vec<u8> {
    gpufeed::synth::embedding_f16((SAMPLES * EMB_DIM) as usize, 11)
}

fn pack_dataset(root: &Path) -> PathBuf {
    let dir = root.join("mixed");
    let fields = vec![
        common::field("emb", DType::F16, &[EMB_DIM], embedding_bytes()),
        common::field("tok", DType::I32, &[TOK_LEN], token_bytes()),
    ];
    common::pack_fields(
        &dir,
        &fields,
        &common::options("mixed", 64 << 10, Some(1000)),
    );
    dir
}

/// Runs the consume example against `socket` with `args` and `--dump`, returning the dumped payload
/// (the .npy data after its header) and the final JSON line.
fn consume_dump(socket: &Path, device: &str, args: &[&str], dump: &Path) -> Child {
    // A mixture names its sources instead (`--source DATASET=WEIGHT`).
    let dataset: &[&str] = if args.contains(&"--source") {
        &[]
    } else {
        &["--dataset", "mixed"]
    };
    Command::new(consume_bin())
        .arg("--socket")
        .arg(socket)
        .args(dataset)
        .args(["--device", device])
        .args(args)
        .arg("--dump")
        .arg(dump)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the consume example")
}

/// `consume` arguments for the raw embedding field alone as f32, batches of 96, in `shuffle` order
/// (windows of two shards) with `seed`: a resident stream, which copies shards ahead in dataset order
/// and window shuffles.
fn emb_rows(shuffle: &'static str, seed: &'static str) -> Vec<&'static str> {
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
        seed,
    ]
}

fn finish(child: Child) -> serde_json::Value {
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "consume failed: {output:?}");
    let text = String::from_utf8(output.stdout).unwrap();
    serde_json::from_str(text.lines().last().unwrap()).unwrap()
}

fn f16_to_f32_bytes(bytes: &[u8]) -> Vec<u8> {
    bytes
        .chunks_exact(2)
        .flat_map(|c| {
            half::f16::from_le_bytes([c[0], c[1]])
                .to_f32()
                .to_le_bytes()
        })
        .collect()
}

/// The same requests from the GPU and the CPU backend, two consumer processes at once on the GPU.
fn compare_backends(root: &Path, requests: &[(&str, Vec<&str>)]) -> Vec<(Vec<u8>, Vec<u8>)> {
    compare_backends_with(root, requests, &[])
}

/// [`compare_backends`] with extra flags for the GPU daemon.
fn compare_backends_with(
    root: &Path,
    requests: &[(&str, Vec<&str>)],
    gpu_flags: &[&str],
) -> Vec<(Vec<u8>, Vec<u8>)> {
    compare_backends_logged(root, requests, gpu_flags, None)
}

/// [`compare_backends_with`], the GPU daemon's log going to `log` when given.
fn compare_backends_logged(
    root: &Path,
    requests: &[(&str, Vec<&str>)],
    gpu_flags: &[&str],
    log: Option<&Path>,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    compare_backends_logged_env(root, requests, gpu_flags, log, &[])
}

/// [`compare_backends_logged`] with the variables `env` in the GPU daemon's environment.
fn compare_backends_logged_env(
    root: &Path,
    requests: &[(&str, Vec<&str>)],
    gpu_flags: &[&str],
    log: Option<&Path>,
    env: &[(&str, &str)],
) -> Vec<(Vec<u8>, Vec<u8>)> {
    let cpu_root = root.join("cpu-root");
    if !cpu_root.join("mixed").exists() {
        copy_dataset(&root.join("mixed"), &cpu_root.join("mixed"));
    }
    let gpu = start_daemon_logged_env(root, "cuda:0", gpu_flags, log, env);
    let cpu = start_daemon(&cpu_root, "cpu");
    let dumps = root
        .join("dumps")
        .join(gpufeed_client::protocol::monotonic_ns().to_string());
    std::fs::create_dir_all(&dumps).unwrap();
    let gpu_children: Vec<Child> = requests
        .iter()
        .map(|(name, args)| {
            consume_dump(
                &gpu.socket,
                "cuda:0",
                args,
                &dumps.join(format!("{name}-gpu.npy")),
            )
        })
        .collect();
    for child in gpu_children {
        let line = finish(child);
        assert!(line["device"].as_str().unwrap().contains("Cuda"), "{line}");
    }
    for (name, args) in requests {
        finish(consume_dump(
            &cpu.socket,
            "cpu",
            args,
            &dumps.join(format!("{name}-cpu.npy")),
        ));
    }
    requests
        .iter()
        .map(|(name, _)| {
            (
                npy_payload(&dumps.join(format!("{name}-gpu.npy"))),
                npy_payload(&dumps.join(format!("{name}-cpu.npy"))),
            )
        })
        .collect()
}

/// A mixture on a CUDA device (assembled on the host, uploaded into device slots) delivers,
/// batch for batch, what the CPU backend delivers: dataset order and a full shuffle, two fields
/// converted and not, a corrupt block in one source replaced by zeros on both, two epochs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_mixture_on_a_device_equals_the_cpu_backend() {
    let root = tempfile::tempdir().unwrap();
    pack_dataset(root.path());
    // The second source: the same fields, other values (its token ids and embeddings shifted).
    let other = root.path().join("other");
    let tokens: Vec<u8> = token_bytes()
        .chunks_exact(4)
        .flat_map(|c| (i32::from_le_bytes(c.try_into().unwrap()) + 1_000_000).to_le_bytes())
        .collect();
    let fields = vec![
        common::field(
            "emb",
            DType::F16,
            &[EMB_DIM],
            gpufeed::synth::embedding_f16((SAMPLES * EMB_DIM) as usize, 12),
        ),
        common::field("tok", DType::I32, &[TOK_LEN], tokens),
    ];
    common::pack_fields(
        &other,
        &fields,
        &common::options("other", 64 << 10, Some(700)),
    );
    let shard = corrupt_an_emb_block(&other);
    copy_dataset(&other, &root.path().join("cpu-root").join("other"));
    let rows = |shuffle: &'static str, batch: &'static str| {
        vec![
            "--source",
            "mixed=0.7",
            "--source",
            "other=0.3",
            "--batch-size",
            batch,
            "--field",
            "emb",
            "--dtype",
            "f32",
            "--field",
            "tok",
            "--shuffle",
            shuffle,
            "--seed",
            "5",
            "--epochs",
            "2",
            "--on-corrupt",
            "replace",
        ]
    };
    let requests = vec![
        ("mixture-order-96", rows("none", "96")),
        ("mixture-full-1000", rows("full", "1000")),
    ];
    let dumps = compare_backends(root.path(), &requests);
    for ((name, _), (gpu, cpu)) in requests.iter().zip(&dumps) {
        assert!(!gpu.is_empty(), "{name}: nothing dumped");
        assert!(gpu == cpu, "{name}: GPU and CPU backends differ");
    }
    // The corrupt block's rows came out as zeros on both (the source's 6000 rows get 3600 of a
    // mixture epoch's 12000 draws: over two epochs every one of them at least once).
    let emb_row = (EMB_DIM * 4) as usize;
    let zero_rows = |dump: &[u8]| {
        dump.chunks_exact(emb_row)
            .filter(|row| row.iter().all(|&b| b == 0))
            .count()
    };
    assert!(
        zero_rows(&dumps[0].0) > 0,
        "no replaced rows in {shard:?}'s mixture"
    );
}

/// A dataset in object storage (a `file://` store) streamed on a device while the node's cache
/// does not hold it yet is assembled on the host as its shards arrive; once the cache holds it
/// whole, a later stream runs on the GPU pipeline. Every batch equals the CPU backend's reading a
/// local copy, in dataset order and a full shuffle.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_dataset_in_object_storage_serves_a_device_before_it_is_fetched_whole() {
    let root = tempfile::tempdir().unwrap();
    let store = tempfile::tempdir().unwrap();
    let source = pack_dataset(store.path());
    copy_dataset(&source, &root.path().join("cpu-root").join("mixed"));
    let url = format!("file://{}", source.display());
    let log = root.path().join("remote.log");
    let dataset = format!("mixed={url}");
    let gpu = start_daemon_logged(root.path(), "cuda:0", &["--dataset", &dataset], Some(&log));
    let cpu = start_daemon(&root.path().join("cpu-root"), "cpu");
    let requests = [
        ("cold-order", emb_rows("none", "3")),
        ("cached-full", emb_rows("full", "4")),
    ];
    for (name, args) in &requests {
        let gpu_dump = root.path().join(format!("{name}-gpu.npy"));
        let cpu_dump = root.path().join(format!("{name}-cpu.npy"));
        let line = finish(consume_dump(&gpu.socket, "cuda:0", args, &gpu_dump));
        assert!(line["device"].as_str().unwrap().contains("Cuda"), "{line}");
        finish(consume_dump(&cpu.socket, "cpu", args, &cpu_dump));
        let (gpu_rows, cpu_rows) = (npy_payload(&gpu_dump), npy_payload(&cpu_dump));
        assert!(!gpu_rows.is_empty(), "{name}: nothing dumped");
        assert!(gpu_rows == cpu_rows, "{name}: GPU and CPU backends differ");
    }
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(
        log.contains("assembled on the host and uploaded")
            && log.contains("device stream filled on the host done"),
        "the first stream did not run before the dataset was fetched whole:\n{log}"
    );
    assert!(
        log.contains("GPU stream done"),
        "no later stream ran on the GPU pipeline:\n{log}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_batches_equal_the_source_and_the_cpu_backend() {
    let root = tempfile::tempdir().unwrap();
    pack_dataset(root.path());
    let requests = vec![
        (
            "emb-f32-ordered",
            vec!["--batch-size", "100", "--field", "emb", "--dtype", "f32"],
        ),
        (
            "tok-shuffled",
            vec![
                "--batch-size",
                "64",
                "--field",
                "tok",
                "--shuffle",
                "full",
                "--seed",
                "7",
            ],
        ),
        (
            "tok-window-rank1",
            vec![
                "--batch-size",
                "50",
                "--field",
                "tok",
                "--shuffle",
                "window",
                "--window-shards",
                "2",
                "--rank",
                "1",
                "--world",
                "3",
                "--dtype",
                "f32",
            ],
        ),
    ];
    let dumps = compare_backends(root.path(), &requests);
    for ((name, _), (gpu, cpu)) in requests.iter().zip(&dumps) {
        assert!(!gpu.is_empty(), "{name}: nothing dumped");
        assert!(gpu == cpu, "{name}: GPU and CPU backends differ");
    }
    // The token (LZ4) streams once more with their blocks read and decoded round by round (the
    // path of datasets larger than the device shard memory) instead of the dataset decoded whole.
    let round_by_round = [("GPUFEED_DECODE_WHOLE", "off")];
    let again =
        compare_backends_logged_env(root.path(), &requests[1..], &[], None, &round_by_round);
    for ((name, _), (gpu, cpu)) in requests[1..].iter().zip(&again) {
        assert!(!gpu.is_empty(), "{name}, round by round: nothing dumped");
        assert!(
            gpu == cpu,
            "{name}, round by round: GPU and CPU backends differ"
        );
    }
    // And against the source itself: the ordered embedding epoch is the source converted by `half`.
    assert_eq!(dumps[0].0, f16_to_f32_bytes(&embedding_bytes()));
    // The shuffled token epoch holds distinct samples (first element = sample id), all but the
    // dropped tail of the permutation.
    let mut ids: Vec<i32> = dumps[1]
        .0
        .chunks_exact((TOK_LEN * 4) as usize)
        .map(|s| i32::from_le_bytes(s[..4].try_into().unwrap()))
        .collect();
    assert_ne!(
        ids,
        (0..ids.len() as i32).collect::<Vec<_>>(),
        "not shuffled"
    );
    assert_eq!(ids.len() as u64, SAMPLES / 64 * 64);
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(
        ids.len() as u64,
        SAMPLES / 64 * 64,
        "a sample was served twice"
    );
    assert!(ids.iter().all(|&id| (0..SAMPLES as i32).contains(&id)));
}

/// The sample ids (first token) of a dumped token epoch, sorted, checked to be distinct.
fn distinct_ids(dump: &[u8]) -> Vec<i32> {
    let mut ids: Vec<i32> = dump
        .chunks_exact((TOK_LEN * 4) as usize)
        .map(|s| i32::from_le_bytes(s[..4].try_into().unwrap()))
        .collect();
    let count = ids.len();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), count, "a sample was served twice");
    ids
}

/// Rows of raw blocks read in place from registered page cache (zero-copy), with a registration
/// budget (4 windows of 256 KiB: enough for registering ahead; shards of about 750 KiB span several windows) smaller than the dataset (about 4.5 MiB), so that windows are evicted,
/// re-registered and pinned while rounds read them: every order mode bit-exact against the CPU
/// backend, every sample once per epoch, and a corrupt raw block found by the in-place checksum.
#[test]
#[ignore = "needs a CUDA GPU"]
fn zero_copy_reads_are_bit_exact_in_every_order_beyond_the_budget() {
    let root = tempfile::tempdir().unwrap();
    pack_dataset(root.path());
    let both = |batch: &'static str, shuffle: &'static str| {
        vec![
            "--batch-size",
            batch,
            "--field",
            "tok",
            "--field",
            "emb",
            "--dtype",
            "f32",
            "--shuffle",
            shuffle,
            "--window-shards",
            "2",
            "--seed",
            "5",
        ]
    };
    let requests = vec![
        ("none", both("128", "none")),
        ("window", both("96", "window")),
        ("full", both("64", "full")),
    ];
    for zero_copy in ["always", "auto"] {
        let flags = [
            "--registered-window",
            "256K",
            "--registered-memory-max",
            "1M",
            "--zero-copy",
            zero_copy,
        ];
        let dumps = compare_backends_with(root.path(), &requests, &flags);
        for ((name, _), (gpu, cpu)) in requests.iter().zip(&dumps) {
            assert!(!gpu.is_empty(), "{zero_copy} {name}: nothing dumped");
            assert!(
                gpu == cpu,
                "{zero_copy} {name}: GPU and CPU backends differ"
            );
        }
    }
    // The embedding field alone, in place, against the source converted by `half`.
    let emb = vec![(
        "emb",
        vec!["--batch-size", "100", "--field", "emb", "--dtype", "f32"],
    )];
    let flags = [
        "--registered-window",
        "256K",
        "--registered-memory-max",
        "1M",
        "--zero-copy",
        "always",
    ];
    let dumps = compare_backends_with(root.path(), &emb, &flags);
    assert_eq!(dumps[0].0, f16_to_f32_bytes(&embedding_bytes()));
    // Full shuffle: every sample of the epoch once (the dump's first field is the token field).
    let tok_full = vec![(
        "full-tok",
        vec![
            "--batch-size",
            "64",
            "--field",
            "tok",
            "--shuffle",
            "full",
            "--seed",
            "5",
        ],
    )];
    let full = compare_backends_with(root.path(), &tok_full, &flags);
    assert_eq!(distinct_ids(&full[0].0).len() as u64, SAMPLES / 64 * 64);
    // Resident streams: the raw embedding field alone, the whole dataset mapped for the stream's
    // life (default budget), every order planned row by row in place.
    let emb_orders = |shuffle| emb_rows(shuffle, "3");
    let resident = vec![
        ("resident-none", emb_orders("none")),
        ("resident-window", emb_orders("window")),
        ("resident-full", emb_orders("full")),
    ];
    // Shards copied ahead into device memory (in order and window shuffle): room for every shard
    // (the default), for two of the six (slots refilled as the stream moves on, a window of two
    // shards evicting the last), and none.
    for (zero_copy, device_shards) in [
        ("always", "4G"),
        ("auto", "4G"),
        ("auto", "2M"),
        ("always", "0"),
    ] {
        let flags = [
            "--registered-window",
            "256K",
            "--zero-copy",
            zero_copy,
            "--device-shard-memory",
            device_shards,
        ];
        let dumps = compare_backends_with(root.path(), &resident, &flags);
        for ((name, _), (gpu, cpu)) in resident.iter().zip(&dumps) {
            assert!(
                !gpu.is_empty(),
                "{zero_copy} {device_shards} {name}: nothing dumped"
            );
            assert!(
                gpu == cpu,
                "{zero_copy} {device_shards} {name}: GPU and CPU backends differ"
            );
        }
    }
    // Beyond the registration budget (1M; the embedding shards are larger): resident streams in
    // order and in a window shuffle copy each shard through windows registered only for their
    // copies, and read every row from a device copy. Three streams at once share the budget (so
    // some windows are copied from pageable memory). Room for every shard; for five (the window
    // shuffle's two windows of two shards and one more: both orders streamed); for three (in order
    // streamed with slots refilled; the window shuffle stages blocks instead). Each shard spans
    // several windows, which the loader shares with its copy threads (the default two; none: the
    // loader alone; more threads than a shard has windows). The full shuffle reads the rows of the
    // windows the budget holds in place and copies the others' on as many row copy threads (two;
    // the default; sixteen).
    for (device_shards, copy_threads) in [("4G", "2"), ("5M", "0"), ("3M", "16")] {
        let flags = [
            "--loader-copy-threads",
            copy_threads,
            "--registered-window",
            "256K",
            "--registered-memory-max",
            "1M",
            "--zero-copy",
            "auto",
            "--device-shard-memory",
            device_shards,
        ];
        let log = root.path().join(format!("streamed-{device_shards}.log"));
        let dumps = compare_backends_logged(root.path(), &resident, &flags, Some(&log));
        for ((name, _), (gpu, cpu)) in resident.iter().zip(&dumps) {
            assert!(
                !gpu.is_empty(),
                "streamed {device_shards} {name}: nothing dumped"
            );
            assert!(
                gpu == cpu,
                "streamed {device_shards} {name}: GPU and CPU backends differ"
            );
        }
        let log = std::fs::read_to_string(&log).unwrap();
        let streamed = log.matches("through the registration budget").count();
        let expected = if device_shards == "3M" { 1 } else { 2 };
        assert!(
            streamed >= expected,
            "streamed {device_shards}: {streamed} streamed streams, expected {expected}:\n{log}"
        );
        // The full shuffle beyond the budget: the rows of windows the budget has no room for are
        // copied by host threads into each round's staging (once it registered every window per
        // round, or staged a whole block per row, far below the link's rate).
        assert!(
            log.contains("full shuffle beyond the registration budget"),
            "streamed {device_shards}: the full shuffle did not copy rows:\n{log}"
        );
    }
    // A corrupt raw embedding block read in place: zeroed like the CPU backend does.
    let dataset = Dataset::open(&root.path().join("mixed")).unwrap();
    let shard = &dataset.shards[2];
    let emb_block = shard
        .metadata
        .field_blocks(dataset.field_index("emb").unwrap())[1];
    for path in [
        shard.path.clone(),
        root.path()
            .join("cpu-root/mixed")
            .join(shard.path.file_name().unwrap()),
    ] {
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[(emb_block.stored_offset + 64) as usize] ^= 0x10;
        std::fs::write(&path, bytes).unwrap();
    }
    let corrupt = vec![(
        "corrupt-full",
        vec![
            "--batch-size",
            "64",
            "--field",
            "emb",
            "--dtype",
            "f32",
            "--shuffle",
            "full",
            "--on-corrupt",
            "replace",
        ],
    )];
    let dumps = compare_backends_with(root.path(), &corrupt, &flags);
    assert!(dumps[0].0 == dumps[0].1, "GPU and CPU substitutes differ");
    // The same from a resident stream (found when it opens), and `fail` ends it naming the shard.
    let resident_flags = ["--registered-window", "256K", "--zero-copy", "always"];
    let dumps = compare_backends_with(root.path(), &corrupt, &resident_flags);
    assert!(
        dumps[0].0 == dumps[0].1,
        "resident: GPU and CPU substitutes differ"
    );
    let gpu = start_daemon_with(root.path(), "cuda:0", &resident_flags);
    let output = Command::new(consume_bin())
        .arg("--socket")
        .arg(&gpu.socket)
        .args([
            "--dataset",
            "mixed",
            "--device",
            "cuda:0",
            "--batch-size",
            "64",
            "--field",
            "emb",
            "--shuffle",
            "full",
        ])
        .output()
        .unwrap();
    assert!(!output.status.success(), "a corrupt block with policy fail");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let shard_name = shard.path.file_name().unwrap().to_string_lossy();
    assert!(stderr.contains(&*shard_name), "{stderr}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn corrupt_blocks_are_handled_like_the_cpu_backend() {
    let root = tempfile::tempdir().unwrap();
    let dir = pack_dataset(root.path());
    // Flip a byte in the middle of a compressed token block of shard 3, and in a raw embedding block.
    let dataset = Dataset::open(&dir).unwrap();
    let shard = &dataset.shards[3];
    let tok = shard
        .metadata
        .field_blocks(dataset.field_index("tok").unwrap())[1];
    let emb = shard
        .metadata
        .field_blocks(dataset.field_index("emb").unwrap())[2];
    let mut bytes = std::fs::read(&shard.path).unwrap();
    bytes[(tok.stored_offset + tok.stored_bytes as u64 / 2) as usize] ^= 0x5A;
    bytes[(emb.stored_offset + 100) as usize] ^= 0x01;
    std::fs::write(&shard.path, bytes).unwrap();
    let requests = vec![
        (
            "replace",
            vec![
                "--batch-size",
                "100",
                "--on-corrupt",
                "replace",
                "--field",
                "tok",
                "--field",
                "emb",
                "--dtype",
                "f32",
            ],
        ),
        (
            // In a window shuffle the corrupt LZ4 block may be read ahead of the rows that need it.
            "replace-window",
            vec![
                "--batch-size",
                "64",
                "--on-corrupt",
                "replace",
                "--field",
                "tok",
                "--shuffle",
                "window",
                "--window-shards",
                "2",
                "--seed",
                "11",
            ],
        ),
    ];
    // By default the small LZ4 dataset is decoded whole for each stream (see
    // `DeviceTier::acquire_held`); `GPUFEED_DECODE_WHOLE=off` reads its blocks round by round,
    // the path of datasets larger than the device shard memory.
    let whole: &[(&str, &str)] = &[];
    let round_by_round: &[(&str, &str)] = &[("GPUFEED_DECODE_WHOLE", "off")];
    for env in [whole, round_by_round] {
        let dumps = compare_backends_logged_env(root.path(), &requests, &[], None, env);
        for ((name, _), (gpu, cpu)) in requests.iter().zip(&dumps) {
            assert!(!gpu.is_empty(), "{name} {env:?}: nothing dumped");
            assert!(gpu == cpu, "{name} {env:?}: GPU and CPU substitutes differ");
        }
        // With `fail` (the default policy), the GPU stream ends with an error naming the shard.
        let gpu = start_daemon_logged_env(root.path(), "cuda:0", &[], None, env);
        assert_fails_naming(&gpu.socket, &["--batch-size", "100"], &shard.path);
    }
}

/// Flips a byte of raw `emb` block 2 of shard 3 of the dataset at `dir`; returns the shard's path.
fn corrupt_an_emb_block(dir: &Path) -> PathBuf {
    let dataset = Dataset::open(dir).unwrap();
    let shard = &dataset.shards[3];
    let emb = shard
        .metadata
        .field_blocks(dataset.field_index("emb").unwrap())[2];
    let mut bytes = std::fs::read(&shard.path).unwrap();
    bytes[(emb.stored_offset + 100) as usize] ^= 0x01;
    std::fs::write(&shard.path, bytes).unwrap();
    shard.path.clone()
}

/// A GPU consumer of `mixed` with `args` fails, its error naming the file `shard`.
fn assert_fails_naming(socket: &Path, args: &[&str], shard: &Path) {
    let output = Command::new(consume_bin())
        .arg("--socket")
        .arg(socket)
        .args(["--dataset", "mixed", "--device", "cuda:0"])
        .args(args)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    let shard_name = shard.file_name().unwrap().to_string_lossy();
    assert!(stderr.contains(&*shard_name), "{stderr}");
}

/// A full shuffle of a dataset larger than the daemon's memory reads its rows from the disk
/// (`GPUFEED_ROW_READS=disk` stands in for a dataset beyond the memory limit) and verifies each
/// block as it is first read: batches are bit-exact against the CPU backend, at batch sizes whose
/// rounds read many rows of a block and few; a corrupt raw block's rows are zeros counted like the
/// CPU backend's under `replace`, and the stream fails naming the shard under `fail`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn full_shuffle_rows_read_from_the_disk_are_bit_exact_and_corrupt_blocks_handled() {
    let root = tempfile::tempdir().unwrap();
    let shard = corrupt_an_emb_block(&pack_dataset(root.path()));
    let full = |batch: &'static str, seed: &'static str, policy: &'static str| {
        vec![
            "--batch-size",
            batch,
            "--field",
            "emb",
            "--dtype",
            "f32",
            "--shuffle",
            "full",
            "--seed",
            seed,
            "--on-corrupt",
            policy,
        ]
    };
    let requests = vec![
        ("full-96", full("96", "5", "replace")),
        ("full-1000", full("1000", "9", "replace")),
    ];
    let flags = [
        "--registered-window",
        "256K",
        "--registered-memory-max",
        "1M",
    ];
    let env = [("GPUFEED_ROW_READS", "disk")];
    let log = root.path().join("disk-rows.log");
    let dumps = compare_backends_logged_env(root.path(), &requests, &flags, Some(&log), &env);
    for ((name, _), (gpu, cpu)) in requests.iter().zip(&dumps) {
        assert!(!gpu.is_empty(), "{name}: nothing dumped");
        assert!(gpu == cpu, "{name}: GPU and CPU backends differ");
    }
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(
        log.contains("rows read from the disk at a queue depth"),
        "the full shuffle did not read rows from the disk:\n{log}"
    );
    assert!(
        log.contains("found reading rows from the disk"),
        "the corrupt block was not found by a disk read:\n{log}"
    );
    // With `fail`, the stream ends with an error naming the shard.
    let gpu = start_daemon_logged_env(root.path(), "cuda:0", &flags, None, &env);
    assert_fails_naming(&gpu.socket, &full("96", "5", "fail"), &shard);
}

/// Beyond the daemon's memory (`GPUFEED_MEMORY_LIMIT=1M` stands in for a dataset larger than it),
/// a window shuffle reads its first steps' rows from the disk (its cold start), then copies shards
/// ahead with each shard's blocks verified by the loader just before its copy, and dataset order
/// stages its blocks: both bit-exact against the CPU backend, a corrupt
/// raw block's rows zeros under `replace` (found by the loader's check, said in the log), and the
/// window shuffle fails naming the shard under `fail`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn beyond_the_memory_limit_shards_are_verified_as_copied_and_corrupt_blocks_handled() {
    let root = tempfile::tempdir().unwrap();
    let shard = corrupt_an_emb_block(&pack_dataset(root.path()));
    let rows = |shuffle: &'static str, batch: &'static str, policy: &'static str| {
        vec![
            "--batch-size",
            batch,
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
            "--on-corrupt",
            policy,
        ]
    };
    let requests = vec![
        ("window-96", rows("window", "96", "replace")),
        ("window-1000", rows("window", "1000", "replace")),
        ("order-96", rows("none", "96", "replace")),
    ];
    // The slot memory is given: its default is bounded by the (here tiny) memory limit.
    let flags = [
        "--registered-window",
        "256K",
        "--registered-memory-max",
        "1M",
        "--slot-memory-max",
        "256M",
    ];
    // The window shuffles' first 3 steps read their rows from the disk (a cold start), the others
    // from the loader's copies.
    let env = [
        ("GPUFEED_MEMORY_LIMIT", "1M"),
        ("GPUFEED_COLD_START_STEPS", "3"),
    ];
    let log = root.path().join("beyond-memory.log");
    let dumps = compare_backends_logged_env(root.path(), &requests, &flags, Some(&log), &env);
    for ((name, _), (gpu, cpu)) in requests.iter().zip(&dumps) {
        assert!(!gpu.is_empty(), "{name}: nothing dumped");
        assert!(gpu == cpu, "{name}: GPU and CPU backends differ");
    }
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(
        log.contains("found checking the shard before its copy"),
        "the loader did not find the corrupt block:\n{log}"
    );
    assert!(
        log.contains("(until step 3) read their rows from the disk"),
        "no cold start:\n{log}"
    );
    let gpu = start_daemon_logged_env(root.path(), "cuda:0", &flags, None, &env);
    assert_fails_naming(&gpu.socket, &rows("window", "96", "fail"), &shard);
}

/// Shard slots go back to the device's pool when a stream closes, and the next stream that copies
/// shards ahead takes them (the daemon's log says how many it kept): streams one after another, in
/// dataset order, a window shuffle and dataset order again, each bit-exact against the CPU backend
/// although its slots still hold the previous stream's shards when it starts. The batches are small,
/// so each stream gathers several in one round (the log counts them). The daemon plans rows on the
/// host (`GPUFEED_DEVICE_ORDER=off`): with the order computed on the device a window shuffle inside
/// the registration budget reads in place and copies no shards (copying ahead remains the path of
/// window shuffles beyond the budget, and of devices without the ordered gather).
#[test]
#[ignore = "needs a CUDA GPU"]
fn shard_slots_kept_from_a_closed_stream_serve_the_next() {
    let root = tempfile::tempdir().unwrap();
    pack_dataset(root.path());
    let cpu_root = root.path().join("cpu-root");
    copy_dataset(&root.path().join("mixed"), &cpu_root.join("mixed"));
    let log = root.path().join("pool.log");
    let gpu = start_daemon_logged_env(
        root.path(),
        "cuda:0",
        &[],
        Some(&log),
        &[("GPUFEED_DEVICE_ORDER", "off")],
    );
    let cpu = start_daemon(&cpu_root, "cpu");
    let emb = |shuffle| emb_rows(shuffle, "6");
    for (index, shuffle) in ["none", "window", "none"].into_iter().enumerate() {
        let gpu_dump = root.path().join(format!("pool-{index}-gpu.npy"));
        let cpu_dump = root.path().join(format!("pool-{index}-cpu.npy"));
        finish(consume_dump(
            &gpu.socket,
            "cuda:0",
            &emb(shuffle),
            &gpu_dump,
        ));
        // The stream is closed, and its slots handed back, once the daemon counts no stream.
        wait_for_no_streams(&gpu.socket);
        finish(consume_dump(&cpu.socket, "cpu", &emb(shuffle), &cpu_dump));
        let gpu_rows = npy_payload(&gpu_dump);
        assert!(
            !gpu_rows.is_empty(),
            "stream {index} ({shuffle}): nothing dumped"
        );
        assert!(
            gpu_rows == npy_payload(&cpu_dump),
            "stream {index} ({shuffle}): GPU and CPU backends differ"
        );
    }
    let log = std::fs::read_to_string(&log).unwrap();
    let kept: Vec<usize> = log
        .lines()
        .filter(|line| line.contains("stream copies shards ahead into"))
        .map(|line| {
            let (_, after) = line.split_once('(').expect("the kept count in parentheses");
            after.split(' ').next().unwrap().parse().unwrap()
        })
        .collect();
    assert_eq!(kept.len(), 3, "three streams copying shards ahead:\n{log}");
    // Batches of 96 rows are small: rounds gathered several at once, bit-exact above.
    let grouped: Vec<u64> = log
        .lines()
        .filter_map(|line| line.split_once(" batches gathered in groups"))
        .map(|(before, _)| before.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(grouped.len(), 3, "three streams' summaries:\n{log}");
    assert!(
        grouped.iter().all(|&n| n > 0),
        "a stream gathered no batches in groups ({grouped:?}):\n{log}"
    );
    assert_eq!(kept[0], 0, "the first stream found slots kept:\n{log}");
    assert!(
        kept[1] > 0 && kept[2] > 0,
        "later streams kept no slots ({kept:?}):\n{log}"
    );
}

/// Waits until copies decoded for streams that closed are freed: they stay `HELD_GRACE` after
/// their last stream closed (a consumer's next epoch finds them), so a baseline is taken after
/// that.
fn wait_for_held_copies_freed() {
    std::thread::sleep(HELD_GRACE + std::time::Duration::from_millis(500));
}

/// Waits (`HELD_GRACE` and 5 s more at most) for the free memory of `device` to be back at
/// `baseline`; returns what it is then.
fn free_memory_back_to(device: &Device, baseline: usize) -> usize {
    let deadline = std::time::Instant::now() + HELD_GRACE + std::time::Duration::from_secs(5);
    loop {
        let free = device.memory_info().unwrap().0;
        if free == baseline || std::time::Instant::now() > deadline {
            return free;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_memory_returns_to_baseline_after_100_killed_consumers() {
    let root = tempfile::tempdir().unwrap();
    pack_dataset(root.path());
    let daemon = start_daemon(root.path(), "cuda:0");
    let device = Device::open(0).unwrap();
    let spawn = || {
        Command::new(consume_bin())
            .arg("--socket")
            .arg(&daemon.socket)
            .args([
                "--dataset",
                "mixed",
                "--device",
                "cuda:0",
                "--batch-size",
                "200",
                "--dtype",
                "f32",
                "--hold-after",
                "3",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap()
    };
    // One consumer run to the end first, so that whatever the daemon sets up once is in the baseline.
    let mut first = spawn();
    drop(first.stdin.take());
    first.wait().unwrap();
    wait_for_no_streams(&daemon.socket);
    wait_for_held_copies_freed();
    let (baseline, _) = device.memory_info().unwrap();
    let mut during = usize::MAX;
    for kill in 0..100 {
        let mut child = spawn();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.starts_with("holding"), "consumer {kill} said {line:?}");
        if kill == 0 {
            during = device.memory_info().unwrap().0;
        }
        child.kill().unwrap();
        child.wait().unwrap();
        wait_for_no_streams(&daemon.socket);
    }
    let after = free_memory_back_to(&device, baseline);
    eprintln!(
        "device free bytes: baseline {baseline}, with a consumer {during}, after 100 kills {after}"
    );
    assert!(during < baseline, "a stream did not use device memory?");
    assert_eq!(
        after, baseline,
        "device memory did not return to its baseline"
    );
}

/// One daemon serving two devices (`--device cuda:0,cuda:1`), sharing one registry of page-cache
/// windows: a consumer on each device at once, each bit-exact against the CPU backend in a shuffled
/// order; a stream asking for a device the daemon does not serve is refused naming the ones it
/// serves, and the others go on; consumers killed while holding batches on both devices leave each
/// device's free memory at its baseline; one device's stream failing on a corrupt block leaves the
/// other device's stream and the daemon serving. Run on a machine with two GPUs:
/// `gpu_serve --include-ignored two_devices` (scripts/gpu-multi.sh); the single-GPU scripts skip it.
#[test]
#[ignore = "needs two CUDA GPUs"]
fn two_devices_are_served_by_one_daemon() {
    let devices = gpufeed::device::Device::count().unwrap_or(0);
    assert!(
        devices >= 2,
        "this test needs two CUDA GPUs and sees {devices}: run it on a machine with two (the \
         single-GPU scripts skip it with --skip two_devices)"
    );
    serve_a_device_list("cuda:0,cuda:1", &["cuda:0", "cuda:1"]);
}

/// What a single GPU allows of the test above: `--device all` on a machine with one GPU is a device
/// list of one; two consumer processes on it at once bit-exact, a device it does not serve refused
/// naming it, kill safety, and one stream failing on a corrupt block while another stream on the
/// same device goes on.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_device_list_of_one_gpu_serves_like_two() {
    let devices = gpufeed::device::Device::count().unwrap_or(0);
    assert!(devices >= 1, "this test needs a CUDA GPU");
    if devices > 1 {
        eprintln!(
            "{devices} GPUs: two_devices_are_served_by_one_daemon covers them; --device all here"
        );
    }
    let served: Vec<String> = (0..devices).map(|i| format!("cuda:{i}")).collect();
    // Two consumers on the first device (on the first two with several).
    let consumers = [served[0].as_str(), served[1.min(devices - 1)].as_str()];
    serve_a_device_list("all", &consumers);
}

/// The daemon's refusal of a stream of `mixed` on CUDA device `ordinal`, asked for over a raw
/// connection.
fn open_stream_refusal(socket: &Path, ordinal: u32) -> String {
    use gpufeed_client::protocol::{Message, StreamSpec};
    use gpufeed_client::transport;
    let socket = std::os::unix::net::UnixStream::connect(socket).unwrap();
    let hello = Message::Hello {
        client: "gpu_serve test".to_string(),
    };
    transport::send(&socket, &hello, &[]).unwrap();
    assert!(matches!(
        transport::recv(&socket).unwrap().0,
        Message::Welcome { .. }
    ));
    let mut spec = StreamSpec::new("mixed", 8);
    spec.device = gpufeed_client::protocol::Device::Cuda(ordinal);
    transport::send(&socket, &Message::OpenStream(spec), &[]).unwrap();
    match transport::recv(&socket).unwrap().0 {
        Message::Error { message, .. } => message,
        other => panic!("expected a refusal of cuda:{ordinal}, got {other:?}"),
    }
}

/// The checks of [`two_devices_are_served_by_one_daemon`] for a daemon started with `--device
/// device_flag`, with one consumer on each of `consumers` (two).
fn serve_a_device_list(device_flag: &str, consumers: &[&str; 2]) {
    let root = tempfile::tempdir().unwrap();
    pack_dataset(root.path());
    let cpu_root = root.path().join("cpu-root");
    copy_dataset(&root.path().join("mixed"), &cpu_root.join("mixed"));
    let log = root.path().join("two-devices.log");
    let gpu = start_daemon_logged(root.path(), device_flag, &[], Some(&log));
    let cpu = start_daemon(&cpu_root, "cpu");
    let dumps = root.path().join("dumps");
    std::fs::create_dir_all(&dumps).unwrap();
    let mut distinct: Vec<&str> = consumers.to_vec();
    distinct.dedup();
    let served_list = distinct.join(", ");
    if distinct.len() > 1 {
        // One registry of page-cache windows serves both devices (portable registrations).
        let log_text = std::fs::read_to_string(&log).unwrap();
        assert!(
            log_text.contains(&format!("page-cache registrations shared by {served_list}")),
            "{log_text}"
        );
    }
    let args = emb_rows("window", "4");
    // Both devices at once, then the CPU reference.
    let children: Vec<(Child, &str)> = consumers
        .iter()
        .enumerate()
        .map(|(i, &device)| {
            let dump = dumps.join(format!("consumer{i}.npy"));
            (consume_dump(&gpu.socket, device, &args, &dump), device)
        })
        .collect();
    for (child, device) in children {
        let line = finish(child);
        assert!(
            line["device"].as_str().unwrap().contains("Cuda"),
            "{device}: {line}"
        );
    }
    finish(consume_dump(
        &cpu.socket,
        "cpu",
        &args,
        &dumps.join("cpu.npy"),
    ));
    let reference = npy_payload(&dumps.join("cpu.npy"));
    assert!(!reference.is_empty());
    for (i, device) in consumers.iter().enumerate() {
        assert!(
            npy_payload(&dumps.join(format!("consumer{i}.npy"))) == reference,
            "{device}: GPU and CPU backends differ"
        );
    }
    // A device the daemon does not serve: refused, naming the served ones; the daemon serves on.
    // (Asked for with a raw request: a consumer would fail opening a device its host lacks.)
    let message = open_stream_refusal(&gpu.socket, 7);
    assert!(message.contains(&served_list), "{message}");
    // Consumers killed while holding batches on each device: their sessions end, each device's
    // free memory returns to what it was before them, and the daemon serves both devices again.
    wait_for_no_streams(&gpu.socket);
    let opened: Vec<Device> = (0..distinct.len())
        .map(|i| Device::open(i).unwrap())
        .collect();
    wait_for_held_copies_freed();
    let baselines: Vec<usize> = opened.iter().map(|d| d.memory_info().unwrap().0).collect();
    for round in 0..5 {
        for &device in consumers {
            let mut child = Command::new(consume_bin())
                .arg("--socket")
                .arg(&gpu.socket)
                .args([
                    "--dataset",
                    "mixed",
                    "--device",
                    device,
                    "--batch-size",
                    "200",
                ])
                .args(["--dtype", "f32", "--hold-after", "3"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap();
            let mut line = String::new();
            BufReader::new(child.stdout.take().unwrap())
                .read_line(&mut line)
                .unwrap();
            assert!(
                line.starts_with("holding"),
                "{device} kill {round}: {line:?}"
            );
            child.kill().unwrap();
            child.wait().unwrap();
        }
        wait_for_no_streams(&gpu.socket);
    }
    for (index, device) in opened.iter().enumerate() {
        let after = free_memory_back_to(device, baselines[index]);
        assert_eq!(
            after, baselines[index],
            "cuda:{index}: device memory did not return to its baseline after the kills"
        );
    }
    for (i, &device) in consumers.iter().enumerate() {
        let dump = dumps.join(format!("again-{i}.npy"));
        finish(consume_dump(&gpu.socket, device, &args, &dump));
        assert!(npy_payload(&dump) == reference, "{device}: after the kills");
    }
    // One device's stream failing (a corrupt block, policy `fail`) while the other device's stream
    // (policy `replace`) runs: the failure ends only its own stream, the other epoch completes, and
    // both devices serve on.
    let dataset = Dataset::open(&root.path().join("mixed")).unwrap();
    let shard = &dataset.shards[1];
    let block = shard
        .metadata
        .field_blocks(dataset.field_index("emb").unwrap())[0];
    let mut bytes = std::fs::read(&shard.path).unwrap();
    bytes[(block.stored_offset + 64) as usize] ^= 0x10;
    std::fs::write(&shard.path, bytes).unwrap();
    // A fresh daemon: the running one verified every block already (its record of verified blocks
    // assumes shards do not change in place).
    drop(gpu);
    let gpu = start_daemon(root.path(), device_flag);
    let corrupt_args = |policy: &'static str| {
        vec![
            "--dataset",
            "mixed",
            "--batch-size",
            "64",
            "--field",
            "emb",
            "--dtype",
            "f32",
            "--on-corrupt",
            policy,
        ]
    };
    let spawn = |device: &str, policy: &'static str| {
        Command::new(consume_bin())
            .arg("--socket")
            .arg(&gpu.socket)
            .args(["--device", device])
            .args(corrupt_args(policy))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let failing = spawn(consumers[1], "fail");
    let serving = spawn(consumers[0], "replace");
    let failed = failing.wait_with_output().unwrap();
    assert!(
        !failed.status.success(),
        "{} with policy fail succeeded",
        consumers[1]
    );
    let stderr = String::from_utf8_lossy(&failed.stderr);
    let shard_name = shard.path.file_name().unwrap().to_string_lossy();
    assert!(stderr.contains(&*shard_name), "{stderr}");
    let served = serving.wait_with_output().unwrap();
    assert!(
        served.status.success(),
        "{} ended with {}'s failure",
        consumers[0],
        consumers[1]
    );
    let line: serde_json::Value = serde_json::from_str(
        String::from_utf8_lossy(&served.stdout)
            .lines()
            .last()
            .unwrap(),
    )
    .unwrap();
    assert!(line["replaced"].as_u64().unwrap() > 0, "{line}");
    let after_failure = spawn(consumers[1], "replace").wait_with_output().unwrap();
    assert!(
        after_failure.status.success(),
        "{} after its stream failed",
        consumers[1]
    );
}
