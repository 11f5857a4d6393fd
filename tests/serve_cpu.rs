//! The daemon end to end on the CPU backend, over a real Unix socket: `gpufeed serve` as a child
//! process, consumers through the `gpufeed-client` crate. Covers bit-exact values over a whole epoch,
//! deterministic order, rank coverage, resume and elastic resume, concurrent consumers, malformed
//! frames, the uid allowlist, corrupt-block policies, and slot reclamation when a consumer dies.

mod common;

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::daemon::Daemon;
use gpufeed::format::Dataset;
use gpufeed::input::FieldSource;
use gpufeed::pack::{self, CodecChoice, OnExisting, PackOptions, Quiet, ShuffleChoice};
use gpufeed_client::consumer::{Client, ClientError};
use gpufeed_client::protocol::{
    CorruptPolicy, ErrorCode, FieldRequest, Message, Shuffle, StreamSpec, Tail,
};
use gpufeed_client::{transport, DType};

const SAMPLES: u64 = 1000;
const EMB_DIM: u64 = 8;

fn start_daemon(root: &Path, extra: &[&str]) -> Daemon {
    let binary = Path::new(env!("CARGO_BIN_EXE_gpufeed"));
    let socket = root.join("gpufeed.sock");
    common::daemon::start_daemon(binary, root, socket, "cpu", extra, Stdio::null())
}

/// Token field: sample i holds [i, i*7, i*13, -i] so every sample identifies itself.
fn token_bytes() -> Vec<u8> {
    (0..SAMPLES as i32)
        .flat_map(|i| [i, i * 7, i * 13, -i])
        .flat_map(i32::to_le_bytes)
        .collect()
}

fn embedding_bytes() -> Vec<u8> {
    gpufeed::synth::embedding_f16((SAMPLES * EMB_DIM) as usize, 5)
}

fn pack_dataset(root: &Path, name: &str) -> PathBuf {
    let fields = vec![
        FieldSource::from_bytes("emb", DType::F16, vec![EMB_DIM], embedding_bytes()).unwrap(),
        FieldSource::from_bytes("tok", DType::I32, vec![4], token_bytes()).unwrap(),
    ];
    let options = PackOptions {
        name: name.into(),
        block_bytes: 4096,
        samples_per_shard: Some(128),
        codec: CodecChoice::Auto,
        shuffle: ShuffleChoice::Auto,
        on_existing: OnExisting::Refuse,
        threads: 2,
    };
    let dir = root.join(name);
    pack::pack(&dir, &fields, &options, &Quiet).unwrap();
    dir
}

fn setup() -> (tempfile::TempDir, Daemon) {
    let root = tempfile::tempdir().unwrap();
    pack_dataset(root.path(), "demo");
    let daemon = start_daemon(root.path(), &[]);
    (root, daemon)
}

/// Sample ids of every batch of a stream, in order, plus the stream's final state cursor.
fn sample_ids(socket: &Path, spec: StreamSpec, limit: Option<usize>) -> (Vec<Vec<i32>>, u64) {
    let mut stream = Client::connect(socket).unwrap().open_stream(spec).unwrap();
    let mut batches = Vec::new();
    for batch in stream.by_ref() {
        let batch = batch.unwrap();
        let tok = batch.field("tok").unwrap();
        let ids: Vec<i32> = tok
            .host_bytes()
            .unwrap()
            .chunks_exact(16)
            .map(|c| i32::from_le_bytes(c[..4].try_into().unwrap()))
            .collect();
        batches.push(ids);
        if limit == Some(batches.len()) {
            break;
        }
    }
    (batches, stream.state().cursor)
}

fn spec(batch_size: u32) -> StreamSpec {
    StreamSpec::new("demo", batch_size)
}

