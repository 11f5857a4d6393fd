//! The client against a scripted fake daemon on the other end of a socket pair.

use super::*;
use crate::dtype::DType;
use crate::protocol::{
    BatchField, BatchInfo, CorruptPolicy, ErrorCode, FieldLayout, FieldRequest, Shuffle,
    StreamLayout, Tail, BATCH_NDIM_MAX, FRAME_BYTES_MAX, FRAME_HEADER_BYTES, STREAM_FIELDS_MAX,
    STRING_BYTES_MAX,
};
use crate::transport::TransportError;
use gpufeed_proto::spec::StreamState;
use gpufeed_proto::spec::{OPEN_STREAM_FIXED_BYTES, PREFETCH_DEFAULT};
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;

use std::thread::JoinHandle;
use std::time::Duration;

/// A safety net against a hung test, not a synchronisation mechanism.
const TEST_TIMEOUT: Duration = Duration::from_secs(30);
const SLOT_BYTES: u64 = 8192;
const BATCH_SIZE: u32 = 2;

struct Fake {
    socket: UnixStream,
    ring: Option<FakeRing>,
}

/// The daemon's end of the hand-off ring.
struct FakeRing {
    file: File,
    _map: memmap2::MmapMut,
    view: gpufeed_proto::ring::RingView,
    consumer_bell: gpufeed_proto::ring::Doorbell,
    daemon_bell: gpufeed_proto::ring::Doorbell,
    published: u64,
    releases_taken: u64,
}

impl FakeRing {
    fn new(slot_count: u32) -> FakeRing {
        let slot_count = slot_count.clamp(1, SLOTS_MAX);
        let file = memfd(4096 * 2);
        // SAFETY: a sealed memfd mapped shared; only accessed through the view.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&file).unwrap() };
        let base = std::ptr::NonNull::new(map.as_mut_ptr()).unwrap();
        // SAFETY: page-aligned, two pages (enough for 64 slots), alive as long as the view.
        let view = unsafe { gpufeed_proto::ring::RingView::init(base, slot_count) };
        FakeRing {
            file,
            _map: map,
            view,
            consumer_bell: gpufeed_proto::ring::Doorbell::new().unwrap(),
            daemon_bell: gpufeed_proto::ring::Doorbell::new().unwrap(),
            published: 0,
            releases_taken: 0,
        }
    }
}

impl Fake {
    fn ring(&mut self) -> &mut FakeRing {
        self.ring.as_mut().expect("the fake opened a stream")
    }

    /// Publishes `info` as the next batch entry (its fields are the layout's).
    fn batch(&mut self, info: BatchInfo) {
        let ring = self.ring();
        let entry = gpufeed_proto::ring::RingBatch {
            slot: info.slot,
            samples: info.samples,
            replaced: info.replaced,
            epoch: info.epoch,
            step: info.step,
            cursor_after: info.cursor_after,
            ready_ns: info.ready_ns,
        };
        let index = ring.published;
        ring.published += 1;
        if ring.view.publish_batch(index, &entry) {
            ring.consumer_bell.ring();
        }
    }

    /// The releases the client published since the last call.
    fn releases(&mut self) -> Vec<u32> {
        let ring = self.ring();
        let published = ring.view.releases_published();
        let slot_count = ring.view.slot_count();
        let slots = (ring.releases_taken..published)
            .map(|index| {
                gpufeed_proto::ring::decode_release(
                    index,
                    ring.view.release_entry(index),
                    slot_count,
                )
                .unwrap()
            })
            .collect();
        ring.releases_taken = published;
        slots
    }

    /// Waits for the client's next release.
    fn release(&mut self) -> u32 {
        let deadline = std::time::Instant::now() + TEST_TIMEOUT;
        loop {
            let ring = self.ring();
            if ring.view.releases_published() > ring.releases_taken {
                let index = ring.releases_taken;
                ring.releases_taken += 1;
                let word = ring.view.release_entry(index);
                return gpufeed_proto::ring::decode_release(index, word, ring.view.slot_count())
                    .unwrap();
            }
            assert!(std::time::Instant::now() < deadline, "no release");
            let _ = ring.daemon_bell.wait(None, 10);
            ring.daemon_bell.clear();
        }
    }

