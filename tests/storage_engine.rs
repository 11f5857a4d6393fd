//! The read engine against real files: io_uring and pread queues, O_DIRECT and buffered descriptors,
//! random extents of every alignment compared with plain `pread`, and every error path through the
//! fault-injecting queue (EIO, EINTR, EAGAIN, short reads, end of file).

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;

use gpufeed::storage::fault::{Fault, FaultQueue};
use gpufeed::storage::{
    DirectIo, EngineLimits, Extent, FileId, FileTable, PreadQueue, ReadEngine, ReadQueue,
    UringQueue,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const FILE_BYTES: usize = 3 * 1024 * 1024 + 1234;

fn limits() -> EngineLimits {
    EngineLimits {
        chunk_bytes_max: 64 * 1024,
        retries_max: 4,
    }
}

fn write_random_file(
    dir: &Path,
    name: &str,
    bytes: usize,
    seed: u64,
) -> (std::path::PathBuf, Vec<u8>) {
    let data = gpufeed::synth::random_bytes(bytes, seed);
    let path = dir.join(name);
    fs::write(&path, &data).unwrap();
    (path, data)
}

/// An aligned destination buffer: O_DIRECT needs 4096-aligned addresses, so the tests place
/// destinations inside a page-aligned allocation.
struct AlignedBuffer {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuffer {
    fn new(len: usize) -> AlignedBuffer {
        let storage = vec![0u8; len + 4096];
        let start = (4096 - storage.as_ptr() as usize % 4096) % 4096;
        AlignedBuffer {
            storage,
            start,
            len,
        }
    }
    fn slice(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

fn random_extents(rng: &mut StdRng, file: FileId, count: usize) -> (Vec<Extent>, usize) {
    let mut extents = Vec::new();
    let mut dest = 0usize;
    for _ in 0..count {
        let aligned = rng.gen_bool(0.5);
        let offset = if aligned {
            rng.gen_range(0..FILE_BYTES as u64 / 4096) * 4096
        } else {
            rng.gen_range(0..FILE_BYTES as u64 - 1)
        };
        let max_len = (FILE_BYTES as u64 - offset) as usize;
        let len = match rng.gen_range(0..4) {
            0 => rng.gen_range(1..=max_len.min(100)),
            1 => (rng.gen_range(1..=8usize) * 4096).min(max_len),
            2 => rng.gen_range(1..=max_len.min(300_000)),
            _ => (rng.gen_range(1..=4usize) * 4096 + rng.gen_range(1..4096usize)).min(max_len),
        };
        if rng.gen_bool(0.7) {
            dest = dest.div_ceil(4096) * 4096;
        }
        extents.push(Extent {
            file,
            offset,
            len,
            dest_offset: dest,
        });
        dest += len + rng.gen_range(0..3usize);
    }
    (extents, dest)
}

fn check_against_pread<Q: ReadQueue>(
    engine: &mut ReadEngine<Q>,
    files: &FileTable,
    path: &Path,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let reference = fs::File::open(path).unwrap();
    for round in 0..20 {
        let count = rng.gen_range(1..40);
        let (extents, dest_len) = random_extents(&mut rng, FileId(0), count);
        let mut buffer = AlignedBuffer::new(dest_len);
        let results = engine.read(files, &extents, buffer.slice()).unwrap();
        let dest = buffer.slice();
        for (index, (extent, result)) in extents.iter().zip(results).enumerate() {
            result.unwrap_or_else(|e| panic!("round {round} extent {index}: {e}"));
            let mut expected = vec![0u8; extent.len];
            reference
                .read_exact_at(&mut expected, extent.offset)
                .unwrap();
            assert!(
                dest[extent.dest_offset..extent.dest_offset + extent.len] == expected[..],
                "round {round} extent {index} {extent:?} differs from pread"
            );
        }
    }
}

#[test]
fn uring_reads_equal_pread_with_direct_and_buffered_descriptors() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = write_random_file(dir.path(), "data", FILE_BYTES, 1);
    for direct in [DirectIo::Prefer, DirectIo::Off] {
        let mut files = FileTable::new(4);
        files.open(&path, direct).unwrap();
        let queue = UringQueue::new(16).expect("io_uring is available on Linux 5.6+");
        let mut engine = ReadEngine::new(queue, limits());
        check_against_pread(&mut engine, &files, &path, 7);
    }
}

#[test]
fn pread_queue_reads_equal_pread() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = write_random_file(dir.path(), "data", FILE_BYTES, 2);
    let mut files = FileTable::new(1);
    files.open(&path, DirectIo::Prefer).unwrap();
    let mut engine = ReadEngine::new(PreadQueue::new(8), limits());
    check_against_pread(&mut engine, &files, &path, 8);
}

#[test]
fn shallow_queue_with_many_extents_completes_them_all() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = write_random_file(dir.path(), "data", FILE_BYTES, 3);
    let mut files = FileTable::new(1);
    files.open(&path, DirectIo::Prefer).unwrap();
    let mut engine = ReadEngine::new(UringQueue::new(1).unwrap(), limits());
    check_against_pread(&mut engine, &files, &path, 9);
}

fn faulty_engine(
    path: &Path,
    script: HashMap<u64, Fault>,
    every: Option<Fault>,
) -> (ReadEngine<FaultQueue<UringQueue>>, FileTable) {
    let mut files = FileTable::new(1);
    files.open(path, DirectIo::Prefer).unwrap();
    let mut queue = FaultQueue::new(UringQueue::new(8).unwrap(), script);
    if let Some(fault) = every {
        queue = queue.with_every(fault);
    }
    (ReadEngine::new(queue, limits()), files)
}

fn three_extents() -> Vec<Extent> {
    (0..3)
        .map(|i| Extent {
            file: FileId(0),
            offset: i as u64 * 40_960,
            len: 20_000,
            dest_offset: i * 24_576,
        })
        .collect()
}

#[test]
fn eio_fails_only_its_extent_and_names_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = write_random_file(dir.path(), "shard.gfs", FILE_BYTES, 4);
    // Reads are pushed in extent order; each 20 000-byte extent is an aligned 16 384-byte read plus a
    // tail, so read 2 is the second extent's aligned head.
    let (mut engine, files) =
        faulty_engine(&path, HashMap::from([(2, Fault::Errno(libc::EIO))]), None);
    let extents = three_extents();
    let mut buffer = AlignedBuffer::new(3 * 24_576);
    let results = engine.read(&files, &extents, buffer.slice()).unwrap();
    assert!(results[0].is_ok() && results[2].is_ok());
    let message = results[1].as_ref().unwrap_err().to_string();
    assert!(
        message.contains("shard.gfs") && message.contains("offset 40960"),
        "{message}"
    );
    assert!(message.contains("Input/output error"), "{message}");
    let dest = buffer.slice();
    assert_eq!(dest[..20_000], data[..20_000]);
    assert_eq!(dest[2 * 24_576..2 * 24_576 + 20_000], data[81_920..101_920]);
}

