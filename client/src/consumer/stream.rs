//! An open stream: the slot memory, the write half of the session, and the iterator of batches.

use std::net::Shutdown;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use gpufeed_proto::protocol::monotonic_ns;
use gpufeed_proto::ring::{check_published, decode_batch};
use gpufeed_proto::spec::StreamState;

use super::batch::Batch;
use super::error::{recv_plain, unexpected, ClientError};
use super::layout::extent_bytes;
use super::pacing::Pacing;
use super::slots::{Outbox, SlotMemory, Slots};

use crate::protocol::{
    Backend, BatchField, BatchInfo, DaemonStatus, Message, StreamLayout, StreamSpec,
};

#[derive(Debug)]
pub(super) enum Phase {
    /// Batches may still arrive.
    Streaming,
    /// `EndOfEpoch` arrived; queued batches may remain.
    Finished,
    /// An error ended the session. `reported` is false until the iterator has yielded it once.
    Failed { reason: String, reported: bool },
}

/// What the stream read from the socket.
pub(super) enum Event {
    EndOfEpoch,
    Status(DaemonStatus),
}

/// How long a consumer waiting for a batch watches the ring at least before it sleeps on its
/// doorbell, by default. Once the stream has a steady pace, the consumer also sleeps until shortly
/// before each batch is due and watches from then until shortly after (`pacing.rs`), so that a
/// batch arriving on time is taken without the doorbell's wake-up latency.
pub const SPIN_US_DEFAULT: u64 = 50;

/// Most microseconds `GPUFEED_SPIN_US` may ask for.
pub const SPIN_US_MAX: u64 = 10_000;

/// The least watch before sleeping: `GPUFEED_SPIN_US` (0 to [`SPIN_US_MAX`] microseconds; read once
/// per process) or [`SPIN_US_DEFAULT`]. 0 never watches: the consumer sleeps on the doorbell only,
/// which saves the most host CPU and pays a wake-up (tens to hundreds of microseconds on a busy
/// host) on every batch it waits for; a value that does not parse is ignored with a warning on
/// stderr.
fn spin() -> std::time::Duration {
    static SPIN_US: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let us = *SPIN_US.get_or_init(|| match std::env::var("GPUFEED_SPIN_US") {
        Err(_) => SPIN_US_DEFAULT,
        Ok(text) => match text.trim().parse::<u64>() {
            Ok(us) if us <= SPIN_US_MAX => us,
            _ => {
                eprintln!(
                    "gpufeed-client: GPUFEED_SPIN_US={text:?} is not 0 to {SPIN_US_MAX} microseconds; using {SPIN_US_DEFAULT}"
                );
                SPIN_US_DEFAULT
            }
        },
    });
    std::time::Duration::from_micros(us)
}

/// An open stream: an iterator over the epoch's batches for this rank, in step order.
///
/// `next()` blocks until the daemon sends a batch. The daemon fills at most `slot_count` slots ahead;
/// holding that many batches and calling `next()` waits forever unless the epoch ends, so drop (or
/// finish with) batches as you go. The session ends (`Close`) once the stream and every batch from it
/// are dropped.
#[derive(Debug)]
pub struct Stream {
    /// Read half; only the stream reads.
    pub(super) socket: UnixStream,
    pub(super) session: u64,
    pub(super) backend: Backend,
    pub(super) spec: StreamSpec,
    pub(super) memory: Arc<SlotMemory>,
    pub(super) outbox: Arc<Outbox>,
    pub(super) last_step: Option<u64>,
    pub(super) last_cursor_received: u64,
    pub(super) batches_received: u64,
    /// `cursor_after` of the last batch yielded.
    pub(super) cursor: u64,
    pub(super) phase: Phase,
    /// The pace of the daemon's batches, for waiting on them.
    pub(super) pacing: Pacing,
    /// Where the stream's opening went.
    pub(super) open_phases: OpenPhases,
}

/// Where a stream's opening went, in seconds: the daemon's answer to the request (its plan, slots and
/// pipeline set-up, and the frame both ways), then mapping the ring and the slots in this process
/// (for device slots: importing each allocation and opening its events).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpenPhases {
    /// From sending the request to receiving the daemon's answer.
    pub daemon_s: f64,
    /// Mapping the ring and the slots after the answer.
    pub map_s: f64,
}

impl Stream {
    /// The slot layout the daemon chose.
    pub fn layout(&self) -> &StreamLayout {
        &self.memory.layout
    }

    /// Where the stream's opening went.
    pub fn open_phases(&self) -> OpenPhases {
        self.open_phases
    }

    /// The spec the stream was opened with.
    pub fn spec(&self) -> &StreamSpec {
        &self.spec
    }

