//! A fault-injecting [`ReadQueue`] wrapper: the test seam for every error path of the engines.
//!
//! Faults are scripted per submitted read (the n-th read pushed, counting from 0), so a test states
//! exactly which read fails and how, and the engine's recovery is checked against real file contents.

use std::collections::HashMap;
use std::io;

use super::queue::{Completion, ReadOp, ReadQueue};

/// What happens to one read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The read fails with this errno (for example `libc::EIO`, `libc::EINTR`, `libc::EAGAIN`).
    Errno(i32),
    /// The read returns at most this many bytes (a short read).
    Short(u32),
    /// The read returns 0, as at end of file.
    Eof,
}

/// Wraps a queue and applies scripted faults.
pub struct FaultQueue<Q> {
    inner: Q,
    script: HashMap<u64, Fault>,
    /// Applied to every read not in `script`.
    every: Option<Fault>,
    pushed: u64,
    inner_outstanding: usize,
    injected: Vec<Completion>,
    /// Tags of forwarded reads whose result is to be clamped (short reads).
    clamp: HashMap<u64, u32>,
    /// Faults applied so far.
    pub faults_applied: u64,
}

impl<Q: ReadQueue> FaultQueue<Q> {
    /// Wraps `inner`; `script` maps read ordinals to faults.
    pub fn new(inner: Q, script: HashMap<u64, Fault>) -> FaultQueue<Q> {
        FaultQueue {
            inner,
            script,
            every: None,
            pushed: 0,
            inner_outstanding: 0,
            injected: Vec::new(),
            clamp: HashMap::new(),
            faults_applied: 0,
        }
    }

    /// Applies `fault` to every read that the script does not name.
    pub fn with_every(mut self, fault: Fault) -> FaultQueue<Q> {
        self.every = Some(fault);
        self
    }
}

impl<Q: ReadQueue> ReadQueue for FaultQueue<Q> {
    fn depth(&self) -> usize {
        self.inner.depth()
    }

    unsafe fn push(&mut self, op: ReadOp) {
        let ordinal = self.pushed;
        self.pushed += 1;
        let fault = self.script.get(&ordinal).copied().or(self.every);
        if fault.is_some() {
            self.faults_applied += 1;
        }
        match fault {
            Some(Fault::Errno(errno)) => self.injected.push(Completion {
                tag: op.tag,
                result: -errno,
            }),
            Some(Fault::Eof) => self.injected.push(Completion {
                tag: op.tag,
                result: 0,
            }),
            Some(Fault::Short(bytes)) => {
                // The read runs in full (an O_DIRECT descriptor would reject a shortened length) and
                // its reported result is clamped, as a kernel returning early would report it.
                self.clamp.insert(op.tag, bytes.max(1));
                self.inner_outstanding += 1;
                // SAFETY: forwarded unchanged under the caller's guarantee.
                unsafe { self.inner.push(op) };
            }
            None => {
                self.inner_outstanding += 1;
                // SAFETY: forwarded unchanged under the caller's guarantee.
                unsafe { self.inner.push(op) };
            }
        }
    }

    fn submit_and_wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<()> {
        let want = min
            .saturating_sub(self.injected.len())
            .min(self.inner_outstanding);
        let before = out.len();
        self.inner.submit_and_wait(want, out)?;
        self.inner_outstanding -= out.len() - before;
        for completion in &mut out[before..] {
            if let Some(bytes) = self.clamp.remove(&completion.tag) {
                if completion.result > bytes as i32 {
                    completion.result = bytes as i32;
                }
            }
        }
        out.append(&mut self.injected);
        Ok(())
    }
}
