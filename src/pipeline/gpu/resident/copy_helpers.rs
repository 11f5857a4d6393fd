//! Copies of shard windows through pinned buffers, for a loader beyond the registration budget.
//!
//! Registering each window for its copy is bound by the driver's register and unregister calls
//! (they are serialised across threads, and unregistering waits for the device's queued work, so
//! copy threads beside a registering loader gained nothing on the H100 test machine). A copy helper needs no registration: it reads a window with `pread` into
//! one of its pinned buffers (a memory copy by the kernel from the page cache, or a disk read when
//! the window is not cached) and queues the upload on its own stream while it reads the next.
//! The loader thread has a helper of its own and `copy_threads - 1` helper threads beside it: they
//! share the windows of a group of shards (the jobs queued, up to four), the loader taking them
//! from the front, shard after shard (copying straight from windows the budget keeps registered,
//! through its helper otherwise), and the threads from the back of the first shard with bytes
//! left, until they meet, so none waits for another and each moves what its pace allows: the copy
//! engines move one shard from registered windows while the threads read the next.
//!
//! On the H100 test machine (a dataset three times the registration budget, in dataset order) eight
//! threads moved about a third more than registering each window (the default), but on about six
//! host cores against one, and ten or twelve threads no more than eight; the loader registering
//! windows for its own share beside the threads held up their driver calls, and gained nothing.
//! The figures are in `docs/benchmarks`. `loader_copy_threads` is 0 by default: the threads are for
//! hosts with cores to spare, or where registering is refused.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;

use crate::device::{Device, DeviceError, Event, EventTiming, PinnedBuffer, Stream};

/// Bytes of one pinned buffer (one read, one upload). Small buffers stay in the host's caches
/// between the read that fills them and the upload that reads them: on the H100 test machine 1 MiB
/// buffers moved about half again as much as 8 MiB ones on 8 threads.
pub(super) const CHUNK_BYTES: usize = 1 << 20;

/// Pinned buffers per copy thread: one being read into while the others upload.
const BUFFERS: usize = 4;

/// Which bytes of a shard are not yet taken: `front..back`. The loader takes the rest of a window
/// from the front, a copy thread one unit (a pinned buffer's worth, within one window) from the back:
/// fine enough that the threads finish a shard together.
pub(super) struct Claims {
    left: Mutex<(u64, u64)>,
    window_bytes: u64,
    unit_bytes: u64,
}

impl Claims {
    /// Bytes `0..bytes` of a shard read in windows of `window_bytes`.
    pub(super) fn new(bytes: u64, window_bytes: u64) -> Claims {
        let unit_bytes = if window_bytes % CHUNK_BYTES as u64 == 0 {
            CHUNK_BYTES as u64
        } else {
            window_bytes
        };
        Claims {
            left: Mutex::new((0, bytes)),
            window_bytes,
            unit_bytes,
        }
    }

    /// For the loader: the bytes from the first not taken to the end of its window (or to the
    /// first byte taken from the back).
    pub(super) fn take_front(&self) -> Option<(u64, u64)> {
        let mut left = self.left.lock().expect("shard claims poisoned");
        let (front, back) = *left;
        (front < back).then(|| {
            let end = ((front / self.window_bytes + 1) * self.window_bytes).min(back);
            left.0 = end;
            (front, end)
        })
    }

    /// For a copy thread: the last unit not taken (or what is left of it).
    fn take_back(&self) -> Option<(u64, u64)> {
        let mut left = self.left.lock().expect("shard claims poisoned");
        let (front, back) = *left;
        (front < back).then(|| {
            let start = ((back - 1) / self.unit_bytes * self.unit_bytes).max(front);
            left.1 = start;
            (start, back)
        })
    }

    /// For the loader, after [`Self::take_front`] gave it bytes up to `end`: gives back bytes
    /// `from..end` (it copied less than it took).
    pub(super) fn give_back_front(&self, from: u64, end: u64) {
        let mut left = self.left.lock().expect("shard claims poisoned");
        // Unless a failure took every byte meanwhile (`take_all`), the front is where it left it.
        debug_assert!(from <= end && (left.0 == end || left.0 == left.1));
        if left.0 == end {
            left.0 = from;
        }
    }

    /// Bytes a copy thread takes at a time.
    pub(super) fn unit_bytes(&self) -> u64 {
        self.unit_bytes
    }

    /// Takes every byte left (after a failure: nobody copies more of the shard).
    pub(super) fn take_all(&self) {
        let mut left = self.left.lock().expect("shard claims poisoned");
        left.0 = left.1;
    }
}

