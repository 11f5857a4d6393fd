//! Streams, events and CUDA graphs.
//!
//! Work is ordered with streams and events only; nothing here synchronises the whole device. A host
//! thread that must wait waits for one event or one stream.

use cudarc::driver::sys as cu;

use super::{ffi, Device, DeviceError};

/// A non-blocking CUDA stream (it does not synchronise with the legacy default stream).
pub struct Stream {
    device: Device,
    stream: cu::CUstream,
}

// SAFETY: a stream handle may be used from any thread (the driver API is thread-safe).
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a stream on `device`.
    pub fn new(device: &Device) -> Result<Stream, DeviceError> {
        device.bind()?;
        // SAFETY: the device's context is current.
        let stream = unsafe { ffi::stream_create() }?;
        Ok(Stream {
            device: device.clone(),
            stream,
        })
    }

    /// The raw handle, for launches. Valid while `self` lives.
    pub fn raw(&self) -> cu::CUstream {
        self.stream
    }

    /// The stream's device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Blocks the calling thread until the work queued so far on this stream is done.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.device.bind()?;
        // SAFETY: the stream is live.
        unsafe { ffi::stream_synchronize(self.stream) }?;
        Ok(())
    }

    /// Makes later work on this stream wait until `event`'s recorded work is done (no host wait).
    pub fn wait(&self, event: &Event) -> Result<(), DeviceError> {
        self.device.bind()?;
        // SAFETY: both handles are live.
        unsafe { ffi::stream_wait_event(self.stream, event.event) }?;
        Ok(())
    }

    /// Records what `enqueue` queues on this stream into a [`Graph`] instead of running it.
    ///
    /// The capture is thread-local: other threads' work is unaffected. If `enqueue` fails, the capture
    /// is ended and its graph discarded before the error is returned.
    pub fn capture<F>(&self, enqueue: F) -> Result<Graph, DeviceError>
    where
        F: FnOnce(&Stream) -> Result<(), DeviceError>,
    {
        self.device.bind()?;
        // SAFETY: the stream is live and not capturing (captures are not nested here).
        unsafe { ffi::stream_begin_capture(self.stream) }?;
        let enqueued = enqueue(self);
        // SAFETY: the capture was begun above on this thread.
        let ended = unsafe { ffi::stream_end_capture(self.stream) };
        let graph = match (enqueued, ended) {
            (Ok(()), Ok(graph)) => graph,
            (Err(e), Ok(graph)) => {
                // SAFETY: the graph came from the capture and is not used again.
                let _ = unsafe { ffi::graph_destroy(graph) };
                return Err(e);
            }
            (Err(e), Err(_)) => return Err(e),
            (Ok(()), Err(e)) => return Err(e.into()),
        };
        // SAFETY: `graph` is live; it is destroyed right after instantiation, which copies it.
        let exec = unsafe { ffi::graph_instantiate(graph) };
        // SAFETY: as above.
        let _ = unsafe { ffi::graph_destroy(graph) };
        Ok(Graph {
            device: self.device.clone(),
            exec: exec?,
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: created in `new`, destroyed once; queued work still completes.
        let _ = unsafe { ffi::stream_destroy(self.stream) };
    }
}

/// A CUDA event: a point in a stream that other streams and the host can wait for.
pub struct Event {
    device: Device,
    event: cu::CUevent,
}

// SAFETY: event handles may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

/// Whether an event records timestamps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventTiming {
    /// For [`Event::elapsed_ms`]; slightly more costly to record.
    Enabled,
    /// For synchronisation only.
    Disabled,
}

impl Event {
    /// Creates an event.
    pub fn new(device: &Device, timing: EventTiming) -> Result<Event, DeviceError> {
        device.bind()?;
        // SAFETY: the device's context is current.
        let event = unsafe { ffi::event_create(timing == EventTiming::Enabled) }?;
        Ok(Event {
            device: device.clone(),
            event,
        })
    }

