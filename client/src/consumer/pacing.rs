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
//!
//! The pace is often not even but periodic: a stream in dataset order waits for each window of a
//! shard to be copied to the device, then serves the window's batches back to back, so the gaps go
//! long, short, short, ... (one long gap every eight batches of 8 MiB in 64 MiB windows). The next
//! gap is predicted as the gap one period back, the period (1 to 8) being the one that best predicts
//! the recent gaps, and the margin grows with that prediction's recent error.

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

/// Gaps kept for the prediction.
const HISTORY: usize = 24;

/// A last gap this many times the median gap is a lone long gap (see [`Pacing::plan`]).
const LONE_GAP_FACTOR: u64 = 4;

/// Longest period of the gaps' pattern looked for.
const PERIOD_MAX: usize = 8;

/// Gaps known before the pace is predicted (enough to find the longest period on two gaps).
const EARLY_GAPS: usize = PERIOD_MAX + 2;

/// Least watch before the pace is known: a stream's first batches come in bursts (a window's
/// batches after its copy) that a short watch misses, and each miss costs a wake-up.
const EARLY_WATCH_NS: u64 = 500_000;

/// The stream's recent pace.
#[derive(Debug, Default)]
pub(super) struct Pacing {
    /// Gaps seen between completion stamps, kept for the prediction or not.
    gaps_seen: u64,
    last_ready_ns: Option<u64>,
    /// The last gaps between batches, oldest first, nanoseconds (at most [`HISTORY`]).
    gaps: std::collections::VecDeque<u64>,
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
            self.gaps_seen += 1;
            let gap = ready_ns - last;
            if gap <= GAP_MAX_NS {
                if self.gaps.len() == HISTORY {
                    self.gaps.pop_front();
                }
                self.gaps.push_back(gap);
            }
        }
        self.last_ready_ns = Some(ready_ns);
    }

    /// The median of the gaps kept (0 when none is).
    fn median_gap(&self) -> u64 {
        let mut sorted = [0u64; HISTORY];
        let n = self.gaps.len();
        for (slot, &gap) in sorted.iter_mut().zip(&self.gaps) {
            *slot = gap;
        }
        sorted[..n].sort_unstable();
        if n == 0 {
            0
        } else {
            sorted[n / 2]
        }
    }

    /// The next gap and the mean error of that way of predicting over the recent gaps: the gap one
    /// period back, for the period (1 to [`PERIOD_MAX`], the shortest of equals) that best predicted
    /// the gaps kept.
    fn predict(&self) -> Option<(u64, u64)> {
        let gaps = &self.gaps;
        let n = gaps.len();
        let last = *gaps.back()?;
        let mut best: Option<(usize, u64)> = None;
        // Each period is judged on at least two gaps where there are three or more: period 8 is
        // found from the tenth gap on.
        let periods = if n >= 3 { n - 2 } else { n.saturating_sub(1) };
        for period in 1..=PERIOD_MAX.min(periods) {
            let error = (period..n)
                .map(|i| gaps[i].abs_diff(gaps[i - period]))
                .sum::<u64>()
                / (n - period) as u64;
            if best.is_none_or(|(_, least)| error < least) {
                best = Some((period, error));
            }
        }
        Some(match best {
            Some((period, error)) => (gaps[n - period], error),
            // One gap: no error known yet.
            None => (last, last / 4),
        })
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
        // (Counted in gaps seen, not gaps kept: a stream whose gaps are all too long to be a pace
        // leaves the early phase all the same.)
        if self.gaps_seen < EARLY_GAPS as u64 {
            // Too few gaps to know the pace (a stream's first batches): watch longer rather than
            // sleep, for a few batches.
            return WaitPlan {
                sleep: Duration::ZERO,
                watch: min_watch.max(Duration::from_nanos(EARLY_WATCH_NS)),
            };
        }
        let (Some(last), Some((mut gap, error))) = (self.last_ready_ns, self.predict()) else {
            return no_prediction;
        };
        // A lone long gap in a fast pace (a window's copy between bursts of more batches than the
        // longest period looked for) predicts itself, period 1, and would put the consumer to sleep
        // while the burst resumes: after a gap that long the median gap is predicted instead.
        let median = self.median_gap();
        if self
            .gaps
            .back()
            .is_some_and(|&g| g > LONE_GAP_FACTOR * median)
            && gap > LONE_GAP_FACTOR * median
        {
            gap = median;
        }
        let due = last.saturating_add(gap);
        let margin = MARGIN_MIN_NS.max(error.saturating_mul(2)).max(gap / 8);
        let watch_end = due.saturating_add(margin);
        if watch_end <= now_ns {
            // Overdue: the pace broke (the daemon waits for storage, or the epoch ends).
            return no_prediction;
        }
        // At most the longest gap kept: a stamp ahead of this clock (another time namespace) cannot
        // put the consumer to sleep for longer; the doorbell wakes it for a batch in any case.
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
    fn before_the_pace_is_known_the_consumer_watches_longer_without_sleeping() {
        let early = WaitPlan {
            sleep: Duration::ZERO,
            watch: Duration::from_nanos(EARLY_WATCH_NS),
        };
        assert_eq!(Pacing::default().plan(5, MIN), early);
        let (few, last) = paced(700 * US, EARLY_GAPS as u64);
        assert_eq!(few.plan(last, MIN), early);
        // One more gap: the pace is known.
        let (known, last) = paced(700 * US, EARLY_GAPS as u64 + 1);
        assert_eq!(
            known.plan(last, MIN).sleep,
            Duration::from_micros(700 - 150)
        );
        // A longer least watch stays.
        let long = Duration::from_millis(1);
        assert_eq!(Pacing::default().plan(5, long).watch, long);
    }

    #[test]
    fn slow_batches_are_slept_for_and_watched_around_their_due_time() {
        let (pacing, last) = paced(800 * US, 12);
        // The consumer took its batch 10 µs after it was ready and waits for the next.
        let plan = pacing.plan(last + 10 * US, MIN);
        // Due 800 µs after the last; an even pace: the least margin, 150 µs.
        assert_eq!(plan.sleep, Duration::from_micros(800 - 150 - 10));
        assert_eq!(plan.watch, Duration::from_micros(300));
    }

    #[test]
    fn fast_batches_are_watched_for_without_sleeping() {
        let (pacing, last) = paced(40 * US, 12);
        let plan = pacing.plan(last + 5 * US, MIN);
        assert_eq!(plan.sleep, Duration::ZERO);
        // Due in 35 µs, watched until 150 µs after it.
        assert_eq!(plan.watch, Duration::from_micros(35 + 150));
    }

    #[test]
    fn an_overdue_batch_or_a_consumer_that_never_watches_falls_back_to_the_doorbell() {
        let (pacing, last) = paced(100 * US, 12);
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
        let (mut pacing, mut last) = paced(1_000 * US, 12);
        last += 600 * US;
        pacing.record(last);
        let plan = pacing.plan(last, MIN);
        assert_eq!(plan.sleep, Duration::from_micros(600 - 150));
        // Gaps of 12 ms: the margin is an eighth, 1.5 ms, and the watch is capped.
        let (slow, last) = paced(12_000 * US, 12);
        let plan = slow.plan(last, MIN);
        assert_eq!(plan.sleep, Duration::from_micros(10_500));
        assert_eq!(plan.watch, Duration::from_nanos(WATCH_MAX_NS));
    }

    /// Regression: in dataset order with batches of 256 rows, a stream serves a 64 MiB window's 128
    /// batches about 20 µs apart, then waits about a millisecond for the next window's copy. After
    /// that long gap the prediction (period 1: the last gap) put the consumer to sleep for most of a
    /// millisecond while the next window's batches came (the likely cause of a hand-off p99 of
    /// 0.66-0.71 ms at 256 rows in two of three runs on the H100 machine, 2026-11-26).
    #[test]
    fn a_lone_long_gap_between_bursts_is_not_slept_for_again() {
        let (mut pacing, mut stamp) = paced(20 * US, 40);
        stamp += 1_000 * US;
        pacing.record(stamp);
        let plan = pacing.plan(stamp + 5 * US, MIN);
        assert_eq!(plan.sleep, Duration::ZERO);
        // Watched for the burst's next batch, with the margin the long gap's error asks for.
        assert!(plan.watch >= Duration::from_micros(15));
        // A pace that has really slowed is slept for again once its gaps are the median.
        for _ in 0..HISTORY {
            stamp += 1_000 * US;
            pacing.record(stamp);
        }
        assert_eq!(
            pacing.plan(stamp, MIN).sleep,
            Duration::from_micros(1_000 - 150)
        );
    }

    #[test]
    fn a_periodic_pace_is_predicted_one_period_back() {
        // A window's copy (1 ms), then its other seven batches 30 µs apart, three times over.
        let mut pacing = Pacing::default();
        let mut stamp = 1_000_000_000;
        pacing.record(stamp);
        for _ in 0..3 {
            stamp += 1_000 * US;
            pacing.record(stamp);
            for _ in 0..7 {
                stamp += 30 * US;
                pacing.record(stamp);
            }
        }
        // After the seventh short gap the long one comes: slept for, watched around its due time.
        let plan = pacing.plan(stamp + 5 * US, MIN);
        assert_eq!(plan.sleep, Duration::from_micros(1_000 - 150 - 5));
        assert_eq!(plan.watch, Duration::from_micros(300));
        // After the long gap, a short one: watched for at once.
        stamp += 1_000 * US;
        pacing.record(stamp);
        let plan = pacing.plan(stamp + 5 * US, MIN);
        assert_eq!(plan.sleep, Duration::ZERO);
        assert_eq!(plan.watch, Duration::from_micros(30 + 150 - 5));
        // The period of eight is found as soon as two gaps judge it: from the tenth gap on.
        let mut pacing = Pacing::default();
        let mut stamp = 1_000_000_000;
        pacing.record(stamp);
        for gap in [1_000, 30, 30, 30, 30, 30, 30, 30, 1_000, 30] {
            stamp += gap * US;
            pacing.record(stamp);
        }
        assert_eq!(pacing.predict(), Some((30 * US, 0)));
        // Long and short in turn.
        let mut pacing = Pacing::default();
        let mut stamp = 1_000_000_000;
        pacing.record(stamp);
        for i in 0..10 {
            stamp += if i % 2 == 0 { 2_400 * US } else { 50 * US };
            pacing.record(stamp);
        }
        let plan = pacing.plan(stamp, MIN);
        assert_eq!(plan.sleep, Duration::from_micros(2_400 - 300));
        assert_eq!(plan.watch, Duration::from_micros(600));
    }

    #[test]
    fn a_stream_too_slow_for_a_pace_leaves_the_early_watch_all_the_same() {
        let (slow, last) = paced(30_000 * US, EARLY_GAPS as u64 + 1);
        assert_eq!(
            slow.plan(last, MIN),
            WaitPlan {
                sleep: Duration::ZERO,
                watch: MIN
            }
        );
    }

    #[test]
    fn stamps_that_go_back_or_stall_do_not_set_the_pace() {
        let (mut pacing, last) = paced(100 * US, 12);
        pacing.record(last - 50 * US);
        pacing.record(0);
        pacing.record(last + 60_000 * US);
        // The stall's gap is left out; the last stamp moves on.
        let plan = pacing.plan(last + 60_000 * US, MIN);
        assert_eq!(plan.sleep, Duration::ZERO);
        assert_eq!(plan.watch, Duration::from_micros(100 + 150));
    }
}
