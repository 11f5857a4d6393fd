//! The hand-off ring is hostile input to the daemon: a consumer that writes garbage into it (a count
//! that runs ahead or back, a slot that does not exist, a release of a slot it does not hold) gets `Error{BadRequest}` naming the ring entry, its stream ends, and the
//! daemon goes on serving everyone else. A client of another protocol version reads the daemon's
//! refusal in its own version.

mod common;

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::ptr::NonNull;

use gpufeed_client::protocol::{ErrorCode, Message, StreamSpec, PROTOCOL_VERSION};
use gpufeed_client::transport;
use gpufeed_proto::ring::RingView;

/// Samples of the test dataset `rows`: more steps than a stream has slots, so that the daemon
/// needs the consumer's releases.
const ROWS: u32 = 4096;

/// A CPU daemon serving `rows` (ROWS samples of four u32, field `v`) from `root/data`.
fn daemon(root: &Path) -> common::daemon::Daemon {
    let data = root.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let bytes: Vec<u8> = (0..ROWS * 4).flat_map(u32::to_le_bytes).collect();
    common::pack_fields(
        &data.join("rows"),
        &[common::field("v", gpufeed_client::DType::U32, &[4], bytes)],
        &common::options("rows", 64 << 10, None),
    );
    common::daemon::start_daemon(
        Path::new(env!("CARGO_BIN_EXE_gpufeed")),
        &data,
        root.join("gpufeed.sock"),
        "cpu",
        &[],
        std::process::Stdio::null(),
    )
}

/// A greeted raw connection with an open stream of `rows` (batch 4), its ring mapped.
struct RawStream {
    socket: UnixStream,
    _map: memmap2::MmapMut,
    ring: RingView,
}

fn open_raw(socket_path: &Path) -> RawStream {
    let socket = UnixStream::connect(socket_path).unwrap();
    let hello = Message::Hello {
        client: "handoff-ring test".to_string(),
    };
    transport::send(&socket, &hello, &[]).unwrap();
    assert!(matches!(
        transport::recv(&socket).unwrap().0,
        Message::Welcome { .. }
    ));
    transport::send(
        &socket,
        &Message::OpenStream(StreamSpec::new("rows", 4)),
        &[],
    )
    .unwrap();
    // A daemon that missed the garbage would leave the test waiting: fail it instead.
    socket
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let (opened, mut fds) = transport::recv(&socket).unwrap();
    let Message::StreamOpened(layout) = opened else {
        panic!("expected StreamOpened, got {opened:?}");
    };
    // The slots' memory, then the hand-off ring and its two doorbells.
    assert_eq!(fds.len(), 4, "{} slots", layout.slot_count);
    let memory: OwnedFd = fds.remove(1);
    let file = std::fs::File::from(memory);
    // SAFETY: the daemon's ring memfd, sealed against shrinking; only accessed through the view.
    let mut map = unsafe { memmap2::MmapMut::map_mut(&file).unwrap() };
    // SAFETY: page-aligned, as long as the file, kept alive in the struct with the view.
    let ring =
        unsafe { RingView::attach(NonNull::new(map.as_mut_ptr()).unwrap(), map.len()) }.unwrap();
    assert_eq!(ring.slot_count(), layout.slot_count);
    RawStream {
        socket,
        _map: map,
        ring,
    }
}

/// Waits for the daemon's error frame (skipping an `EndOfEpoch` that may come first).
fn error_reply(socket: &UnixStream) -> (ErrorCode, String) {
    loop {
        match transport::recv(socket).unwrap().0 {
            Message::EndOfEpoch { .. } => continue,
            Message::Error { code, message } => return (code, message),
            other => panic!("expected an error frame, got {other:?}"),
        }
    }
}

/// Waits until the daemon has published `count` batch entries.
fn wait_published(ring: &RingView, count: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while ring.batches_published() < count {
        assert!(std::time::Instant::now() < deadline, "no batch published");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn garbage_in_the_ring_ends_only_that_stream() {
    let root = tempfile::tempdir().unwrap();
    let daemon = daemon(root.path());
    type Scribble = Box<dyn Fn(&RawStream)>;
    let cases: Vec<(&str, Scribble, &str)> = vec![
        (
            "a slot that does not exist",
            Box::new(|s: &RawStream| {
                s.ring.publish_release(0, s.ring.slot_count());
            }),
            "release entry 0: slot",
        ),
        (
            "a count far ahead",
            Box::new(|s: &RawStream| {
                s.ring.publish_release(999, 0);
            }),
            "release published count 1000 after 0 already taken",
        ),
        (
            "a release of a slot the consumer does not hold",
            Box::new(|s: &RawStream| {
                wait_published(&s.ring, 1);
                let slot = (s.ring.batch_entry(0)[1] & 0xffff_ffff) as u32;
                s.ring.publish_release(0, slot);
                s.ring.publish_release(1, slot);
            }),
            "release entry 1: slot",
        ),
    ];
    for (what, scribble, expected) in cases {
        let raw = open_raw(&daemon.socket);
        scribble(&raw);
        let (code, message) = error_reply(&raw.socket);
        assert_eq!(code, ErrorCode::BadRequest, "{what}: {message}");
        assert!(message.contains(expected), "{what}: {message}");
        if what == "a slot that does not exist" {
            let n = raw.ring.slot_count();
            assert!(
                message.contains(&format!("slot {n} of a ring of {n}")),
                "{message}"
            );
        }
        // The daemon serves a well-behaved consumer as before.
        let client = gpufeed_client::Client::connect(&daemon.socket).unwrap();
        let stream = client.open_stream(StreamSpec::new("rows", 4)).unwrap();
        let served: u64 = stream
            .map(|batch| u64::from(batch.unwrap().samples()))
            .sum();
        assert_eq!(
            served,
            u64::from(ROWS),
            "{what}: the next stream was not served whole"
        );
    }
}

#[test]
fn a_client_of_another_version_reads_the_refusal_in_its_own_version() {
    let root = tempfile::tempdir().unwrap();
    let daemon = common::daemon::tiny_cpu_daemon(root.path());
    let mut socket = UnixStream::connect(&daemon.socket).unwrap();
    let mut hello = Message::Hello {
        client: "an old client".into(),
    }
    .encode();
    hello[4..6].copy_from_slice(&2u16.to_le_bytes());
    socket.write_all(&hello).unwrap();
    let mut reply = Vec::new();
    socket.read_to_end(&mut reply).unwrap();
    assert_eq!(
        &reply[4..6],
        &2u16.to_le_bytes(),
        "the reply speaks version 2"
    );
    reply[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    let Message::Error { code, message } = Message::decode(&reply[4..]).unwrap() else {
        panic!("expected an error frame");
    };
    assert_eq!(code, ErrorCode::UnsupportedVersion);
    assert!(
        message.contains(&format!(
            "speaks consumer protocol version {PROTOCOL_VERSION} and the client speaks version 2"
        )),
        "{message}"
    );
}