#[test]
fn eintr_and_eagain_are_retried() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = write_random_file(dir.path(), "data", FILE_BYTES, 5);
    let script = HashMap::from([
        (0, Fault::Errno(libc::EINTR)),
        (1, Fault::Errno(libc::EAGAIN)),
        (3, Fault::Errno(libc::EINTR)),
    ]);
    let (mut engine, files) = faulty_engine(&path, script, None);
    let extents = three_extents();
    let mut buffer = AlignedBuffer::new(3 * 24_576);
    let results = engine.read(&files, &extents, buffer.slice()).unwrap();
    assert!(results.iter().all(Result::is_ok));
    assert_eq!(engine.queue().faults_applied, 3);
    for extent in &extents {
        let start = extent.offset as usize;
        assert_eq!(
            buffer.slice()[extent.dest_offset..extent.dest_offset + extent.len],
            data[start..start + extent.len]
        );
    }
}

#[test]
fn persistent_eagain_exhausts_the_retry_bound() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = write_random_file(dir.path(), "data", FILE_BYTES, 6);
    let (mut engine, files) =
        faulty_engine(&path, HashMap::new(), Some(Fault::Errno(libc::EAGAIN)));
    let mut buffer = AlignedBuffer::new(3 * 24_576);
    let results = engine
        .read(&files, &three_extents(), buffer.slice())
        .unwrap();
    for result in results {
        let message = result.unwrap_err().to_string();
        assert!(message.contains("after 4 retries"), "{message}");
    }
}