    /// The session id.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// Where the daemon keeps batches.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Makes `stream` (a `CUstream` of the context of the stream's device; null, the default, is the
    /// legacy default stream) the stream batches are delivered on: each batch handed out from now on
    /// is ready for work queued on `stream` after `next()` returns, without the host waiting, and
    /// dropping a batch releases its slot once the work queued on `stream` before the drop is done.
    /// Has no effect on host-memory streams.
    ///
    /// # Safety
    /// `stream` stays valid while batches of this stream exist, and belongs to the primary context
    /// of the stream's device.
    pub unsafe fn set_cuda_stream(&mut self, stream: *mut std::ffi::c_void) {
        self.memory
            .cuda_stream
            .store(stream as usize as u64, Ordering::SeqCst);
    }

    /// Where the epoch stands for a checkpoint: `cursor` is the `cursor_after` of the last batch
    /// yielded. Store it once every rank has consumed that step.
    pub fn state(&self) -> StreamState {
        StreamState {
            dataset: self.spec.dataset.clone(),
            sources: self.spec.sources.clone(),
            mixture_epoch_samples: self.spec.mixture_epoch_samples,
            seed: self.spec.seed,
            epoch: self.spec.epoch,
            shuffle: self.spec.shuffle,
            world_size: self.spec.world_size,
            batch_size: self.spec.batch_size,
            cursor: self.cursor,
        }
    }

    /// Asks the daemon for its counters.
    pub fn status(&mut self) -> Result<DaemonStatus, ClientError> {
        if let Phase::Failed { reason, .. } = &self.phase {
            return Err(ClientError::Ended(reason.clone()));
        }
        if let Err(error) = self.outbox.send(&Message::StatusRequest) {
            return Err(self.fail(error.into(), false));
        }
        loop {
            match self.receive() {
                Ok(Event::EndOfEpoch) => {}
                Ok(Event::Status(status)) => return Ok(status),
                Err(error) => return Err(self.fail(error, false)),
            }
        }
    }

    /// Reads and validates one frame (batches come through the ring; the socket carries the end of
    /// the epoch, status replies and errors).
    pub(super) fn receive(&mut self) -> Result<Event, ClientError> {
        let message = recv_plain(&self.socket)?;
        match message {
            Message::EndOfEpoch { epoch, steps } => {
                if !matches!(self.phase, Phase::Streaming) {
                    return Err(ClientError::Protocol("a second EndOfEpoch".to_string()));
                }
                if epoch != self.spec.epoch || steps != self.memory.layout.steps {
                    return Err(ClientError::Protocol(format!(
                        "EndOfEpoch for epoch {epoch} after {steps} steps, but the stream serves epoch {} in {} steps",
                        self.spec.epoch, self.memory.layout.steps
                    )));
                }
                // Every batch was published in the ring before this frame was sent; the iterator
                // drains them before it ends.
                self.phase = Phase::Finished;
                Ok(Event::EndOfEpoch)
            }
            Message::Status(status) => Ok(Event::Status(status)),
            other => Err(unexpected(other, "EndOfEpoch or Status")),
        }
    }

    /// The next batch entry of the ring, checked, if the daemon has published one.
    fn take_published(&mut self) -> Result<Option<BatchInfo>, ClientError> {
        let view = &self.outbox.ring.view;
        let slot_count = view.slot_count();
        let index = self.batches_received;
        let ready = check_published("batch", view.batches_published(), index, slot_count)
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        if ready == 0 {
            return Ok(None);
        }
        let entry = decode_batch(index, view.batch_entry(index), slot_count)
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        let layout = &self.memory.layout;
        let shapes = if layout.variable.is_empty() {
            None
        } else {
            // The slot is the client's once its entry is published: its index tensors say the
            // shapes of its variable-length fields (`decode_batch` checked the slot's number).
            let read = |at: u64, len: usize| -> Result<Vec<u8>, String> {
                match &self.memory.slots {
                    super::slots::Slots::Host(slots) => {
                        Ok(slots.slot(entry.slot)[at as usize..at as usize + len].to_vec())
                    }
                    super::slots::Slots::Device(slots) => {
                        let mut out = vec![0u8; len];
                        slots
                            .copy_to_host(entry.slot, slots.ptr(entry.slot) + at, &mut out)
                            .map_err(|e| format!("reading a variable-length field's index: {e}"))?;
                        Ok(out)
                    }
                }
            };
            Some(
                super::variable::batch_shapes(layout, read, entry.samples)
                    .map_err(ClientError::Protocol)?,
            )
        };
        let info = BatchInfo {
            slot: entry.slot,
            epoch: entry.epoch,
            step: entry.step,
            cursor_after: entry.cursor_after,
            samples: entry.samples,
            replaced: entry.replaced,
            fields: self
                .memory
                .layout
                .fields
                .iter()
                .enumerate()
                .map(|(at, field)| {
                    let shape = match &shapes {
                        Some(shapes) => shapes[at].clone(),
                        None => {
                            let mut shape = Vec::with_capacity(field.sample_shape.len() + 1);
                            shape.push(u64::from(entry.samples));
                            shape.extend_from_slice(&field.sample_shape);
                            shape
                        }
                    };
                    BatchField {
                        offset: field.offset,
                        dtype: field.dtype,
                        shape,
                    }
                })
                .collect(),
            ready_ns: entry.ready_ns,
        };
        self.accept_batch(&info)?;
        Ok(Some(info))
    }

