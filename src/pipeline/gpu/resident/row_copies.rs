//! Rows copied by host threads: a full shuffle of a dataset larger than the registration budget.
//!
//! Within the budget a full shuffle reads every row in place from windows registered for the
//! stream's life. Beyond it, no window set stays registered for every row a batch draws: a batch of
//! 4096 rows touches nearly every window of the dataset, and registering windows per round (5 to
//! 7.5 ms per 256 MiB, unregistering waiting for the device) or staging a 64 KiB block per 2 KiB
//! row (32 times the bytes) served less than 0.14 GB/s on the H100 test machine. Instead, the
//! stream keeps the windows the budget has room for registered (rows there are read in place, as
//! within the budget), and each round's other rows are copied by host threads from the shards'
//! page-cache maps ([`MappedFile`]) into the round's pinned buffer, packed one after the other,
//! uploaded with one copy into the round's device staging buffer, and gathered from there by the
//! same kernel: the bytes read are the rows' bytes, whatever the order.
//!
//! The planning threads place each such row (a [`RowCopy`]: shard, file offset, length, staging
//! offset) when they plan its round; the filler hands the round's copies to the copy threads
//! ([`RowCopier::copy_round`]), copies a share itself, and waits for them before it queues the
//! upload, so that a round's pinned buffer is complete before the copy engines read it. Everything
//! is bounded: the threads (`loader_copy_threads`, [`ROW_COPY_THREADS_DEFAULT`] when 0), one
//! pinned buffer per set of round buffers, [`ROW_STAGING_BYTES_MAX`] each, and the rows of a round
//! (what its buffer holds).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::device::{Device, PinnedBuffer};
use crate::pipeline::stream_plan::FillError;
use crate::storage::mapped::MappedFile;

pub(super) use crate::pipeline::cold_rows::{ColdRows, RowCopy};

/// Row copy threads of a stream when `loader_copy_threads` is 0, the filler's own share included.
/// One thread copies scattered 2 KiB rows from the page cache at a few GB/s (a memory copy, most
/// of it cache misses); the rows not in registered windows are most of a dataset several times the
/// budget, so reaching 20 GB/s takes several. The threads run only while a round's rows are
/// copied, and the host's cores belong to the training processes first: eight, and never more than
/// half the host's CPUs.
pub(super) const ROW_COPY_THREADS_DEFAULT: usize = 8;

/// Bytes of a round's pinned row buffer at most (and of the device staging the rows are uploaded
/// into): a batch of 4096 rows of 2 KiB is 8 MiB, one round.
pub(super) const ROW_STAGING_BYTES_MAX: usize = 16 << 20;

/// Alignment of each row's bytes in the staging buffer: the gather kernel's vector loads want
/// 16-byte aligned sources.
pub(super) const ROW_STAGING_ALIGN: u64 = 16;

/// Rows below this many bytes in a round are copied by the filler alone: waking the threads would
/// cost more than the copy.
const ROUND_BYTES_PER_THREAD_MIN: u64 = 256 << 10;

/// Where the next row goes in a round's staging buffer of `capacity` bytes: `used` rounded up to
/// [`ROW_STAGING_ALIGN`], if `bytes` more fit; the caller then sets `used` past them.
pub(super) fn staging_place(used: u64, bytes: u64, capacity: u64) -> Option<u64> {
    let at = used.div_ceil(ROW_STAGING_ALIGN) * ROW_STAGING_ALIGN;
    (at.checked_add(bytes)? <= capacity).then_some(at)
}

/// The most staging bytes one row may take, given each field's bytes per row and the smallest
/// raw block of the field (`(sample_bytes, block_bytes_min)`), in windows of `window_bytes`: each
/// piece of a field's row starts aligned, and a row's bytes are cut into pieces at every block edge
/// and every window edge they cross (at most one more of each than their bytes over the size).
pub(super) fn row_staging_bytes_max(
    fields: impl Iterator<Item = (usize, u64)>,
    window_bytes: u64,
) -> u64 {
    fields
        .map(|(bytes, block_bytes_min)| {
            let bytes = bytes as u64;
            let pieces =
                1 + (bytes / block_bytes_min.max(1) + 1) + (bytes / window_bytes.max(1) + 1);
            bytes + pieces * ROW_STAGING_ALIGN
        })
        .sum()
}

