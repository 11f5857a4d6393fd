//! Rows read from the disk: a full shuffle of a dataset larger than the memory its page cache may
//! hold (the host's RAM, or the daemon's memory cgroup limit), on either backend.
//!
//! Copying rows from the shards' page-cache maps (the GPU backend's `row_copies`, the CPU backend's
//! rows read in place) is right while the dataset stays cached. Beyond that memory, most rows a batch draws are on the disk: each copy would fault
//! in its page and the kernel's read-around with it (32 times a 2 KiB row), one fault at a time per
//! copy thread, and evict pages another round still wants. Instead, each round's rows are read with
//! io_uring at a deep queue ([`COLD_QUEUE_DEPTH`]), `O_DIRECT` where the file system allows, into an
//! aligned bounce buffer: the 4 KiB pages that hold each row, adjacent and overlapping reads
//! merged. The rows are then copied from there into the round's pinned buffer, and the round goes
//! on as with page-cache copies (one upload, the same gather); on the CPU backend, into a staging
//! buffer the batch's rows are converted from.
//!
//! Blocks are verified as they are first read, not before the stream's first batch (which would
//! read the whole dataset first): a row of a block the dataset has not verified yet is read with
//! its whole block, the block's checksum checked, and the block recorded in the dataset's verified
//! set (shared by every stream and epoch). A block found corrupt ends the stream with an error
//! naming it, or, under the replace policy, its rows are served as zeros and counted in their
//! batch's report, as a block found corrupt when a stream opens.
//!
//! Bounds: the queue's depth, one bounce buffer per stream ([`COLD_BOUNCE_BYTES`], or the largest
//! single read a round needs: a row and the blocks around it), reads merged up to
//! [`COLD_MERGE_BYTES_MAX`].

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use crate::decode;
use crate::format::Dataset;
use crate::pipeline::stream_plan::{BlockKey, CorruptBlock, CorruptPolicy, FillError};
use crate::storage::{
    AlignedBuffer, AnyQueue, DirectIo, EngineLimits, Extent, FileId, FileTable, ReadEngine,
    IO_ALIGN_BYTES,
};

/// One row's bytes (of one field) to copy from a shard into the round's staging buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowCopy {
    pub(crate) shard: u32,
    /// Offset in the shard file.
    pub(crate) file_offset: u64,
    pub(crate) bytes: u32,
    /// Offset in the round's staging buffer.
    pub(crate) staging_offset: u64,
    /// The field (its index in the dataset) whose bytes these are.
    pub(crate) field: u32,
    /// The row of the round (the index its planner zeroes when it replaces it).
    pub(crate) row: u32,
}

/// Reads in flight at once: random reads of a few KiB reach a disk's rate only at a deep queue.
pub(crate) const COLD_QUEUE_DEPTH: usize = 64;

/// Bytes of a stream's bounce buffer: a round's reads are made in parts of at most this many bytes.
pub(crate) const COLD_BOUNCE_BYTES: usize = 64 << 20;

/// Reads of adjacent or overlapping pages are merged into one read of at most this many bytes.
pub(crate) const COLD_MERGE_BYTES_MAX: u64 = 1 << 20;

/// Where a full shuffle beyond the registration budget reads the rows it copies (the
/// `GPUFEED_ROW_READS` variable).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RowReads {
    /// From the disk when the dataset is larger than the memory the daemon may use, from the page
    /// cache otherwise.
    Auto,
    /// Always from the disk ([`ColdRows`]).
    Disk,
    /// Always from the page cache (copies from the shards' maps).
    PageCache,
}

impl RowReads {
    /// The setting of `GPUFEED_ROW_READS` (`auto`, `disk` or `page-cache`); `auto` when unset, and,
    /// with a warning naming it, for an unknown value.
    pub(crate) fn from_env() -> RowReads {
        let value = std::env::var("GPUFEED_ROW_READS").unwrap_or_default();
        match value.as_str() {
            "" | "auto" => RowReads::Auto,
            "disk" => RowReads::Disk,
            "page-cache" => RowReads::PageCache,
            other => {
                tracing::warn!(
                    "GPUFEED_ROW_READS={other:?} is not one of auto, disk, page-cache: auto is used"
                );
                RowReads::Auto
            }
        }
    }