#[test]
fn a_whole_epoch_equals_the_source_bit_for_bit() {
    let (_root, daemon) = setup();
    let mut request = spec(50);
    request.fields = vec![
        FieldRequest {
            name: "emb".into(),
            dtype: Some(DType::F32),
        },
        FieldRequest {
            name: "tok".into(),
            dtype: None,
        },
    ];
    let mut stream = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(request)
        .unwrap();
    let (mut emb, mut tok) = (Vec::new(), Vec::new());
    let mut steps = 0;
    for batch in stream.by_ref() {
        let batch = batch.unwrap();
        assert_eq!(batch.step(), steps);
        assert_eq!(batch.samples(), 50);
        let field = batch.field("emb").unwrap();
        assert_eq!(field.dtype, DType::F32);
        assert_eq!(field.shape, &[50, EMB_DIM]);
        emb.extend_from_slice(field.host_bytes().unwrap());
        tok.extend_from_slice(batch.field("tok").unwrap().host_bytes().unwrap());
        steps += 1;
    }
    assert_eq!(steps, 20);
    assert_eq!(tok, token_bytes());
    let source = embedding_bytes();
    let mut expected = vec![0u8; source.len() * 2];
    gpufeed::decode::convert(DType::F16, &source, DType::F32, &mut expected).unwrap();
    assert!(
        emb == expected,
        "embeddings differ from the f16 source converted to f32"
    );
}

#[test]
fn the_same_seed_gives_the_same_order_and_another_seed_does_not() {
    let (_root, daemon) = setup();
    let shuffled = |seed, shuffle| {
        let mut request = spec(40);
        request.seed = seed;
        request.shuffle = shuffle;
        sample_ids(&daemon.socket, request, None).0
    };
    for shuffle in [Shuffle::Full, Shuffle::Window(2)] {
        let first = shuffled(7, shuffle);
        assert_eq!(first, shuffled(7, shuffle));
        assert_ne!(first, shuffled(8, shuffle));
        let unique: HashSet<i32> = first.iter().flatten().copied().collect();
        assert_eq!(unique.len(), 1000);
    }
}

#[test]
fn ranks_are_disjoint_cover_the_epoch_and_get_equal_counts() {
    let (_root, daemon) = setup();
    let mut per_rank = Vec::new();
    for rank in 0..3 {
        let mut request = spec(16);
        request.shuffle = Shuffle::Full;
        request.seed = 3;
        request.rank = rank;
        request.world_size = 3;
        request.tail = Tail::Pad;
        per_rank.push(sample_ids(&daemon.socket, request, None).0);
    }
    let counts: HashSet<usize> = per_rank.iter().map(Vec::len).collect();
    assert_eq!(
        counts,
        HashSet::from([21]),
        "ceil(1000 / 48) = 21 steps on every rank"
    );
    let all: Vec<i32> = per_rank.iter().flatten().flatten().copied().collect();
    let unique: HashSet<i32> = all.iter().copied().collect();
    assert_eq!(unique.len(), 1000, "padding covers every sample");
    assert_eq!(all.len(), 21 * 48);
}

#[test]
fn resuming_at_a_step_equals_the_tail_of_an_uninterrupted_run_also_elastically() {
    let (_root, daemon) = setup();
    let base = |rank, world, batch| {
        let mut request = spec(batch);
        request.shuffle = Shuffle::Window(3);
        request.seed = 11;
        request.rank = rank;
        request.world_size = world;
        request
    };
    let (full, _) = sample_ids(&daemon.socket, base(1, 2, 20), None);
    let mut resumed = base(1, 2, 20);
    resumed.start_at_step(7);
    let (tail, _) = sample_ids(&daemon.socket, resumed, None);
    assert_eq!(tail, full[7..]);

    // Elastic: two ranks consume 5 steps of 20, checkpoint, then three ranks of 10 finish the epoch.
    let mut served: Vec<i32> = Vec::new();
    let mut cursor = 0;
    for rank in 0..2 {
        let (batches, state_cursor) = sample_ids(&daemon.socket, base(rank, 2, 20), Some(5));
        served.extend(batches.into_iter().flatten());
        cursor = state_cursor;
    }
    assert_eq!(cursor, 200);
    for rank in 0..3 {
        let mut request = base(rank, 3, 10);
        request.start_cursor = cursor;
        served.extend(
            sample_ids(&daemon.socket, request, None)
                .0
                .into_iter()
                .flatten(),
        );
    }
    let unique: HashSet<i32> = served.iter().copied().collect();
    assert_eq!(unique.len(), served.len(), "no sample twice");
    assert_eq!(served.len(), 200 + 780, "800 left, 26 full steps of 30");
}

