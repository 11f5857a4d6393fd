//! The table of active pack jobs (queued or running) with the bounds on them, and each job's live
//! state shared with its pack thread: progress, cancellation and the rate limit. The control state
//! ([`super::state::Control`]) owns the table; the job handlers (`jobs`) drive it. It depends on
//! neither, so that the state does not import the handlers that import it.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{watch, Notify, Semaphore};

use super::error::ApiError;
use crate::catalog::JobState;
use crate::config::JobLimits;
use crate::pack::PackObserver;

/// Why an active job is being stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StopReason {
    Operator,
    Shutdown,
}

/// A queued or running job: progress and cancellation shared with its pack thread.
pub(crate) struct LiveJob {
    pub(crate) id: u64,
    pub(crate) raw_bytes_total: AtomicU64,
    pub(crate) raw_bytes_done: AtomicU64,
    pub(crate) cancel: AtomicBool,
    pub(crate) stop_reason: Mutex<Option<StopReason>>,
    pub(crate) cancel_notify: Notify,
    pub(crate) state: watch::Sender<JobState>,
    pub(crate) bytes_per_s_max: Option<u64>,
    pub(crate) pack_started: Mutex<Option<Instant>>,
}

impl LiveJob {
    pub(crate) fn request_stop(&self, reason: StopReason) {
        self.stop_reason
            .lock()
            .expect("job lock poisoned")
            .get_or_insert(reason);
        self.cancel.store(true, Ordering::SeqCst);
        self.cancel_notify.notify_one();
    }

    pub(crate) fn stop_reason(&self) -> Option<StopReason> {
        *self.stop_reason.lock().expect("job lock poisoned")
    }

    /// Waits until the job has finished or `limit` passed.
    pub(crate) async fn wait_finished(&self, limit: Duration) {
        let mut state = self.state.subscribe();
        let _ = tokio::time::timeout(limit, state.wait_for(|s| s.is_finished())).await;
    }
}

/// The pack observer of one job.
pub(crate) struct JobObserver(pub(crate) Arc<LiveJob>);

/// Longest a rate-limited pack sleeps before looking at the cancel flag again.
const THROTTLE_SLICE: Duration = Duration::from_millis(50);

impl PackObserver for JobObserver {
    fn started(&self, raw_bytes_total: u64) {
        self.0
            .raw_bytes_total
            .store(raw_bytes_total, Ordering::SeqCst);
        *self.0.pack_started.lock().expect("job lock poisoned") = Some(Instant::now());
    }

    fn progress(&self, raw_bytes_done: u64) {
        self.0
            .raw_bytes_done
            .store(raw_bytes_done, Ordering::SeqCst);
        let Some(rate) = self.0.bytes_per_s_max else {
            return;
        };
        let Some(started) = *self.0.pack_started.lock().expect("job lock poisoned") else {
            return;
        };
        // Hold the pack to the configured rate: it may not be ahead of `rate` bytes per second
        // since it started. Sleep in slices so that a cancel is seen promptly.
        let due = Duration::from_secs_f64(raw_bytes_done as f64 / rate as f64);
        while !self.cancelled() {
            let elapsed = started.elapsed();
            if elapsed >= due {
                break;
            }
            std::thread::sleep((due - elapsed).min(THROTTLE_SLICE));
        }
    }

    fn cancelled(&self) -> bool {
        self.0.cancel.load(Ordering::SeqCst)
    }
}

/// The active jobs and the bounds on them.
pub(crate) struct JobTable {
    live: Mutex<std::collections::BTreeMap<u64, Arc<LiveJob>>>,
    pub(crate) running: Arc<Semaphore>,
    pub(crate) active: AtomicU32,
    pub(crate) limits: JobLimits,
}

/// A place among the active jobs, given back when dropped unless the job was started, whose end
/// (`jobs::finish`) gives it back.
pub(crate) struct Admission<'a>(Option<&'a AtomicU32>);

impl Admission<'_> {
    /// Hands the place to the started job.
    pub(crate) fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        if let Some(active) = self.0 {
            active.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl JobTable {
    pub(crate) fn new(limits: JobLimits) -> JobTable {
        JobTable {
            live: Mutex::new(Default::default()),
            running: Arc::new(Semaphore::new(limits.running_max as usize)),
            active: AtomicU32::new(0),
            limits,
        }
    }

    pub(crate) fn live(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<u64, Arc<LiveJob>>> {
        self.live.lock().expect("job table lock poisoned")
    }

    pub(crate) fn get(&self, id: u64) -> Option<Arc<LiveJob>> {
        self.live().get(&id).cloned()
    }

    /// Jobs queued or running now.
    pub(crate) fn active_count(&self) -> u32 {
        self.active.load(Ordering::SeqCst)
    }

    /// Jobs running now.
    pub(crate) fn running_count(&self) -> u32 {
        self.limits.running_max - self.running.available_permits() as u32
    }

    pub(crate) fn limits(&self) -> JobLimits {
        self.limits
    }

    pub(crate) fn admit(&self) -> Result<Admission<'_>, ApiError> {
        let limit = self.limits.running_max + self.limits.queued_max;
        self.active
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < limit).then_some(n + 1)
            })
            .map_err(|_| {
                ApiError::too_many_requests(format!(
                    "{limit} pack jobs are queued or running (the most this daemon runs at once \
                     plus the most it queues); retry when one has finished"
                ))
            })?;
        Ok(Admission(Some(&self.active)))
    }
}