    /// Whether a dataset of `dataset_bytes` is read from the disk, given the memory the daemon
    /// may use (`memory_limit`, `None` when unknown).
    pub(crate) fn reads_disk(self, dataset_bytes: u64, memory_limit: Option<u64>) -> bool {
        match self {
            RowReads::Disk => true,
            RowReads::PageCache => false,
            RowReads::Auto => memory_limit.is_some_and(|limit| dataset_bytes > limit),
        }
    }
}

/// What a stream's disk reads did, for its log line.
#[derive(Default, Debug, Clone, Copy)]
pub(crate) struct ColdStats {
    /// Bytes read from the disk (whole pages, and whole blocks verified).
    pub(crate) read_bytes: u64,
    /// Bytes of rows delivered.
    pub(crate) row_bytes: u64,
    /// Reads submitted (after merging).
    pub(crate) reads: u64,
    /// Blocks verified by this stream.
    pub(crate) blocks_verified: u64,
    /// Seconds spent reading, verifying and copying.
    pub(crate) busy_s: f64,
}

/// One copy's read: pages `start .. end` of shard `shard`, the extent it was merged into.
#[derive(Clone, Copy)]
struct Need {
    shard: u32,
    start: u64,
    end: u64,
    copy: usize,
    extent: usize,
    /// Whether a block the copy reads was not verified yet (then read whole, and checked).
    verify: bool,
}

/// A merged read.
#[derive(Clone, Copy)]
struct Read {
    shard: u32,
    start: u64,
    end: u64,
    /// Offset in the bounce buffer, once the read is placed in a part.
    at: usize,
}

/// The disk reader of one stream's rows (see the module documentation).
pub(crate) struct ColdRows {
    dataset: Arc<Dataset>,
    files: FileTable,
    file_bytes: Vec<u64>,
    engine: ReadEngine<AnyQueue>,
    bounce: AlignedBuffer,
    /// Blocks this stream found corrupt.
    corrupt: HashMap<BlockKey, Arc<CorruptBlock>>,
    policy: CorruptPolicy,
    stats: ColdStats,
}

impl ColdRows {
    /// Opens the dataset's shards for direct reads (buffered where the file system refuses
    /// `O_DIRECT`) and sets up the queue.
    pub(crate) fn open(
        dataset: Arc<Dataset>,
        policy: CorruptPolicy,
    ) -> Result<ColdRows, FillError> {
        let mut files = FileTable::new(dataset.shards.len());
        let mut file_bytes = Vec::with_capacity(dataset.shards.len());
        for shard in &dataset.shards {
            let id = files
                .open(&shard.path, DirectIo::Prefer)
                .map_err(|error| shard_error(&shard.path, error.to_string()))?;
            file_bytes.push(files.get(id).len);
        }
        if let Some(reason) = files_direct_unavailable(&files) {
            tracing::info!("rows are read from the disk through the page cache: {reason}");
        }
        let (queue, fallback) = AnyQueue::best(COLD_QUEUE_DEPTH);
        if let Some(reason) = fallback {
            tracing::info!("rows are read from the disk with pread: {reason}");
        }
        Ok(ColdRows {
            dataset,
            files,
            file_bytes,
            engine: ReadEngine::new(queue, EngineLimits::node_defaults()),
            bounce: AlignedBuffer::new(COLD_BOUNCE_BYTES),
            corrupt: HashMap::new(),
            policy,
            stats: ColdStats::default(),
        })
    }

    /// What this stream's reads did so far.
    pub(crate) fn stats(&self) -> ColdStats {
        self.stats
    }

