//! The shared-memory hand-off ring of a stream (specified byte by byte in `docs/PROTOCOL.md`,
//! "The hand-off ring").
//!
//! Batch descriptors go from the daemon to the consumer, and slot releases from the consumer to the
//! daemon, through one small shared memory region per stream (a sealed memfd passed with
//! `StreamOpened`) instead of socket frames. Each direction is a single-producer ring of
//! `slot_count` entries with a published count; a side that finds nothing to do sets its *waiting*
//! word and sleeps on an eventfd **doorbell**, which the other side rings only when it sees that word
//! set. A busy stream therefore costs no system call per batch.
//!
//! The region is shared with a process the daemon does not trust: every word is read once, through
//! an atomic load, and checked before use ([`decode_batch`], [`decode_release`], [`check_published`]);
//! nothing the other side writes can make a reader index outside the region, and a bad word ends only
//! the stream whose ring it is.
//!
//! This module does not map memory: the daemon and the client map the memfd and hand the mapping's
//! address to [`RingView::init`] / [`RingView::attach`].

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU64, Ordering};

/// The first word of a ring: `GPUFRING` in ASCII, little-endian.
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"GPUFRING");
/// Layout version of the ring, in the second word's low half.
pub const RING_LAYOUT_VERSION: u32 = 1;
/// Bytes of the header, before the batch entries.
pub const RING_HEADER_BYTES: usize = 256;
/// Bytes of one batch entry.
pub const BATCH_ENTRY_BYTES: usize = 64;
/// Bytes of one release entry.
pub const RELEASE_ENTRY_BYTES: usize = 8;

/// Word indices (in `u64`s) of the header.
const MAGIC: usize = 0;
const VERSION_AND_SLOTS: usize = 1;
const BATCHES_OFFSET: usize = 2;
const RELEASES_OFFSET: usize = 3;
/// Written by the daemon: batches published so far.
const BATCHES_PUBLISHED: usize = 8;
/// Written by the daemon: 1 while it sleeps waiting for a release.
const DAEMON_WAITING: usize = 9;
/// Written by the consumer: releases published so far.
const RELEASES_PUBLISHED: usize = 16;
/// Written by the consumer: 1 while it sleeps waiting for a batch.
const CONSUMER_WAITING: usize = 17;

/// Bytes of a ring for `slot_count` slots (before rounding to pages).
pub const fn ring_bytes(slot_count: u32) -> usize {
    RING_HEADER_BYTES + (BATCH_ENTRY_BYTES + RELEASE_ENTRY_BYTES) * slot_count as usize
}

/// What is wrong with a ring or with a word read from it. The messages name the entry and field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The header is not a ring of this layout, or does not fit the mapping.
    #[error("hand-off ring header: {0}")]
    Header(String),
    /// A published count went backwards or ran more than a ring's length ahead.
    #[error("hand-off ring: {what} published count {published} after {seen} already taken, with {capacity} entries (a count may only grow, by at most the ring's length ahead of the reader)")]
    Count {
        /// Which count ("batch" or "release").
        what: &'static str,
        /// The count read.
        published: u64,
        /// Entries the reader has taken.
        seen: u64,
        /// Entries of the ring.
        capacity: u32,
    },
    /// A batch entry is malformed.
    #[error("hand-off ring: batch entry {index}: {reason}")]
    Batch {
        /// The entry's index (batches published before it).
        index: u64,
        /// What is wrong.
        reason: String,
    },
    /// A release entry is malformed.
    #[error("hand-off ring: release entry {index}: {reason}")]
    Release {
        /// The entry's index (releases published before it).
        index: u64,
        /// What is wrong.
        reason: String,
    },
}

