//! Blocks verified shard by shard as a stream's loader copies them, for a dataset larger than the
//! memory the daemon may use.
//!
//! A stream that copies shards ahead into device memory verifies its blocks before its first batch
//! (`open::verify_blocks`), through the page cache. Within memory that read leaves the shards
//! cached for the copies; beyond it, it reads the whole dataset from the disk before the first
//! batch (8 to 9 s for 12 GiB on the H200 test machine) and the copies read it all again. Instead,
//! the loader verifies each shard just before it copies it (the copy then reads the pages the check
//! just brought in), on a few threads, and records what it found here. A round that reads a shard
//! is queued only once the shard's copy is queued, so by then its blocks are known: the filler asks
//! [`ShardChecks::corrupt_in`] for the shards a round reads, and the rows whose pieces read a corrupt
//! block ([`rows_reading`]) end the stream (policy `fail`) or are zeroed and counted (`replace`), as
//! rows of a block found corrupt when the stream opened.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use crate::decode;
use crate::format::Dataset;
use crate::kernels::{GatherOp, GATHER_PIECE_BYTES, GATHER_SOURCES_MAX};
use crate::pipeline::stream_plan::{BlockKey, CorruptBlock, FieldPlan};
use crate::storage::mapped::MappedFile;

/// Threads that verify one shard.
const CHECK_THREADS_MAX: usize = 4;

/// A block found corrupt by a shard's check: what is wrong, and its stored bytes in the shard.
#[derive(Clone, Debug)]
pub(super) struct FoundCorrupt {
    pub(super) bad: Arc<CorruptBlock>,
    pub(super) stored: Range<u64>,
}

/// The shard checks of one stream (see the module documentation).
pub(super) struct ShardChecks {
    dataset: Arc<Dataset>,
    /// The dataset's indices of the fields the stream reads.
    fields: Vec<usize>,
    /// Per shard checked, the corrupt blocks found (none: an empty list).
    found: Mutex<HashMap<usize, Vec<FoundCorrupt>>>,
}

impl ShardChecks {
    /// Checks of the blocks of `fields` of `dataset`.
    pub(super) fn new(dataset: Arc<Dataset>, fields: Vec<usize>) -> ShardChecks {
        ShardChecks {
            dataset,
            fields,
            found: Mutex::new(HashMap::new()),
        }
    }

