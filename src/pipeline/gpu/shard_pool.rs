//! Device memory for shard copies, kept from one stream of a device to the next.
//!
//! A resident stream in dataset order or a window shuffle copies shards ahead into slots of device
//! memory (`device_shards`): 9 slots of 512 MiB by default. Allocating them when each stream opened
//! and freeing them when it closed made every epoch after a consumer's first about 10 ms (6 %)
//! longer on the H100 test machine (`docs/benchmarks/read-path-2026-11-25.md`, run 70): allocating
//! and freeing device memory waits on the device work already queued, and a training process's next
//! epoch is opened while its current one runs. So a closing stream hands its slots here once its
//! work on them is done, and the next stream that copies shards of the same size takes them.
//!
//! At most `bytes_max` are kept idle: one stream's worth. A stream opened ahead while another still
//! runs allocates its own; from then on the two streams of a consumer alternate through the pool.
//! Slots of another size (another dataset's) give way to a stream that needs new ones. Slots idle
//! for [`IDLE_RELEASE`] are freed by the pool's thread, so a daemon nobody reads from gives the
//! memory back to the training processes on the device, and a stream whose opening runs short of
//! device memory frees them all and tries once more. The idle bytes are the
//! `gpufeed_shard_slots_idle_bytes` gauge.

use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::device::{DeviceBuffer, DeviceMemory};
use crate::metrics::Metrics;

/// How long a slot may stay idle before it is freed.
pub const IDLE_RELEASE: Duration = Duration::from_secs(30);

/// Shard slots kept between the streams of one device (see the module's text).
pub struct ShardSlotPool {
    shared: Arc<Shared>,
}

struct Shared {
    /// Idle slots, each with the time it was handed back.
    idle: Mutex<Vec<(DeviceBuffer, Instant)>>,
    /// Wakes the releasing thread when slots come back.
    returned: Condvar,
    /// Started on the first slot handed back.
    releaser: OnceLock<()>,
    bytes_max: usize,
    ordinal: u32,
    metrics: OnceLock<Arc<Metrics>>,
}

impl ShardSlotPool {
    /// An empty pool of device `ordinal` keeping at most `bytes_max` idle bytes.
    pub fn new(bytes_max: usize, ordinal: u32) -> ShardSlotPool {
        ShardSlotPool {
            shared: Arc::new(Shared {
                idle: Mutex::new(Vec::new()),
                returned: Condvar::new(),
                releaser: OnceLock::new(),
                bytes_max,
                ordinal,
                metrics: OnceLock::new(),
            }),
        }
    }

    /// Reports the pool's idle device bytes to `metrics` from now on (the first call wins).
    pub fn report_to(&self, metrics: &Arc<Metrics>) {
        let idle = self.shared.lock();
        if self.shared.metrics.set(Arc::clone(metrics)).is_ok() {
            let bytes: usize = idle.iter().map(|(b, _)| b.len()).sum();
            metrics.add_shard_slots_idle_bytes(self.shared.ordinal, bytes as i64);
        }
    }

    /// Up to `count` idle slots of exactly `bytes` bytes. Idle slots of another size are freed: the
    /// stream about to allocate its own needs the memory more.
    pub(super) fn take(&self, bytes: usize, count: usize) -> Vec<DeviceBuffer> {
        let (taken, freed) = {
            let mut idle = self.shared.lock();
            let (mut same, other): (Vec<_>, Vec<_>) =
                idle.drain(..).partition(|(b, _)| b.len() == bytes);
            // The most recently returned are taken; the others stay, with their idle time.
            let kept = same.len().saturating_sub(count);
            let taken: Vec<DeviceBuffer> = same.drain(kept..).map(|(b, _)| b).collect();
            idle.extend(same);
            // Counted under the lock, as every change of the idle set is.
            let gone: usize = taken.iter().map(|b| b.len()).sum::<usize>()
                + other.iter().map(|(b, _)| b.len()).sum::<usize>();
            self.shared.count(-(gone as i64));
            (taken, other)
        };
        // Freed outside the lock: freeing device memory can wait for the device.
        drop(freed);
        taken
    }

    /// Frees every idle slot now, for an allocation of the device that ran short of memory;
    /// returns the bytes freed.
    pub fn release_all(&self) -> usize {
        let freed: Vec<(DeviceBuffer, Instant)> = {
            let mut idle = self.shared.lock();
            let freed: Vec<_> = idle.drain(..).collect();
            let bytes: usize = freed.iter().map(|(b, _)| b.len()).sum();
            self.shared.count(-(bytes as i64));
            freed
        };
        // Freed outside the lock: freeing device memory can wait for the device.
        freed.into_iter().map(|(b, _)| b.len()).sum()
    }

    /// Keeps `slots` (no work on the device reads or writes them any more) for a later stream, as
    /// far as the pool has room; the rest are freed.
    pub(super) fn put(&self, slots: Vec<DeviceBuffer>) {
        let mut rest = Vec::new();
        {
            let mut idle = self.shared.lock();
            let mut bytes: usize = idle.iter().map(|(b, _)| b.len()).sum();
            let now = Instant::now();
            for slot in slots {
                if bytes + slot.len() <= self.shared.bytes_max {
                    bytes += slot.len();
                    self.shared.count(slot.len() as i64);
                    idle.push((slot, now));
                } else {
                    rest.push(slot);
                }
            }
        }
        drop(rest);
        // One releasing thread per pool, started by the first slots handed back (if it cannot be
        // started, slots stay until a stream takes them).
        self.shared.releaser.get_or_init(|| {
            let shared = Arc::clone(&self.shared);
            let _ = std::thread::Builder::new()
                .name("gpufeed-slot-pool".into())
                .spawn(move || shared.release_idle());
        });
        self.shared.returned.notify_all();
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(DeviceBuffer, Instant)>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn count(&self, bytes: i64) {
        if let Some(metrics) = self.metrics.get() {
            metrics.add_shard_slots_idle_bytes(self.ordinal, bytes);
        }
    }

    /// The pool's thread: frees slots idle for [`IDLE_RELEASE`], sleeping until the oldest is due
    /// (or until slots come back, when there are none).
    fn release_idle(&self) {
        let mut idle = self.lock();
        loop {
            let now = Instant::now();
            let (expired, kept): (Vec<_>, Vec<_>) = idle
                .drain(..)
                .partition(|(_, since)| now.duration_since(*since) >= IDLE_RELEASE);
            *idle = kept;
            if !expired.is_empty() {
                let bytes: usize = expired.iter().map(|(b, _)| b.len()).sum();
                self.count(-(bytes as i64));
                drop(idle);
                drop(expired);
                idle = self.lock();
                continue;
            }
            let wait = idle
                .iter()
                .map(|(_, since)| (*since + IDLE_RELEASE).saturating_duration_since(now))
                .min()
                .unwrap_or(IDLE_RELEASE);
            idle = self
                .returned
                .wait_timeout(idle, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}
