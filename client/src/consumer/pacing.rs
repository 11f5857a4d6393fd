//! When a consumer waiting for a batch sleeps and when it watches the ring.
//!
//! A sleeper woken by the doorbell pays the host's wake-up latency (tens to hundreds of
//! microseconds on a busy host) on every batch it waits for; a consumer that watches the ring the
//! whole time pays a core. Batches of a busy stream come at a steady pace, so the consumer predicts
//! the next one from the daemon's completion stamps (`ready_ns`, the daemon's pace whatever the
//! consumer's), sleeps on the doorbell until shortly before it is due, and watches the ring from
//! then until shortly after. This is the block layer's hybrid polling (sleep for part of the mean
//! completion time, then poll) applied to the hand-off. A batch that comes early still rings the
//! doorbell; one that comes late after the watch is over is found by the doorbell as before.

use std::time::Duration;

/// Least time kept between the end of a planned sleep and the predicted batch, and watched after
/// it: covers a timer's slack (50 µs by default on Linux) and a wake-up.
const MARGIN_MIN_NS: u64 = 150_000;

/// Gaps between batches longer than this are not a pace (an epoch's start, a stall); they are left
/// out of the prediction.
const GAP_MAX_NS: u64 = 20_000_000;

/// Longest watch of the ring a prediction may ask for, after the wait began (sleeping excluded).
pub(super) const WATCH_MAX_NS: u64 = 2_000_000;

/// How a wait for the next batch goes: first sleep on the doorbell for `sleep`, then watch the ring
/// for `watch`, then sleep on the doorbell until the batch comes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct WaitPlan {
    pub sleep: Duration,
    pub watch: Duration,
}

/// The stream's recent pace.
#[derive(Debug, Default)]
pub(super) struct Pacing {
    last_ready_ns: Option<u64>,
    /// Moving average of the gaps between batches, nanoseconds.
    mean_gap_ns: Option<u64>,
    last_gap_ns: Option<u64>,
}

impl Pacing {
    /// Takes the completion stamp of a batch received (0, or one not after the last: ignored, the
    /// daemon's word is not trusted further than this).
    pub fn record(&mut self, ready_ns: u64) {
        if ready_ns == 0 {
            return;
        }
        if let Some(last) = self.last_ready_ns {
            if ready_ns <= last {
                return;
            }
            let gap = ready_ns - last;
            if gap <= GAP_MAX_NS {
                self.last_gap_ns = Some(gap);
                self.mean_gap_ns = Some(match self.mean_gap_ns {
                    None => gap,
                    Some(mean) => (mean * 7 + gap) / 8,
                });
            }
        }
        self.last_ready_ns = Some(ready_ns);
    }

