//! Mixture streams end to end on the CPU backend, over a real Unix socket: `gpufeed serve` as a
//! child process, consumers through the `gpufeed-client` crate. Every sample of every source
//! names itself (`id` = source, index), so each row says where it came from. Covers the realised
//! proportions over an epoch, the rule when a source's epoch ends, determinism for a seed, resume
//! and elastic resume (4 ranks, then 3), and the refusal of sources whose fields disagree.

mod common;

use std::collections::HashSet;
use std::path::Path;
use std::process::Stdio;

use common::daemon::Daemon;
use gpufeed::input::FieldSource;
use gpufeed::pack::{self, CodecChoice, OnExisting, PackOptions, Quiet, ShuffleChoice};
use gpufeed_client::consumer::{Client, ClientError};
use gpufeed_client::protocol::{MixtureSource, Shuffle, StreamSpec, Tail};
use gpufeed_client::spec::StreamState;
use gpufeed_client::DType;

/// Samples of the source "web" (source 0) and "code" (source 1).
const WEB: u64 = 3000;
const CODE: u64 = 700;

/// `id`: [source, index] as i32 pairs; `emb`: 4 f32 values derived from them.
fn fields(source: i32, samples: u64, id_dtype: DType, extra: bool) -> Vec<FieldSource> {
    let ids: Vec<u8> = (0..samples as i32)
        .flat_map(|i| [source, i])
        .flat_map(|v| match id_dtype {
            DType::I64 => i64::from(v).to_le_bytes().to_vec(),
            _ => v.to_le_bytes().to_vec(),
        })
        .collect();
    let emb: Vec<u8> = (0..samples as i32)
        .flat_map(|i| (0..4).map(move |k| (source * 100_000 + i * 4 + k) as f32))
        .flat_map(f32::to_le_bytes)
        .collect();
    let mut fields = vec![
        FieldSource::from_bytes("id", id_dtype, vec![2], ids).unwrap(),
        FieldSource::from_bytes("emb", DType::F32, vec![4], emb).unwrap(),
    ];
    if extra {
        let flags = vec![1u8; samples as usize];
        fields.push(FieldSource::from_bytes("flag", DType::U8, vec![], flags).unwrap());
    }
    fields
}

fn pack_source(root: &Path, name: &str, fields: &[FieldSource]) {
    let options = PackOptions {
        name: name.into(),
        block_bytes: 4096,
        samples_per_shard: Some(256),
        codec: CodecChoice::Auto,
        shuffle: ShuffleChoice::Auto,
        on_existing: OnExisting::Refuse,
        threads: 2,
    };
    pack::pack(&root.join(name), fields, &options, &Quiet).unwrap();
}

fn setup() -> (tempfile::TempDir, Daemon) {
    let root = tempfile::tempdir().unwrap();
    pack_source(root.path(), "web", &fields(0, WEB, DType::I32, false));
    pack_source(root.path(), "code", &fields(1, CODE, DType::I32, false));
    pack_source(root.path(), "wide", &fields(2, 100, DType::I64, false));
    pack_source(root.path(), "extra", &fields(3, 100, DType::I32, true));
    // The same fields, and a variable-length one: sample i holds i % 5 int32 values.
    let mut docs = fields(4, 100, DType::I32, false);
    let ends: Vec<u64> = (0..100u64)
        .scan(0, |end, i| {
            *end += i % 5;
            Some(*end)
        })
        .collect();
    let values = vec![7u8; *ends.last().unwrap() as usize * 4];
    docs.push(
        FieldSource::variable(
            FieldSource::from_bytes("tokens", DType::I32, vec![], values).unwrap(),
            ends,
        )
        .unwrap(),
    );
    pack_source(root.path(), "docs", &docs);
    let binary = Path::new(env!("CARGO_BIN_EXE_gpufeed"));
    let socket = root.path().join("gpufeed.sock");
    let daemon =
        common::daemon::start_daemon(binary, root.path(), socket, "cpu", &[], Stdio::null());
    (root, daemon)
}