/// A batch entry: what the consumer learns about a filled slot (the fields' offsets, dtypes and
/// per-sample shapes are the layout's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingBatch {
    /// The slot; it belongs to the consumer until released.
    pub slot: u32,
    /// Samples in the batch.
    pub samples: u32,
    /// Samples replaced because their block was corrupt.
    pub replaced: u32,
    /// Epoch of the batch.
    pub epoch: u64,
    /// Step within the epoch.
    pub step: u64,
    /// The epoch cursor once every rank has consumed this step.
    pub cursor_after: u64,
    /// `CLOCK_MONOTONIC` nanoseconds at which the daemon saw the batch complete.
    pub ready_ns: u64,
}

/// The eight words of batch entry `index`.
pub fn encode_batch(index: u64, batch: &RingBatch) -> [u64; 8] {
    [
        index.wrapping_add(1),
        u64::from(batch.slot) | u64::from(batch.samples) << 32,
        u64::from(batch.replaced),
        batch.epoch,
        batch.step,
        batch.cursor_after,
        batch.ready_ns,
        0,
    ]
}

/// Decodes batch entry `index` from its words, checking its sequence number, that the slot exists
/// in a ring of `slot_count`, and that the reserved bits are zero.
pub fn decode_batch(index: u64, words: [u64; 8], slot_count: u32) -> Result<RingBatch, RingError> {
    let fail = |reason: String| Err(RingError::Batch { index, reason });
    if words[0] != index.wrapping_add(1) {
        return fail(format!(
            "sequence {} where {} was expected (the entry was not written, or written for another lap)",
            words[0],
            index.wrapping_add(1)
        ));
    }
    let slot = words[1] as u32;
    let samples = (words[1] >> 32) as u32;
    if slot >= slot_count {
        return fail(format!("slot {slot} of a ring of {slot_count}"));
    }
    if words[2] >> 32 != 0 || words[7] != 0 {
        return fail("reserved bits are not zero".to_string());
    }
    Ok(RingBatch {
        slot,
        samples,
        replaced: words[2] as u32,
        epoch: words[3],
        step: words[4],
        cursor_after: words[5],
        ready_ns: words[6],
    })
}

/// The word of release entry `index` for `slot`: the slot in the low half, the low 32 bits of the
/// entry's sequence number (`index + 1`) in the high half.
pub fn encode_release(index: u64, slot: u32) -> u64 {
    u64::from(slot) | u64::from(index.wrapping_add(1) as u32) << 32
}

/// Decodes release entry `index`: its sequence number must match and its slot exist.
pub fn decode_release(index: u64, word: u64, slot_count: u32) -> Result<u32, RingError> {
    let expected = index.wrapping_add(1) as u32;
    let sequence = (word >> 32) as u32;
    let slot = word as u32;
    if sequence != expected {
        return Err(RingError::Release {
            index,
            reason: format!(
                "sequence {sequence} where {expected} was expected (the entry was not written, or written for another lap)"
            ),
        });
    }
    if slot >= slot_count {
        return Err(RingError::Release {
            index,
            reason: format!("slot {slot} of a ring of {slot_count}"),
        });
    }
    Ok(slot)
}

/// Checks a published count read from the other side: it may not be below what the reader has
/// taken, nor more than `capacity` ahead of it. Returns the entries ready to take.
pub fn check_published(
    what: &'static str,
    published: u64,
    seen: u64,
    capacity: u32,
) -> Result<u64, RingError> {
    match published.checked_sub(seen) {
        Some(ready) if ready <= u64::from(capacity) => Ok(ready),
        _ => Err(RingError::Count {
            what,
            published,
            seen,
            capacity,
        }),
    }
}