#[test]
fn short_reads_are_continued_to_the_exact_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = write_random_file(dir.path(), "data", FILE_BYTES, 7);
    // Every read returns at most 1000 bytes: continuations start unaligned and must move to the
    // buffered descriptor.
    let (mut engine, files) = faulty_engine(&path, HashMap::new(), Some(Fault::Short(1000)));
    let extents = three_extents();
    let mut buffer = AlignedBuffer::new(3 * 24_576);
    let results = engine.read(&files, &extents, buffer.slice()).unwrap();
    assert!(results.iter().all(Result::is_ok));
    for extent in &extents {
        let start = extent.offset as usize;
        assert_eq!(
            buffer.slice()[extent.dest_offset..extent.dest_offset + extent.len],
            data[start..start + extent.len]
        );
    }
}

#[test]
fn injected_eof_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = write_random_file(dir.path(), "data", FILE_BYTES, 8);
    let (mut engine, files) = faulty_engine(&path, HashMap::from([(0, Fault::Eof)]), None);
    let mut buffer = AlignedBuffer::new(3 * 24_576);
    let results = engine
        .read(&files, &three_extents(), buffer.slice())
        .unwrap();
    let message = results[0].as_ref().unwrap_err().to_string();
    assert!(message.contains("unexpected end of file"), "{message}");
    assert!(results[1].is_ok() && results[2].is_ok());
}

#[test]
fn extent_past_the_real_end_of_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = write_random_file(dir.path(), "short.gfs", 10_000, 9);
    let mut files = FileTable::new(1);
    files.open(&path, DirectIo::Prefer).unwrap();
    let mut engine = ReadEngine::new(UringQueue::new(4).unwrap(), limits());
    let extents = [
        Extent {
            file: FileId(0),
            offset: 8192,
            len: 4096,
            dest_offset: 0,
        },
        Extent {
            file: FileId(0),
            offset: 20_000,
            len: 100,
            dest_offset: 4096,
        },
        Extent {
            file: FileId(0),
            offset: 0,
            len: 10_000,
            dest_offset: 8192,
        },
    ];
    let mut buffer = AlignedBuffer::new(20_000);
    let results = engine.read(&files, &extents, buffer.slice()).unwrap();
    for result in &results[..2] {
        let message = result.as_ref().unwrap_err().to_string();
        assert!(
            message.contains("short.gfs") && message.contains("end of file"),
            "{message}"
        );
    }
    results[2].as_ref().unwrap();
    assert_eq!(buffer.slice()[8192..18_192], data[..]);
}

#[test]
fn file_table_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = write_random_file(dir.path(), "data", 100, 10);
    let mut files = FileTable::new(1);
    files.open(&path, DirectIo::Off).unwrap();
    let error = files.open(&path, DirectIo::Off).unwrap_err().to_string();
    assert!(error.contains("cannot open more than 1 files"), "{error}");
    let missing = files.open(&dir.path().join("nope"), DirectIo::Off);
    assert!(missing.is_err());
}

#[test]
fn reads_into_a_registered_fixed_buffer_equal_pread() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = write_random_file(dir.path(), "data", FILE_BYTES, 11);
    let mut files = FileTable::new(1);
    files.open(&path, DirectIo::Prefer).unwrap();
    let mut buffer = gpufeed::storage::AlignedBuffer::new(1 << 20);
    let mut queue = UringQueue::new(8).unwrap();
    let iovec = libc::iovec {
        iov_base: buffer.as_mut_slice().as_mut_ptr().cast(),
        iov_len: buffer.len(),
    };
    // SAFETY: the buffer outlives the queue (dropped after the engine below).
    unsafe { queue.register_buffers(&[iovec]) }.unwrap();
    let mut engine = ReadEngine::new(queue, limits());
    let extents = [
        Extent {
            file: FileId(0),
            offset: 0,
            len: 300_000,
            dest_offset: 0,
        },
        Extent {
            file: FileId(0),
            offset: 1_000_001,
            len: 5_000,
            dest_offset: 303_104,
        },
        Extent {
            file: FileId(0),
            offset: 2_097_152,
            len: 65_536,
            dest_offset: 311_296,
        },
    ];
    let results = engine
        .read_with(&files, &extents, buffer.as_mut_slice(), Some(0))
        .unwrap();
    assert!(results.iter().all(Result::is_ok));
    for extent in &extents {
        let start = extent.offset as usize;
        assert_eq!(
            buffer.as_slice()[extent.dest_offset..extent.dest_offset + extent.len],
            data[start..start + extent.len]
        );
    }
    drop(engine);
}