fn mixture(sources: &[(&str, f64)], batch_size: u32) -> StreamSpec {
    let sources = sources
        .iter()
        .map(|&(dataset, weight)| MixtureSource {
            dataset: dataset.into(),
            weight,
        })
        .collect();
    let mut spec = StreamSpec::mixture(sources, batch_size);
    spec.shuffle = Shuffle::Full;
    spec.seed = 17;
    spec
}

/// The (source, index) of every row of every batch of a stream, checking each row's `emb`
/// against its id, and the stream's state at the end; at most `limit` batches.
fn rows(socket: &Path, spec: StreamSpec, limit: Option<usize>) -> (Vec<(i32, i32)>, StreamState) {
    let mut stream = Client::connect(socket).unwrap().open_stream(spec).unwrap();
    let mut rows = Vec::new();
    let mut batches = 0;
    for batch in stream.by_ref() {
        let batch = batch.unwrap();
        let ids = batch.field("id").unwrap().host_bytes().unwrap().to_vec();
        let emb = batch.field("emb").unwrap().host_bytes().unwrap().to_vec();
        for (id, emb) in ids.chunks_exact(8).zip(emb.chunks_exact(16)) {
            let source = i32::from_le_bytes(id[..4].try_into().unwrap());
            let index = i32::from_le_bytes(id[4..].try_into().unwrap());
            let first = f32::from_le_bytes(emb[..4].try_into().unwrap());
            assert_eq!(
                first,
                (source * 100_000 + index * 4) as f32,
                "row {source}/{index}"
            );
            rows.push((source, index));
        }
        batches += 1;
        if limit == Some(batches) {
            break;
        }
    }
    (rows, stream.state())
}

/// Over one mixture epoch (3700 positions), the sources come in their weights' proportions
/// within 1 %, every row is a sample of its source, the small source starts a new epoch of its
/// own when it runs out (each of its samples once before any again), and the large one serves
/// each sample at most once.
#[test]
fn an_epoch_follows_the_weights_and_the_epoch_rule() {
    let (_root, daemon) = setup();
    let (served, state) = rows(
        &daemon.socket,
        mixture(&[("web", 0.7), ("code", 0.3)], 100),
        None,
    );
    assert_eq!(served.len() as u64, WEB + CODE);
    assert_eq!(state.cursor, WEB + CODE);
    let code: Vec<i32> = served
        .iter()
        .filter(|(s, _)| *s == 1)
        .map(|&(_, i)| i)
        .collect();
    let share = code.len() as f64 / served.len() as f64;
    assert!((share - 0.3).abs() < 0.01, "code's share {share}");
    assert!(code.iter().all(|&i| (i as u64) < CODE));
    // 0.3 of 3700 is 1110 draws of 700 samples: one whole epoch of it, then part of the next.
    let first: HashSet<i32> = code[..CODE as usize].iter().copied().collect();
    assert_eq!(
        first.len() as u64,
        CODE,
        "code's first epoch serves each sample once"
    );
    let second: HashSet<i32> = code[CODE as usize..].iter().copied().collect();
    assert_eq!(second.len(), code.len() - CODE as usize);
    let web: Vec<i32> = served
        .iter()
        .filter(|(s, _)| *s == 0)
        .map(|&(_, i)| i)
        .collect();
    let distinct: HashSet<i32> = web.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        web.len(),
        "web is downsampled without repeats"
    );
    assert!(web.iter().all(|&i| (i as u64) < WEB));
}

/// The same seed gives the same rows, batch for batch; another seed another order.
#[test]
fn a_mixture_is_deterministic_for_a_seed() {
    let (_root, daemon) = setup();
    let spec = mixture(&[("web", 0.7), ("code", 0.3)], 64);
    let (once, _) = rows(&daemon.socket, spec.clone(), Some(20));
    let (again, _) = rows(&daemon.socket, spec.clone(), Some(20));
    assert_eq!(once, again);
    let mut other = spec;
    other.seed = 18;
    let (different, _) = rows(&daemon.socket, other, Some(20));
    assert_ne!(once, different);
}

