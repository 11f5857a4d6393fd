//! Device memory kept from one stream of a device to the next: shard slots, and each stream's own
//! buffers (its block cache and its region table).
//!
//! A resident stream in dataset order or a window shuffle copies shards ahead into slots of device
//! memory (`device_shards`): 9 slots of 512 MiB by default. Allocating them when each stream opened
//! and freeing them when it closed made every epoch after a consumer's first longer by a few percent
//! on the H100 test machine: allocating and freeing device memory waits on the device work already
//! queued, and a training process's next
//! epoch is opened while its current one runs. So a closing stream hands its slots here once its
//! work on them is done, and the next stream that copies shards of the same size takes them.
//!
//! The same holds for the stream's other device buffers. Freeing one (`cuMemFree`) may wait until
//! the whole device is idle, and other threads' driver calls wait with it: when a consumer's epoch
//! closed, the next epoch's stream, opened ahead, delivered its first batch and then none until
//! every shard copy it had queued was done (tens of milliseconds).
//! In a window shuffle the link then idled while the first window was served. So a closing stream
//! hands its block cache and region table here too ([`KeptBuffer`]), and the next stream takes
//! buffers of the same size.
//!
//! At most `bytes_max` of shard slots are kept idle (one stream's worth), and at most
//! [`STREAM_BUFFERS_MAX`] stream buffers. A stream opened ahead while another still runs allocates
//! its own; from then on the two streams of a consumer alternate through the pool. Slots of another
//! size (another dataset's) give way to a stream that needs new ones. Memory idle for
//! the idle release time is freed by the pool's thread, so a daemon nobody reads from gives it back to
//! the training processes on the device. A stream whose opening fails short of device memory, when
//! the pool held memory, frees all of it and opens once more; a stream short of memory for its
//! slots frees it before taking fewer slots. Idle stream buffers of another size stay until then or
//! until the idle release (freeing one while other streams run could stall them). The idle bytes
//! are the `gpufeed_shard_slots_idle_bytes` gauge.

use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::device::{Device, DeviceBuffer, DeviceError, DeviceMemory};
use crate::metrics::Metrics;

/// The default time a buffer may stay idle before it is freed (see [`ShardSlotPool::new`]).
pub const DEVICE_POOL_IDLE_RELEASE_DEFAULT: Duration = Duration::from_secs(30);
/// Shortest idle release time.
pub const DEVICE_POOL_IDLE_RELEASE_MIN: Duration = Duration::from_secs(1);
/// Longest idle release time: a day.
pub const DEVICE_POOL_IDLE_RELEASE_MAX: Duration = Duration::from_secs(86_400);

/// Most stream buffers kept idle: the block caches and region tables of two streams.
pub const STREAM_BUFFERS_MAX: usize = 4;

/// What an idle buffer was used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Use {
    ShardSlot,
    Stream,
}

/// An idle buffer: the buffer, what it was used for, and when it was handed back.
type Idle<B> = (B, Use, Instant);

/// What the pool keeps: device memory of a known size. (A trait, so that the pool's bookkeeping is
/// tested without a device.)
pub trait Pooled: Send + 'static {
    /// Its size in bytes.
    fn bytes(&self) -> usize;
}

impl Pooled for DeviceBuffer {
    fn bytes(&self) -> usize {
        DeviceMemory::len(self)
    }
}

/// Device memory kept between the streams of one device (see the module's text).
pub struct ShardSlotPool<B: Pooled = DeviceBuffer> {
    shared: Arc<Shared<B>>,
}

struct Shared<B> {
    /// Idle buffers, each with its use and the time it was handed back.
    idle: Mutex<Vec<Idle<B>>>,
    /// Wakes the releasing thread when slots come back.
    returned: Condvar,
    /// Started on the first slot handed back.
    releaser: OnceLock<()>,
    bytes_max: usize,
    /// How long a buffer may stay idle (the idle release time).
    idle_release: Duration,
    ordinal: u32,
    metrics: OnceLock<Arc<Metrics>>,
}

impl<B: Pooled> ShardSlotPool<B> {
    /// An empty pool of device `ordinal` keeping at most `bytes_max` idle bytes of shard slots (and
    /// at most [`STREAM_BUFFERS_MAX`] stream buffers besides), freeing what stays idle for
    /// `idle_release` ([`DEVICE_POOL_IDLE_RELEASE_DEFAULT`] by default, from [`DEVICE_POOL_IDLE_RELEASE_MIN`] to
    /// [`DEVICE_POOL_IDLE_RELEASE_MAX`]).
    pub fn new(bytes_max: usize, ordinal: u32, idle_release: Duration) -> ShardSlotPool<B> {
        ShardSlotPool {
            shared: Arc::new(Shared {
                idle: Mutex::new(Vec::new()),
                returned: Condvar::new(),
                releaser: OnceLock::new(),
                bytes_max,
                idle_release,
                ordinal,
                metrics: OnceLock::new(),
            }),
        }
    }