/// Takes every byte left of every shard in `copies` (after a failure: nobody copies more of them).
pub(super) fn stop_all(copies: &[ShardCopy<'_>]) {
    for copy in copies {
        copy.claims.take_all();
    }
}

/// One shard's copy as a copy thread sees it.
pub(super) struct ShardCopy<'a> {
    pub file: &'a File,
    /// The device address of the shard's first byte.
    pub dst: u64,
    /// What the copies wait for first (the rounds that read the slot's previous shard).
    pub after: Option<&'a Event>,
    pub claims: &'a Claims,
}

/// A copy thread's stream, buffers and events; kept by the loader from one shard to the next.
pub(super) struct CopyHelper {
    device: Device,
    stream: Stream,
    /// Each buffer with the event recorded after the upload from it last queued.
    buffers: Vec<(PinnedBuffer, Event)>,
    next: usize,
    /// Recorded after the last upload of a shard: the loader's stream waits for it.
    done: Event,
    /// Whether this helper copied any of the current shard (its stream waited for `after`).
    started: bool,
    /// Whether it copied any of the current group of shards.
    copied_any: bool,
    /// What it did, for the loader's log.
    pub(super) stats: HelperStats,
}

/// Where a copy helper's time went.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct HelperStats {
    pub bytes: u64,
    /// Seconds reading into pinned buffers.
    pub read_s: f64,
    /// Seconds waiting for a buffer's last upload.
    pub wait_s: f64,
    /// Seconds in a copy thread's share of a shard.
    pub busy_s: f64,
}

impl std::ops::AddAssign for HelperStats {
    fn add_assign(&mut self, other: HelperStats) {
        self.bytes += other.bytes;
        self.read_s += other.read_s;
        self.wait_s += other.wait_s;
        self.busy_s += other.busy_s;
    }
}

impl CopyHelper {
    /// A helper on `device` with its own stream and pinned buffers.
    pub(super) fn new(device: &Device) -> Result<CopyHelper, DeviceError> {
        let stream = Stream::new(device)?;
        let mut buffers = Vec::with_capacity(BUFFERS);
        for _ in 0..BUFFERS {
            let buffer = PinnedBuffer::new(device, CHUNK_BYTES)?;
            let event = Event::new(device, EventTiming::Disabled)?;
            event.record(&stream)?;
            buffers.push((buffer, event));
        }
        let done = Event::new(device, EventTiming::Disabled)?;
        Ok(CopyHelper {
            device: device.clone(),
            stream,
            buffers,
            next: 0,
            done,
            started: false,
            copied_any: false,
            stats: HelperStats::default(),
        })
    }

    /// The event recorded after this helper's last upload of the shard it last copied.
    pub(super) fn done(&self) -> &Event {
        &self.done
    }