    fn send(&self, message: Message) {
        transport::send(&self.socket, &message, &[]).unwrap();
    }

    fn send_with(&self, message: Message, files: &[File]) {
        let fds: Vec<_> = files.iter().map(|f| f.as_fd()).collect();
        transport::send(&self.socket, &message, &fds).unwrap();
    }

    fn recv(&self) -> Message {
        let (message, fds) = transport::recv(&self.socket).unwrap();
        assert!(fds.is_empty());
        message
    }

    fn welcome(&self) {
        match self.recv() {
            Message::Hello { client } => assert!(client.starts_with("gpufeed-client/")),
            other => panic!("expected Hello, got {other:?}"),
        }
        self.send(Message::Welcome {
            session: 42,
            backend: Backend::Cpu,
            daemon_version: "fake".into(),
        });
    }

    /// Greets, reads the OpenStream, and answers with `layout`, the slots' memory (one memfd of
    /// `slot_count` × `slot_stride` bytes, which the fake keeps to fill), and the hand-off ring.
    fn open(&mut self, layout: StreamLayout) -> File {
        let bytes = u64::from(layout.slot_count) * layout.slot_stride;
        self.open_with(layout, vec![memfd(bytes)])
            .pop()
            .expect("one memfd")
    }

    /// Like `open`, with `descriptors` memfds of `file_bytes` each in place of the slots' memory.
    fn open_files(&mut self, layout: StreamLayout, descriptors: usize, file_bytes: u64) {
        let files = (0..descriptors).map(|_| memfd(file_bytes)).collect();
        self.open_with(layout, files);
    }

    /// Greets, reads the OpenStream, and answers with `layout`, `files` and the hand-off ring.
    fn open_with(&mut self, layout: StreamLayout, files: Vec<File>) -> Vec<File> {
        self.welcome();
        match self.recv() {
            Message::OpenStream(spec) => assert_eq!(spec.batch_size, BATCH_SIZE),
            other => panic!("expected OpenStream, got {other:?}"),
        }
        let ring = FakeRing::new(layout.slot_count);
        let mut fds: Vec<_> = files.iter().map(|f| f.as_fd()).collect();
        fds.extend([
            ring.file.as_fd(),
            ring.consumer_bell.as_fd(),
            ring.daemon_bell.as_fd(),
        ]);
        transport::send(&self.socket, &Message::StreamOpened(layout), &fds).unwrap();
        self.ring = Some(ring);
        files
    }

    /// Reads until the client disconnects and returns what it sent.
    fn drain(&self) -> Vec<Message> {
        let mut messages = Vec::new();
        loop {
            match transport::recv(&self.socket) {
                Ok((message, _)) => messages.push(message),
                Err(TransportError::Closed) => return messages,
                Err(other) => panic!("fake daemon: {other}"),
            }
        }
    }
}

/// A slot file as the daemon makes it: sealed against resizing.
fn memfd(bytes: u64) -> File {
    let file = unsealed_memfd(bytes);
    fcntl(
        &file,
        FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW),
    )
    .unwrap();
    file
}

fn unsealed_memfd(bytes: u64) -> File {
    use nix::sys::memfd::{memfd_create, MFdFlags};
    let fd = memfd_create(c"slot", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING).unwrap();
    let file = File::from(fd);
    file.set_len(bytes).unwrap();
    file
}

/// Runs `script` as the daemon and returns a greeted client on the other end.
fn spawn_daemon(script: impl FnOnce(Fake) + Send + 'static) -> (UnixStream, JoinHandle<()>) {
    let (client, daemon) = UnixStream::pair().unwrap();
    client.set_read_timeout(Some(TEST_TIMEOUT)).unwrap();
    daemon.set_read_timeout(Some(TEST_TIMEOUT)).unwrap();
    let handle = std::thread::spawn(move || {
        script(Fake {
            socket: daemon,
            ring: None,
        })
    });
    (client, handle)
}