    /// Reports the pool's idle device bytes to `metrics` from now on (the first call wins).
    pub fn report_to(&self, metrics: &Arc<Metrics>) {
        let idle = self.shared.lock();
        if self.shared.metrics.set(Arc::clone(metrics)).is_ok() {
            let bytes: usize = idle.iter().map(|(b, _, _)| b.bytes()).sum();
            metrics.add_shard_slots_idle_bytes(self.shared.ordinal, bytes as i64);
        }
    }

    /// Up to `count` idle slots of exactly `bytes` bytes. Idle slots of another size are freed: the
    /// stream about to allocate its own needs the memory more.
    pub(super) fn take(&self, bytes: usize, count: usize) -> Vec<B> {
        self.take_of(Use::ShardSlot, bytes, count)
    }

    /// An idle stream buffer of exactly `bytes` bytes, if there is one.
    fn take_stream_buffer(&self, bytes: usize) -> Option<B> {
        self.take_of(Use::Stream, bytes, 1).pop()
    }

    fn take_of(&self, usage: Use, bytes: usize, count: usize) -> Vec<B> {
        let (taken, freed) = {
            let mut idle = self.shared.lock();
            let (mine, others): (Vec<Idle<B>>, Vec<Idle<B>>) =
                idle.drain(..).partition(|(_, u, _)| *u == usage);
            idle.extend(others);
            let (mut same, other): (Vec<Idle<B>>, Vec<Idle<B>>) =
                mine.into_iter().partition(|(b, _, _)| b.bytes() == bytes);
            // The most recently returned are taken; the others stay, with their idle time.
            let kept = same.len().saturating_sub(count);
            let taken: Vec<B> = same.drain(kept..).map(|(b, _, _)| b).collect();
            idle.extend(same);
            // Shard slots of another size give way to the slots about to be allocated. Stream
            // buffers of other sizes stay (they are few, and freeing one here could stall the
            // device's other streams): the idle release or an allocation short of memory frees them.
            let freed = if usage == Use::ShardSlot {
                other
            } else {
                idle.extend(other);
                Vec::new()
            };
            // Counted under the lock, as every change of the idle set is.
            let gone: usize = taken.iter().map(|b| b.bytes()).sum::<usize>()
                + freed.iter().map(|(b, _, _)| b.bytes()).sum::<usize>();
            self.shared.count(-(gone as i64));
            (taken, freed)
        };
        // Freed outside the lock: freeing device memory can wait for the device.
        drop(freed);
        taken
    }

    /// The bytes idle in the pool now (shard slots and stream buffers).
    pub fn idle_bytes(&self) -> usize {
        self.shared.lock().iter().map(|(b, _, _)| b.bytes()).sum()
    }

    /// Frees every idle buffer now, for an allocation of the device that ran short of memory;
    /// returns the bytes freed.
    pub fn release_all(&self) -> usize {
        let freed: Vec<Idle<B>> = {
            let mut idle = self.shared.lock();
            let freed: Vec<Idle<B>> = idle.drain(..).collect();
            let bytes: usize = freed.iter().map(|(b, _, _)| b.bytes()).sum();
            self.shared.count(-(bytes as i64));
            freed
        };
        // Freed outside the lock: freeing device memory can wait for the device.
        freed.into_iter().map(|(b, _, _)| b.bytes()).sum()
    }

    /// Keeps `slots` (no work on the device reads or writes them any more) for a later stream, as
    /// far as the pool has room; the rest are freed.
    pub(super) fn put(&self, slots: Vec<B>) {
        self.put_of(Use::ShardSlot, slots);
    }