    /// Copies units of `copies` (a loader's group of shards, in order) taken from the back of the
    /// first shard with bytes left until none is left in any, then records [`Self::done`]. Returns
    /// whether it copied any; on an error, the index in `copies` of the shard it was copying, and
    /// every shard's claims are emptied so the other threads stop too.
    pub(super) fn copy_shards(
        &mut self,
        copies: &[ShardCopy<'_>],
    ) -> Result<bool, (usize, DeviceError)> {
        let started = std::time::Instant::now();
        let outcome = self.copy_units(copies);
        self.stats.busy_s += started.elapsed().as_secs_f64();
        if outcome.is_err() {
            stop_all(copies);
        }
        outcome
    }

    fn copy_units(&mut self, copies: &[ShardCopy<'_>]) -> Result<bool, (usize, DeviceError)> {
        self.device.bind().map_err(|error| (0, error))?;
        self.begin_group();
        for (index, copy) in copies.iter().enumerate() {
            self.begin();
            while let Some((start, end)) = copy.claims.take_back() {
                self.copy_range(copy, start, end)
                    .map_err(|error| (index, error))?;
            }
        }
        self.finish()
            .map_err(|error| (copies.len().saturating_sub(1), error))
    }

    /// Starts a group of shards.
    pub(super) fn begin_group(&mut self) {
        self.started = false;
        self.copied_any = false;
    }

    /// Starts a shard of the group: its first copy waits for the shard's `after`.
    pub(super) fn begin(&mut self) {
        self.started = false;
    }

    /// Copies bytes `start..end` of the shard (the first ones after the shard's `after`).
    pub(super) fn copy_range(
        &mut self,
        copy: &ShardCopy<'_>,
        start: u64,
        end: u64,
    ) -> Result<(), DeviceError> {
        if !self.started {
            if let Some(after) = copy.after {
                self.stream.wait(after)?;
            }
            self.started = true;
            self.copied_any = true;
        }
        let mut at = start;
        while at < end {
            let bytes = (end - at).min(CHUNK_BYTES as u64) as usize;
            self.copy_chunk(copy, at, bytes)?;
            at += bytes as u64;
        }
        Ok(())
    }

    /// Ends a group: records [`Self::done`] if this helper copied any of it, and says whether.
    pub(super) fn finish(&mut self) -> Result<bool, DeviceError> {
        if self.copied_any {
            self.done.record(&self.stream)?;
        }
        Ok(self.copied_any)
    }

    /// Reads `bytes` at `at` of the shard into the next buffer once its last upload is done, and
    /// queues the upload.
    fn copy_chunk(
        &mut self,
        copy: &ShardCopy<'_>,
        at: u64,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        let (buffer, uploaded) = &mut self.buffers[self.next];
        self.next = (self.next + 1) % BUFFERS;
        let started = std::time::Instant::now();
        uploaded.synchronize()?;
        let waited = started.elapsed();
        let into = &mut buffer.as_mut_slice()[..bytes];
        copy.file
            .read_exact_at(into, at)
            .map_err(|source| DeviceError::Os {
                what: "reading a shard into a pinned buffer",
                source,
            })?;
        self.stats += HelperStats {
            bytes: bytes as u64,
            read_s: (started.elapsed() - waited).as_secs_f64(),
            wait_s: waited.as_secs_f64(),
            busy_s: 0.0,
        };
        // SAFETY: the source is this helper's pinned buffer, which is not written again until the
        // event recorded just below has completed (`uploaded.synchronize()` above, next time round)
        // and which outlives the upload (the loader synchronises the helpers' streams before it
        // drops them); the destination lies within the shard's slot, which the loader sized for
        // the largest shard and which no round reads before the loader's stream, waiting for
        // `done`, records the slot's event.
        unsafe {
            crate::device::ffi::memcpy_htod_async(
                copy.dst + at,
                into.as_ptr(),
                bytes,
                self.stream.raw(),
            )
        }?;
        uploaded.record(&self.stream)
    }

    /// Waits for every upload queued (before the buffers may be dropped).
    pub(super) fn synchronize(&self) -> Result<(), DeviceError> {
        self.stream.synchronize()
    }
}

impl Drop for CopyHelper {
    fn drop(&mut self) {
        // The pinned buffers are freed after this: nothing may still read them.
        let _ = self.stream.synchronize();
    }
}

#[cfg(test)]
mod tests {
    use super::{Claims, CHUNK_BYTES};

    #[test]
    fn front_and_back_take_each_byte_once() {
        // Units of one pinned buffer (U), windows of two, a shard of five units and a byte.
        const U: u64 = CHUNK_BYTES as u64;
        let claims = Claims::new(5 * U + 1, 2 * U);
        assert_eq!(claims.take_back(), Some((5 * U, 5 * U + 1)));
        assert_eq!(claims.take_front(), Some((0, 2 * U)));
        assert_eq!(claims.take_back(), Some((4 * U, 5 * U)));
        assert_eq!(claims.take_back(), Some((3 * U, 4 * U)));
        assert_eq!(claims.take_front(), Some((2 * U, 3 * U)));
        assert_eq!(claims.take_back(), None);
        assert_eq!(claims.take_front(), None);
        // Windows smaller than a buffer are the unit; a window not a multiple of it too.
        for window in [U / 4, U + U / 2] {
            let claims = Claims::new(3 * window, window);
            assert_eq!(claims.take_back(), Some((2 * window, 3 * window)));
            assert_eq!(claims.take_front(), Some((0, window)));
            assert_eq!(claims.take_back(), Some((window, 2 * window)));
            assert_eq!(claims.take_front(), None);
        }
        // The loader gives back what it took and did not copy.
        let claims = Claims::new(4 * U, 2 * U);
        assert_eq!(claims.take_front(), Some((0, 2 * U)));
        claims.give_back_front(U, 2 * U);
        assert_eq!(claims.take_back(), Some((3 * U, 4 * U)));
        assert_eq!(claims.take_front(), Some((U, 2 * U)));
        assert_eq!(claims.take_front(), Some((2 * U, 3 * U)));
        assert_eq!(claims.take_back(), None);
        let claims = Claims::new(3 * U, 16 * U);
        claims.take_all();
        assert_eq!(claims.take_front(), None);
        assert_eq!(claims.take_back(), None);
        // A failure elsewhere takes every byte while the loader holds a range: what it gives back
        // stays taken.
        let claims = Claims::new(4 * U, 2 * U);
        assert_eq!(claims.take_front(), Some((0, 2 * U)));
        claims.take_all();
        claims.give_back_front(U, 2 * U);
        assert_eq!(claims.take_front(), None);
        assert_eq!(claims.take_back(), None);
    }
}