/// Checks a ring header's words against the mapping's length; returns the slot count.
pub fn decode_header(words: [u64; 4], mapped_bytes: usize) -> Result<u32, RingError> {
    let fail = |reason: String| Err(RingError::Header(reason));
    if words[0] != RING_MAGIC {
        return fail(format!("magic {:#018x}, not {RING_MAGIC:#018x}", words[0]));
    }
    let version = words[1] as u32;
    let slot_count = (words[1] >> 32) as u32;
    if version != RING_LAYOUT_VERSION {
        return fail(format!(
            "layout version {version}, this build reads {RING_LAYOUT_VERSION}"
        ));
    }
    if slot_count == 0 || slot_count > crate::protocol::SLOTS_MAX {
        return fail(format!(
            "{slot_count} slots (1 to {})",
            crate::protocol::SLOTS_MAX
        ));
    }
    let batches = RING_HEADER_BYTES as u64;
    let releases = batches + (BATCH_ENTRY_BYTES as u64) * u64::from(slot_count);
    if words[2] != batches || words[3] != releases {
        return fail(format!(
            "entries at {} and {}, expected {batches} and {releases}",
            words[2], words[3]
        ));
    }
    if mapped_bytes < ring_bytes(slot_count) {
        return fail(format!(
            "{slot_count} slots need {} bytes, the region has {mapped_bytes}",
            ring_bytes(slot_count)
        ));
    }
    Ok(slot_count)
}

/// A mapped ring, seen through atomic words. Both sides use it; each writes only its own words.
#[derive(Debug)]
pub struct RingView {
    base: NonNull<AtomicU64>,
    slot_count: u32,
}

// SAFETY: the view only touches the region through atomic operations, which any thread may perform.
unsafe impl Send for RingView {}
// SAFETY: as above.
unsafe impl Sync for RingView {}

impl RingView {
    /// Writes a fresh header for `slot_count` slots (both counts zero) and returns the view. The
    /// daemon does this before passing the memfd.
    ///
    /// # Safety
    /// `base` is 8-byte aligned and the start of a mapping of at least `ring_bytes(slot_count)`
    /// bytes that stays mapped while the view lives, and which is only accessed atomically.
    pub unsafe fn init(base: NonNull<u8>, slot_count: u32) -> RingView {
        assert!((1..=crate::protocol::SLOTS_MAX).contains(&slot_count));
        let view = RingView {
            base: base.cast(),
            slot_count,
        };
        for word in 0..ring_bytes(slot_count) / 8 {
            view.word(word).store(0, Ordering::Relaxed);
        }
        view.word(MAGIC).store(RING_MAGIC, Ordering::Relaxed);
        view.word(VERSION_AND_SLOTS).store(
            u64::from(RING_LAYOUT_VERSION) | u64::from(slot_count) << 32,
            Ordering::Relaxed,
        );
        view.word(BATCHES_OFFSET)
            .store(RING_HEADER_BYTES as u64, Ordering::Relaxed);
        view.word(RELEASES_OFFSET).store(
            (RING_HEADER_BYTES + BATCH_ENTRY_BYTES * slot_count as usize) as u64,
            Ordering::Relaxed,
        );
        fence(Ordering::SeqCst);
        view
    }

    /// Checks the header the daemon wrote and returns the view. The consumer does this after mapping.
    ///
    /// # Safety
    /// `base` is 8-byte aligned and the start of a mapping of `mapped_bytes` bytes that stays
    /// mapped while the view lives, and which is only accessed atomically.
    pub unsafe fn attach(base: NonNull<u8>, mapped_bytes: usize) -> Result<RingView, RingError> {
        if mapped_bytes < RING_HEADER_BYTES {
            return Err(RingError::Header(format!(
                "the region has {mapped_bytes} bytes, less than the {RING_HEADER_BYTES}-byte header"
            )));
        }
        let mut view = RingView {
            base: base.cast(),
            slot_count: 0,
        };
        let words = [0, 1, 2, 3].map(|w| view.word(w).load(Ordering::Acquire));
        view.slot_count = decode_header(words, mapped_bytes)?;
        Ok(view)
    }

    /// Slots (and entries in each direction) of the ring.
    pub fn slot_count(&self) -> u32 {
        self.slot_count
    }

