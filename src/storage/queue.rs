//! The submission/completion seam under the read engine.
//!
//! [`ReadQueue`] is the narrow interface the engine drives: push positional reads, submit, collect
//! completions as `(tag, result)` pairs with io_uring's convention (bytes read, or `-errno`). The real
//! implementation is [`UringQueue`]; [`PreadQueue`] performs the same reads synchronously where io_uring
//! is unavailable (seccomp-filtered containers, old kernels); tests wrap either in a fault injector
//! (`storage::fault`) to exercise every error path without hardware.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;

/// Most reads a queue may hold in flight: bounds the ring (and its completion queue, twice as large)
/// and the pread fallback's batch.
pub const QUEUE_DEPTH_MAX: usize = 4096;

/// One positional read handed to a queue.
#[derive(Clone, Copy, Debug)]
pub struct ReadOp {
    /// File descriptor to read from.
    pub fd: RawFd,
    /// Destination of the read.
    pub buf: *mut u8,
    /// Bytes to read (at most `u32::MAX`).
    pub len: u32,
    /// File offset.
    pub offset: u64,
    /// Index of a buffer registered with [`UringQueue::register_buffers`] that contains `buf`, if any;
    /// such reads skip the kernel's per-read page pinning.
    pub fixed_buffer: Option<u16>,
    /// Returned with the completion.
    pub tag: u64,
}

/// A completion: the op's tag and its result (bytes read, or `-errno`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The tag given with the op.
    pub tag: u64,
    /// Bytes read (0 at end of file), or a negated errno.
    pub result: i32,
}

/// A queue of positional reads.
pub trait ReadQueue {
    /// Most reads that may be in flight at once.
    fn depth(&self) -> usize;

    /// Queues one read; it starts at the next [`ReadQueue::submit_and_wait`].
    ///
    /// # Safety
    /// `op.buf .. op.buf + op.len` must be valid for writes and not accessed by anyone else until this
    /// op's completion has been returned by `submit_and_wait`: the kernel writes into it asynchronously.
    /// The caller keeps at most [`ReadQueue::depth`] ops pushed and not yet completed.
    unsafe fn push(&mut self, op: ReadOp);

    /// Submits queued reads and waits until at least `min` completions are available, appending every
    /// available completion to `out`.
    fn submit_and_wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<()>;
}

/// A read queue backed by one io_uring instance.
pub struct UringQueue {
    ring: io_uring::IoUring,
    depth: usize,
    queued: usize,
}

impl UringQueue {
    /// Creates a ring with room for `depth` reads in flight.
    pub fn new(depth: usize) -> io::Result<UringQueue> {
        assert!(
            depth > 0 && depth <= QUEUE_DEPTH_MAX,
            "queue depth {depth} outside 1..={QUEUE_DEPTH_MAX}"
        );
        let entries = depth.next_power_of_two() as u32;
        let ring = io_uring::IoUring::builder()
            .setup_cqsize(entries * 2)
            .build(entries)?;
        Ok(UringQueue {
            ring,
            depth,
            queued: 0,
        })
    }

    /// Registers buffers with the ring so reads into them can use `fixed_buffer`.
    ///
    /// # Safety
    /// Every `iovec` must describe memory that stays valid until the ring is dropped or the buffers
    /// are unregistered.
    pub unsafe fn register_buffers(&mut self, buffers: &[libc::iovec]) -> io::Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.ring.submitter().register_buffers(buffers) }
    }
}

impl ReadQueue for UringQueue {
    fn depth(&self) -> usize {
        self.depth
    }

    unsafe fn push(&mut self, op: ReadOp) {
        use io_uring::{opcode, types};
        let entry = match op.fixed_buffer {
            Some(index) => opcode::ReadFixed::new(types::Fd(op.fd), op.buf, op.len, index)
                .offset(op.offset)
                .build(),
            None => opcode::Read::new(types::Fd(op.fd), op.buf, op.len)
                .offset(op.offset)
                .build(),
        }
        .user_data(op.tag);
        // SAFETY: the caller guarantees the buffer outlives the op; the ring has room because the
        // engine keeps at most `depth` ops outstanding and the ring has at least `depth` entries
        // (submit_and_wait drains the submission queue every time).
        let pushed = unsafe { self.ring.submission().push(&entry) };
        assert!(
            pushed.is_ok(),
            "submission queue overflow: more than depth ops pushed"
        );
        self.queued += 1;
    }

    fn submit_and_wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<()> {
        let available = self.ring.completion().len();
        let want = min.saturating_sub(available);
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => break,
                // A signal interrupted the wait; the submissions were consumed or will be, so waiting
                // again is safe.
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
        }
        self.queued = 0;
        for cqe in self.ring.completion() {
            out.push(Completion {
                tag: cqe.user_data(),
                result: cqe.result(),
            });
        }
        Ok(())
    }
}