    /// Creates an event whose [`Event::synchronize`] sleeps instead of spinning (no timing): for a host
    /// thread that waits for the device on the hot path without burning a core.
    pub fn new_blocking(device: &Device) -> Result<Event, DeviceError> {
        device.bind()?;
        // SAFETY: the device's context is current.
        let event = unsafe { ffi::event_create_blocking() }?;
        Ok(Event {
            device: device.clone(),
            event,
        })
    }

    /// Creates an interprocess event (no timing): [`Event::ipc_handle`] gives the bytes another
    /// process opens it with.
    pub fn new_interprocess(device: &Device) -> Result<Event, DeviceError> {
        device.bind()?;
        // SAFETY: the device's context is current.
        let event = unsafe { ffi::event_create_interprocess() }?;
        Ok(Event {
            device: device.clone(),
            event,
        })
    }

    /// The interprocess handle of an event made by [`Event::new_interprocess`].
    pub fn ipc_handle(&self) -> Result<[u8; 64], DeviceError> {
        self.device.bind()?;
        // SAFETY: the event is live; the driver refuses events made without the interprocess flag.
        Ok(unsafe { ffi::ipc_event_handle(self.event) }?)
    }

    /// Records the event at the current end of `stream`.
    pub fn record(&self, stream: &Stream) -> Result<(), DeviceError> {
        self.device.bind()?;
        // SAFETY: both handles are live.
        unsafe { ffi::event_record(self.event, stream.raw()) }?;
        Ok(())
    }

    /// Blocks until the work before the last record is done.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.device.bind()?;
        // SAFETY: the event is live.
        unsafe { ffi::event_synchronize(self.event) }?;
        Ok(())
    }

    /// Whether the work before the last record is done (true for an event never recorded), without
    /// waiting.
    pub fn is_complete(&self) -> Result<bool, DeviceError> {
        self.device.bind()?;
        // SAFETY: the event is live.
        Ok(unsafe { ffi::event_query(self.event) }?)
    }

    /// Milliseconds between `start` and `self`; both must be timing events, recorded and complete.
    pub fn elapsed_ms(&self, start: &Event) -> Result<f32, DeviceError> {
        self.device.bind()?;
        // SAFETY: both events are live; the driver reports an error if either is incomplete or lacks
        // timing.
        Ok(unsafe { ffi::event_elapsed_ms(start.event, self.event) }?)
    }
}

/// Times `run`, which queues work on `stream`, with a pair of timing events: `warmup` untimed runs,
/// then `reps` timed ones. Returns each timed run's milliseconds, in order. For the benchmarks.
pub fn time_on_stream<E: From<DeviceError>>(
    device: &Device,
    stream: &Stream,
    warmup: usize,
    reps: usize,
    mut run: impl FnMut() -> Result<(), E>,
) -> Result<Vec<f64>, E> {
    let start = Event::new(device, EventTiming::Enabled)?;
    let end = Event::new(device, EventTiming::Enabled)?;
    for _ in 0..warmup {
        run()?;
    }
    stream.synchronize()?;
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        start.record(stream)?;
        run()?;
        end.record(stream)?;
        end.synchronize()?;
        samples.push(f64::from(end.elapsed_ms(&start)?));
    }
    Ok(samples)
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { ffi::event_destroy(self.event) };
    }
}

/// An instantiated CUDA graph: a captured sequence of copies and launches replayed with one call.
pub struct Graph {
    device: Device,
    exec: cu::CUgraphExec,
}

// SAFETY: executable graph handles may be launched from any thread (one launch at a time per graph is
// the caller's concern, as for any stream work).
unsafe impl Send for Graph {}
// SAFETY: as above.
unsafe impl Sync for Graph {}

impl Graph {
    /// Queues one replay of the graph on `stream`.
    ///
    /// # Safety
    /// Every buffer the captured work uses is still allocated, and used by nothing conflicting, until
    /// the replay has completed on `stream` (the same contract as the captured operations).
    pub unsafe fn launch(&self, stream: &Stream) -> Result<(), DeviceError> {
        self.device.bind()?;
        ffi::graph_launch(self.exec, stream.raw())?;
        Ok(())
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: instantiated in Stream::capture, destroyed once.
        let _ = unsafe { ffi::graph_exec_destroy(self.exec) };
    }
}