    /// Reads the rows `copies` name into `dst` at their staging offsets; returns the rows
    /// ([`RowCopy::row`], sorted) whose blocks are corrupt, to be served as zeros. Under the fail
    /// policy a corrupt block is an error naming it instead. A read that fails is an error naming
    /// the shard.
    pub(crate) fn read_round(
        &mut self,
        copies: &[RowCopy],
        dst: &mut [u8],
    ) -> Result<Vec<usize>, FillError> {
        let started = std::time::Instant::now();
        let mut bad_rows = BTreeSet::new();
        let mut needs = self.needs(copies, &mut bad_rows)?;
        let reads = merge(&mut needs);
        // Reads in parts that fit the bounce buffer; `needs` are in the order of `reads`.
        let largest = reads.iter().map(aligned_len).max().unwrap_or(0);
        if largest > self.bounce.len() {
            self.bounce = AlignedBuffer::new(largest);
        }
        let (mut first, mut need_at) = (0usize, 0usize);
        while first < reads.len() {
            let mut part: Vec<Read> = Vec::new();
            let mut used = 0usize;
            while first + part.len() < reads.len() {
                let mut read = reads[first + part.len()];
                let len = aligned_len(&read);
                if !part.is_empty() && used + len > self.bounce.len() {
                    break;
                }
                read.at = used;
                used += len;
                part.push(read);
            }
            self.read_part(&part)?;
            let last = first + part.len();
            let mut end = need_at;
            while end < needs.len() && needs[end].extent < last {
                end += 1;
            }
            self.verify_part(&needs[need_at..end], &part, first, copies, &mut bad_rows)?;
            self.copy_part(&needs[need_at..end], &part, first, copies, &bad_rows, dst)?;
            need_at = end;
            first = last;
        }
        self.stats.busy_s += started.elapsed().as_secs_f64();
        Ok(bad_rows.into_iter().collect())
    }

    /// The pages each copy needs: its own, and those of the blocks it reads that the dataset has
    /// not verified yet. A copy of a block known corrupt needs nothing: its row is added to
    /// `bad_rows` (or, under the fail policy, the block is the error).
    fn needs(
        &self,
        copies: &[RowCopy],
        bad_rows: &mut BTreeSet<usize>,
    ) -> Result<Vec<Need>, FillError> {
        let mut needs = Vec::with_capacity(copies.len());
        for (index, copy) in copies.iter().enumerate() {
            let shard = copy.shard as usize;
            let (start, end) = (copy.file_offset, copy.file_offset + copy.bytes as u64);
            let file_bytes = *self
                .file_bytes
                .get(shard)
                .ok_or_else(|| shard_error(&self.dataset.dir, format!("no shard {shard}")))?;
            if end > file_bytes {
                return Err(shard_error(
                    &self.dataset.shards[shard].path,
                    "a row lies beyond the end of the shard file".into(),
                ));
            }
            let (mut from, mut to) = (start, end);
            let (mut corrupt, mut verify) = (false, false);
            for (block, entry) in blocks_over(&self.dataset, copy, start, end) {
                let key = key(copy, block);
                if let Some(bad) = self.corrupt.get(&key) {
                    if self.policy == CorruptPolicy::Fail {
                        return Err(bad.to_error());
                    }
                    corrupt = true;
                    break;
                }
                if !self
                    .dataset
                    .verified
                    .contains(shard, copy.field as usize, block)
                {
                    from = from.min(entry.stored_offset);
                    to = to.max(entry.stored_offset + entry.stored_bytes as u64);
                    verify = true;
                }
            }
            if corrupt {
                bad_rows.insert(copy.row as usize);
                continue;
            }
            let from = from / IO_ALIGN_BYTES * IO_ALIGN_BYTES;
            let to = to.div_ceil(IO_ALIGN_BYTES) * IO_ALIGN_BYTES;
            needs.push(Need {
                shard: copy.shard,
                start: from,
                end: to.min(file_bytes),
                copy: index,
                extent: 0,
                verify,
            });
        }
        Ok(needs)
    }