/// Two fields: `ids` (u8 × 4 at offset 0) and `emb` (f32 × 2 at offset 4096).
fn layout(slot_count: u32, steps: u64) -> StreamLayout {
    StreamLayout {
        slot_count,
        slot_bytes: SLOT_BYTES,
        slot_stride: SLOT_BYTES,
        epoch_samples: steps * u64::from(BATCH_SIZE),
        steps,
        fields: vec![
            FieldLayout {
                name: "ids".into(),
                dtype: DType::U8,
                sample_shape: vec![4],
                offset: 0,
                batch_bytes: 8,
            },
            FieldLayout {
                name: "emb".into(),
                dtype: DType::F32,
                sample_shape: vec![2],
                offset: 4096,
                batch_bytes: 16,
            },
        ],
        device: crate::protocol::Device::Cpu,
        slot_events: Vec::new(),
        variable: Vec::new(),
    }
}

fn batch(slot: u32, step: u64) -> BatchInfo {
    BatchInfo {
        slot,
        epoch: 0,
        step,
        cursor_after: (step + 1) * u64::from(BATCH_SIZE),
        samples: BATCH_SIZE,
        replaced: 0,
        fields: vec![
            BatchField {
                offset: 0,
                dtype: DType::U8,
                shape: vec![2, 4],
            },
            BatchField {
                offset: 4096,
                dtype: DType::F32,
                shape: vec![2, 2],
            },
        ],
        ready_ns: 0,
    }
}

fn ids_of(step: u64) -> Vec<u8> {
    (0..8).map(|i| step as u8 * 10 + i).collect()
}

fn emb_of(step: u64) -> Vec<u8> {
    (0..4)
        .flat_map(|i| (step as f32 + i as f32 / 4.0).to_le_bytes())
        .collect()
}

/// Writes step `step`'s data into a slot, as the daemon would.
/// Writes step `step`'s fields into slot `slot` of the slots' memory (slots `SLOT_BYTES` apart).
fn fill(slots: &File, slot: u64, step: u64) {
    fill_at(slots, slot * SLOT_BYTES, step);
}

/// Writes step `step`'s fields into the slot that starts at byte `at` of the slots' memory.
fn fill_at(slots: &File, at: u64, step: u64) {
    slots.write_at(&ids_of(step), at).unwrap();
    slots.write_at(&emb_of(step), at + 4096).unwrap();
}

fn assert_holds_step(batch: &Batch, step: u64) {
    assert_eq!(batch.step(), step);
    assert_eq!(batch.cursor_after(), (step + 1) * 2);
    let ids = batch.field("ids").unwrap();
    assert_eq!(
        (ids.name, ids.dtype, ids.shape),
        ("ids", DType::U8, &[2u64, 4][..])
    );
    assert_eq!(ids.host_bytes().unwrap(), &ids_of(step)[..]);
    let emb = batch.field("emb").unwrap();
    assert_eq!((emb.dtype, emb.shape), (DType::F32, &[2u64, 2][..]));
    assert_eq!(emb.host_bytes().unwrap(), &emb_of(step)[..]);
    let names: Vec<&str> = batch.fields().map(|f| f.name).collect();
    assert_eq!(names, ["ids", "emb"]);
    assert!(batch.field("labels").is_none());
}

fn open(socket: UnixStream) -> Result<Stream, ClientError> {
    Client::from_socket(socket)?.open_stream(StreamSpec::new("demo", BATCH_SIZE))
}

#[test]
fn handshake_and_status_before_a_stream() {
    let (socket, daemon) = spawn_daemon(|fake| {
        fake.welcome();
        assert_eq!(fake.recv(), Message::StatusRequest);
        fake.send(Message::Status(DaemonStatus {
            sessions: 3,
            batches_served: 17,
            ..DaemonStatus::default()
        }));
        assert!(fake.drain().is_empty());
    });
    let mut client = Client::from_socket(socket).unwrap();
    assert_eq!(
        (client.session(), client.backend(), client.daemon_version()),
        (42, Backend::Cpu, "fake")
    );
    let status = client.status().unwrap();
    assert_eq!((status.sessions, status.batches_served), (3, 17));
    drop(client);
    daemon.join().unwrap();
}

#[test]
fn an_error_instead_of_welcome_is_a_daemon_error() {
    let (socket, daemon) = spawn_daemon(|fake| {
        fake.recv();
        fake.send(Message::Error {
            code: ErrorCode::PermissionDenied,
            message: "uid 1234 is not allowed".into(),
        });
    });
    match Client::from_socket(socket) {
        Err(ClientError::Daemon { code, message }) => {
            assert_eq!(code, ErrorCode::PermissionDenied);
            assert!(message.contains("1234"));
        }
        other => panic!("expected a daemon error, got {other:?}"),
    }
    daemon.join().unwrap();
}

