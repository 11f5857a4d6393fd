//! The C ABI called as C would call it: batches bit-exact against the source, resume from a state
//! at another world size, and the error codes of bad calls.

mod common;

use std::ffi::{CStr, CString};
use std::ptr::{null, null_mut};

use gpufeed_ffi::*;

fn connect(socket: &std::path::Path) -> *mut GfClient {
    let socket = CString::new(socket.to_str().unwrap()).unwrap();
    let mut client = null_mut();
    // SAFETY: valid string and out-pointer.
    let status = unsafe { gf_connect(socket.as_ptr(), &mut client) };
    assert_eq!(status, GfStatus::Ok, "{}", last_error());
    client
}

fn last_error() -> String {
    // SAFETY: never null, NUL-terminated.
    unsafe { CStr::from_ptr(gf_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn options(dataset: &CStr, batch: u32) -> GfStreamOptions {
    let mut options = std::mem::MaybeUninit::<GfStreamOptions>::uninit();
    // SAFETY: writable out-pointer; the dataset outlives the options' use.
    let status = unsafe { gf_stream_options_init(options.as_mut_ptr(), dataset.as_ptr(), batch) };
    assert_eq!(status, GfStatus::Ok);
    // SAFETY: initialised above.
    unsafe { options.assume_init() }
}

fn open(socket: &std::path::Path, options: &GfStreamOptions) -> *mut GfStream {
    let client = connect(socket);
    let mut stream = null_mut();
    // SAFETY: a fresh client, initialised options, writable out-pointer.
    let status = unsafe { gf_open_stream(client, options, &mut stream) };
    assert_eq!(status, GfStatus::Ok, "{}", last_error());
    stream
}

/// The `ids` rows (the sample index column) of up to `limit` batches.
fn take(stream: *mut GfStream, limit: usize) -> Vec<i32> {
    let mut ids = Vec::new();
    for _ in 0..limit {
        let mut batch = null_mut();
        // SAFETY: a live stream, writable out-pointer.
        match unsafe { gf_next(stream, &mut batch) } {
            GfStatus::EndOfEpoch => break,
            GfStatus::Ok => {}
            other => panic!("gf_next: {other:?}: {}", last_error()),
        }
        let mut field = std::mem::MaybeUninit::<GfField>::uninit();
        // SAFETY: a live batch, writable out-pointer.
        let value = unsafe { gf_batch_field(batch, 0, field.as_mut_ptr()) };
        assert_eq!(value, GfStatus::Ok);
        // SAFETY: written above.
        let field = unsafe { field.assume_init() };
        assert_eq!(field.dtype, GfDtype::I32);
        assert!(!field.host.is_null() && field.device_ptr == 0);
        // SAFETY: `bytes` bytes of host memory, valid until the release below.
        let bytes =
            unsafe { std::slice::from_raw_parts(field.host as *const u8, field.bytes as usize) };
        ids.extend(
            bytes
                .chunks_exact(8)
                .map(|row| i32::from_le_bytes(row[..4].try_into().unwrap())),
        );
        // SAFETY: released once.
        unsafe { gf_batch_release(batch) };
    }
    ids
}

#[test]
fn batches_are_the_source_rows_and_resume_at_another_world_size() {
    let root = tempfile::tempdir().unwrap();
    let daemon = common::Daemon::start(root.path());
    let dataset = CString::new("toy").unwrap();
    // In order, whole rows bit-exact.
    let plain = options(&dataset, 100);
    let stream = open(&daemon.socket, &plain);
    let mut batch = null_mut();
    // SAFETY: live stream.
    assert_eq!(unsafe { gf_next(stream, &mut batch) }, GfStatus::Ok);
    let mut field = std::mem::MaybeUninit::<GfField>::uninit();
    // SAFETY: live batch.
    let value = unsafe { gf_batch_field(batch, 0, field.as_mut_ptr()) };
    assert_eq!(value, GfStatus::Ok);
    // SAFETY: written above.
    let field = unsafe { field.assume_init() };
    assert_eq!((field.ndim, field.shape[0], field.shape[1]), (2, 100, 2));
    // SAFETY: the field's host bytes, valid until the release.
    let bytes =
        unsafe { std::slice::from_raw_parts(field.host as *const u8, field.bytes as usize) };
    assert_eq!(bytes, &common::ids_bytes()[..800]);
    // SAFETY: the name is NUL-terminated, owned by the batch.
    let value = unsafe { CStr::from_ptr(field.name) }.to_str().unwrap();
    assert_eq!(value, "ids");
    // SAFETY: released once; the stream closed once.
    unsafe {
        gf_batch_release(batch);
        gf_stream_close(stream);
    }
    // A full shuffle: 3 steps, then the state resumes the epoch at world size 2.
    let mut shuffled = options(&dataset, 50);
    shuffled.shuffle = GfShuffle::Full as u32;
    shuffled.seed = 11;
    let whole = take(open(&daemon.socket, &shuffled), usize::MAX);
    assert_eq!(whole.len(), 1000);
    let stream = open(&daemon.socket, &shuffled);
    let head = take(stream, 3);
    let mut state = std::mem::MaybeUninit::<GfStreamState>::uninit();
    // SAFETY: live stream, writable out-pointer.
    let value = unsafe { gf_stream_state(stream, state.as_mut_ptr()) };
    assert_eq!(value, GfStatus::Ok);
    // SAFETY: written above.
    let state = unsafe { state.assume_init() };
    // SAFETY: closed once.
    unsafe { gf_stream_close(stream) };
    assert_eq!(state.cursor, 150);
    assert_eq!(head, whole[..150]);
    let mut rest = Vec::new();
    for rank in 0..2 {
        let mut resumed = options(&dataset, 50);
        resumed.rank = rank;
        resumed.world_size = 2;
        resumed.resume = &state;
        rest.extend(take(open(&daemon.socket, &resumed), usize::MAX));
    }
    // 850 samples left: 8 steps of 100 at world 2 (the tail of 50 dropped).
    let mut expected = whole[150..950].to_vec();
    expected.sort_unstable();
    rest.sort_unstable();
    assert_eq!(rest, expected);
    resume_state_does_not_override_the_options(&daemon, &state);
}

/// `options.resume` with another dataset (or another seed) won over `options.dataset` (and
/// `options.seed`): the checkpoint's stream was served. A mismatch is refused, naming the field and
/// both values.
fn resume_state_does_not_override_the_options(daemon: &common::Daemon, state: &GfStreamState) {
    let other = CString::new("ds1").unwrap();
    let mut another_dataset = options(&other, 50);
    another_dataset.resume = state;
    let mut stream = null_mut();
    // SAFETY: a fresh client and initialised options.
    let status = unsafe { gf_open_stream(connect(&daemon.socket), &another_dataset, &mut stream) };
    assert_eq!(status, GfStatus::InvalidArgument);
    let message = last_error();
    assert!(
        message.contains("options.resume")
            && message.contains("'ds1'")
            && message.contains("'toy'"),
        "{message}"
    );
    let toy = CString::new("toy").unwrap();
    let mut another_seed = options(&toy, 50);
    another_seed.shuffle = GfShuffle::Full as u32;
    another_seed.seed = 12;
    another_seed.resume = state;
    // SAFETY: as above.
    let status = unsafe { gf_open_stream(connect(&daemon.socket), &another_seed, &mut stream) };
    assert_eq!(status, GfStatus::InvalidArgument);
    let message = last_error();
    assert!(
        message.contains("seed 12") && message.contains("seed 11"),
        "{message}"
    );
}

/// A mixture through `gf_open_mixture_stream`: its state names the mixture, resumes it at another
/// world size where an uninterrupted stream would have gone on, and refuses another mixture.
#[test]
fn a_mixture_resumes_from_its_state_and_refuses_another() {
    let root = tempfile::tempdir().unwrap();
    let daemon = common::Daemon::start(root.path());
    let (toy, toy2) = (CString::new("toy").unwrap(), CString::new("toy2").unwrap());
    let sources = |second: f64| {
        [
            GfMixtureSource {
                dataset: toy.as_ptr(),
                weight: 3.0,
            },
            GfMixtureSource {
                dataset: toy2.as_ptr(),
                weight: second,
            },
        ]
    };
    let open_mixture = |options: &GfStreamOptions, second: f64| {
        let client = connect(&daemon.socket);
        let mut stream = null_mut();
        let sources = sources(second);
        // SAFETY: a fresh client, initialised options, two sources, writable out-pointer.
        let status =
            unsafe { gf_open_mixture_stream(client, options, sources.as_ptr(), 2, 0, &mut stream) };
        (status, stream)
    };
    let mut options = options(c"unused", 40);
    options.dataset = null();
    options.shuffle = GfShuffle::Full as u32;
    options.seed = 5;
    let (status, stream) = open_mixture(&options, 1.0);
    assert_eq!(status, GfStatus::Ok, "{}", last_error());
    let whole = take(stream, usize::MAX);
    assert_eq!(whole.len(), 2000);
    let (_, stream) = open_mixture(&options, 1.0);
    let head = take(stream, 5);
    let mut state = std::mem::MaybeUninit::<GfStreamState>::uninit();
    // SAFETY: live stream, writable out-pointer.
    let status = unsafe { gf_stream_state(stream, state.as_mut_ptr()) };
    assert_eq!(status, GfStatus::Ok);
    // SAFETY: written above.
    let state = unsafe { state.assume_init() };
    // SAFETY: closed once.
    unsafe { gf_stream_close(stream) };
    // SAFETY: NUL-terminated.
    let name = unsafe { CStr::from_ptr(state.dataset.as_ptr()) }
        .to_str()
        .unwrap();
    assert_eq!(name, "mixture of toy (3), toy2 (1)");
    assert_eq!(head, whole[..200]);
    let mut resumed = options;
    resumed.world_size = 2;
    resumed.batch_size = 20;
    resumed.resume = &state;
    let mut rest = Vec::new();
    for rank in 0..2 {
        resumed.rank = rank;
        let (status, stream) = open_mixture(&resumed, 1.0);
        assert_eq!(status, GfStatus::Ok, "{}", last_error());
        rest.push(take(stream, usize::MAX));
    }
    let interleaved: Vec<i32> = rest[0]
        .chunks(20)
        .zip(rest[1].chunks(20))
        .flat_map(|(a, b)| a.iter().chain(b).copied())
        .collect();
    assert_eq!(interleaved, whole[200..]);
    let (status, _) = open_mixture(&resumed, 2.0);
    assert_eq!(status, GfStatus::InvalidArgument);
    assert!(
        last_error().contains("the state is of mixture of toy (3), toy2 (1)"),
        "{}",
        last_error()
    );
}

#[test]
fn bad_calls_get_codes_and_messages() {
    let root = tempfile::tempdir().unwrap();
    let daemon = common::Daemon::start(root.path());
    let mut client = null_mut();
    let missing = CString::new(root.path().join("nope.sock").to_str().unwrap()).unwrap();
    // SAFETY: valid arguments.
    let value = unsafe { gf_connect(missing.as_ptr(), &mut client) };
    assert_eq!(value, GfStatus::Connect);
    assert!(last_error().contains("nope.sock"), "{}", last_error());
    // SAFETY: null arguments are refused, not dereferenced.
    let value = unsafe { gf_connect(null(), &mut client) };
    assert_eq!(value, GfStatus::InvalidArgument);
    // SAFETY: as above.
    let value = unsafe { gf_next(null_mut(), null_mut()) };
    assert_eq!(value, GfStatus::InvalidArgument);
    let unknown = CString::new("no-such-dataset").unwrap();
    let client = connect(&daemon.socket);
    let mut stream = null_mut();
    // SAFETY: a fresh client and initialised options.
    let status = unsafe { gf_open_stream(client, &options(&unknown, 10), &mut stream) };
    assert_eq!(status, GfStatus::Daemon);
    assert_eq!(gf_last_daemon_code(), GfDaemonCode::UnknownDataset);
    let dataset = CString::new("toy").unwrap();
    let mut bad = options(&dataset, 10);
    bad.shuffle = 7;
    let client = connect(&daemon.socket);
    // SAFETY: as above.
    let status = unsafe { gf_open_stream(client, &bad, &mut stream) };
    assert_eq!(status, GfStatus::InvalidArgument);
    assert!(last_error().contains("GfShuffle"), "{}", last_error());
    let mut bad = options(&dataset, 10);
    bad.rank = 3;
    bad.world_size = 2;
    let client = connect(&daemon.socket);
    // SAFETY: as above.
    let status = unsafe { gf_open_stream(client, &bad, &mut stream) };
    assert_eq!(status, GfStatus::InvalidArgument);
    assert!(last_error().contains("rank 3"), "{}", last_error());
    // A batch form that is no GfBatchForm is refused naming the entry; a form asked for a field
    // that is not variable-length reaches the daemon, which refuses it naming the field.
    let name = CString::new("ids").unwrap();
    for (form, status, message) in [
        (9, GfStatus::InvalidArgument, "options.variable[0].form 9"),
        (GfBatchForm::Packed as u32, GfStatus::Daemon, "fixed shape"),
    ] {
        let request = GfVariableRequest {
            name: name.as_ptr(),
            form,
            cap: 0,
        };
        let mut bad = options(&dataset, 10);
        bad.variable = &request;
        bad.variable_count = 1;
        let client = connect(&daemon.socket);
        // SAFETY: as above; `request` outlives the call.
        let value = unsafe { gf_open_stream(client, &bad, &mut stream) };
        assert_eq!(value, status);
        assert!(last_error().contains(message), "{}", last_error());
    }
    // Options of the struct's first version (without `variable`) still open a stream.
    let mut first = options(&dataset, 10);
    first.struct_size = std::mem::offset_of!(GfStreamOptions, variable) as u32;
    let opened = open(&daemon.socket, &first);
    // SAFETY: a live stream, closed once.
    unsafe { gf_stream_close(opened) };
    // Holding every slot: gf_next says so instead of waiting forever.
    let mut two = options(&dataset, 10);
    two.prefetch = 2;
    let stream = open(&daemon.socket, &two);
    // Slot rings are sized in bytes, so the stream has at least `prefetch` slots (more for small
    // batches, at most 64): hold them all.
    let mut held = Vec::new();
    let mut c = null_mut();
    // SAFETY: live stream, writable out-pointers; batches released once.
    unsafe {
        loop {
            let mut batch = null_mut();
            match gf_next(stream, &mut batch) {
                GfStatus::Ok => held.push(batch),
                GfStatus::AllSlotsHeld => {
                    assert!(batch.is_null());
                    break;
                }
                other => panic!("gf_next: {other:?} {}", last_error()),
            }
            assert!(
                held.len() <= 64,
                "more batches held than a stream has slots"
            );
        }
        assert!(held.len() >= 2, "{} slots", held.len());
        assert!(last_error().contains("slot"), "{}", last_error());
        gf_batch_release(held.remove(0));
        assert_eq!(gf_next(stream, &mut c), GfStatus::Ok);
        for batch in held {
            gf_batch_release(batch);
        }
        gf_batch_release(c);
        gf_stream_close(stream);
    }
}