    /// Verifies the blocks of shard `shard` (open as `file`) the dataset has not verified yet, once
    /// per stream, recording the corrupt ones. A shard that cannot be mapped has every unverified
    /// block recorded corrupt, naming why.
    pub(super) fn check_shard(&self, shard: usize, file: &std::fs::File) {
        if self.lock().contains_key(&shard) {
            return;
        }
        let work = self.unverified(shard);
        let map = MappedFile::map(file);
        if let (Ok(map), Some(range)) = (&map, self.stored_range(shard, &work)) {
            // The check threads fault the shard in page by page, each in its own part: ask the
            // kernel to read it all now, in large reads at the disk's queue depth.
            map.advise_will_need(range.start as usize, (range.end - range.start) as usize);
        }
        let threads = CHECK_THREADS_MAX.min(work.len()).max(1);
        let chunk = work.len().div_ceil(threads).max(1);
        let found: Vec<FoundCorrupt> = std::thread::scope(|scope| {
            let handles: Vec<_> = work
                .chunks(chunk)
                .map(|part| {
                    let map = map.as_ref();
                    scope.spawn(move || {
                        part.iter()
                            .filter_map(|&(field, block)| self.check(shard, field, block, map))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().expect("a shard check thread panicked"))
                .collect()
        });
        for corrupt in &found {
            tracing::warn!(
                "{} (found checking the shard before its copy)",
                corrupt.bad.to_error()
            );
        }
        self.lock().insert(shard, found);
    }

    /// Asks the kernel to read ahead the blocks of shard `shard` (open as `file`) that its check
    /// will read, where it has not been checked yet: the loader calls it for the next shard it
    /// will copy, so that the disk reads that shard while this one is copied. Best effort, and
    /// it does not wait for the reads.
    pub(super) fn prefetch(&self, shard: usize, file: &std::fs::File) {
        if self.lock().contains_key(&shard) {
            return;
        }
        let work = self.unverified(shard);
        if let Some(range) = self.stored_range(shard, &work) {
            use std::os::fd::AsRawFd;
            // SAFETY: a plain advice on an open descriptor; nothing is read into our memory.
            unsafe {
                libc::posix_fadvise(
                    file.as_raw_fd(),
                    range.start as libc::off_t,
                    (range.end - range.start) as libc::off_t,
                    libc::POSIX_FADV_WILLNEED,
                )
            };
        }
    }

    /// The blocks (field, block) of the stream's fields in shard `shard` that the dataset has not
    /// verified yet.
    fn unverified(&self, shard: usize) -> Vec<(usize, u32)> {
        let meta = &self.dataset.shards[shard];
        let mut work = Vec::new();
        for &field in &self.fields {
            for block in 0..meta.metadata.field_blocks(field).len() as u32 {
                if !self.dataset.verified.contains(shard, field, block) {
                    work.push((field, block));
                }
            }
        }
        work
    }

    /// The stored bytes of shard `shard` from the first of `blocks` (field, block) to the end of
    /// the last, in file order; `None` when there are none.
    fn stored_range(&self, shard: usize, blocks: &[(usize, u32)]) -> Option<Range<u64>> {
        let meta = &self.dataset.shards[shard];
        blocks
            .iter()
            .map(|&(field, block)| {
                let entry = &meta.metadata.field_blocks(field)[block as usize];
                entry.stored_offset..entry.stored_offset + entry.stored_bytes as u64
            })
            .reduce(|a, b| a.start.min(b.start)..a.end.max(b.end))
    }

    /// Checks one block from `map`; records it verified, or returns it corrupt.
    fn check(
        &self,
        shard: usize,
        field: usize,
        block: u32,
        map: Result<&MappedFile, &std::io::Error>,
    ) -> Option<FoundCorrupt> {
        let meta = &self.dataset.shards[shard];
        let entry = &meta.metadata.field_blocks(field)[block as usize];
        let stored = entry.stored_offset..entry.stored_offset + entry.stored_bytes as u64;
        let key = BlockKey {
            shard: shard as u32,
            field: field as u32,
            block,
        };
        let checked = match map {
            Err(error) => Err(Arc::new(CorruptBlock::from(decode::BlockError::Io {
                at: decode::BlockRef {
                    shard: meta.path.clone(),
                    field: meta.metadata.fields[field].name.clone(),
                    block,
                    stored_offset: entry.stored_offset,
                },
                source: std::io::Error::other(format!("the shard could not be mapped: {error}")),
            }))),
            Ok(map) => check_in_map(&self.dataset, Some(map), key),
        };
        match checked {
            Ok(()) => {
                self.dataset.verified.insert(shard, field, block);
                None
            }
            Err(bad) => Some(FoundCorrupt { bad, stored }),
        }
    }

    /// The corrupt blocks found in shard `shard` (none when it was not checked or is sound).
    pub(super) fn corrupt_in(&self, shard: usize) -> Vec<FoundCorrupt> {
        self.lock().get(&shard).cloned().unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<usize, Vec<FoundCorrupt>>> {
        self.found.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The rows of a one-batch round whose pieces (the encoded piece table `table`) read any of `bad`
/// (the corrupt blocks of shard `shard`, whose windows of `window_bytes` are regions
/// `first_region ..` of the stream's table), given the batch's `fields` and `rows`: sorted, each
/// once.
pub(super) fn rows_reading(
    table: &[u8],
    shard_regions: Range<usize>,
    window_bytes: u64,
    bad: &[FoundCorrupt],
    fields: &[FieldPlan],
    rows: usize,
) -> Vec<usize> {
    let mut found = Vec::new();
    for piece in table.chunks_exact(GATHER_PIECE_BYTES) {
        let word = |at: usize, n: usize| {
            let mut b = [0u8; 8];
            b[..n].copy_from_slice(&piece[at..at + n]);
            u64::from_le_bytes(b)
        };
        let Some(region) = (word(20, 2) as usize).checked_sub(GATHER_SOURCES_MAX) else {
            continue;
        };
        if !shard_regions.contains(&region) {
            continue;
        }
        let op = GatherOp::ALL[piece[22] as usize];
        let start = (region - shard_regions.start) as u64 * window_bytes + word(0, 8);
        let end = start + word(16, 4) * op.in_bytes();
        if !bad
            .iter()
            .any(|b| b.stored.start < end && start < b.stored.end)
        {
            continue;
        }
        // A piece may cover several rows (merged): each row whose own bytes overlap a bad block.
        let dst = word(8, 8) as usize;
        let out_end = dst + word(16, 4) as usize * op.out_bytes() as usize;
        let Some(field) = fields.iter().find(|field| {
            (field.offset..field.offset + rows * field.sample_bytes_out).contains(&dst)
        }) else {
            continue;
        };
        let row_bytes = field.sample_bytes_out.max(1);
        let (first, last) = (
            (dst - field.offset) / row_bytes,
            (out_end - 1 - field.offset) / row_bytes,
        );
        for row in first..=last.min(rows.saturating_sub(1)) {
            let row_out = (field.offset + row * row_bytes).max(dst)
                ..(field.offset + (row + 1) * row_bytes).min(out_end);
            let to_in = |out: usize| start + ((out - dst) as u64 / op.out_bytes()) * op.in_bytes();
            let (from, to) = (to_in(row_out.start), to_in(row_out.end));
            if bad
                .iter()
                .any(|b| b.stored.start < to && from < b.stored.end)
            {
                found.push(row);
            }
        }
    }
    found.sort_unstable();
    found.dedup();
    found
}

/// Checks one block's stored bytes in its shard's map (`None`: the shard could not be mapped)
/// against its table checksum.
pub(super) fn check_in_map(
    dataset: &Dataset,
    map: Option<&MappedFile>,
    key: BlockKey,
) -> Result<(), Arc<CorruptBlock>> {
    let shard = &dataset.shards[key.shard as usize];
    let entry = shard.metadata.field_blocks(key.field as usize)[key.block as usize];
    let at = || decode::BlockRef {
        shard: shard.path.clone(),
        field: shard.metadata.fields[key.field as usize].name.clone(),
        block: key.block,
        stored_offset: entry.stored_offset,
    };
    let start = entry.stored_offset as usize;
    let end = start + entry.stored_bytes as usize;
    let stored = map.and_then(|map| map.bytes().get(start..end));
    let Some(stored) = stored else {
        let error = decode::BlockError::Io {
            at: at(),
            source: std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the block lies beyond the end of its shard file",
            ),
        };
        return Err(Arc::new(CorruptBlock::from(error)));
    };
    let checked = decode::check_block(stored, &entry, at);
    // A read that reached past the end of a shard truncated meanwhile read zeros: the block is not
    // verified, whatever its checksum said.
    if map.is_some_and(MappedFile::faulted) {
        let error = decode::BlockError::Io {
            at: at(),
            source: std::io::Error::other("the shard was truncated while it was verified"),
        };
        return Err(Arc::new(CorruptBlock::from(error)));
    }
    checked.map_err(|e| Arc::new(CorruptBlock::from(e)))
}
