//! The hand-off ring's fuzz smoke test on stable Rust (CI has no nightly for cargo-fuzz): the
//! property of `fuzz/fuzz_targets/ring_decode.rs` (`ring::check_decode_region`) over random regions
//! and over mutations of valid rings, and a hostile writer that scribbles over a live ring while a
//! reader takes entries from it. `PROPTEST_CASES` raises the case count (CI's fuzz step runs
//! 200 000 per property).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use gpufeed_proto::ring::{
    check_decode_region, check_published, decode_batch, decode_release, ring_bytes, RingBatch,
    RingError, RingView,
};
use proptest::prelude::*;

/// The bytes of a valid ring of `slot_count` slots with `batches` batches and `releases` releases
/// published.
fn valid_ring(slot_count: u32, batches: u64, releases: u64) -> Vec<u8> {
    let mut words = vec![0u64; ring_bytes(slot_count) / 8];
    let base = NonNull::new(words.as_mut_ptr().cast::<u8>()).unwrap();
    // SAFETY: the vector is 8-aligned, exactly `ring_bytes(slot_count)` long, and outlives the view.
    let view = unsafe { RingView::init(base, slot_count) };
    for index in 0..batches {
        let slot = (index % u64::from(slot_count)) as u32;
        view.publish_batch(
            index,
            &RingBatch {
                slot,
                samples: 16,
                replaced: 0,
                epoch: 1,
                step: index,
                cursor_after: 16 * (index + 1),
                ready_ns: 1_000 + index,
            },
        );
    }
    for index in 0..releases {
        view.publish_release(index, (index % u64::from(slot_count)) as u32);
    }
    words.iter().flat_map(|word| word.to_le_bytes()).collect()
}

fn mutate(mut bytes: Vec<u8>, flips: &[(usize, u8)], cut: Option<usize>) -> Vec<u8> {
    for &(at, bits) in flips {
        if !bytes.is_empty() {
            let at = at % bytes.len();
            bytes[at] ^= bits;
        }
    }
    if let Some(cut) = cut {
        bytes.truncate(cut % (bytes.len() + 1));
    }
    bytes
}

proptest! {
    /// Random bytes, usually too short or without the magic: never a panic.
    #[test]
    fn random_regions_never_panic(region in proptest::collection::vec(any::<u8>(), 0..2048), seen in any::<u64>()) {
        check_decode_region(&region, seen % (1 << 40));
    }

    /// Valid rings with bits flipped, words overwritten and tails cut: never a panic, and entries
    /// that decode encode back to their words (checked inside `check_decode_region`).
    #[test]
    fn mutated_rings_never_panic(
        slot_count in 1u32..=64,
        batches in 0u64..200,
        releases in 0u64..200,
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..16),
        cut in proptest::option::of(any::<usize>()),
        seen in 0u64..256,
    ) {
        let region = mutate(valid_ring(slot_count, batches, releases), &flips, cut);
        check_decode_region(&region, seen);
    }

    /// An untouched ring decodes: every published entry in reach of the reader is taken.
    #[test]
    fn valid_rings_decode(slot_count in 1u32..=64, lap in 0u64..5, ready in 0u64..=64) {
        let ready = ready.min(u64::from(slot_count));
        let seen = lap * u64::from(slot_count);
        let region = valid_ring(slot_count, seen + ready, seen + ready);
        let mut words: Vec<u64> = region
            .chunks(8)
            .map(|chunk| u64::from_le_bytes(chunk.try_into().unwrap()))
            .collect();
        let base = NonNull::new(words.as_mut_ptr().cast::<u8>()).unwrap();
        // SAFETY: as in `valid_ring`.
        let view = unsafe { RingView::attach(base, region.len()) }.unwrap();
        prop_assert_eq!(check_published("batch", view.batches_published(), seen, slot_count), Ok(ready));
        for index in seen..seen + ready {
            let batch = decode_batch(index, view.batch_entry(index), slot_count).unwrap();
            prop_assert_eq!(batch.step, index);
            let slot = decode_release(index, view.release_entry(index), slot_count).unwrap();
            prop_assert_eq!(u64::from(slot), index % u64::from(slot_count));
        }
    }
}

/// A consumer that scribbles over its own half of a live ring (counts, entries, even the daemon's
/// words) while the daemon's reader takes releases: the reader sees only errors or valid entries,
/// never a slot outside the ring, and stops at the first error as the daemon does.
#[test]
fn a_hostile_writer_never_gets_a_bad_slot_past_the_reader() {
    const SLOTS: u32 = 8;
    let words: Arc<Vec<AtomicU64>> = Arc::new(
        (0..ring_bytes(SLOTS) / 8)
            .map(|_| AtomicU64::new(0))
            .collect(),
    );
    let base = NonNull::new(words.as_ptr() as *mut u8).unwrap();
    // SAFETY: the atomics are 8-aligned, `ring_bytes(SLOTS)` long, outlive both views (the Arc is
    // held until the threads are joined) and are only touched atomically.
    let reader = unsafe { RingView::init(base, SLOTS) };
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let words = Arc::clone(&words);
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut state = 0x9e37_79b9_7f4a_7c15u64;
            let mut writes = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // xorshift: a word of the ring and a value, half of them plausible.
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let at = (state % words.len() as u64) as usize;
                let value = if state & 1 == 0 { state >> 40 } else { state };
                words[at].store(value, Ordering::Relaxed);
                writes += 1;
            }
            writes
        })
    };
    let (mut taken, mut errors) = (0u64, 0u64);
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(500);
    while std::time::Instant::now() < deadline {
        let mut seen = 0u64;
        // One "stream": read until the first error, as the daemon ends a stream at the first bad word.
        loop {
            let ready = match check_published("release", reader.releases_published(), seen, SLOTS) {
                Ok(ready) => ready,
                Err(error) => {
                    assert!(matches!(error, RingError::Count { .. }));
                    errors += 1;
                    break;
                }
            };
            if ready == 0 {
                if std::time::Instant::now() >= deadline {
                    break;
                }
                continue;
            }
            match decode_release(seen, reader.release_entry(seen), SLOTS) {
                Ok(slot) => {
                    assert!(slot < SLOTS);
                    taken += 1;
                    seen += 1;
                }
                Err(error) => {
                    assert!(error.to_string().contains(&format!("release entry {seen}")));
                    errors += 1;
                    break;
                }
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let writes = writer.join().unwrap();
    assert!(writes > 0, "the writer ran");
    assert!(errors > 0, "the scribbles were noticed ({taken} taken)");
}