/// Cuts `copies` into at most `parts` consecutive ranges of about equal bytes (none empty), for
/// the copy threads.
pub(super) fn split_copies(copies: &[RowCopy], parts: usize) -> Vec<Range<usize>> {
    let total: u64 = copies.iter().map(|c| c.bytes as u64).sum();
    let parts = parts.clamp(1, copies.len().max(1));
    let mut ranges = Vec::with_capacity(parts);
    let mut start = 0;
    let mut done = 0u64;
    for part in 1..=parts {
        if start == copies.len() {
            break;
        }
        let target = total * part as u64 / parts as u64;
        let mut end = start;
        while end < copies.len() && (done < target || end == start) {
            done += copies[end].bytes as u64;
            end += 1;
        }
        if part == parts {
            while end < copies.len() {
                done += copies[end].bytes as u64;
                end += 1;
            }
        }
        ranges.push(start..end);
        start = end;
    }
    ranges
}

/// Copies each of `copies` from its shard's map into `dst` (a buffer of `dst_bytes` bytes) at its
/// staging offset. A copy outside its shard's map or the buffer is an error naming the shard; the
/// caller checks the maps ([`MappedFile::check`]) before the bytes are used.
///
/// # Safety
/// `dst .. dst + dst_bytes` is writable memory that nothing else reads or writes meanwhile, except
/// other calls of this function given copies whose staging ranges do not overlap these.
unsafe fn copy_rows(
    maps: &[MappedFile],
    copies: &[RowCopy],
    dst: *mut u8,
    dst_bytes: usize,
) -> Result<(), usize> {
    for copy in copies {
        let shard = copy.shard as usize;
        let map = maps.get(shard).ok_or(shard)?;
        let start = copy.file_offset as usize;
        let end = start + copy.bytes as usize;
        let source = map.bytes().get(start..end).ok_or(shard)?;
        let at = copy.staging_offset as usize;
        if at + source.len() > dst_bytes {
            return Err(shard);
        }
        // SAFETY: the destination range lies within the buffer (checked above), which the caller
        // vouches no one else touches at these offsets; the source is a live map of the shard.
        unsafe { std::ptr::copy_nonoverlapping(source.as_ptr(), dst.add(at), source.len()) };
    }
    Ok(())
}

/// Host time and bytes of one row copy thread (the filler's share is counted as thread 0).
#[derive(Default)]
struct ThreadStats {
    bytes: AtomicU64,
    busy_ns: AtomicU64,
}

/// A round's copies being made: the parts not yet done, and the first failure.
struct Progress {
    left: usize,
    /// A shard whose rows could not be copied, or `usize::MAX` for a copy thread that panicked.
    failed: Option<usize>,
}

type Completion = Arc<(Mutex<Progress>, Condvar)>;

/// One copy thread's part of a round.
struct Part {
    copies: Arc<Vec<RowCopy>>,
    range: Range<usize>,
    /// The round's pinned buffer (address and length), written only at these copies' offsets.
    dst: usize,
    dst_bytes: usize,
    done: Completion,
}

/// Counts a part done when dropped, also when its thread panics, so that the filler waiting for
/// the round never waits forever.
struct PartDone<'a> {
    done: &'a Completion,
    failed: Option<usize>,
}

impl Drop for PartDone<'_> {
    fn drop(&mut self) {
        let (lock, cvar) = &**self.done;
        let mut progress = lock.lock().unwrap_or_else(|p| p.into_inner());
        progress.left -= 1;
        let failed = if std::thread::panicking() {
            Some(usize::MAX)
        } else {
            self.failed
        };
        if progress.failed.is_none() {
            progress.failed = failed;
        }
        cvar.notify_all();
    }
}