    /// The next batch; `None` at the end of the epoch. Sleeps on the doorbell and the socket (which
    /// brings the end of the epoch and errors) until shortly before the stream's pace says the batch
    /// is due, watches the ring from then until shortly after, then sleeps until it comes
    /// (`pacing.rs`).
    fn wait_for_batch(&mut self) -> Result<Option<BatchInfo>, ClientError> {
        // A batch already published is taken without planning a wait (no clock read): the usual
        // case while the daemon runs ahead, and for every batch after the first of a group
        // published together.
        if let Some(info) = self.take_published()? {
            self.pacing.record(info.ready_ns);
            return Ok(Some(info));
        }
        let plan = self.pacing.plan(monotonic_ns(), spin());
        let mut planned_sleep = (!plan.sleep.is_zero()).then_some(plan.sleep);
        let mut watch_until = None;
        let mut polls = 0u32;
        loop {
            if let Some(info) = self.take_published()? {
                self.pacing.record(info.ready_ns);
                return Ok(Some(info));
            }
            if matches!(self.phase, Phase::Finished) {
                if self.batches_received == self.memory.layout.steps {
                    return Ok(None);
                }
                return Err(ClientError::Protocol(format!(
                    "EndOfEpoch after {} of the {} announced batches",
                    self.batches_received, self.memory.layout.steps
                )));
            }
            if let Some(sleep) = planned_sleep.take() {
                self.sleep_on_doorbell(Some(sleep))?;
                continue;
            }
            let until = *watch_until.get_or_insert_with(|| std::time::Instant::now() + plan.watch);
            polls += 1;
            if polls % 64 != 0 || std::time::Instant::now() < until {
                std::hint::spin_loop();
                continue;
            }
            self.sleep_on_doorbell(None)?;
        }
    }

    /// Sleeps until the doorbell rings, the socket has a frame, or `timeout` passes (`None`: no
    /// limit), unless a batch is published meanwhile.
    fn sleep_on_doorbell(
        &mut self,
        timeout: Option<std::time::Duration>,
    ) -> Result<(), ClientError> {
        // Say that we sleep, then look once more: a batch published before the daemon saw the
        // waiting word is found here; one published after it rings the doorbell.
        let ring = &self.outbox.ring;
        ring.view.set_consumer_waiting(true);
        if ring.view.batches_published() != self.batches_received {
            ring.view.set_consumer_waiting(false);
            return Ok(());
        }
        let (_, socket_ready) = ring
            .consumer_bell
            .wait_for(Some(self.socket.as_fd()), timeout);
        ring.consumer_bell.clear();
        ring.view.set_consumer_waiting(false);
        // The ring first: batches published before an error or the end of the epoch are served
        // before it.
        if socket_ready && ring.view.batches_published() == self.batches_received {
            if let Event::Status(_) = self.receive()? {
                return Err(ClientError::Protocol(
                    "Status without a StatusRequest".to_string(),
                ));
            }
        }
        Ok(())
    }