    fn word(&self, index: usize) -> &AtomicU64 {
        // SAFETY: every index used is inside the header or the entries of `slot_count` slots, which
        // the constructors' contracts put inside the mapping; the mapping is 8-byte aligned.
        unsafe { &*self.base.as_ptr().add(index) }
    }

    fn batch_word(&self, index: u64, word: usize) -> &AtomicU64 {
        let entry = (index % u64::from(self.slot_count)) as usize;
        self.word(RING_HEADER_BYTES / 8 + entry * (BATCH_ENTRY_BYTES / 8) + word)
    }

    fn release_word(&self, index: u64) -> &AtomicU64 {
        let entry = (index % u64::from(self.slot_count)) as usize;
        self.word((RING_HEADER_BYTES + BATCH_ENTRY_BYTES * self.slot_count as usize) / 8 + entry)
    }

    // ---- the daemon's side ----

    /// Writes batch entry `index` and publishes it (the batch count becomes `index + 1`). Returns
    /// true when the consumer sleeps and its doorbell must be rung.
    pub fn publish_batch(&self, index: u64, batch: &RingBatch) -> bool {
        self.publish_batches(index, std::slice::from_ref(batch))
    }

    /// Writes the entries of `batches`, the first as entry `first`, and publishes them at once (the
    /// batch count becomes `first + batches.len()`): one count store and one fence for them all.
    /// Returns true when the consumer sleeps and its doorbell must be rung. The caller never has
    /// more than the ring's slots published and unreleased, so no entry overwrites one unread.
    pub fn publish_batches(&self, first: u64, batches: &[RingBatch]) -> bool {
        for (index, batch) in (first..).zip(batches) {
            for (word, value) in encode_batch(index, batch).into_iter().enumerate() {
                self.batch_word(index, word).store(value, Ordering::Relaxed);
            }
        }
        self.word(BATCHES_PUBLISHED)
            .store(first + batches.len() as u64, Ordering::Release);
        // Pairs with the consumer's fence between setting its waiting word and reading the count.
        fence(Ordering::SeqCst);
        self.word(CONSUMER_WAITING).load(Ordering::Relaxed) != 0
    }

    /// The consumer's release count, unchecked (see [`check_published`]).
    pub fn releases_published(&self) -> u64 {
        self.word(RELEASES_PUBLISHED).load(Ordering::Acquire)
    }

    /// The word of release entry `index`, unchecked (see [`decode_release`]).
    pub fn release_entry(&self, index: u64) -> u64 {
        self.release_word(index).load(Ordering::Relaxed)
    }

    /// Says whether the daemon sleeps waiting for a release. After setting it, the daemon reads the
    /// release count once more before it sleeps.
    pub fn set_daemon_waiting(&self, waiting: bool) {
        self.word(DAEMON_WAITING)
            .store(u64::from(waiting), Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    // ---- the consumer's side ----

    /// The daemon's batch count, unchecked (see [`check_published`]).
    pub fn batches_published(&self) -> u64 {
        self.word(BATCHES_PUBLISHED).load(Ordering::Acquire)
    }

    /// The words of batch entry `index`, unchecked (see [`decode_batch`]).
    pub fn batch_entry(&self, index: u64) -> [u64; 8] {
        std::array::from_fn(|word| self.batch_word(index, word).load(Ordering::Relaxed))
    }

    /// Writes release entry `index` for `slot` and publishes it. Returns true when the daemon sleeps
    /// and its doorbell must be rung.
    pub fn publish_release(&self, index: u64, slot: u32) -> bool {
        self.release_word(index)
            .store(encode_release(index, slot), Ordering::Relaxed);
        self.word(RELEASES_PUBLISHED)
            .store(index + 1, Ordering::Release);
        fence(Ordering::SeqCst);
        self.word(DAEMON_WAITING).load(Ordering::Relaxed) != 0
    }

    /// Says whether the consumer sleeps waiting for a batch. After setting it, the consumer reads the
    /// batch count once more before it sleeps.
    pub fn set_consumer_waiting(&self, waiting: bool) {
        self.word(CONSUMER_WAITING)
            .store(u64::from(waiting), Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }
}

/// An eventfd that one side rings and the other sleeps on.
#[derive(Debug)]
pub struct Doorbell {
    fd: OwnedFd,
}

impl Doorbell {
    /// A new doorbell (non-blocking, close-on-exec).
    pub fn new() -> std::io::Result<Doorbell> {
        // SAFETY: eventfd takes no pointers; a non-negative result is a new descriptor we own.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Doorbell { fd })
    }

    /// A doorbell received from the peer. Its descriptor is made non-blocking.
    pub fn from_fd(fd: OwnedFd) -> std::io::Result<Doorbell> {
        // SAFETY: F_GETFL on a descriptor we own.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        if flags < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: F_SETFL on a descriptor we own.
        let set = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) };
        if set < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Doorbell { fd })
    }