    fn put_of(&self, usage: Use, buffers: Vec<B>) {
        let mut rest = Vec::new();
        {
            let mut idle = self.shared.lock();
            let mut bytes: usize = idle
                .iter()
                .filter(|(_, u, _)| *u == Use::ShardSlot)
                .map(|(b, _, _)| b.bytes())
                .sum();
            let mut stream_buffers = idle.iter().filter(|(_, u, _)| *u == Use::Stream).count();
            let now = Instant::now();
            for buffer in buffers {
                if usage == Use::Stream && stream_buffers >= STREAM_BUFFERS_MAX {
                    // The oldest idle stream buffer makes room: the newest is the likelier to be
                    // taken again.
                    if let Some(oldest) = idle
                        .iter()
                        .enumerate()
                        .filter(|(_, (_, u, _))| *u == Use::Stream)
                        .min_by_key(|(_, (_, _, since))| *since)
                        .map(|(index, _)| index)
                    {
                        let (evicted, _, _) = idle.remove(oldest);
                        self.shared.count(-(evicted.bytes() as i64));
                        rest.push(evicted);
                        stream_buffers -= 1;
                    }
                }
                let room = match usage {
                    Use::ShardSlot => bytes + buffer.bytes() <= self.shared.bytes_max,
                    Use::Stream => stream_buffers < STREAM_BUFFERS_MAX,
                };
                if room {
                    match usage {
                        Use::ShardSlot => bytes += buffer.bytes(),
                        Use::Stream => stream_buffers += 1,
                    }
                    self.shared.count(buffer.bytes() as i64);
                    idle.push((buffer, usage, now));
                } else {
                    rest.push(buffer);
                }
            }
        }
        drop(rest);
        // One releasing thread per pool, started by the first buffers handed back (if it cannot be
        // started, they stay until a stream takes them).
        self.shared.releaser.get_or_init(|| {
            let shared = Arc::clone(&self.shared);
            let _ = std::thread::Builder::new()
                .name("gpufeed-slot-pool".into())
                .spawn(move || shared.release_idle());
        });
        self.shared.returned.notify_all();
    }
}

/// A device buffer of one stream (its block cache, its region table) taken from the device's
/// [`ShardSlotPool`] where it has one of the size, and handed back to it when dropped, unless
/// [`KeptBuffer::discard`] was called: then it is freed.
pub(super) struct KeptBuffer {
    buffer: Option<DeviceBuffer>,
    /// Where it goes when dropped; `None`: freed.
    pool: Option<Arc<ShardSlotPool>>,
}

impl KeptBuffer {
    /// `bytes` of device memory, from `pool` if it has a buffer of that size.
    pub(super) fn new(
        device: &Device,
        bytes: usize,
        pool: &Arc<ShardSlotPool>,
    ) -> Result<KeptBuffer, DeviceError> {
        let buffer = match pool.take_stream_buffer(bytes) {
            Some(buffer) => buffer,
            None => DeviceBuffer::new(device, bytes)?,
        };
        Ok(KeptBuffer {
            buffer: Some(buffer),
            pool: Some(Arc::clone(pool)),
        })
    }

    /// A buffer holding `data`, written synchronously.
    pub(super) fn from_host(
        device: &Device,
        data: &[u8],
        pool: &Arc<ShardSlotPool>,
    ) -> Result<KeptBuffer, DeviceError> {
        let mut kept = KeptBuffer::new(device, data.len(), pool)?;
        if let Err(error) = kept.write(0, data) {
            // A failed copy may have left work on the buffer: it is freed, not kept.
            kept.discard();
            return Err(error);
        }
        Ok(kept)
    }

    /// Frees the buffer when it is dropped instead of handing it back: for when work on it may not
    /// be done (freeing waits for the device; the pool does not).
    pub(super) fn discard(&mut self) {
        self.pool = None;
    }
}

impl std::ops::Deref for KeptBuffer {
    type Target = DeviceBuffer;

    fn deref(&self) -> &DeviceBuffer {
        self.buffer
            .as_ref()
            .expect("a kept buffer holds one until dropped")
    }
}

impl DeviceMemory for KeptBuffer {
    fn device_ptr(&self) -> u64 {
        <DeviceBuffer as DeviceMemory>::device_ptr(self)
    }
    fn len(&self) -> usize {
        <DeviceBuffer as DeviceMemory>::len(self)
    }
}

impl Drop for KeptBuffer {
    /// The holder has made sure that no device work uses the buffer any more, or called
    /// [`KeptBuffer::discard`].
    fn drop(&mut self) {
        if let (Some(buffer), Some(pool)) = (self.buffer.take(), &self.pool) {
            pool.put_of(Use::Stream, vec![buffer]);
        }
    }
}