    /// Reads `part` into the bounce buffer.
    fn read_part(&mut self, part: &[Read]) -> Result<(), FillError> {
        let extents: Vec<Extent> = part
            .iter()
            .map(|read| Extent {
                file: FileId(read.shard),
                offset: read.start,
                len: (read.end - read.start) as usize,
                dest_offset: read.at,
            })
            .collect();
        let results = self
            .engine
            .read(&self.files, &extents, self.bounce.as_mut_slice())
            .map_err(|error| shard_error(&self.dataset.dir, error.to_string()))?;
        for (read, result) in part.iter().zip(results) {
            if let Err(error) = result {
                return Err(shard_error(
                    &self.dataset.shards[read.shard as usize].path,
                    error.to_string(),
                ));
            }
            self.stats.read_bytes += read.end - read.start;
        }
        self.stats.reads += part.len() as u64;
        Ok(())
    }

    /// Verifies the blocks of `needs` (reads `first ..` of the round, placed as in `part`) that
    /// the dataset has not verified: each lies whole in its need's read.
    fn verify_part(
        &mut self,
        needs: &[Need],
        part: &[Read],
        first: usize,
        copies: &[RowCopy],
        bad_rows: &mut BTreeSet<usize>,
    ) -> Result<(), FillError> {
        let dataset = Arc::clone(&self.dataset);
        // A need whose blocks were all verified has nothing to check (a verified block is never
        // corrupt).
        for need in needs.iter().filter(|need| need.verify) {
            let copy = &copies[need.copy];
            let read = &part[need.extent - first];
            let shard = &dataset.shards[copy.shard as usize];
            let end = copy.file_offset + copy.bytes as u64;
            for (block, entry) in blocks_over(&dataset, copy, copy.file_offset, end) {
                let key = key(copy, block);
                if let Some(bad) = self.corrupt.get(&key) {
                    if self.policy == CorruptPolicy::Fail {
                        return Err(bad.to_error());
                    }
                    bad_rows.insert(copy.row as usize);
                    continue;
                }
                let field = copy.field as usize;
                if dataset.verified.contains(copy.shard as usize, field, block) {
                    continue;
                }
                let at = read.at + (entry.stored_offset - read.start) as usize;
                let stored = &self.bounce.as_slice()[at..at + entry.stored_bytes as usize];
                let checked = decode::check_block(stored, entry, || decode::BlockRef {
                    shard: shard.path.clone(),
                    field: shard.metadata.fields[field].name.clone(),
                    block,
                    stored_offset: entry.stored_offset,
                });
                match checked {
                    Ok(()) => {
                        dataset.verified.insert(copy.shard as usize, field, block);
                        self.stats.blocks_verified += 1;
                    }
                    Err(error) => {
                        let bad = Arc::new(CorruptBlock::from(error));
                        tracing::warn!("{} (found reading rows from the disk)", bad.to_error());
                        if self.policy == CorruptPolicy::Fail {
                            return Err(bad.to_error());
                        }
                        self.corrupt.insert(key, bad);
                        bad_rows.insert(copy.row as usize);
                    }
                }
            }
        }
        Ok(())
    }

    /// Copies the rows of `needs` from the bounce buffer into `dst`, but those of `bad_rows`.
    fn copy_part(
        &mut self,
        needs: &[Need],
        part: &[Read],
        first: usize,
        copies: &[RowCopy],
        bad_rows: &BTreeSet<usize>,
        dst: &mut [u8],
    ) -> Result<(), FillError> {
        for need in needs {
            let copy = &copies[need.copy];
            if bad_rows.contains(&(copy.row as usize)) {
                continue;
            }
            let read = &part[need.extent - first];
            let from = read.at + (copy.file_offset - read.start) as usize;
            let bytes = copy.bytes as usize;
            let to = copy.staging_offset as usize;
            let target = dst.get_mut(to..to + bytes).ok_or_else(|| {
                shard_error(
                    &self.dataset.shards[copy.shard as usize].path,
                    "a row lies beyond the round's staging".into(),
                )
            })?;
            target.copy_from_slice(&self.bounce.as_slice()[from..from + bytes]);
            self.stats.row_bytes += bytes as u64;
        }
        Ok(())
    }
}