#[test]
fn an_error_instead_of_stream_opened_is_a_daemon_error() {
    let (socket, daemon) = spawn_daemon(|fake| {
        fake.welcome();
        fake.recv();
        fake.send(Message::Error {
            code: ErrorCode::UnknownDataset,
            message: "no dataset demo".into(),
        });
    });
    assert!(matches!(
        open(socket),
        Err(ClientError::Daemon {
            code: ErrorCode::UnknownDataset,
            ..
        })
    ));
    daemon.join().unwrap();
}

/// The main flow: batches arrive, are read in place, several are held at once, a dropped batch is
/// released and its slot comes back with new data, `EndOfEpoch` ends the iterator, and the session
/// closes only once the stream and every batch are gone.
#[test]
fn batches_are_leased_released_and_reused() {
    let (socket, daemon) = spawn_daemon(|mut fake| {
        let slots = fake.open(layout(2, 3));
        fill(&slots, 0, 0);
        fill(&slots, 1, 1);
        fake.batch(batch(0, 0));
        fake.batch(batch(1, 1));
        assert_eq!(fake.release(), 0);
        fill(&slots, 0, 2);
        fake.batch(batch(0, 2));
        fake.send(Message::EndOfEpoch { epoch: 0, steps: 3 });
        assert_eq!(fake.drain(), [Message::Close]);
        assert_eq!(fake.releases(), [1, 0]);
    });
    let mut stream = open(socket).unwrap();
    assert_eq!(stream.layout().slot_count, 2);
    assert_eq!(stream.state().cursor, 0);
    let first = stream.next().unwrap().unwrap();
    assert_holds_step(&first, 0);
    assert_eq!(stream.state().cursor, 2);
    drop(first);
    let second = stream.next().unwrap().unwrap();
    let third = stream.next().unwrap().unwrap();
    assert_eq!(third.slot(), 0);
    assert_holds_step(&second, 1);
    assert_holds_step(&third, 2);
    assert!(stream.next().is_none());
    assert!(stream.next().is_none());
    assert_eq!(stream.state().cursor, 6);
    // The batches outlive the stream; the session ends with the last of them.
    drop(stream);
    assert_holds_step(&second, 1);
    drop(second);
    drop(third);
    daemon.join().unwrap();
}

/// A daemon may space slots wider than they are: each slot is read at its index times the stride.
#[test]
fn slots_are_found_at_their_stride() {
    const STRIDE: u64 = 3 * SLOT_BYTES;
    let (socket, daemon) = spawn_daemon(|mut fake| {
        let mut wide = layout(2, 2);
        wide.slot_stride = STRIDE;
        let slots = fake.open(wide);
        // What a reader at the slot size instead of the stride would find: the wrong step.
        fill_at(&slots, SLOT_BYTES, 7);
        fill_at(&slots, 0, 0);
        fill_at(&slots, STRIDE, 1);
        fake.batch(batch(0, 0));
        fake.batch(batch(1, 1));
        fake.send(Message::EndOfEpoch { epoch: 0, steps: 2 });
        fake.drain();
    });
    let mut stream = open(socket).unwrap();
    assert_eq!(stream.layout().slot_stride, STRIDE);
    let first = stream.next().unwrap().unwrap();
    let second = stream.next().unwrap().unwrap();
    assert_holds_step(&first, 0);
    assert_eq!(second.slot(), 1);
    assert_holds_step(&second, 1);
    drop((first, second));
    assert!(stream.next().is_none());
    drop(stream);
    daemon.join().unwrap();
}