impl<B: Pooled> Shared<B> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle<B>>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn count(&self, bytes: i64) {
        if let Some(metrics) = self.metrics.get() {
            metrics.add_shard_slots_idle_bytes(self.ordinal, bytes);
        }
    }

    /// The pool's thread: frees slots idle for the idle release time, sleeping until the oldest is due
    /// (or until slots come back, when there are none).
    fn release_idle(&self) {
        let mut idle = self.lock();
        loop {
            let now = Instant::now();
            let (expired, kept): (Vec<_>, Vec<_>) = idle
                .drain(..)
                .partition(|(_, _, since)| now.duration_since(*since) >= self.idle_release);
            *idle = kept;
            if !expired.is_empty() {
                let bytes: usize = expired.iter().map(|(b, _, _)| b.bytes()).sum();
                self.count(-(bytes as i64));
                drop(idle);
                drop(expired);
                idle = self.lock();
                continue;
            }
            let wait = idle
                .iter()
                .map(|(_, _, since)| (*since + self.idle_release).saturating_duration_since(now))
                .min()
                .unwrap_or(self.idle_release);
            idle = self
                .returned
                .wait_timeout(idle, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A stand-in for device memory: its size, and the bytes of its kind freed so far.
    struct Fake {
        bytes: usize,
        freed: Arc<AtomicUsize>,
    }

    impl Pooled for Fake {
        fn bytes(&self) -> usize {
            self.bytes
        }
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            self.freed.fetch_add(self.bytes, Ordering::SeqCst);
        }
    }

    fn fakes(freed: &Arc<AtomicUsize>, sizes: &[usize]) -> Vec<Fake> {
        sizes
            .iter()
            .map(|&bytes| Fake {
                bytes,
                freed: Arc::clone(freed),
            })
            .collect()
    }

    /// A pool reporting to a fresh `Metrics`, as the daemon's does.
    fn pool(bytes_max: usize, idle_release: Duration) -> (ShardSlotPool<Fake>, Arc<Metrics>) {
        let pool = ShardSlotPool::<Fake>::new(bytes_max, 0, idle_release);
        let metrics = Arc::new(Metrics::new());
        metrics.serve_device(0);
        pool.report_to(&metrics);
        (pool, metrics)
    }

    #[test]
    fn slots_are_kept_up_to_the_bound_and_taken_by_size() {
        let freed = Arc::new(AtomicUsize::new(0));
        let (pool, metrics) = pool(300, DEVICE_POOL_IDLE_RELEASE_DEFAULT);
        pool.put(fakes(&freed, &[100, 100, 100, 100]));
        assert_eq!(pool.idle_bytes(), 300);
        assert_eq!(
            freed.load(Ordering::SeqCst),
            100,
            "the slot over the bound is freed"
        );
        assert_eq!(metrics.shard_slots_idle_bytes(), 300);
        let taken = pool.take(100, 2);
        assert_eq!(taken.len(), 2);
        assert_eq!(pool.idle_bytes(), 100);
        // A stream of another shard size: the idle slot gives way.
        assert!(pool.take(200, 3).is_empty());
        assert_eq!(pool.idle_bytes(), 0);
        assert_eq!(freed.load(Ordering::SeqCst), 200);
        assert_eq!(metrics.shard_slots_idle_bytes(), 0);
        drop(taken);
        assert_eq!(freed.load(Ordering::SeqCst), 400);
    }

    #[test]
    fn stream_buffers_are_bounded_apart_from_slots_and_stay_on_a_miss() {
        let freed = Arc::new(AtomicUsize::new(0));
        let (pool, metrics) = pool(100, DEVICE_POOL_IDLE_RELEASE_DEFAULT);
        pool.put(fakes(&freed, &[100]));
        for size in [10, 20, 30, 40, 50] {
            pool.put_of(Use::Stream, fakes(&freed, &[size]));
        }
        // Four stream buffers at most, beside the slot's bound: the oldest (10) gave way.
        assert_eq!(freed.load(Ordering::SeqCst), 10);
        assert_eq!(pool.idle_bytes(), 100 + 20 + 30 + 40 + 50);
        // A miss frees nothing.
        assert!(pool.take_stream_buffer(70).is_none());
        assert_eq!(pool.idle_bytes(), 240);
        // Slots of another size give way to new slots; stream buffers do not.
        assert!(pool.take(80, 1).is_empty());
        assert_eq!(freed.load(Ordering::SeqCst), 110);
        assert_eq!(pool.idle_bytes(), 140);
        let buffer = pool.take_stream_buffer(30).expect("a buffer of 30 bytes");
        assert_eq!(buffer.bytes(), 30);
        assert_eq!(pool.idle_bytes(), 110);
        assert_eq!(metrics.shard_slots_idle_bytes(), 110);
        assert_eq!(pool.release_all(), 110);
        assert_eq!(pool.idle_bytes(), 0);
        assert_eq!(metrics.shard_slots_idle_bytes(), 0);
        assert_eq!(freed.load(Ordering::SeqCst), 220);
    }

    #[test]
    fn idle_buffers_are_freed_once_idle_for_the_release_time() {
        let freed = Arc::new(AtomicUsize::new(0));
        let (pool, metrics) = pool(1000, Duration::from_millis(50));
        pool.put(fakes(&freed, &[100, 100]));
        pool.put_of(Use::Stream, fakes(&freed, &[10]));
        let started = Instant::now();
        while freed.load(Ordering::SeqCst) < 210 && started.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(freed.load(Ordering::SeqCst), 210);
        assert!(started.elapsed() >= Duration::from_millis(40));
        assert_eq!(pool.idle_bytes(), 0);
        assert_eq!(metrics.shard_slots_idle_bytes(), 0);
    }
}