    /// Validates a batch entry against the layout and the stream's progress, then records its slot
    /// as held.
    pub(super) fn accept_batch(&mut self, info: &BatchInfo) -> Result<(), ClientError> {
        let layout = &self.memory.layout;
        let violation = |reason: String| Err(ClientError::Protocol(reason));
        if matches!(self.phase, Phase::Failed { .. }) {
            return violation(format!(
                "batch for step {} after the session ended",
                info.step
            ));
        }
        if info.slot >= layout.slot_count {
            return violation(format!(
                "batch in slot {} of {}",
                info.slot, layout.slot_count
            ));
        }
        if self.batches_received >= layout.steps {
            return violation(format!("more than the {} announced batches", layout.steps));
        }
        if info.epoch != self.spec.epoch {
            return violation(format!(
                "batch of epoch {} in a stream of epoch {}",
                info.epoch, self.spec.epoch
            ));
        }
        if let Some(last) = self.last_step {
            if Some(info.step) != last.checked_add(1) {
                return violation(format!("step {} follows step {last}", info.step));
            }
        }
        if info.cursor_after <= self.last_cursor_received {
            return violation(format!(
                "cursor_after {} does not advance past {}",
                info.cursor_after, self.last_cursor_received
            ));
        }
        if info.samples == 0 || info.samples > self.spec.batch_size {
            return violation(format!(
                "{} samples in a batch of at most {}",
                info.samples, self.spec.batch_size
            ));
        }
        if info.replaced > info.samples {
            return violation(format!(
                "{} of {} samples replaced",
                info.replaced, info.samples
            ));
        }
        if info.fields.len() != layout.fields.len() {
            return violation(format!(
                "batch with {} fields, the layout has {}",
                info.fields.len(),
                layout.fields.len()
            ));
        }
        for (at, (field, expected)) in info.fields.iter().zip(&layout.fields).enumerate() {
            let variable = layout
                .variable
                .iter()
                .any(|v| usize::from(v.values) == at || usize::from(v.index) == at);
            // Variable-length shapes were checked against their bounds as they were read; their
            // extent is checked below like any field's.
            if !variable
                && (field.dtype != expected.dtype
                    || field.shape.first() != Some(&u64::from(info.samples))
                    || field.shape[1..] != expected.sample_shape[..])
            {
                return violation(format!(
                    "field {:?} arrived as {:?} {}, expected [{}] + {:?} {}",
                    expected.name,
                    field.shape,
                    field.dtype,
                    info.samples,
                    expected.sample_shape,
                    expected.dtype
                ));
            }
            let bytes = extent_bytes(&field.shape, field.dtype.size_bytes());
            if bytes.is_none_or(|bytes| bytes > expected.batch_bytes)
                || bytes
                    .and_then(|bytes| field.offset.checked_add(bytes))
                    .is_none_or(|end| end > layout.slot_bytes)
            {
                return violation(format!(
                    "field {:?} at offset {} with shape {:?} does not fit its {} reserved bytes in the {}-byte slot",
                    expected.name, field.offset, field.shape, expected.batch_bytes, layout.slot_bytes
                ));
            }
        }
        if !self.outbox.take_slot(info.slot) {
            return violation(format!(
                "slot {} handed out again while the client holds it",
                info.slot
            ));
        }
        self.last_step = Some(info.step);
        self.last_cursor_received = info.cursor_after;
        self.batches_received += 1;
        Ok(())
    }

    /// Ends the session after `error`: drops queued batches, shuts the socket down so the daemon
    /// reclaims the slots, and refuses further work.
    pub(super) fn fail(&mut self, error: ClientError, reported: bool) -> ClientError {
        let _ = self.socket.shutdown(Shutdown::Both);
        self.phase = Phase::Failed {
            reason: error.to_string(),
            reported,
        };
        error
    }

    pub(super) fn hand_out(&mut self, info: BatchInfo) -> Result<Batch, ClientError> {
        self.cursor = info.cursor_after;
        let batch = Batch {
            info,
            memory: Arc::clone(&self.memory),
            outbox: Arc::clone(&self.outbox),
            release_stream: None,
        };
        if let Slots::Device(slots) = &self.memory.slots {
            slots.wait_ready(batch.info.slot, self.memory.cuda_stream())?;
        }
        Ok(batch)
    }
}

impl Iterator for Stream {
    type Item = Result<Batch, ClientError>;

    /// The next batch in step order; `None` after `EndOfEpoch`, and after an error has been yielded.
    fn next(&mut self) -> Option<Result<Batch, ClientError>> {
        match &mut self.phase {
            Phase::Streaming | Phase::Finished => {}
            Phase::Failed { reported: true, .. } => return None,
            Phase::Failed { reason, reported } => {
                *reported = true;
                return Some(Err(ClientError::Ended(reason.clone())));
            }
        }
        let layout = &self.memory.layout;
        if self.batches_received == layout.steps && matches!(self.phase, Phase::Finished) {
            return None;
        }
        let slots = layout.slot_count;
        let held = self.outbox.lock().held_slots.count_ones();
        if held >= slots && self.batches_received < layout.steps {
            return Some(Err(ClientError::AllSlotsHeld { slots }));
        }
        match self.wait_for_batch() {
            Ok(Some(info)) => Some(self.hand_out(info)),
            Ok(None) => None,
            Err(error) => Some(Err(self.fail(error, true))),
        }
    }
}