#[test]
fn batches_published_before_a_status_reply_and_end_of_epoch_are_still_served() {
    let (socket, daemon) = spawn_daemon(|mut fake| {
        let slots = fake.open(layout(2, 2));
        fill(&slots, 0, 0);
        fill(&slots, 1, 1);
        fake.batch(batch(0, 0));
        fake.batch(batch(1, 1));
        assert_eq!(fake.recv(), Message::StatusRequest);
        fake.send(Message::EndOfEpoch { epoch: 0, steps: 2 });
        fake.send(Message::Status(DaemonStatus {
            streams: 1,
            ..DaemonStatus::default()
        }));
        assert_eq!(fake.drain(), [Message::Close]);
        assert_eq!(fake.releases(), [0, 1]);
    });
    let mut stream = open(socket).unwrap();
    assert_eq!(stream.status().unwrap().streams, 1);
    let steps: Vec<u64> = stream.by_ref().map(|b| b.unwrap().step()).collect();
    assert_eq!(steps, [0, 1]);
    drop(stream);
    daemon.join().unwrap();
}

#[test]
fn an_error_frame_ends_the_stream_with_a_daemon_error() {
    let (socket, daemon) = spawn_daemon(|mut fake| {
        let slots = fake.open(layout(2, 3));
        fill(&slots, 0, 0);
        fake.batch(batch(0, 0));
        fake.send(Message::Error {
            code: ErrorCode::CorruptData,
            message: "shard shard-000003.gfs field emb block 7: checksum mismatch".into(),
        });
        fake.drain();
    });
    let mut stream = open(socket).unwrap();
    assert_holds_step(&stream.next().unwrap().unwrap(), 0);
    match stream.next() {
        Some(Err(ClientError::Daemon { code, message })) => {
            assert_eq!(code, ErrorCode::CorruptData);
            assert!(message.contains("block 7"));
        }
        other => panic!("expected CorruptData, got {other:?}"),
    }
    assert!(stream.next().is_none());
    assert!(matches!(stream.status(), Err(ClientError::Ended(_))));
    drop(stream);
    daemon.join().unwrap();
}

#[test]
fn an_error_read_by_status_is_reported_once_by_the_iterator() {
    let (socket, daemon) = spawn_daemon(|mut fake| {
        fake.open(layout(2, 3));
        assert_eq!(fake.recv(), Message::StatusRequest);
        fake.send(Message::Error {
            code: ErrorCode::Internal,
            message: "reader thread died".into(),
        });
        fake.drain();
    });
    let mut stream = open(socket).unwrap();
    assert!(matches!(
        stream.status(),
        Err(ClientError::Daemon {
            code: ErrorCode::Internal,
            ..
        })
    ));
    assert!(matches!(stream.next(), Some(Err(ClientError::Ended(_)))));
    assert!(stream.next().is_none());
    drop(stream);
    daemon.join().unwrap();
}

#[test]
fn a_dropped_connection_is_a_transport_error() {
    let (socket, daemon) = spawn_daemon(|mut fake| {
        let slots = fake.open(layout(2, 3));
        fill(&slots, 0, 0);
        fake.batch(batch(0, 0));
    });
    let mut stream = open(socket).unwrap();
    let first = stream.next().unwrap().unwrap();
    assert!(matches!(
        stream.next(),
        Some(Err(ClientError::Transport(TransportError::Closed)))
    ));
    assert!(stream.next().is_none());
    // The mapping outlives the connection.
    assert_holds_step(&first, 0);
    daemon.join().unwrap();
}

/// Runs a fake that answers OpenStream with `layout`, `descriptors` memfds of `file_bytes` for the
/// slots' memory, and expects the client to refuse it.
fn assert_layout_refused(layout: StreamLayout, descriptors: usize, file_bytes: u64) {
    let (socket, daemon) = spawn_daemon(move |mut fake| {
        fake.open_files(layout, descriptors, file_bytes);
        fake.drain();
    });
    match open(socket) {
        Err(ClientError::Protocol(reason)) => assert!(!reason.is_empty()),
        other => panic!("expected a protocol error, got {other:?}"),
    }
    daemon.join().unwrap();
}