/// A run of 4 ranks stopped mid-epoch and resumed from its state on 3 ranks serves the rest of
/// the epoch exactly as one uninterrupted rank would have: no row repeated, none skipped.
#[test]
fn a_mixture_resumes_mid_epoch_on_another_world_size() {
    let (_root, daemon) = setup();
    let base = mixture(&[("web", 2.0), ("code", 1.0)], 25);
    let mut whole = base.clone();
    whole.batch_size = 100;
    let (expected, _) = rows(&daemon.socket, whole, None);

    let ranks = |world_size: u32, spec: &StreamSpec, steps: Option<usize>| {
        let mut per_rank = Vec::new();
        let mut state = None;
        for rank in 0..world_size {
            let mut spec = spec.clone();
            spec.world_size = world_size;
            spec.rank = rank;
            let (served, at) = rows(&daemon.socket, spec, steps);
            per_rank.push(served);
            state = Some(at);
        }
        // Step k is rank 0's k-th batch, then rank 1's, and so on.
        let steps = per_rank[0].len() / 25;
        let mut global = Vec::new();
        for step in 0..steps {
            for served in &per_rank {
                global.extend_from_slice(&served[step * 25..(step + 1) * 25]);
            }
        }
        (global, state.expect("at least one rank"))
    };
    let (first, state) = ranks(4, &base, Some(10));
    assert_eq!(state.cursor, 1000);
    let mut resumed = mixture(&[("web", 2.0), ("code", 1.0)], 25);
    resumed.seed = 0;
    resumed.shuffle = Shuffle::None;
    resumed.resume(&state).unwrap();
    assert_eq!((resumed.seed, resumed.shuffle), (17, Shuffle::Full));
    let (rest, end) = ranks(3, &resumed, None);
    assert_eq!(end.cursor, WEB + CODE);
    let mut all = first;
    all.extend(rest);
    assert_eq!(all, expected);

    // A checkpoint of the mixture does not resume another one.
    let mut other = mixture(&[("web", 1.0), ("code", 1.0)], 25);
    let error = other.resume(&state).unwrap_err().to_string();
    assert!(error.contains("mixture of web (2), code (1)"), "{error}");
}

/// Sources whose fields disagree are refused, naming the source and the field; so is a source
/// with a field the first lacks when the request names no fields, which naming the shared fields
/// then serves.
#[test]
fn sources_whose_fields_disagree_are_refused() {
    let (_root, daemon) = setup();
    let refused =
        |spec: StreamSpec| match Client::connect(&daemon.socket).unwrap().open_stream(spec) {
            Err(ClientError::Daemon { message, .. }) => message,
            Err(other) => panic!("refused with {other}"),
            Ok(_) => panic!("a mixture of disagreeing sources was opened"),
        };
    let message = refused(mixture(&[("web", 1.0), ("wide", 1.0)], 10));
    assert!(
        message.contains("mixture source 'wide'")
            && message.contains("field 'id'")
            && message.contains("i64"),
        "{message}"
    );
    let message = refused(mixture(&[("web", 1.0), ("extra", 1.0)], 10));
    assert!(
        message.contains("mixture source 'extra' has field 'flag'"),
        "{message}"
    );
    let message = refused(mixture(&[("web", 1.0), ("nothing", 1.0)], 10));
    assert!(message.contains("no dataset named 'nothing'"), "{message}");

    let mut shared = mixture(&[("web", 1.0), ("extra", 1.0)], 10);
    shared.fields = vec![gpufeed_client::protocol::FieldRequest {
        name: "id".into(),
        dtype: None,
    }];
    shared.tail = Tail::Pad;
    let mut stream = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(shared)
        .unwrap();
    let batch = stream.next().unwrap().unwrap();
    assert_eq!(batch.samples(), 10);
}