#[test]
fn two_consumers_read_concurrently() {
    let (_root, daemon) = setup();
    let socket = daemon.socket.clone();
    let other = std::thread::spawn(move || {
        let mut request = spec(25);
        request.shuffle = Shuffle::Full;
        sample_ids(&socket, request, None).0
    });
    let mine = sample_ids(&daemon.socket, spec(10), None).0;
    let theirs = other.join().unwrap();
    assert_eq!(mine.concat(), (0..1000).collect::<Vec<i32>>());
    let unique: HashSet<i32> = theirs.concat().into_iter().collect();
    assert_eq!(unique.len(), 1000);
}

fn status(socket: &Path) -> gpufeed_client::protocol::DaemonStatus {
    Client::connect(socket).unwrap().status().unwrap()
}

/// Waits until the daemon's status satisfies `done`, or fails after a generous deadline. This waits on
/// an observable condition (the daemon reclaiming a dead session), not for a fixed time.
fn wait_for_status(socket: &Path, done: impl Fn(&gpufeed_client::protocol::DaemonStatus) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = status(socket);
        if done(&now) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "daemon state never reached the condition: {now:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_killed_consumer_leaks_no_slot_while_another_keeps_reading() {
    let (_root, daemon) = setup();
    let baseline = status(&daemon.socket);
    assert_eq!(baseline.slots_allocated, 0);
    // A reader that holds its stream open, with all its slots, for the whole test.
    let mut survivor = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(spec(10))
        .unwrap();
    let first = survivor.next().unwrap().unwrap();
    drop(first);
    // Slot rings are sized in bytes: a stream of small batches has more slots than its prefetch.
    let survivor_slots = u64::from(survivor.layout().slot_count);
    assert!(survivor_slots >= 4, "{survivor_slots} slots");
    let with_survivor = status(&daemon.socket);
    assert_eq!(with_survivor.slots_allocated, survivor_slots);

    let consumer = example_binary("consume");
    for _ in 0..3 {
        let mut child = Command::new(&consumer)
            .arg("--socket")
            .arg(&daemon.socket)
            .args([
                "--dataset",
                "demo",
                "--batch-size",
                "8",
                "--hold-after",
                "3",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the consume example");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.starts_with("holding"), "consumer said {line:?}");
        let held = status(&daemon.socket);
        assert!(held.slots_allocated > survivor_slots, "{held:?}");
        child.kill().unwrap();
        child.wait().unwrap();
        wait_for_status(&daemon.socket, |s| {
            s.slots_allocated == survivor_slots && s.streams == 1
        });
        // The survivor keeps reading through every kill.
        let batch = survivor.next().unwrap().unwrap();
        assert_eq!(batch.samples(), 10);
        let _ = child.stdin.take().map(|mut stdin| stdin.write_all(b""));
    }
    drop(survivor);
    wait_for_status(&daemon.socket, |s| {
        s.slots_allocated == 0 && s.slot_bytes_allocated == 0 && s.streams == 0
    });
}

/// Path of an example binary built next to the test binaries (`cargo test` builds examples).
fn example_binary(name: &str) -> PathBuf {
    let deps = std::env::current_exe().unwrap();
    let path = deps
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        path.exists(),
        "{} missing: build it with `cargo build --examples`",
        path.display()
    );
    path
}

/// When a malformed frame is sent: before the handshake, or after it.
#[derive(Clone, Copy)]
enum Moment {
    First,
    AfterHello,
}

#[test]
fn malformed_frames_end_only_their_session() {
    let (_root, daemon) = setup();
    let v = gpufeed_client::protocol::PROTOCOL_VERSION as u8;
    let cases: [(Moment, Vec<u8>); 5] = [
        // A length far over the frame bound.
        (Moment::First, u32::MAX.to_le_bytes().to_vec()),
        // Unknown message kind 99.
        (Moment::First, vec![6, 0, 0, 0, v, 0, 99, 0, 0, 0]),
        // A Hello whose string length runs past the frame.
        (Moment::First, vec![6, 0, 0, 0, v, 0, 1, 0, 200, 0]),
        // Kind 6, a Release frame of protocol version 2, unassigned since version 3.
        (Moment::AfterHello, vec![8, 0, 0, 0, v, 0, 6, 0, 0, 0, 0, 0]),
        // A frame only the daemon sends.
        (
            Moment::AfterHello,
            Message::EndOfEpoch { epoch: 0, steps: 0 }.encode(),
        ),
    ];
    for (moment, garbage) in cases {
        let mut raw = UnixStream::connect(&daemon.socket).unwrap();
        if let Moment::AfterHello = moment {
            transport::send(&raw, &Message::Hello { client: "t".into() }, &[]).unwrap();
            let (welcome, _) = transport::recv(&raw).unwrap();
            assert!(matches!(welcome, Message::Welcome { .. }));
        }
        raw.write_all(&garbage).unwrap();
        let (reply, _) = transport::recv(&raw).unwrap();
        match reply {
            Message::Error { code, .. } => {
                assert!(
                    matches!(code, ErrorCode::BadFrame | ErrorCode::BadRequest),
                    "{code:?}"
                )
            }
            other => panic!("expected an error frame, got {other:?}"),
        }
        assert!(
            transport::recv(&raw).is_err(),
            "the session must end after an error"
        );
    }
    // The daemon still serves.
    let (batches, _) = sample_ids(&daemon.socket, spec(100), None);
    assert_eq!(batches.len(), 10);
}

#[test]
fn a_uid_outside_the_allowlist_is_refused() {
    let root = tempfile::tempdir().unwrap();
    pack_dataset(root.path(), "demo");
    let daemon = start_daemon(root.path(), &["--allow-uid", "4242"]);
    match Client::connect(&daemon.socket) {
        Err(ClientError::Daemon { code, message }) => {
            assert_eq!(code, ErrorCode::PermissionDenied);
            assert!(message.contains("not allowed"), "{message}");
        }
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("a foreign uid was let in"),
    }
    // The allowlist names another uid, so the socket lets anyone connect and the allowlist decides
    // (tests/socket_mode.rs); it is owner-only only while the daemon's own uid alone is allowed.
    let mode = std::fs::metadata(&daemon.socket).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(mode.permissions().mode() & 0o777, 0o666);
}

/// Flips a byte of the payload of field `tok`'s only block in shard 2 (samples 256..384), naming the
/// shard file.
fn corrupt_a_block(dir: &Path) -> String {
    let dataset = Dataset::open(dir).unwrap();
    let shard = &dataset.shards[2];
    let field = dataset.field_index("tok").unwrap();
    let block = shard.metadata.field_blocks(field)[0];
    let mut bytes = std::fs::read(&shard.path).unwrap();
    bytes[block.stored_offset as usize + 3] ^= 0x40;
    std::fs::write(&shard.path, bytes).unwrap();
    shard
        .path
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

#[test]
fn corrupt_blocks_fail_the_stream_or_are_replaced_keeping_ranks_in_step() {
    let root = tempfile::tempdir().unwrap();
    let dir = pack_dataset(root.path(), "demo");
    let shard = corrupt_a_block(&dir);
    let daemon = start_daemon(root.path(), &[]);

    let mut stream = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(spec(50))
        .unwrap();
    let error = stream
        .by_ref()
        .find_map(Result::err)
        .expect("the stream must fail");
    let message = error.to_string();
    assert!(
        message.contains(&shard) && message.contains("field 'tok'") && message.contains("block 0"),
        "{message}"
    );

    let mut counts = Vec::new();
    let mut replaced = 0;
    for rank in 0..2 {
        let mut request = spec(25);
        request.rank = rank;
        request.world_size = 2;
        request.on_corrupt = CorruptPolicy::Replace;
        let mut stream = Client::connect(&daemon.socket)
            .unwrap()
            .open_stream(request)
            .unwrap();
        let mut batches = 0;
        for batch in stream.by_ref() {
            let batch = batch.unwrap();
            replaced += batch.replaced();
            if batch.replaced() > 0 {
                let tok = batch.field("tok").unwrap();
                let zero_samples = tok
                    .host_bytes()
                    .unwrap()
                    .chunks_exact(16)
                    .filter(|c| c.iter().all(|&b| b == 0))
                    .count();
                // Sample 0 is all zeros by construction; substitutes are zero too.
                assert!(zero_samples >= batch.replaced() as usize);
            }
            batches += 1;
        }
        counts.push(batches);
    }
    assert_eq!(counts, vec![20, 20], "ranks stay in step");
    assert_eq!(replaced, 128, "every sample of the corrupt block, once");
    assert_eq!(status(&daemon.socket).samples_replaced, replaced as u64);
}
