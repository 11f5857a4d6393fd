//! The read engine: turns extents into bounded, aligned, retried queue operations.

use std::collections::VecDeque;

use super::files::FileTable;
use super::queue::{Completion, ReadOp, ReadQueue};
use super::{Extent, ReadError, ReadErrorKind, StorageError, IO_ALIGN_BYTES};

/// Bounds of one engine.
#[derive(Clone, Copy, Debug)]
pub struct EngineLimits {
    /// Largest single read submitted; longer extents are split.
    pub chunk_bytes_max: usize,
    /// How often one read is resubmitted after EINTR or EAGAIN before the extent fails.
    pub retries_max: u32,
}

impl EngineLimits {
    /// The daemon's bounds: reads of at most 1 MiB (large enough for full-speed NVMe, small enough to
    /// spread an extent over the queue), and 8 resubmissions after EINTR or EAGAIN.
    pub fn node_defaults() -> EngineLimits {
        EngineLimits {
            chunk_bytes_max: 1 << 20,
            retries_max: 8,
        }
    }
}

/// Reads extents of open files into a destination buffer through a [`ReadQueue`].
///
/// Aligned pieces (file offset, length and destination address all multiples of 4096) go to the O_DIRECT
/// descriptor when the file has one; everything else, including the unaligned tail of an extent and the
/// rest of a short read that ended unaligned, goes through the page cache. Short reads are continued,
/// EINTR and EAGAIN retried up to a bound, and end of file before an extent's end is an error naming the
/// file and offset.
pub struct ReadEngine<Q> {
    queue: Q,
    limits: EngineLimits,
    pending: VecDeque<Piece>,
    completions: Vec<Completion>,
    /// Pieces currently in the queue, by tag.
    in_flight: Vec<Option<Piece>>,
    free_tags: Vec<u64>,
    /// Set when the queue itself failed; the engine then refuses further work.
    broken: bool,
}

/// A part of an extent still to be read.
#[derive(Clone, Copy, Debug)]
struct Piece {
    extent: usize,
    file_offset: u64,
    dest_offset: usize,
    len: usize,
    retries: u32,
}

impl Piece {
    /// What is left of this piece after its first `done` bytes, with a fresh retry count.
    fn rest_after(&self, done: usize) -> Piece {
        debug_assert!(done < self.len);
        Piece {
            extent: self.extent,
            file_offset: self.file_offset + done as u64,
            dest_offset: self.dest_offset + done,
            len: self.len - done,
            retries: 0,
        }
    }
}

impl<Q: ReadQueue> ReadEngine<Q> {
    /// An engine over `queue`.
    pub fn new(queue: Q, limits: EngineLimits) -> ReadEngine<Q> {
        assert!(limits.chunk_bytes_max >= IO_ALIGN_BYTES as usize);
        assert!(limits.chunk_bytes_max % IO_ALIGN_BYTES as usize == 0);
        assert!(limits.chunk_bytes_max <= u32::MAX as usize);
        let depth = queue.depth();
        ReadEngine {
            queue,
            limits,
            pending: VecDeque::new(),
            completions: Vec::with_capacity(depth),
            in_flight: vec![None; depth],
            free_tags: (0..depth as u64).rev().collect(),
            broken: false,
        }
    }

    /// The queue underneath (tests inspect fault injectors through this).
    pub fn queue(&self) -> &Q {
        &self.queue
    }

    /// The queue underneath, for registering fixed buffers.
    pub fn queue_mut(&mut self) -> &mut Q {
        &mut self.queue
    }

    /// Reads every extent into `dest` and reports a result per extent, in order.
    ///
    /// Extents must lie within `dest` (a programmer error otherwise). Every read has completed when
    /// this returns, also after errors, so `dest` is never written to afterwards.
    pub fn read(
        &mut self,
        files: &FileTable,
        extents: &[Extent],
        dest: &mut [u8],
    ) -> Result<Vec<Result<(), ReadError>>, StorageError> {
        self.read_with(files, extents, dest, None)
    }