/// Sorts `needs` by shard and offset, merges overlapping or adjacent ones into reads of at most
/// [`COLD_MERGE_BYTES_MAX`] (a single need may be longer), and sets each need's read.
fn merge(needs: &mut [Need]) -> Vec<Read> {
    needs.sort_unstable_by_key(|n| (n.shard, n.start, n.end));
    let mut reads: Vec<Read> = Vec::new();
    for need in needs.iter_mut() {
        if let Some(last) = reads.last_mut() {
            let end = last.end.max(need.end);
            if last.shard == need.shard
                && need.start <= last.end
                && (end - last.start <= COLD_MERGE_BYTES_MAX || need.end <= last.end)
            {
                last.end = end;
                need.extent = reads.len() - 1;
                continue;
            }
        }
        need.extent = reads.len();
        reads.push(Read {
            shard: need.shard,
            start: need.start,
            end: need.end,
            at: 0,
        });
    }
    reads
}

/// Bytes a read takes in the bounce buffer: its length rounded up to whole pages, so that the
/// next read starts aligned.
fn aligned_len(read: &Read) -> usize {
    ((read.end - read.start).div_ceil(IO_ALIGN_BYTES) * IO_ALIGN_BYTES) as usize
}

/// The blocks of `copy`'s field in its shard whose stored bytes overlap `start .. end`.
fn blocks_over<'a>(
    dataset: &'a Dataset,
    copy: &RowCopy,
    start: u64,
    end: u64,
) -> impl Iterator<Item = (u32, &'a crate::format::BlockEntry)> + 'a {
    let blocks = dataset.shards[copy.shard as usize]
        .metadata
        .field_blocks(copy.field as usize);
    let first = blocks.partition_point(|b| b.stored_offset + b.stored_bytes as u64 <= start);
    blocks[first..]
        .iter()
        .enumerate()
        .take_while(move |(_, b)| b.stored_offset < end)
        .map(move |(i, b)| ((first + i) as u32, b))
}

fn key(copy: &RowCopy, block: u32) -> BlockKey {
    BlockKey {
        shard: copy.shard,
        field: copy.field,
        block,
    }
}

fn shard_error(path: &std::path::Path, reason: String) -> FillError {
    FillError::RowRead {
        shard: path.to_path_buf(),
        source: Arc::new(std::io::Error::other(reason)),
    }
}

fn files_direct_unavailable(files: &FileTable) -> Option<String> {
    (0..files.len())
        .filter_map(|i| files.get(FileId(i as u32)).direct_unavailable.clone())
        .next()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A packed raw dataset of `samples` rows of 3000 bytes (u8), blocks of 8 KiB, 100 rows a
    /// shard; returns it and the rows' bytes.
    fn dataset(dir: &std::path::Path, samples: usize) -> (Arc<Dataset>, Vec<u8>) {
        let bytes = crate::synth::random_bytes(samples * 3000, 5);
        let field = crate::input::FieldSource::from_bytes(
            "a",
            gpufeed_proto::DType::U8,
            vec![3000],
            bytes.clone(),
        )
        .unwrap();
        let out = dir.join("rows");
        let options = crate::pack::PackOptions {
            name: "rows".into(),
            block_bytes: 8192,
            samples_per_shard: Some(100),
            codec: crate::pack::CodecChoice::Raw,
            shuffle: crate::pack::ShuffleChoice::Auto,
            on_existing: crate::pack::OnExisting::Refuse,
            threads: 1,
        };
        crate::pack::pack(&out, &[field], &options, &crate::pack::Quiet).unwrap();
        (Arc::new(Dataset::open(&out).unwrap()), bytes)
    }

    /// The copies of samples `samples` (one per row of the round, cut at block edges), as the
    /// planner makes them, and each sample's bytes in the order they are placed.
    fn copies_of(dataset: &Dataset, samples: &[usize]) -> Vec<RowCopy> {
        let mut copies = Vec::new();
        let mut used = 0u64;
        for (row, &sample) in samples.iter().enumerate() {
            let shard = sample / 100;
            let blocks = dataset.shards[shard].metadata.field_blocks(0);
            let (start, end) = (
                (sample % 100) as u64 * 3000,
                (sample % 100 + 1) as u64 * 3000,
            );
            for (block, entry) in blocks.iter().enumerate() {
                let (lo, hi) = (entry.raw_offset, entry.raw_offset + entry.raw_bytes as u64);
                if hi <= start || lo >= end {
                    continue;
                }
                let (from, to) = (start.max(lo), end.min(hi));
                let bytes = to - from;
                // Placed 16-byte aligned one after the other, as the planner places them.
                let at = used.div_ceil(16) * 16;
                used = at + bytes;
                copies.push(RowCopy {
                    shard: shard as u32,
                    file_offset: entry.stored_offset + (from - lo),
                    bytes: bytes as u32,
                    staging_offset: at,
                    field: 0,
                    row: row as u32,
                });
                let _ = block;
            }
        }
        copies
    }

    fn assert_rows(copies: &[RowCopy], samples: &[usize], rows: &[u8], dst: &[u8], skip: &[usize]) {
        for copy in copies {
            if skip.contains(&(copy.row as usize)) {
                continue;
            }
            let sample = samples[copy.row as usize];
            let got = &dst[copy.staging_offset as usize..][..copy.bytes as usize];
            let whole = &rows[sample * 3000..(sample + 1) * 3000];
            assert!(
                whole.windows(got.len()).any(|w| w == got),
                "row {} (sample {sample}) holds bytes of another sample",
                copy.row
            );
        }
    }

    /// Rows in a scattered order, crossing blocks, some sharing pages, are read into place, and
    /// every block they touch is verified once, by the first round that reads it.
    #[test]
    fn rows_are_read_from_the_disk_into_place_and_their_blocks_verified() {
        let dir = tempfile::tempdir().unwrap();
        let (dataset, rows) = dataset(dir.path(), 500);
        let mut cold = ColdRows::open(Arc::clone(&dataset), CorruptPolicy::Fail).unwrap();
        let samples: Vec<usize> = (0..200).map(|i| (i * 7919 + 13) % 500).collect();
        let copies = copies_of(&dataset, &samples);
        let mut dst = vec![0u8; 1 << 24];
        let bad = cold.read_round(&copies, &mut dst).unwrap();
        assert!(bad.is_empty());
        assert_rows(&copies, &samples, &rows, &dst, &[]);
        // Whole rows land in order too: the copies of a row are its bytes, one after the other.
        for (row, &sample) in samples.iter().enumerate() {
            let mut got = Vec::new();
            for copy in copies.iter().filter(|c| c.row as usize == row) {
                got.extend_from_slice(&dst[copy.staging_offset as usize..][..copy.bytes as usize]);
            }
            assert_eq!(got, rows[sample * 3000..(sample + 1) * 3000], "row {row}");
        }
        let first = cold.stats();
        assert!(first.blocks_verified > 0);
        assert_eq!(first.row_bytes, 200 * 3000);
        // The same rows again: every block is verified, so only the rows' pages are read.
        dst.fill(0);
        let bad = cold.read_round(&copies, &mut dst).unwrap();
        assert!(bad.is_empty());
        assert_rows(&copies, &samples, &rows, &dst, &[]);
        let second = cold.stats();
        assert_eq!(second.blocks_verified, first.blocks_verified);
        assert!(second.read_bytes - first.read_bytes < first.read_bytes);
        // Another stream of the dataset finds them verified as well.
        let mut other = ColdRows::open(Arc::clone(&dataset), CorruptPolicy::Fail).unwrap();
        other.read_round(&copies, &mut dst).unwrap();
        assert_eq!(other.stats().blocks_verified, 0);
    }

    /// A part of the reads at a time when the round's reads exceed the bounce buffer.
    #[test]
    fn a_round_larger_than_the_bounce_buffer_is_read_in_parts() {
        let dir = tempfile::tempdir().unwrap();
        let (dataset, rows) = dataset(dir.path(), 500);
        let mut cold = ColdRows::open(Arc::clone(&dataset), CorruptPolicy::Fail).unwrap();
        cold.bounce = AlignedBuffer::new(3 * IO_ALIGN_BYTES as usize);
        let samples: Vec<usize> = (0..150).map(|i| (i * 331 + 7) % 500).collect();
        let copies = copies_of(&dataset, &samples);
        let mut dst = vec![0u8; 1 << 24];
        assert!(cold.read_round(&copies, &mut dst).unwrap().is_empty());
        assert_rows(&copies, &samples, &rows, &dst, &[]);
        assert!(cold.stats().reads > 10);
    }

    /// A corrupt block: its rows are zeros to be counted under the replace policy, and the error
    /// names shard, field and block under the fail policy; other rows are served.
    #[test]
    fn a_corrupt_block_found_reading_rows_is_handled_by_the_policy() {
        use std::io::{Seek, SeekFrom, Write};
        let dir = tempfile::tempdir().unwrap();
        let (dataset, rows) = dataset(dir.path(), 300);
        let entry = dataset.shards[1].metadata.field_blocks(0)[3];
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .open(&dataset.shards[1].path)
            .unwrap();
        file.seek(SeekFrom::Start(entry.stored_offset + 10))
            .unwrap();
        let original = rows[100 * 3000 + entry.raw_offset as usize + 10];
        file.write_all(&[0xFF ^ original]).unwrap();
        drop(file);
        // The samples of shard 1 whose bytes lie in block 3, and others.
        let (lo, hi) = (entry.raw_offset, entry.raw_offset + entry.raw_bytes as u64);
        let in_block: Vec<usize> = (100..200)
            .filter(|s| ((s - 100) as u64 * 3000) < hi && ((s - 99) as u64 * 3000) > lo)
            .collect();
        assert!(in_block.len() >= 2, "{in_block:?}");
        let samples = vec![5, in_block[0], 250, in_block[1], 199];
        let copies = copies_of(&dataset, &samples);
        let mut dst = vec![0u8; 1 << 24];
        let mut replace = ColdRows::open(Arc::clone(&dataset), CorruptPolicy::Replace).unwrap();
        let bad = replace.read_round(&copies, &mut dst).unwrap();
        assert_eq!(bad, vec![1, 3]);
        assert_rows(&copies, &samples, &rows, &dst, &bad);
        // Known corrupt now: not read again.
        let read = replace.stats().read_bytes;
        let bad = replace.read_round(&copies[..], &mut dst).unwrap();
        assert_eq!(bad, vec![1, 3]);
        assert!(replace.stats().read_bytes - read < 5 * 8192);
        let mut fail = ColdRows::open(Arc::clone(&dataset), CorruptPolicy::Fail).unwrap();
        let error = fail.read_round(&copies, &mut dst).unwrap_err().to_string();
        assert!(error.contains("block 3"), "{error}");
        assert!(!dataset.verified.contains(1, 0, 3));
    }

    #[test]
    fn reads_merge_when_they_touch_up_to_their_bound() {
        let need = |shard, start, end| Need {
            shard,
            start,
            end,
            copy: 0,
            extent: 0,
            verify: false,
        };
        let mut needs = vec![
            need(1, 0, 4096),
            need(0, 8192, 12288),
            need(0, 4096, 8192),
            need(0, 0, 4096),
            need(0, 20480, 24576),
            need(1, 4096, 4096 + COLD_MERGE_BYTES_MAX),
        ];
        let reads = merge(&mut needs);
        let spans: Vec<_> = reads.iter().map(|r| (r.shard, r.start, r.end)).collect();
        assert_eq!(
            spans,
            vec![
                (0, 0, 12288),
                (0, 20480, 24576),
                (1, 0, 4096),
                (1, 4096, 4096 + COLD_MERGE_BYTES_MAX)
            ]
        );
        let extents: Vec<usize> = needs.iter().map(|n| n.extent).collect();
        assert_eq!(extents, vec![0, 0, 0, 1, 2, 3]);
    }

    #[test]
    fn rows_are_read_from_the_disk_beyond_the_memory_limit_unless_told() {
        assert!(RowReads::Auto.reads_disk(10, Some(9)));
        assert!(!RowReads::Auto.reads_disk(9, Some(9)));
        assert!(!RowReads::Auto.reads_disk(10, None));
        assert!(RowReads::Disk.reads_disk(1, Some(9)));
        assert!(!RowReads::PageCache.reads_disk(10, Some(9)));
    }
}