#[test]
fn bad_layouts_are_refused() {
    const RING: u64 = 2 * SLOT_BYTES;
    // No memory for the slots (more descriptors than StreamOpened carries are refused by the
    // transport: see its tests).
    assert_layout_refused(layout(2, 3), 0, RING);
    assert_layout_refused(layout(0, 3), 1, RING);
    // Memory shorter than two slots.
    assert_layout_refused(layout(2, 3), 1, RING - 1);
    // Slots closer than their size, or not on a page of their own.
    let mut overlapping_slots = layout(2, 3);
    overlapping_slots.slot_stride = SLOT_BYTES - 4096;
    assert_layout_refused(overlapping_slots, 1, RING);
    let mut unaligned_stride = layout(2, 3);
    unaligned_stride.slot_stride = SLOT_BYTES + 64;
    assert_layout_refused(unaligned_stride, 1, 2 * (SLOT_BYTES + 64));
    let mut huge_stride = layout(2, 3);
    huge_stride.slot_stride = u64::MAX - 4095;
    assert_layout_refused(huge_stride, 1, RING);
    let mut beyond = layout(2, 3);
    beyond.fields[1].offset = SLOT_BYTES;
    assert_layout_refused(beyond, 1, RING);
    let mut overflowing = layout(2, 3);
    overflowing.fields[1].batch_bytes = u64::MAX - 100;
    assert_layout_refused(overflowing, 1, RING);
    let mut unaligned = layout(2, 3);
    unaligned.fields[1].offset = 100;
    assert_layout_refused(unaligned, 1, RING);
    let mut too_small = layout(2, 3);
    too_small.fields[0].batch_bytes = 7;
    assert_layout_refused(too_small, 1, RING);
    let mut overlapping = layout(2, 3);
    overlapping.fields[0].batch_bytes = 4097;
    assert_layout_refused(overlapping, 1, RING);
    let mut duplicate = layout(2, 3);
    duplicate.fields[1].name = "ids".into();
    assert_layout_refused(duplicate, 1, RING);
    let mut wrong_steps = layout(2, 3);
    wrong_steps.steps = 4;
    assert_layout_refused(wrong_steps, 1, RING);
    let mut too_many_dims = layout(2, 3);
    too_many_dims.fields[0].sample_shape = vec![1; BATCH_NDIM_MAX];
    assert_layout_refused(too_many_dims, 1, RING);
    let mut no_fields = layout(2, 3);
    no_fields.fields.clear();
    assert_layout_refused(no_fields, 1, RING);
}

#[test]
fn slots_that_can_shrink_are_refused() {
    let (socket, daemon) = spawn_daemon(|mut fake| {
        let files = vec![unsealed_memfd(2 * SLOT_BYTES)];
        fake.open_with(layout(2, 3), files);
        fake.drain();
    });
    match open(socket) {
        Err(ClientError::Protocol(reason)) => {
            assert!(reason.contains("sealed against shrinking"), "{reason}")
        }
        other => panic!("expected a protocol error, got {other:?}"),
    }
    daemon.join().unwrap();
}

/// A daemon that refuses the peer's uid answers before reading Hello and closes; the client
/// reports the refusal even when its Hello can no longer be sent.
#[test]
fn a_refusal_sent_before_hello_is_reported() {
    let (client, daemon) = UnixStream::pair().unwrap();
    client.set_read_timeout(Some(TEST_TIMEOUT)).unwrap();
    transport::send(
        &daemon,
        &Message::Error {
            code: ErrorCode::PermissionDenied,
            message: "uid 1234 is not allowed to connect".into(),
        },
        &[],
    )
    .unwrap();
    drop(daemon);
    match Client::from_socket(client) {
        Err(ClientError::Daemon { code, .. }) => assert_eq!(code, ErrorCode::PermissionDenied),
        other => panic!("expected the refusal, got {other:?}"),
    }
}

#[test]
fn a_layout_must_match_the_requested_fields() {
    let (socket, daemon) = spawn_daemon(|mut fake| {
        fake.open(layout(2, 3));
        fake.drain();
    });
    let mut spec = StreamSpec::new("demo", BATCH_SIZE);
    spec.fields = vec![
        FieldRequest {
            name: "ids".into(),
            dtype: None,
        },
        FieldRequest {
            name: "emb".into(),
            dtype: Some(DType::F16),
        },
    ];
    let result = Client::from_socket(socket).unwrap().open_stream(spec);
    assert!(matches!(result, Err(ClientError::Protocol(_))));
    daemon.join().unwrap();
}

/// What the fake daemon does after opening a good stream.
enum Step {
    /// Publishes this batch entry.
    Batch(BatchInfo),
    /// Publishes a batch entry this many entries ahead of the next (a count that runs ahead).
    Skip(u64),
    /// Sends this frame with this many descriptors.
    Frame(Message, usize),
}