/// A mixture serves fixed-shape fields only: one that would serve a source's variable-length
/// field, or asks for a batch form, is refused naming the source or the field; naming the
/// fixed-shape fields serves a source that also has variable-length ones.
#[test]
fn variable_length_fields_are_not_mixed() {
    let (_root, daemon) = setup();
    let refused =
        |spec: StreamSpec| match Client::connect(&daemon.socket).unwrap().open_stream(spec) {
            Err(ClientError::Daemon { message, .. }) => message,
            Err(other) => panic!("refused with {other}"),
            Ok(_) => panic!("a mixture with a variable-length field was opened"),
        };
    let message = refused(mixture(&[("web", 1.0), ("docs", 1.0)], 10));
    assert!(
        message.contains("mixture source 'docs': field 'tokens' is variable-length"),
        "{message}"
    );
    let mut forms = mixture(&[("web", 1.0), ("code", 1.0)], 10);
    forms.variable = vec![gpufeed_client::protocol::VariableRequest {
        name: "tokens".into(),
        form: gpufeed_client::protocol::BatchForm::Packed,
        cap: None,
    }];
    let message = refused(forms);
    assert!(
        message.contains("batch form is asked for field 'tokens'")
            && message.contains("fixed-shape fields only"),
        "{message}"
    );

    let mut fixed = mixture(&[("web", 1.0), ("docs", 1.0)], 10);
    fixed.fields = ["id", "emb"]
        .map(|name| gpufeed_client::protocol::FieldRequest {
            name: name.into(),
            dtype: None,
        })
        .to_vec();
    let (served, _) = rows(&daemon.socket, fixed, Some(20));
    assert_eq!(served.len(), 200);
    assert!(served.iter().any(|&(source, _)| source == 4), "{served:?}");
}

/// `gpufeed consume --source DATASET=WEIGHT ...` consumes a mixture (and says what is wrong with a
/// source that is not DATASET=WEIGHT).
#[test]
fn gpufeed_consume_takes_a_mixture() {
    let (_root, daemon) = setup();
    let binary = Path::new(env!("CARGO_BIN_EXE_gpufeed"));
    let consume = |sources: &[&str]| {
        let mut command = std::process::Command::new(binary);
        command.arg("consume").arg("--socket").arg(&daemon.socket);
        for source in sources {
            command.args(["--source", source]);
        }
        command.args(["--batch-size", "100", "--shuffle", "full"]);
        command.output().unwrap()
    };
    let output = consume(&["web=0.7", "code=0.3"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(summary["samples"], WEB + CODE, "{summary}");
    let output = consume(&["web", "code=0.3"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("\"web\" is not DATASET=WEIGHT"), "{stderr}");
}

/// What the daemon serves is the mixture order of `pipeline::mixture`, row for row, in a window
/// shuffle with the last step padded (positions past the epoch wrap to its start), with an epoch
/// length of its own.
#[test]
fn the_daemon_serves_the_mixture_order_row_for_row() {
    use gpufeed::pipeline::mixture::{MixtureOrder, MixtureSource as Layout};
    use gpufeed::pipeline::ShuffleMode;
    let (root, daemon) = setup();
    let mut spec = mixture(&[("web", 1.0), ("code", 4.0)], 64);
    spec.shuffle = Shuffle::Window(2);
    spec.tail = Tail::Pad;
    spec.epoch = 3;
    spec.mixture_epoch_samples = Some(1000);
    let (served, state) = rows(&daemon.socket, spec, None);
    assert_eq!(served.len(), 16 * 64);
    assert_eq!(state.cursor, 1000);
    let layout = |name: &str| {
        let dataset = gpufeed::format::Dataset::open(&root.path().join(name)).unwrap();
        let shard_samples: Vec<u64> = dataset
            .manifest
            .shards
            .iter()
            .map(|s| s.sample_count)
            .collect();
        Layout {
            sample_count: shard_samples.iter().sum(),
            shard_samples,
        }
    };
    let order = MixtureOrder::new(
        vec![layout("web"), layout("code")],
        &[1.0, 4.0],
        17,
        ShuffleMode::Window { shards: 2 },
        3,
        Some(1000),
    )
    .unwrap();
    let expected: Vec<(i32, i32)> = order
        .draws((0..16 * 64).map(|p| p % 1000))
        .iter()
        .map(|d| (d.source as i32, d.sample as i32))
        .collect();
    assert_eq!(served, expected);
}