    /// [`ReadEngine::read`] into a buffer registered with the queue as fixed buffer `fixed_buffer`
    /// (`dest` must lie within that registered buffer), so the kernel skips pinning its pages per read.
    pub fn read_with(
        &mut self,
        files: &FileTable,
        extents: &[Extent],
        dest: &mut [u8],
        fixed_buffer: Option<u16>,
    ) -> Result<Vec<Result<(), ReadError>>, StorageError> {
        if self.broken {
            return Err(StorageError::EngineBroken);
        }
        let mut results: Vec<Result<(), ReadError>> = (0..extents.len()).map(|_| Ok(())).collect();
        for (index, extent) in extents.iter().enumerate() {
            assert!(
                extent.dest_offset.checked_add(extent.len) <= Some(dest.len()),
                "extent {index} runs past the destination"
            );
            assert!(
                (extent.file.0 as usize) < files.len(),
                "extent {index}: unknown file"
            );
            let mut offset = 0usize;
            while offset < extent.len {
                let len = (extent.len - offset).min(self.limits.chunk_bytes_max);
                self.pending.push_back(Piece {
                    extent: index,
                    file_offset: extent.offset + offset as u64,
                    dest_offset: extent.dest_offset + offset,
                    len,
                    retries: 0,
                });
                offset += len;
            }
        }
        let base = dest.as_mut_ptr();
        let mut outstanding = 0usize;
        let mut failure = None;
        while !self.pending.is_empty() || outstanding > 0 {
            if failure.is_none() {
                while let Some(piece) = self.pending.front().copied() {
                    let Some(tag) = self.free_tags.pop() else {
                        break;
                    };
                    self.pending.pop_front();
                    if results[piece.extent].is_err() {
                        self.free_tags.push(tag);
                        continue;
                    }
                    let (piece, mut op) = self.prepare(files, extents, piece, base, tag);
                    op.fixed_buffer = fixed_buffer;
                    self.in_flight[tag as usize] = Some(piece);
                    // SAFETY: `op.buf .. + op.len` lies within `dest` (asserted above), which this call
                    // borrows mutably until every op has completed: the loop only exits with nothing
                    // outstanding, including on errors.
                    unsafe { self.queue.push(op) };
                    outstanding += 1;
                }
            } else {
                self.pending.clear();
            }
            if outstanding == 0 {
                continue;
            }
            if let Err(source) = self.queue.submit_and_wait(1, &mut self.completions) {
                // The ring itself failed: we cannot know whether the outstanding reads will still
                // write into `dest`, so stop using this engine rather than return and let the buffer
                // be reused. Waiting once more is the only safe step; if that fails too, abort.
                failure = Some(source);
                let mut drained = Vec::new();
                if self
                    .queue
                    .submit_and_wait(outstanding, &mut drained)
                    .is_err()
                {
                    std::process::abort();
                }
                self.completions.extend(drained);
            }
            let completions = std::mem::take(&mut self.completions);
            for completion in &completions {
                outstanding -= 1;
                let tag = completion.tag;
                let piece = self.in_flight[tag as usize]
                    .take()
                    .expect("completion for a tag in flight");
                self.free_tags.push(tag);
                self.complete(files, extents, piece, completion.result, &mut results);
            }
            self.completions = completions;
            self.completions.clear();
        }
        if let Some(source) = failure {
            self.broken = true;
            return Err(StorageError::Queue { source });
        }
        Ok(results)
    }

    /// Chooses the descriptor for a piece and builds its op. An aligned prefix goes direct; an
    /// unaligned piece is cut so that its aligned head can still go direct.
    fn prepare(
        &mut self,
        files: &FileTable,
        extents: &[Extent],
        mut piece: Piece,
        base: *mut u8,
        tag: u64,
    ) -> (Piece, ReadOp) {
        let file = files.get(extents[piece.extent].file);
        let align = IO_ALIGN_BYTES as usize;
        // SAFETY: dest_offset is within the destination slice (asserted in `read`).
        let buf = unsafe { base.add(piece.dest_offset) };
        let aligned_start = piece.file_offset % IO_ALIGN_BYTES == 0 && (buf as usize) % align == 0;
        let fd = match file.direct_fd() {
            Some(direct) if aligned_start && piece.len >= align => {
                let aligned_len = piece.len - piece.len % align;
                if aligned_len < piece.len {
                    // The unaligned tail becomes its own piece, read through the page cache.
                    self.pending.push_front(piece.rest_after(aligned_len));
                    piece.len = aligned_len;
                }
                direct
            }
            _ => file.buffered_fd(),
        };
        let op = ReadOp {
            fd,
            buf,
            len: piece.len as u32,
            offset: piece.file_offset,
            fixed_buffer: None,
            tag,
        };
        (piece, op)
    }

    fn complete(
        &mut self,
        files: &FileTable,
        extents: &[Extent],
        piece: Piece,
        result: i32,
        results: &mut [Result<(), ReadError>],
    ) {
        let extent = &extents[piece.extent];
        let error = |kind| ReadError {
            path: files.get(extent.file).path.clone(),
            offset: piece.file_offset,
            len: piece.len,
            kind,
        };
        if results[piece.extent].is_err() {
            return;
        }
        match result {
            r if r == -libc::EINTR || r == -libc::EAGAIN => {
                if piece.retries >= self.limits.retries_max {
                    results[piece.extent] = Err(error(ReadErrorKind::RetriesExhausted {
                        errno: -r,
                        retries: piece.retries,
                    }));
                } else {
                    self.pending.push_back(Piece {
                        retries: piece.retries + 1,
                        ..piece
                    });
                }
            }
            r if r < 0 => {
                results[piece.extent] = Err(error(ReadErrorKind::Os(
                    std::io::Error::from_raw_os_error(-r),
                )));
            }
            0 => results[piece.extent] = Err(error(ReadErrorKind::UnexpectedEof)),
            r if (r as usize) < piece.len => {
                // A short read: continue where it stopped. `prepare` sends an unaligned remainder
                // through the page cache.
                self.pending.push_front(piece.rest_after(r as usize));
            }
            r if r as usize == piece.len => {}
            r => {
                results[piece.extent] = Err(error(ReadErrorKind::Overlong {
                    returned: r as usize,
                }))
            }
        }
    }
}