/// Opens a good stream, plays `steps` (the first batch's slot is filled), and expects the client to
/// yield `good` batches and then a protocol error.
fn assert_batches_refused(good: usize, steps: Vec<Step>) {
    let (socket, daemon) = spawn_daemon(move |mut fake| {
        let slots = fake.open(layout(2, 3));
        fill(&slots, 0, 0);
        for step in steps {
            match step {
                Step::Batch(info) => fake.batch(info),
                Step::Skip(ahead) => {
                    let ring = fake.ring();
                    let index = ring.published + ahead;
                    if ring.view.publish_batch(
                        index,
                        &gpufeed_proto::ring::RingBatch {
                            slot: 0,
                            samples: BATCH_SIZE,
                            replaced: 0,
                            epoch: 0,
                            step: 0,
                            cursor_after: 2,
                            ready_ns: 0,
                        },
                    ) {
                        ring.consumer_bell.ring();
                    }
                }
                Step::Frame(message, descriptors) => {
                    let files: Vec<File> = (0..descriptors).map(|_| memfd(4096)).collect();
                    fake.send_with(message, &files);
                }
            }
        }
        fake.drain();
    });
    let mut stream = open(socket).unwrap();
    let mut held = Vec::new();
    for _ in 0..good {
        held.push(stream.next().unwrap().unwrap());
    }
    match stream.next() {
        Some(Err(ClientError::Protocol(reason))) => assert!(!reason.is_empty()),
        other => panic!("expected a protocol error, got {other:?}"),
    }
    assert!(stream.next().is_none());
    drop(stream);
    drop(held);
    daemon.join().unwrap();
}

#[test]
fn bad_batches_are_refused() {
    let ok = |slot, step| Step::Batch(batch(slot, step));
    let bad = |edit: fn(&mut BatchInfo)| {
        let mut info = batch(0, 0);
        edit(&mut info);
        Step::Batch(info)
    };
    assert_batches_refused(0, vec![bad(|b| b.slot = 2)]);
    assert_batches_refused(0, vec![bad(|b| b.epoch = 1)]);
    assert_batches_refused(0, vec![bad(|b| b.samples = 3)]);
    assert_batches_refused(0, vec![bad(|b| b.samples = 0)]);
    assert_batches_refused(0, vec![bad(|b| b.replaced = 3)]);
    assert_batches_refused(0, vec![bad(|b| b.cursor_after = 0)]);
    // A published count more than the ring's length ahead.
    assert_batches_refused(0, vec![Step::Skip(2)]);
    // Descriptors on a frame other than StreamOpened.
    assert_batches_refused(
        0,
        vec![Step::Frame(Message::EndOfEpoch { epoch: 0, steps: 3 }, 1)],
    );
    // The same slot again while the client holds it.
    assert_batches_refused(1, vec![ok(0, 0), ok(0, 1)]);
    // Steps must follow each other.
    assert_batches_refused(1, vec![ok(0, 0), ok(1, 2)]);
    // An EndOfEpoch before the announced number of batches, or announcing another number.
    assert_batches_refused(
        1,
        vec![
            ok(0, 0),
            Step::Frame(Message::EndOfEpoch { epoch: 0, steps: 3 }, 0),
        ],
    );
    assert_batches_refused(
        1,
        vec![
            ok(0, 0),
            Step::Frame(Message::EndOfEpoch { epoch: 0, steps: 1 }, 0),
        ],
    );
    // Messages that only the client sends, and a Status nobody asked for.
    assert_batches_refused(0, vec![Step::Frame(Message::Close, 0)]);
    assert_batches_refused(
        0,
        vec![Step::Frame(Message::Status(DaemonStatus::default()), 0)],
    );
}

#[test]
fn more_batches_than_announced_are_refused() {
    let (socket, daemon) = spawn_daemon(|mut fake| {
        fake.open(layout(2, 1));
        fake.batch(batch(0, 0));
        fake.batch(batch(1, 1));
        fake.drain();
    });
    let mut stream = open(socket).unwrap();
    let first = stream.next().unwrap().unwrap();
    assert!(matches!(stream.next(), Some(Err(ClientError::Protocol(_)))));
    drop(first);
    drop(stream);
    daemon.join().unwrap();
}