/// A read queue that performs each read with `pread(2)` when submitted.
///
/// Used where io_uring cannot be set up; it has the same semantics, without the parallelism.
pub struct PreadQueue {
    depth: usize,
    pending: VecDeque<ReadOp>,
    done: Vec<Completion>,
}

impl PreadQueue {
    /// Creates a queue accepting up to `depth` pushed reads between submissions.
    pub fn new(depth: usize) -> PreadQueue {
        assert!(
            depth > 0 && depth <= QUEUE_DEPTH_MAX,
            "queue depth {depth} outside 1..={QUEUE_DEPTH_MAX}"
        );
        PreadQueue {
            depth,
            pending: VecDeque::with_capacity(depth),
            done: Vec::with_capacity(depth),
        }
    }
}

// SAFETY: the raw buffer pointers held between `push` and `submit_and_wait` are covered by `push`'s
// contract (valid and exclusively the queue's until completion), which does not depend on the thread
// the queue runs on.
unsafe impl Send for PreadQueue {}

impl ReadQueue for PreadQueue {
    fn depth(&self) -> usize {
        self.depth
    }

    unsafe fn push(&mut self, op: ReadOp) {
        assert!(
            self.pending.len() < self.depth,
            "more than depth ops pushed"
        );
        self.pending.push_back(op);
    }

    fn submit_and_wait(&mut self, _min: usize, out: &mut Vec<Completion>) -> io::Result<()> {
        while let Some(op) = self.pending.pop_front() {
            // SAFETY: `push`'s contract keeps `op.buf .. + op.len` valid and exclusively ours until
            // this completion is returned.
            let result = unsafe {
                libc::pread(
                    op.fd,
                    op.buf.cast::<libc::c_void>(),
                    op.len as usize,
                    op.offset as libc::off_t,
                )
            };
            let result = if result < 0 {
                -io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO)
            } else {
                result as i32
            };
            self.done.push(Completion {
                tag: op.tag,
                result,
            });
        }
        out.append(&mut self.done);
        Ok(())
    }
}

/// The queue an engine was given: io_uring where the kernel allows it, pread otherwise.
pub enum AnyQueue {
    /// io_uring (boxed: the ring handle is large and the queue is created once per engine).
    Uring(Box<UringQueue>),
    /// Synchronous pread.
    Pread(PreadQueue),
}

impl AnyQueue {
    /// An io_uring queue of `depth`, or a pread queue with the reason io_uring could not be set up.
    pub fn best(depth: usize) -> (AnyQueue, Option<String>) {
        match UringQueue::new(depth) {
            Ok(queue) => (AnyQueue::Uring(Box::new(queue)), None),
            Err(error) => (
                AnyQueue::Pread(PreadQueue::new(depth)),
                Some(format!("io_uring unavailable ({error}); using pread")),
            ),
        }
    }

    /// Registers buffers as io_uring fixed buffers; returns false (and does nothing) for the pread
    /// queue, which has no such notion.
    ///
    /// # Safety
    /// As [`UringQueue::register_buffers`]: the memory stays valid while the queue lives.
    pub unsafe fn register_buffers(&mut self, buffers: &[libc::iovec]) -> io::Result<bool> {
        match self {
            // SAFETY: forwarded under the caller's guarantee.
            AnyQueue::Uring(q) => unsafe { q.register_buffers(buffers) }.map(|()| true),
            AnyQueue::Pread(_) => Ok(false),
        }
    }

    /// Name for logs and status.
    pub fn name(&self) -> &'static str {
        match self {
            AnyQueue::Uring(_) => "io_uring",
            AnyQueue::Pread(_) => "pread",
        }
    }
}

impl ReadQueue for AnyQueue {
    fn depth(&self) -> usize {
        match self {
            AnyQueue::Uring(q) => q.depth(),
            AnyQueue::Pread(q) => q.depth(),
        }
    }

    unsafe fn push(&mut self, op: ReadOp) {
        match self {
            // SAFETY: forwarded under the caller's guarantee.
            AnyQueue::Uring(q) => unsafe { q.push(op) },
            // SAFETY: forwarded under the caller's guarantee.
            AnyQueue::Pread(q) => unsafe { q.push(op) },
        }
    }

    fn submit_and_wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<()> {
        match self {
            AnyQueue::Uring(q) => q.submit_and_wait(min, out),
            AnyQueue::Pread(q) => q.submit_and_wait(min, out),
        }
    }
}