fn run_part(maps: &[MappedFile], part: &Part, stats: &ThreadStats) {
    let mut done = PartDone {
        done: &part.done,
        failed: None,
    };
    let started = std::time::Instant::now();
    let copies = &part.copies[part.range.clone()];
    // SAFETY: the filler does not touch the buffer, nor drop it, until every part of the round is
    // counted done (`PartDone`), and the parts' staging ranges are disjoint (the planner placed
    // each row after the last).
    let copied = unsafe { copy_rows(maps, copies, part.dst as *mut u8, part.dst_bytes) };
    done.failed = copied.err();
    let bytes: u64 = copies.iter().map(|c| c.bytes as u64).sum();
    stats.bytes.fetch_add(bytes, Ordering::Relaxed);
    stats
        .busy_ns
        .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

/// The copy threads of a stream and the shard maps they read (see the module documentation).
pub(super) struct CopyThreads {
    maps: Arc<Vec<MappedFile>>,
    /// One channel per copy thread besides the filler.
    senders: Vec<std::sync::mpsc::SyncSender<Part>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Per thread, the filler's share first.
    stats: Arc<Vec<ThreadStats>>,
    /// Seconds the filler waited for the copy threads.
    wait_s: f64,
}

impl CopyThreads {
    /// Starts `threads - 1` copy threads reading `maps` (the filler is the first).
    pub(super) fn start(maps: Vec<MappedFile>, threads: usize) -> CopyThreads {
        let maps = Arc::new(maps);
        let threads = threads.max(1);
        let stats: Arc<Vec<ThreadStats>> =
            Arc::new((0..threads).map(|_| ThreadStats::default()).collect());
        let mut senders = Vec::with_capacity(threads - 1);
        let mut handles = Vec::with_capacity(threads - 1);
        for thread in 1..threads {
            // One part at a time: the filler waits for a round's parts before it sends the next.
            let (sender, receiver) = std::sync::mpsc::sync_channel::<Part>(1);
            let (maps, stats) = (Arc::clone(&maps), Arc::clone(&stats));
            let spawned = std::thread::Builder::new()
                .name(format!("gpufeed-rows-{thread}"))
                .spawn(move || {
                    for part in receiver {
                        run_part(&maps, &part, &stats[thread]);
                    }
                });
            match spawned {
                Ok(handle) => {
                    senders.push(sender);
                    handles.push(handle);
                }
                // Fewer threads: the filler copies their share.
                Err(error) => {
                    tracing::warn!("starting a row copy thread failed: {error}");
                    break;
                }
            }
        }
        CopyThreads {
            maps,
            senders,
            threads: handles,
            stats,
            wait_s: 0.0,
        }
    }

    /// Copies `copies` into `dst` on the copy threads and this one, and returns once every part
    /// is done: the bytes copied, or the index of a shard a copy fell outside of (`usize::MAX`: a
    /// copy thread panicked).
    ///
    /// # Safety
    /// `dst .. dst + dst_bytes` is writable memory that nothing else reads or writes until this
    /// returns.
    unsafe fn copy(
        &mut self,
        copies: Vec<RowCopy>,
        dst: *mut u8,
        dst_bytes: usize,
    ) -> Result<u64, usize> {
        let bytes: u64 = copies.iter().map(|c| c.bytes as u64).sum();
        let threads =
            (self.senders.len() + 1).min((bytes / ROUND_BYTES_PER_THREAD_MIN).max(1) as usize);
        let copies = Arc::new(copies);
        let ranges = split_copies(&copies, threads);
        let done: Completion = Arc::new((
            Mutex::new(Progress {
                left: ranges.len(),
                failed: None,
            }),
            Condvar::new(),
        ));
        let part = |range: Range<usize>| Part {
            copies: Arc::clone(&copies),
            range,
            dst: dst as usize,
            dst_bytes,
            done: Arc::clone(&done),
        };
        let mut ranges = ranges.into_iter();
        let own = ranges.next();
        for (sender, range) in self.senders.iter().zip(ranges.by_ref()) {
            if let Err(returned) = sender.send(part(range)) {
                // The thread is gone: this one copies its part.
                run_part(&self.maps, &returned.0, &self.stats[0]);
            }
        }
        for range in own.into_iter().chain(ranges) {
            run_part(&self.maps, &part(range), &self.stats[0]);
        }
        let waited = std::time::Instant::now();
        let (lock, cvar) = &*done;
        let mut progress = lock.lock().unwrap_or_else(|p| p.into_inner());
        while progress.left > 0 {
            progress = cvar.wait(progress).unwrap_or_else(|p| p.into_inner());
        }
        let failed = progress.failed;
        drop(progress);
        self.wait_s += waited.elapsed().as_secs_f64();
        match failed {
            Some(shard) => Err(shard),
            None => Ok(bytes),
        }
    }

    /// Seconds each thread (the filler's share first) spent copying, and the bytes it copied.
    pub(super) fn thread_stats(&self) -> Vec<(f64, u64)> {
        self.stats
            .iter()
            .map(|s| {
                (
                    s.busy_ns.load(Ordering::Relaxed) as f64 * 1e-9,
                    s.bytes.load(Ordering::Relaxed),
                )
            })
            .collect()
    }
}

impl Drop for RowCopier {
    fn drop(&mut self) {
        if let Some(cold) = &self.cold {
            let stats = cold.stats();
            tracing::info!(
                "rows read from the disk: {} bytes of rows in {} reads of {} bytes ({:.2}x), {} \
                 blocks verified, in {:.2} s ({:.2} GB/s of rows)",
                stats.row_bytes,
                stats.reads,
                stats.read_bytes,
                stats.read_bytes as f64 / stats.row_bytes.max(1) as f64,
                stats.blocks_verified,
                stats.busy_s,
                stats.row_bytes as f64 / stats.busy_s.max(1e-9) * 1e-9
            );
        }
    }
}

impl Drop for CopyThreads {
    fn drop(&mut self) {
        // Closing the channels ends the threads; none holds a part (the filler waited for each).
        self.senders.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        let stats = self.thread_stats();
        let (busy_s, bytes) = stats
            .iter()
            .fold((0.0, 0u64), |(s, b), &(ts, tb)| (s + ts, b + tb));
        if bytes > 0 {
            tracing::info!(
                "row copies: {} bytes on {} threads in {:.2} s of host time ({:.2} GB/s per busy \
                 thread; per thread [s, bytes]: {:?}); the filler waited {:.2} s for the others",
                bytes,
                stats.len(),
                busy_s,
                bytes as f64 / busy_s.max(1e-9) * 1e-9,
                stats,
                self.wait_s
            );
        }
    }
}

/// The row copy threads of a stream and its pinned row buffers (see the module documentation), or
/// its disk reader ([`ColdRows`]) where the dataset is larger than the memory the daemon may use.
pub(super) struct RowCopier {
    threads: CopyThreads,
    cold: Option<ColdRows>,
    files: Vec<std::fs::File>,
    paths: Vec<std::path::PathBuf>,
    /// One per set of round buffers: round buffers `i` upload from buffer `i`.
    buffers: Vec<PinnedBuffer>,
}

impl RowCopier {
    /// Maps the shard files `paths`, pins `rounds` buffers of `buffer_bytes`, and starts
    /// `threads - 1` copy threads (the filler is the first), or, given `cold`, reads the rows
    /// through it (and starts no thread).
    pub(super) fn new(
        device: &Device,
        paths: Vec<std::path::PathBuf>,
        rounds: usize,
        buffer_bytes: usize,
        threads: usize,
        cold: Option<ColdRows>,
    ) -> Result<RowCopier, FillError> {
        let mut files = Vec::with_capacity(paths.len());
        let mut maps = Vec::with_capacity(paths.len());
        for path in &paths {
            let opened = std::fs::File::open(path).and_then(|file| {
                let map = MappedFile::map(&file)?;
                Ok((file, map))
            });
            let (file, map) = opened.map_err(|source| FillError::ShardCopy {
                shard: path.clone(),
                source: Arc::new(source),
            })?;
            files.push(file);
            maps.push(map);
        }
        let mut buffers = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            buffers.push(PinnedBuffer::new(device, buffer_bytes)?);
        }
        let threads = if cold.is_some() { 1 } else { threads };
        Ok(RowCopier {
            threads: CopyThreads::start(maps, threads),
            cold,
            files,
            paths,
            buffers,
        })
    }

    /// The pinned buffer of round buffers `index`.
    pub(super) fn buffer(&self, index: usize) -> &PinnedBuffer {
        &self.buffers[index]
    }

    /// Copies `copies` into pinned buffer `index`, on the copy threads and this one (or reads them
    /// from the disk), and returns the bytes copied, and the rows of the round found corrupt
    /// meanwhile (by a disk read, to be served as zeros: see [`ColdRows::read_round`]), once
    /// every copy is done and every shard they read is checked unchanged since it was mapped. The
    /// caller makes sure that no upload from buffer `index` is still in flight (the round that
    /// used it last has completed).
    pub(super) fn copy_round(
        &mut self,
        index: usize,
        copies: Vec<RowCopy>,
    ) -> Result<(u64, Vec<usize>), FillError> {
        let mut shards: Vec<u32> = copies.iter().map(|c| c.shard).collect();
        shards.sort_unstable();
        shards.dedup();
        let buffer = &mut self.buffers[index];
        let mut replaced = Vec::new();
        let bytes = if let Some(cold) = self.cold.as_mut() {
            replaced = cold.read_round(&copies, buffer.as_mut_slice())?;
            copies.iter().map(|c| c.bytes as u64).sum()
        } else {
            let (dst, dst_bytes) = (buffer.as_mut_slice().as_mut_ptr(), buffer.len());
            // SAFETY: the caller's contract: no upload reads the buffer, and this thread writes
            // it only through this call, which returns once every copy into it is done.
            let copied = unsafe { self.threads.copy(copies, dst, dst_bytes) };
            copied.map_err(|shard| {
                self.failure(shard, "the shard is shorter than when the stream opened")
            })?
        };
        // Whatever was read from a shard cut or rewritten meanwhile is not served.
        for shard in shards {
            let shard = shard as usize;
            if let Err(change) = self.threads.maps[shard].check(&self.files[shard]) {
                return Err(self.failure(shard, &change.to_string()));
            }
        }
        Ok((bytes, replaced))
    }

    fn failure(&self, shard: usize, reason: &str) -> FillError {
        let (shard, reason) = match self.paths.get(shard) {
            Some(path) => (path.clone(), reason.to_string()),
            None => (
                self.paths.first().cloned().unwrap_or_default(),
                "a row copy thread panicked".to_string(),
            ),
        };
        FillError::ShardCopy {
            shard,
            source: Arc::new(std::io::Error::other(reason)),
        }
    }
}