    /// The plan for a wait that begins at `now_ns` (`CLOCK_MONOTONIC`), for a consumer that watches
    /// at least `min_watch` (0: never watches, sleeps on the doorbell only).
    pub fn plan(&self, now_ns: u64, min_watch: Duration) -> WaitPlan {
        let no_prediction = WaitPlan {
            sleep: Duration::ZERO,
            watch: min_watch,
        };
        if min_watch.is_zero() {
            return no_prediction;
        }
        let (Some(last), Some(mean), Some(recent)) =
            (self.last_ready_ns, self.mean_gap_ns, self.last_gap_ns)
        else {
            return no_prediction;
        };
        // Early rather than late: an early prediction costs a longer watch, a late one a wake-up.
        let gap = mean.min(recent);
        let due = last.saturating_add(gap);
        let margin = MARGIN_MIN_NS.max(gap / 4);
        let watch_end = due.saturating_add(margin);
        if watch_end <= now_ns {
            // Overdue: the pace broke (the daemon waits for storage, or the epoch ends).
            return no_prediction;
        }
        // At most one gap: a stamp ahead of this clock (another time namespace) cannot put the
        // consumer to sleep for longer; the doorbell wakes it for a batch in any case.
        let sleep_ns = due
            .saturating_sub(margin)
            .saturating_sub(now_ns)
            .min(GAP_MAX_NS);
        let watch_ns = (watch_end - now_ns - sleep_ns).min(WATCH_MAX_NS);
        WaitPlan {
            sleep: Duration::from_nanos(sleep_ns),
            watch: Duration::from_nanos(watch_ns).max(min_watch),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;
    const MIN: Duration = Duration::from_micros(50);

    fn paced(gap_ns: u64, batches: u64) -> (Pacing, u64) {
        let mut pacing = Pacing::default();
        let mut stamp = 1_000_000_000;
        for _ in 0..batches {
            stamp += gap_ns;
            pacing.record(stamp);
        }
        (pacing, stamp)
    }

    #[test]
    fn without_a_pace_the_consumer_watches_the_least_time_only() {
        let pacing = Pacing::default();
        assert_eq!(
            pacing.plan(5, MIN),
            WaitPlan {
                sleep: Duration::ZERO,
                watch: MIN
            }
        );
        let (one, last) = paced(700 * US, 1);
        assert_eq!(one.plan(last, MIN).sleep, Duration::ZERO);
        assert_eq!(one.plan(last, MIN).watch, MIN);
    }

    #[test]
    fn slow_batches_are_slept_for_and_watched_around_their_due_time() {
        let (pacing, last) = paced(800 * US, 10);
        // The consumer took its batch 10 µs after it was ready and waits for the next.
        let plan = pacing.plan(last + 10 * US, MIN);
        // Due 800 µs after the last; the margin is a quarter of the gap, 200 µs.
        assert_eq!(plan.sleep, Duration::from_micros(800 - 200 - 10));
        assert_eq!(plan.watch, Duration::from_micros(400));
    }

    #[test]
    fn fast_batches_are_watched_for_without_sleeping() {
        let (pacing, last) = paced(40 * US, 10);
        let plan = pacing.plan(last + 5 * US, MIN);
        assert_eq!(plan.sleep, Duration::ZERO);
        // Due in 35 µs, watched until 150 µs after it.
        assert_eq!(plan.watch, Duration::from_micros(35 + 150));
    }

    #[test]
    fn an_overdue_batch_or_a_consumer_that_never_watches_falls_back_to_the_doorbell() {
        let (pacing, last) = paced(100 * US, 10);
        let overdue = pacing.plan(last + 10_000 * US, MIN);
        assert_eq!(overdue.sleep, Duration::ZERO);
        assert_eq!(overdue.watch, MIN);
        let never = pacing.plan(last, Duration::ZERO);
        assert_eq!(never.sleep, Duration::ZERO);
        assert_eq!(never.watch, Duration::ZERO);
    }

    #[test]
    fn the_prediction_leans_early_and_the_watch_is_bounded() {
        // A long average, then one short gap: the short one is used.
        let (mut pacing, mut last) = paced(1_000 * US, 8);
        last += 600 * US;
        pacing.record(last);
        let plan = pacing.plan(last, MIN);
        assert_eq!(plan.sleep, Duration::from_micros(600 - 150));
        // Gaps of 12 ms: a quarter is 3 ms, and the watch is capped.
        let (slow, last) = paced(12_000 * US, 4);
        let plan = slow.plan(last, MIN);
        assert_eq!(plan.sleep, Duration::from_micros(9_000));
        assert_eq!(plan.watch, Duration::from_nanos(WATCH_MAX_NS));
    }

    #[test]
    fn stamps_that_go_back_or_stall_do_not_set_the_pace() {
        let (mut pacing, last) = paced(100 * US, 4);
        pacing.record(last - 50 * US);
        pacing.record(0);
        pacing.record(last + 60_000 * US);
        // The stall's gap is left out; the last stamp moves on.
        let plan = pacing.plan(last + 60_000 * US, MIN);
        assert_eq!(plan.sleep, Duration::ZERO);
        assert_eq!(plan.watch, Duration::from_micros(100 + 150));
    }
}