#[test]
fn specs_that_break_a_bound_are_refused_locally() {
    let base = StreamSpec::new("demo", 8);
    assert!(check_spec(&base).is_ok());
    let edits: [fn(&mut StreamSpec); 8] = [
        |s| s.dataset.clear(),
        |s| s.dataset = "d".repeat(STRING_BYTES_MAX + 1),
        |s| s.batch_size = 0,
        |s| s.rank = 1,
        |s| s.prefetch = SLOTS_MAX + 1,
        |s| s.shuffle = Shuffle::Window(0),
        |s| s.device = Device::Cuda(u32::MAX),
        // 256 names of 1024 bytes fit the field bound but not a frame.
        |s| {
            s.fields = (0..STREAM_FIELDS_MAX)
                .map(|i| FieldRequest {
                    name: format!("{i:0>1024}"),
                    dtype: None,
                })
                .collect()
        },
    ];
    for edit in edits {
        let mut spec = base.clone();
        edit(&mut spec);
        assert!(matches!(
            check_spec(&spec),
            Err(ClientError::InvalidSpec(_))
        ));
    }
    // A request of exactly FRAME_BYTES_MAX is accepted and encodes to that size; one byte more
    // is refused.
    let mut largest = base.clone();
    let fixed = FRAME_HEADER_BYTES + 2 + largest.dataset.len() + 2 + OPEN_STREAM_FIXED_BYTES;
    let count = 65;
    let per_field = (FRAME_BYTES_MAX - fixed) / count;
    let remainder = (FRAME_BYTES_MAX - fixed) % count;
    largest.fields = (0..count)
        .map(|i| FieldRequest {
            name: "f".repeat(per_field - 3 + if i == 0 { remainder } else { 0 }),
            dtype: None,
        })
        .collect();
    assert!(check_spec(&largest).is_ok());
    assert_eq!(
        Message::OpenStream(largest.clone()).encode().len(),
        FRAME_BYTES_MAX
    );
    largest.fields[1].name.push('f');
    assert!(matches!(
        check_spec(&largest),
        Err(ClientError::InvalidSpec(_))
    ));
}

#[test]
fn an_invalid_spec_sends_nothing() {
    let (socket, daemon) = spawn_daemon(|fake| {
        fake.welcome();
        assert!(fake.drain().is_empty());
    });
    let mut spec = StreamSpec::new("demo", BATCH_SIZE);
    spec.device = Device::Cuda(u32::MAX);
    let result = Client::from_socket(socket).unwrap().open_stream(spec);
    assert!(matches!(result, Err(ClientError::InvalidSpec(_))));
    daemon.join().unwrap();
}

#[test]
fn streams_and_batches_can_move_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    fn assert_send<T: Send>() {}
    assert_send::<Stream>();
    assert_send::<Client>();
    assert_send_sync::<Batch>();
}

#[test]
fn spec_helpers_set_the_cursor() {
    let mut spec = StreamSpec::new("demo", 8);
    assert_eq!(
        (
            spec.fields.len(),
            spec.world_size,
            spec.prefetch,
            spec.start_cursor
        ),
        (0, 1, PREFETCH_DEFAULT, 0)
    );
    assert_eq!(
        (spec.tail, spec.on_corrupt, spec.device),
        (Tail::Drop, CorruptPolicy::Fail, Device::Cpu)
    );
    spec.world_size = 4;
    spec.start_at_step(10);
    assert_eq!(spec.start_cursor, 320);
    spec.start_at_step(u64::MAX);
    assert_eq!(spec.start_cursor, u64::MAX);

    let state = StreamState {
        dataset: "demo".into(),
        sources: Vec::new(),
        mixture_epoch_samples: None,
        seed: 7,
        epoch: 3,
        shuffle: Shuffle::Window(4),
        world_size: 8,
        batch_size: 16,
        cursor: 4096,
    };
    spec.resume(&state)
        .expect("the spec leaves the order to the state");
    assert_eq!(
        (spec.seed, spec.epoch, spec.shuffle),
        (7, 3, Shuffle::Window(4))
    );
    assert_eq!(spec.start_cursor, 4096);
    // The world and the batch size stay as configured: resume is elastic.
    assert_eq!((spec.world_size, spec.batch_size), (4, 8));
}