/// Row copy threads for a stream whose limits ask for `configured`: as many, or, for 0,
/// [`ROW_COPY_THREADS_DEFAULT`] but at most half the host's `cpus`; at least one.
pub(super) fn row_copy_threads(configured: usize, cpus: usize) -> usize {
    if configured > 0 {
        return configured;
    }
    ROW_COPY_THREADS_DEFAULT.min(cpus / 2).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn copy(shard: u32, file_offset: u64, bytes: u32, staging_offset: u64) -> RowCopy {
        RowCopy {
            shard,
            file_offset,
            bytes,
            staging_offset,
            field: 0,
            row: 0,
        }
    }

    #[test]
    fn rows_are_placed_aligned_one_after_the_other_within_the_buffer() {
        assert_eq!(staging_place(0, 2048, 4096), Some(0));
        assert_eq!(staging_place(2048, 2048, 4096), Some(2048));
        assert_eq!(staging_place(2049, 2048, 4096), None);
        assert_eq!(staging_place(3, 5, 4096), Some(16));
        assert_eq!(staging_place(4096, 1, 4096), None);
        assert_eq!(staging_place(0, u64::MAX, u64::MAX), Some(0));
        assert_eq!(staging_place(1, u64::MAX, u64::MAX), None);
        // A row of two fields of 2 KiB and 6 bytes in blocks of 64 KiB and 4 KiB, windows of
        // 64 MiB: a block edge and a window edge at worst in each.
        let window = 64 << 20;
        let fields = [(2048, 64 << 10), (6, 4096)];
        assert_eq!(
            row_staging_bytes_max(fields.into_iter(), window),
            2048 + 6 + 2 * 3 * ROW_STAGING_ALIGN
        );
        // A row of 10 KiB over blocks of 4 KiB crosses three block edges at most.
        assert_eq!(
            row_staging_bytes_max([(10 << 10, 4096)].into_iter(), window),
            (10 << 10) + 5 * ROW_STAGING_ALIGN
        );
    }

    #[test]
    fn copies_are_split_into_parts_of_about_equal_bytes_covering_each_once() {
        let copies: Vec<RowCopy> = (0..10)
            .map(|i| copy(0, i * 100, if i == 3 { 900 } else { 100 }, i * 1000))
            .collect();
        for parts in 1..=12 {
            let ranges = split_copies(&copies, parts);
            assert!(
                ranges.len() <= parts.min(copies.len()),
                "{parts}: {ranges:?}"
            );
            assert_eq!(ranges.first().unwrap().start, 0);
            assert_eq!(ranges.last().unwrap().end, copies.len());
            for pair in ranges.windows(2) {
                assert_eq!(pair[0].end, pair[1].start);
            }
            assert!(ranges.iter().all(|r| !r.is_empty()), "{parts}: {ranges:?}");
        }
        // 1800 bytes in two: the big row and what precedes it, then the rest.
        assert_eq!(split_copies(&copies, 2), vec![0..4, 4..10]);
        assert!(split_copies(&[], 4).is_empty());
    }

    fn shard_file(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::fs::File {
        let path = dir.join(name);
        std::fs::File::create(&path)
            .unwrap()
            .write_all(bytes)
            .unwrap();
        std::fs::File::open(&path).unwrap()
    }

    /// Rows of two shards copied by four threads land at their staging offsets, each byte as in
    /// its shard; the threads' figures count every byte once.
    #[test]
    fn threads_copy_every_row_to_its_place() {
        let dir = tempfile::tempdir().unwrap();
        let a: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
        let b: Vec<u8> = (0..1 << 20).map(|i| (i % 241) as u8 ^ 0x5A).collect();
        let maps = vec![
            MappedFile::map(&shard_file(dir.path(), "a", &a)).unwrap(),
            MappedFile::map(&shard_file(dir.path(), "b", &b)).unwrap(),
        ];
        let mut threads = CopyThreads::start(maps, 4);
        // 1000 rows of 2 KiB minus 2 bytes, alternating shards, in a scattered order.
        let row = 2046u64;
        let mut copies = Vec::new();
        let mut used = 0u64;
        for i in 0..1000u64 {
            let at = staging_place(used, row, 4 << 20).unwrap();
            used = at + row;
            copies.push(copy((i % 2) as u32, (i * 7919 % 500) * row, row as u32, at));
        }
        let mut dst = vec![0u8; 4 << 20];
        // SAFETY: `dst` is not touched until the call returns.
        let bytes = unsafe { threads.copy(copies.clone(), dst.as_mut_ptr(), dst.len()) }.unwrap();
        assert_eq!(bytes, 1000 * row);
        for c in &copies {
            let shard = if c.shard == 0 { &a } else { &b };
            let from = c.file_offset as usize;
            let to = c.staging_offset as usize;
            assert_eq!(
                dst[to..to + c.bytes as usize],
                shard[from..from + c.bytes as usize]
            );
        }
        let stats = threads.thread_stats();
        assert_eq!(stats.len(), 4);
        assert_eq!(stats.iter().map(|&(_, b)| b).sum::<u64>(), bytes);
        // A second round through the same threads.
        // SAFETY: `dst` is not touched until the call returns.
        let bytes = unsafe { threads.copy(copies[..10].to_vec(), dst.as_mut_ptr(), dst.len()) };
        assert_eq!(bytes, Ok(10 * row));
    }

    /// A copy beyond its shard's end, or beyond the buffer, names the shard instead of reading or
    /// writing out of bounds.
    #[test]
    fn a_copy_out_of_bounds_names_its_shard() {
        let dir = tempfile::tempdir().unwrap();
        let maps = vec![
            MappedFile::map(&shard_file(dir.path(), "a", &[1u8; 4096])).unwrap(),
            MappedFile::map(&shard_file(dir.path(), "b", &[2u8; 4096])).unwrap(),
        ];
        let mut threads = CopyThreads::start(maps, 2);
        let mut dst = vec![0u8; 8192];
        let beyond_file = vec![copy(0, 0, 100, 0), copy(1, 4000, 200, 128)];
        // SAFETY: `dst` is not touched until the call returns.
        let outcome = unsafe { threads.copy(beyond_file, dst.as_mut_ptr(), dst.len()) };
        assert_eq!(outcome, Err(1));
        let beyond_buffer = vec![copy(0, 0, 4096, 8000)];
        // SAFETY: `dst` is not touched until the call returns.
        let outcome = unsafe { threads.copy(beyond_buffer, dst.as_mut_ptr(), dst.len()) };
        assert_eq!(outcome, Err(0));
        let unknown_shard = vec![copy(7, 0, 16, 0)];
        // SAFETY: `dst` is not touched until the call returns.
        let outcome = unsafe { threads.copy(unknown_shard, dst.as_mut_ptr(), dst.len()) };
        assert_eq!(outcome, Err(7));
        assert!(dst[..100].iter().all(|&b| b == 1));
    }

    #[test]
    fn the_default_thread_count_leaves_half_the_host_to_training() {
        assert_eq!(row_copy_threads(3, 64), 3);
        assert_eq!(row_copy_threads(12, 4), 12);
        assert_eq!(row_copy_threads(0, 64), ROW_COPY_THREADS_DEFAULT);
        assert_eq!(row_copy_threads(0, 6), 3);
        assert_eq!(row_copy_threads(0, 1), 1);
    }
}