    /// Rings: wakes a sleeper (a full counter, which a hostile peer could cause, means it is rung
    /// already).
    pub fn ring(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our descriptor.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Clears a ring that was heard (or not: a read of an unrung doorbell does nothing).
    pub fn clear(&self) {
        let mut value = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer from our descriptor.
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), value.as_mut_ptr().cast(), 8) };
    }

    /// Sleeps until the doorbell rings, `also` becomes readable (or hangs up), or `timeout_ms`
    /// passes (-1: no limit). Returns (doorbell rang, `also` ready). The ring is not cleared.
    pub fn wait(&self, also: Option<BorrowedFd<'_>>, timeout_ms: i32) -> (bool, bool) {
        let timeout = u64::try_from(timeout_ms)
            .ok()
            .map(std::time::Duration::from_millis);
        self.wait_for(also, timeout)
    }

    /// As [`Doorbell::wait`], with a timeout to the nanosecond (`None`: no limit), for sleeps shorter
    /// than a millisecond.
    pub fn wait_for(
        &self,
        also: Option<BorrowedFd<'_>>,
        timeout: Option<std::time::Duration>,
    ) -> (bool, bool) {
        let limit = timeout.map(|t| libc::timespec {
            tv_sec: libc::time_t::try_from(t.as_secs()).unwrap_or(libc::time_t::MAX),
            tv_nsec: libc::c_long::from(t.subsec_nanos()),
        });
        let limit_ptr = limit
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        let mut fds = [
            libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: also.map_or(-1, |fd| fd.as_raw_fd()),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two live pollfd structs (a negative fd is ignored), a live timespec or null (no
        // limit), and no signal mask.
        let ready = unsafe { libc::ppoll(fds.as_mut_ptr(), 2, limit_ptr, std::ptr::null()) };
        if ready <= 0 {
            return (false, false);
        }
        (fds[0].revents != 0, fds[1].revents != 0)
    }
}

impl AsFd for Doorbell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// The fuzz property of the ring readers (`fuzz/fuzz_targets/ring_decode.rs`, and CI's stable smoke
/// test `proto/tests/ring_fuzz.rs`): `region` is taken as the bytes of a mapped ring written by a
/// hostile peer, and `seen` as what the reader has taken so far. Attaching, checking both published
/// counts and decoding every entry in reach never panics and never reads outside the region; an
/// entry that decodes encodes back to the same words.
#[doc(hidden)]
pub fn check_decode_region(region: &[u8], seen: u64) {
    let mut words = vec![0u64; region.len().div_ceil(8).max(1)];
    for (word, chunk) in words.iter_mut().zip(region.chunks(8)) {
        let mut bytes = [0u8; 8];
        bytes[..chunk.len()].copy_from_slice(chunk);
        *word = u64::from_le_bytes(bytes);
    }
    let Some(base) = NonNull::new(words.as_mut_ptr().cast::<u8>()) else {
        return;
    };
    // SAFETY: `words` is 8-byte aligned, at least `region.len()` bytes long, outlives the view and
    // is touched only through the view while it lives.
    let Ok(view) = (unsafe { RingView::attach(base, region.len()) }) else {
        return;
    };
    let slot_count = view.slot_count();
    assert!(ring_bytes(slot_count) <= region.len());
    for (what, published) in [
        ("batch", view.batches_published()),
        ("release", view.releases_published()),
    ] {
        let Ok(ready) = check_published(what, published, seen, slot_count) else {
            continue;
        };
        assert!(ready <= u64::from(slot_count));
        for index in seen..seen + ready {
            if what == "batch" {
                let raw = view.batch_entry(index);
                if let Ok(batch) = decode_batch(index, raw, slot_count) {
                    assert!(batch.slot < slot_count);
                    assert_eq!(encode_batch(index, &batch), raw, "batch entry {index}");
                }
            } else {
                let raw = view.release_entry(index);
                if let Ok(slot) = decode_release(index, raw, slot_count) {
                    assert!(slot < slot_count);
                    assert_eq!(encode_release(index, slot), raw, "release entry {index}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(slot_count: u32) -> Vec<u64> {
        vec![0u64; ring_bytes(slot_count) / 8]
    }

    fn view(words: &mut [u64], slot_count: u32) -> RingView {
        // SAFETY: the vector is 8-aligned, large enough, outlives the view in each test, and is only
        // touched through the view.
        unsafe { RingView::init(NonNull::new(words.as_mut_ptr().cast()).unwrap(), slot_count) }
    }

    /// The consumer's view of a ring that `view` initialised in `words`.
    fn attached(words: &mut [u64]) -> RingView {
        // SAFETY: as in `view`.
        unsafe {
            RingView::attach(
                NonNull::new(words.as_mut_ptr().cast()).unwrap(),
                words.len() * 8,
            )
        }
        .unwrap()
    }

    fn batch(slot: u32, step: u64) -> RingBatch {
        RingBatch {
            slot,
            samples: 16,
            replaced: 1,
            epoch: 3,
            step,
            cursor_after: 16 * (step + 1),
            ready_ns: 12345,
        }
    }

    #[test]
    fn batches_and_releases_cross_the_ring_over_several_laps() {
        let mut words = region(3);
        let daemon = view(&mut words, 3);
        let consumer = attached(&mut words);
        assert_eq!(consumer.slot_count(), 3);
        for index in 0..10u64 {
            let sent = batch((index % 3) as u32, index);
            assert!(!daemon.publish_batch(index, &sent));
            let ready = check_published("batch", consumer.batches_published(), index, 3).unwrap();
            assert_eq!(ready, 1);
            let got = decode_batch(index, consumer.batch_entry(index), 3).unwrap();
            assert_eq!(got, sent);
            assert!(!consumer.publish_release(index, got.slot));
            let ready = check_published("release", daemon.releases_published(), index, 3).unwrap();
            assert_eq!(ready, 1);
            assert_eq!(
                decode_release(index, daemon.release_entry(index), 3),
                Ok(got.slot)
            );
        }
    }

    #[test]
    fn batches_published_together_are_seen_together_and_in_order() {
        let mut words = region(4);
        let daemon = view(&mut words, 4);
        let consumer = attached(&mut words);
        // Two laps: three batches at once, one, then the ring's four across the wrap.
        let mut next = 0u64;
        for count in [3u64, 1, 4] {
            let sent: Vec<RingBatch> = (next..next + count)
                .map(|step| batch((step % 4) as u32, step))
                .collect();
            assert!(!daemon.publish_batches(next, &sent));
            let ready = check_published("batch", consumer.batches_published(), next, 4).unwrap();
            assert_eq!(ready, count);
            for (index, expected) in (next..).zip(&sent) {
                assert_eq!(
                    decode_batch(index, consumer.batch_entry(index), 4).unwrap(),
                    *expected
                );
                consumer.publish_release(index, expected.slot);
            }
            next += count;
        }
        assert_eq!(daemon.releases_published(), next);
    }

    #[test]
    fn the_waiting_words_say_when_to_ring() {
        let mut words = region(2);
        let ring = view(&mut words, 2);
        ring.set_consumer_waiting(true);
        assert!(ring.publish_batch(0, &batch(0, 0)));
        ring.set_consumer_waiting(false);
        assert!(!ring.publish_batch(1, &batch(1, 1)));
        ring.set_daemon_waiting(true);
        assert!(ring.publish_release(0, 0));
    }

    #[test]
    fn bad_words_are_named() {
        let good = encode_batch(4, &batch(1, 4));
        assert!(decode_batch(4, good, 2).is_ok());
        let mut wrong_lap = good;
        wrong_lap[0] = 2;
        assert!(decode_batch(4, wrong_lap, 2)
            .unwrap_err()
            .to_string()
            .contains("batch entry 4: sequence 2 where 5"));
        assert!(decode_batch(4, good, 1)
            .unwrap_err()
            .to_string()
            .contains("slot 1 of a ring of 1"));
        let mut reserved = good;
        reserved[7] = 1;
        assert!(decode_batch(4, reserved, 2).is_err());
        assert_eq!(decode_release(7, encode_release(7, 1), 2), Ok(1));
        assert!(decode_release(7, encode_release(6, 1), 2)
            .unwrap_err()
            .to_string()
            .contains("release entry 7: sequence 7 where 8"));
        assert!(decode_release(7, encode_release(7, 2), 2).is_err());
        assert!(check_published("release", 3, 4, 8)
            .unwrap_err()
            .to_string()
            .contains("release published count 3 after 4"));
        assert!(check_published("release", 13, 4, 8).is_err());
        assert_eq!(check_published("release", 12, 4, 8), Ok(8));
    }

    #[test]
    fn a_header_that_is_not_a_ring_is_refused() {
        let mut words = region(4);
        let _ = view(&mut words, 4);
        let header = [words[0], words[1], words[2], words[3]];
        assert_eq!(decode_header(header, ring_bytes(4)), Ok(4));
        assert!(decode_header(header, ring_bytes(4) - 1).is_err());
        let mut bad = header;
        bad[0] ^= 1;
        assert!(decode_header(bad, ring_bytes(4)).is_err());
        let mut too_many = header;
        too_many[1] = u64::from(RING_LAYOUT_VERSION) | 65 << 32;
        assert!(decode_header(too_many, usize::MAX).is_err());
        let mut shifted = header;
        shifted[3] += 8;
        assert!(decode_header(shifted, ring_bytes(4)).is_err());
    }

    #[test]
    fn a_doorbell_wakes_its_sleeper() {
        let bell = Doorbell::new().unwrap();
        assert_eq!(bell.wait(None, 0), (false, false));
        bell.ring();
        assert_eq!(bell.wait(None, 1000), (true, false));
        bell.clear();
        assert_eq!(bell.wait(None, 0), (false, false));
    }

    #[test]
    fn a_doorbell_sleep_shorter_than_a_millisecond_ends_on_time_or_on_a_ring() {
        let bell = Doorbell::new().unwrap();
        let started = std::time::Instant::now();
        let short = std::time::Duration::from_micros(300);
        assert_eq!(bell.wait_for(None, Some(short)), (false, false));
        let slept = started.elapsed();
        assert!(slept >= short, "woke after {slept:?}, before {short:?}");
        bell.ring();
        let long = std::time::Duration::from_secs(5);
        let started = std::time::Instant::now();
        assert_eq!(bell.wait_for(None, Some(long)), (true, false));
        assert!(started.elapsed() < long);
    }
}
