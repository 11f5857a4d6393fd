//! Batch assembly on the GPU backend: blocks are read into device memory (page-cache DMA, the io_uring
//! bounce path or cuFile, per [`GpuReader`]), LZ4 blocks are decoded by the LZ4 kernel into a device
//! block cache, and the gather kernel converts every sample of the batch, in the stream's order, into
//! the slot, which is exportable device memory that the consumer maps.
//!
//! A batch is built in one or more *rounds*. A round reads the blocks its rows need into the staging
//! buffer (raw blocks) or decodes them into the block cache (LZ4 blocks, kept for later batches), then
//! gathers its rows into the slot. Rows join a round until the staging buffer, the cache, the shuffle
//! scratch or the gather table would overflow; the next rows go to the next round. So every size is
//! fixed at stream open, whatever the batch size or the order, and nothing is allocated per batch.
//!
//! Ordering: all device work of a stream runs on its compute stream, except the reads, which
//! [`GpuReader::read`] completes before it returns. A round starts by waiting for the previous round's
//! work (the staging buffer and the tables are reused), and the first write into a slot waits on the
//! slot's `released` event, which the consumer recorded on its own stream when it released the slot.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use gpufeed_client::protocol::CorruptPolicy;

use super::assemble::{BlockKey, FillError, FillReport, Placement, StreamPlan};
use crate::decode::BlockRef;
use crate::device::{
    fill_async, DeviceBuffer, DeviceError, DeviceMemory, Event, ExportableBuffer, Stream,
};
use crate::format::{BlockEntry, Codec, Filter};
use crate::kernels::{
    GatherOp, GatherOutcome, GatherPlan, Kernels, Lz4Job, Lz4Outcome, Lz4Status, Xxh3Job,
    Xxh3Outcome, Xxh3Status, GATHER_OUTCOME_BYTES, GATHER_PIECE_BYTES, LZ4_JOB_BYTES,
    LZ4_OUTCOME_BYTES, XXH3_JOB_BYTES, XXH3_OUTCOME_BYTES,
};
use crate::metrics::{Metrics, ReadPath as MetricsPath};
use crate::storage::gpu::{DeviceExtent, GpuReader, PathChoice, ReadPath};
use crate::storage::{DirectIo, FileId, FileTable, IO_ALIGN_BYTES};

/// Device memory of one GPU stream, all allocated when the stream opens.
#[derive(Clone, Copy, Debug)]
pub struct GpuStreamLimits {
    /// Stored blocks read in one round.
    pub staging_bytes: usize,
    /// Decoded LZ4 blocks kept on the device (the block cache).
    pub cache_bytes: usize,
    /// Room for byte-shuffled blocks to be decoded before they are unshuffled, per round.
    pub scratch_bytes: usize,
    /// Gather pieces per round.
    pub pieces_max: usize,
}

impl GpuStreamLimits {
    /// Defaults for a GPU node: 64 MiB staging, a 256 MiB block cache, 16 MiB of shuffle scratch and
    /// 64 Ki gather pieces (2 MiB of table) per round.
    pub fn node_defaults() -> GpuStreamLimits {
        GpuStreamLimits {
            staging_bytes: 64 << 20,
            cache_bytes: 256 << 20,
            scratch_bytes: 16 << 20,
            pieces_max: 64 << 10,
        }
    }
}

/// Wall time spent in each phase of filling slots (host view: each phase ends with the work it
/// queued done).
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuFillTimings {
    /// Planning rounds on the host.
    pub plan_s: f64,
    /// Reads into staging (their copies complete).
    pub read_s: f64,
    /// Checksum verification and LZ4 decoding.
    pub decode_s: f64,
    /// Gather tables, the gather kernel and its outcome.
    pub gather_s: f64,
    /// Rounds run.
    pub rounds: u64,
}

/// A decoded LZ4 block in the cache, or the reason a block is unusable.
#[derive(Clone)]
enum CacheEntry {
    /// In cache entry `index`; `stamp` is the round that last used it.
    Decoded { index: u32, stamp: u64 },
    /// Corrupt or unreadable; the message names shard, field and block.
    Corrupt(Arc<String>),
}

/// Where a block's bytes are for the gather of the current round.
#[derive(Clone, Copy)]
enum Source {
    /// Decoded, at this offset of the cache buffer.
    Cache(u64),
    /// Raw, at this offset of the staging buffer.
    Staging(u64),
}

/// The blocks a round reads, and where each goes.
#[derive(Default)]
struct Round {
    /// Raw blocks read into staging this round, and where.
    staged: HashMap<BlockKey, u64>,
    /// LZ4 blocks to read and decode this round: key, staging offset, cache entry, scratch offset.
    decode: Vec<(BlockKey, u64, u32, Option<u64>)>,
    /// The keys of `decode`.
    decoding: HashSet<BlockKey>,
    /// Cached blocks that rows of this round use (they must not be evicted by it).
    pinned: usize,
    staging_used: u64,
    scratch_used: u64,
    pieces: usize,
    /// First row and one past the last row of the batch in this round.
    rows: std::ops::Range<usize>,
}

/// Fills device slots: reads, verifies and decodes blocks on the device and gathers each batch.
pub struct GpuAssembler {
    plan: Arc<StreamPlan>,
    kernels: Arc<Kernels>,
    reader: GpuReader,
    choice: PathChoice,
    files: FileTable,
    stream: Stream,
    staging: DeviceBuffer,
    /// The block cache (`cache_entries` entries of `entry_bytes`), then the shuffle scratch.
    cache: DeviceBuffer,
    entry_bytes: u64,
    cache_entries: u32,
    scratch_offset: u64,
    scratch_bytes: u64,
    lz4_jobs: DeviceBuffer,
    lz4_outcomes: DeviceBuffer,
    xxh3_jobs: DeviceBuffer,
    xxh3_outcomes: DeviceBuffer,
    /// Raw blocks whose checksum this stream has verified (LZ4 blocks are verified when they are
    /// decoded into the cache, which keeps them).
    verified: HashSet<BlockKey>,
    /// Where the fill time went, for benchmarks.
    pub timings: GpuFillTimings,
    pieces: DeviceBuffer,
    pieces_max: usize,
    gather_outcome: DeviceBuffer,
    blocks: HashMap<BlockKey, CacheEntry>,
    /// The decoded blocks by (last round used, key): the least recently used first.
    lru: BTreeSet<(u64, BlockKey)>,
    free_entries: Vec<u32>,
    round_stamp: u64,
    metrics: Arc<Metrics>,
}

/// Largest staged size of any block of the stream's fields (stored bytes rounded up to whole pages)
/// and largest decoded size, over the whole dataset.
fn block_sizes_max(plan: &StreamPlan) -> (u64, u64) {
    let align = IO_ALIGN_BYTES;
    let mut staged = align;
    let mut raw = align;
    for shard in &plan.dataset.shards {
        for field in &plan.fields {
            for block in shard.metadata.field_blocks(field.field_index) {
                staged = staged.max((block.stored_bytes as u64).div_ceil(align) * align);
                raw = raw.max(block.raw_bytes as u64);
            }
        }
    }
    (staged, raw.div_ceil(16) * 16)
}

impl GpuAssembler {
    /// Opens the dataset's shards and allocates the stream's device memory on `reader`'s device.
    pub fn new(
        plan: Arc<StreamPlan>,
        kernels: Arc<Kernels>,
        reader: GpuReader,
        choice: PathChoice,
        limits: &GpuStreamLimits,
        metrics: Arc<Metrics>,
    ) -> Result<GpuAssembler, FillError> {
        let device = reader.stream().device().clone();
        let mut files = FileTable::new(plan.dataset.shards.len());
        for shard in &plan.dataset.shards {
            files.open(&shard.path, DirectIo::Prefer)?;
        }
        let (staged_max, raw_max) = block_sizes_max(&plan);
        let device_error = |e: DeviceError| FillError::Device(e.to_string());
        let staging_bytes = (limits.staging_bytes as u64).max(staged_max);
        let cache_entries = (limits.cache_bytes as u64 / raw_max).clamp(1, u32::MAX as u64) as u32;
        let scratch_bytes = (limits.scratch_bytes as u64).max(raw_max);
        let scratch_offset = cache_entries as u64 * raw_max;
        let stream = Stream::new(&device).map_err(device_error)?;
        let staging = DeviceBuffer::new(&device, staging_bytes as usize).map_err(device_error)?;
        let cache = DeviceBuffer::new(&device, (scratch_offset + scratch_bytes) as usize)
            .map_err(device_error)?;
        // At most one LZ4 job per staged page: a bound on the jobs of one round.
        let jobs_max = (staging_bytes / IO_ALIGN_BYTES) as usize;
        let lz4_jobs =
            DeviceBuffer::new(&device, jobs_max * LZ4_JOB_BYTES).map_err(device_error)?;
        let lz4_outcomes =
            DeviceBuffer::new(&device, jobs_max * LZ4_OUTCOME_BYTES).map_err(device_error)?;
        let xxh3_jobs =
            DeviceBuffer::new(&device, jobs_max * XXH3_JOB_BYTES).map_err(device_error)?;
        let xxh3_outcomes =
            DeviceBuffer::new(&device, jobs_max * XXH3_OUTCOME_BYTES).map_err(device_error)?;
        let pieces_max = limits.pieces_max.max(1);
        let pieces =
            DeviceBuffer::new(&device, pieces_max * GATHER_PIECE_BYTES).map_err(device_error)?;
        let gather_outcome =
            DeviceBuffer::new(&device, GATHER_OUTCOME_BYTES).map_err(device_error)?;
        Ok(GpuAssembler {
            kernels,
            reader,
            choice,
            files,
            stream,
            staging,
            cache,
            entry_bytes: raw_max,
            cache_entries,
            scratch_offset,
            scratch_bytes,
            lz4_jobs,
            lz4_outcomes,
            xxh3_jobs,
            xxh3_outcomes,
            verified: HashSet::new(),
            timings: GpuFillTimings::default(),
            pieces,
            pieces_max,
            gather_outcome,
            blocks: HashMap::new(),
            lru: BTreeSet::new(),
            free_entries: (0..cache_entries).rev().collect(),
            round_stamp: 0,
            metrics,
            plan,
        })
    }

    /// The stream the batch work runs on: record a slot's ready event here after [`Self::fill`].
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Why cold reads take the path they take (for the log).
    pub fn cold_path_reason(&self) -> &str {
        &self.reader.cold_path_reason
    }

    /// Device memory this stream holds besides its slots, in bytes.
    pub fn device_bytes(&self) -> u64 {
        (self.staging.len()
            + self.cache.len()
            + self.lz4_jobs.len()
            + self.lz4_outcomes.len()
            + self.xxh3_jobs.len()
            + self.xxh3_outcomes.len()
            + self.pieces.len()
            + self.gather_outcome.len()) as u64
    }

    fn entry(&self, key: &BlockKey) -> &BlockEntry {
        &self.plan.dataset.shards[key.shard as usize]
            .metadata
            .field_blocks(key.field as usize)[key.block as usize]
    }

    fn block_ref(&self, key: &BlockKey) -> BlockRef {
        let shard = &self.plan.dataset.shards[key.shard as usize];
        BlockRef {
            shard: shard.path.clone(),
            field: shard.metadata.fields[key.field as usize].name.clone(),
            block: key.block,
            stored_offset: self.entry(key).stored_offset,
        }
    }

    /// Queues stream step `step` into `slot`. The slot's previous contents may still be read by the
    /// consumer until `released` completes: the first write waits for it on the device. The batch is
    /// complete once the work queued on [`Self::stream`] is.
    pub fn fill(
        &mut self,
        step: u64,
        slot: &ExportableBuffer,
        released: &Event,
    ) -> Result<FillReport, FillError> {
        assert!(slot.len() >= self.plan.slot_bytes);
        let plan = Arc::clone(&self.plan);
        let field_count = plan.fields.len();
        let placements = plan.placements(step);
        let rows = placements.len() / field_count;
        let device_error = |e: DeviceError| FillError::Device(e.to_string());
        self.stream.wait(released).map_err(device_error)?;
        let mut replaced = 0u32;
        let mut row = 0usize;
        while row < rows {
            let planned = Instant::now();
            let round = self.plan_round(&placements, row, rows)?;
            self.timings.plan_s += planned.elapsed().as_secs_f64();
            self.timings.rounds += 1;
            row = round.rows.end;
            replaced += self.run_round(&placements, round, slot)?;
        }
        Ok(FillReport {
            samples: rows as u32,
            replaced,
        })
    }

    /// Chooses the rows of the next round, starting at `first`, and where their blocks go.
    fn plan_round(
        &mut self,
        placements: &[Placement],
        first: usize,
        rows: usize,
    ) -> Result<Round, FillError> {
        self.round_stamp += 1;
        let stamp = self.round_stamp;
        let plan = Arc::clone(&self.plan);
        let fields = &plan.fields;
        let mut round = Round {
            rows: first..first,
            ..Round::default()
        };
        for row in first..rows {
            // What this row adds to the round, checked before anything is committed.
            let mut new_staged: Vec<(BlockKey, u64)> = Vec::new();
            let mut new_decoded: Vec<(BlockKey, u64, Option<u64>)> = Vec::new();
            let mut new_pins: Vec<(BlockKey, u64)> = Vec::new();
            let mut staging = round.staging_used;
            let mut scratch = round.scratch_used;
            let mut pieces = 0usize;
            for (field, placement) in fields.iter().zip(&placements[row * fields.len()..]) {
                // GatherPlan::push splits a run at GATHER_PIECE_OUT_BYTES_MAX output bytes, so a
                // sample takes at most one piece per block plus one per such span.
                pieces += placement.blocks.len()
                    + (field.sample_bytes_out as u64)
                        .div_ceil(crate::kernels::GATHER_PIECE_OUT_BYTES_MAX)
                        as usize;
                for block in placement.blocks.clone() {
                    let key = BlockKey {
                        shard: placement.shard as u32,
                        field: field.field_index as u32,
                        block,
                    };
                    let entry = *self.entry(&key);
                    let staged_len =
                        (entry.stored_bytes as u64).div_ceil(IO_ALIGN_BYTES) * IO_ALIGN_BYTES;
                    match (entry.codec, self.blocks.get(&key)) {
                        (Codec::Raw, _) => {
                            if !round.staged.contains_key(&key)
                                && !new_staged.iter().any(|(k, _)| *k == key)
                            {
                                new_staged.push((key, staging));
                                staging += staged_len;
                            }
                        }
                        (Codec::Lz4, Some(CacheEntry::Decoded { stamp: used, .. })) => {
                            if *used != stamp && !new_pins.iter().any(|(k, _)| *k == key) {
                                new_pins.push((key, *used));
                            }
                        }
                        (Codec::Lz4, Some(CacheEntry::Corrupt(_))) => {}
                        (Codec::Lz4, None) => {
                            if !round.decoding.contains(&key)
                                && !new_decoded.iter().any(|(k, ..)| *k == key)
                            {
                                let shuffled = entry.filter == Filter::ByteShuffle
                                    && field.stored.size_bytes() > 1;
                                let scratch_at = shuffled.then(|| {
                                    let at = self.scratch_offset + scratch;
                                    scratch += (entry.raw_bytes as u64).div_ceil(16) * 16;
                                    at
                                });
                                new_decoded.push((key, staging, scratch_at));
                                staging += staged_len;
                            }
                        }
                    }
                }
            }
            let entries_needed =
                round.decode.len() + new_decoded.len() + round.pinned + new_pins.len();
            let fits = staging <= self.staging.len() as u64
                && scratch <= self.scratch_bytes
                && round.pieces + pieces <= self.pieces_max
                && entries_needed <= self.cache_entries as usize;
            if !fits {
                if round.rows.is_empty() {
                    return Err(FillError::Device(format!(
                        "sample {row} of the batch needs more device memory than one round has \
                         (staging {} bytes, scratch {} bytes, {} gather pieces, {} cache entries of \
                         {} bytes): raise the GPU stream limits",
                        self.staging.len(),
                        self.scratch_bytes,
                        self.pieces_max,
                        self.cache_entries,
                        self.entry_bytes
                    )));
                }
                break;
            }
            // Commit the row: its cached blocks become the round's (not evictable by it).
            for (key, used) in new_pins {
                self.lru.remove(&(used, key));
                self.lru.insert((stamp, key));
                if let Some(CacheEntry::Decoded { stamp: s, .. }) = self.blocks.get_mut(&key) {
                    *s = stamp;
                }
                round.pinned += 1;
            }
            for (key, at) in new_staged {
                round.staged.insert(key, at);
            }
            for (key, at, scratch_at) in new_decoded {
                let index = self.take_entry(stamp);
                round.decoding.insert(key);
                round.decode.push((key, at, index, scratch_at));
            }
            round.staging_used = staging;
            round.scratch_used = scratch;
            round.pieces += pieces;
            round.rows.end = row + 1;
        }
        Ok(round)
    }

    /// A cache entry for a new block of round `stamp`: a free one, else the least recently used one
    /// that the round does not use.
    fn take_entry(&mut self, stamp: u64) -> u32 {
        if let Some(index) = self.free_entries.pop() {
            return index;
        }
        let &(used, key) = self
            .lru
            .first()
            .expect("plan_round checked that an entry can be evicted");
        assert!(
            used != stamp,
            "plan_round checked that an entry can be evicted"
        );
        self.lru.remove(&(used, key));
        match self.blocks.remove(&key) {
            Some(CacheEntry::Decoded { index, .. }) => index,
            _ => unreachable!("the LRU lists decoded blocks only"),
        }
    }

    /// Reads, decodes and gathers one round; returns the rows replaced because of corrupt blocks.
    fn run_round(
        &mut self,
        placements: &[Placement],
        round: Round,
        slot: &ExportableBuffer,
    ) -> Result<u32, FillError> {
        let device_error = |e: DeviceError| FillError::Device(e.to_string());
        // The previous round's decode and gather read the staging buffer and the tables.
        self.stream.synchronize().map_err(device_error)?;
        let stamp = self.round_stamp;

        // 1. Read every block of the round into staging, merging blocks adjacent in a file.
        let mut reads: Vec<(BlockKey, u64)> =
            round.staged.iter().map(|(k, &at)| (*k, at)).collect();
        reads.extend(round.decode.iter().map(|&(key, at, ..)| (key, at)));
        reads.sort_unstable_by_key(|&(key, at)| (key.shard, self.entry(&key).stored_offset, at));
        let mut extents: Vec<DeviceExtent> = Vec::with_capacity(reads.len());
        let mut extent_of: Vec<usize> = Vec::with_capacity(reads.len());
        for &(key, at) in &reads {
            let entry = self.entry(&key);
            let len = (entry.stored_bytes as usize).div_ceil(IO_ALIGN_BYTES as usize)
                * IO_ALIGN_BYTES as usize;
            match extents.last_mut() {
                Some(last)
                    if last.file == FileId(key.shard)
                        && last.offset + last.len as u64 == entry.stored_offset
                        && last.dest_offset + last.len == at as usize =>
                {
                    last.len += len;
                }
                _ => extents.push(DeviceExtent {
                    file: FileId(key.shard),
                    offset: entry.stored_offset,
                    len,
                    dest_offset: at as usize,
                }),
            }
            extent_of.push(extents.len() - 1);
        }
        let read_started = Instant::now();
        let results = self
            .reader
            .read(&self.files, &extents, &self.staging, self.choice)
            .map_err(|e| FillError::Device(e.to_string()))?;
        self.timings.read_s += read_started.elapsed().as_secs_f64();
        let mut unreadable: HashMap<BlockKey, String> = HashMap::new();
        for ((key, _), &extent) in reads.iter().zip(&extent_of) {
            match &results[extent] {
                Ok(path) => {
                    let metrics_path = match path {
                        ReadPath::PageCache => MetricsPath::PageCache,
                        ReadPath::Bounce => MetricsPath::Uring,
                        ReadPath::CuFile => MetricsPath::CuFile,
                    };
                    self.metrics
                        .add_read_bytes(metrics_path, self.entry(key).stored_bytes as u64);
                }
                Err(error) => {
                    unreadable.insert(*key, format!("{}: {error}", self.block_ref(key)));
                }
            }
        }

        // 2. Verify the checksums of the blocks read for the first time, and decode the LZ4 blocks
        //    into their cache entries, in one pass on the stream: a block is usable only if both
        //    succeed (decoding a corrupt block is harmless: the decoder checks every access).
        let decode_started = Instant::now();
        let mut checks: Vec<Xxh3Job> = Vec::new();
        let mut check_keys: Vec<BlockKey> = Vec::new();
        for &(key, at) in &reads {
            let first_time = match self.entry(&key).codec {
                Codec::Raw => !self.verified.contains(&key),
                Codec::Lz4 => true,
            };
            if first_time && !unreadable.contains_key(&key) {
                checks.push(Xxh3Job::for_block(self.entry(&key), at));
                check_keys.push(key);
            }
        }
        let mut jobs: Vec<Lz4Job> = Vec::with_capacity(round.decode.len());
        let mut job_keys: Vec<(BlockKey, u32)> = Vec::with_capacity(round.decode.len());
        for &(key, at, index, scratch_at) in &round.decode {
            if unreadable.contains_key(&key) {
                continue;
            }
            let entry = *self.entry(&key);
            let element_bytes = self.plan.dataset.manifest.fields[key.field as usize]
                .dtype
                .size_bytes() as u32;
            let job = Lz4Job::for_block(
                &entry,
                element_bytes,
                at,
                index as u64 * self.entry_bytes,
                scratch_at.unwrap_or(0),
            )
            .expect("only LZ4 blocks are decoded");
            jobs.push(job);
            job_keys.push((key, index));
        }
        if !checks.is_empty() {
            self.xxh3_jobs
                .write(0, &Xxh3Job::encode_all(&checks))
                .map_err(device_error)?;
            // SAFETY: the tables and the staging buffer are this assembler's and are not touched
            // until the stream is synchronised below.
            unsafe {
                self.kernels.xxh3.verify_async(
                    &self.stream,
                    &self.xxh3_jobs,
                    checks.len() as u32,
                    &self.staging,
                    &self.xxh3_outcomes,
                )
            }
            .map_err(device_error)?;
        }
        if !jobs.is_empty() {
            let table = Lz4Job::encode_all(&jobs);
            self.lz4_jobs.write(0, &table).map_err(device_error)?;
            // SAFETY: the tables and buffers are owned by this assembler and not touched until the
            // stream is synchronised below; staging and cache are different allocations.
            unsafe {
                self.kernels.lz4.decode_async(
                    &self.stream,
                    &self.lz4_jobs,
                    jobs.len() as u32,
                    &self.staging,
                    &self.cache,
                    &self.lz4_outcomes,
                )
            }
            .map_err(device_error)?;
        }
        let mut outcomes: Vec<Lz4Outcome> = Vec::new();
        if !checks.is_empty() || !jobs.is_empty() {
            self.stream.synchronize().map_err(device_error)?;
        }
        if !checks.is_empty() {
            let mut bytes = vec![0u8; checks.len() * XXH3_OUTCOME_BYTES];
            self.xxh3_outcomes
                .read(0, &mut bytes)
                .map_err(device_error)?;
            for ((key, job), outcome) in check_keys
                .iter()
                .zip(&checks)
                .zip(Xxh3Outcome::decode_all(&bytes))
            {
                if outcome.status == Xxh3Status::Ok {
                    if self.entry(key).codec == Codec::Raw {
                        self.verified.insert(*key);
                    }
                } else {
                    unreadable.insert(
                        *key,
                        format!(
                            "{}: checksum mismatch (table says {:016x}, payload hashes to {:016x})",
                            self.block_ref(key),
                            job.expected,
                            outcome.hash
                        ),
                    );
                }
            }
        }
        if !jobs.is_empty() {
            let mut bytes = vec![0u8; jobs.len() * LZ4_OUTCOME_BYTES];
            self.lz4_outcomes
                .read(0, &mut bytes)
                .map_err(device_error)?;
            outcomes = Lz4Outcome::decode_all(&bytes);
        }
        let mut corrupt_blocks = 0u64;
        for ((key, index), outcome) in job_keys.iter().zip(&outcomes) {
            if unreadable.contains_key(key) {
                // The checksum failed: handled with the unreadable blocks below.
                continue;
            }
            let cached = if outcome.status == Lz4Status::Ok {
                self.lru.insert((stamp, *key));
                CacheEntry::Decoded {
                    index: *index,
                    stamp,
                }
            } else {
                corrupt_blocks += 1;
                self.free_entries.push(*index);
                CacheEntry::Corrupt(Arc::new(format!(
                    "{}: LZ4 block does not decode ({:?} after {} bytes)",
                    self.block_ref(key),
                    outcome.status,
                    outcome.produced
                )))
            };
            self.blocks.insert(*key, cached);
        }
        for &(key, _, index, _) in &round.decode {
            if let Some(message) = unreadable.get(&key) {
                corrupt_blocks += 1;
                self.free_entries.push(index);
                self.blocks
                    .insert(key, CacheEntry::Corrupt(Arc::new(message.clone())));
            }
        }
        self.metrics.add_corrupt_blocks(corrupt_blocks);
        self.metrics.add_decode_time(decode_started.elapsed());
        self.timings.decode_s += decode_started.elapsed().as_secs_f64();

        // 3. Gather the round's rows into the slot.
        let gather_started = Instant::now();
        let stream_plan = Arc::clone(&self.plan);
        let fields = &stream_plan.fields;
        let mut plan = GatherPlan::new();
        let mut corrupt_rows: Vec<usize> = Vec::new();
        for row in round.rows.clone() {
            let row_placements = &placements[row * fields.len()..(row + 1) * fields.len()];
            let mut row_pieces = GatherPlan::new();
            let mut corrupt: Option<String> = None;
            'fields: for (field, placement) in fields.iter().zip(row_placements) {
                let op = GatherOp::for_dtypes(field.stored, field.out)
                    .expect("conversions are validated when the stream is planned");
                let in_bytes = op.in_bytes();
                let mut out_at = (field.offset + row * field.sample_bytes_out) as u64;
                for block in placement.blocks.clone() {
                    let key = BlockKey {
                        shard: placement.shard as u32,
                        field: field.field_index as u32,
                        block,
                    };
                    let entry = *self.entry(&key);
                    let source = match (entry.codec, self.blocks.get(&key)) {
                        (Codec::Raw, _) => match unreadable.get(&key) {
                            Some(message) => {
                                corrupt = Some(message.clone());
                                break 'fields;
                            }
                            None => Source::Staging(round.staged[&key]),
                        },
                        (Codec::Lz4, Some(CacheEntry::Decoded { index, .. })) => {
                            Source::Cache(*index as u64 * self.entry_bytes)
                        }
                        (Codec::Lz4, Some(CacheEntry::Corrupt(message))) => {
                            corrupt = Some(message.to_string());
                            break 'fields;
                        }
                        (Codec::Lz4, None) => unreachable!("every LZ4 block of the round is known"),
                    };
                    let from = placement.start.max(entry.raw_offset) - entry.raw_offset;
                    let to = placement.end.min(entry.raw_offset + entry.raw_bytes as u64)
                        - entry.raw_offset;
                    let elements = (to - from) / in_bytes;
                    let (source_index, base) = match source {
                        Source::Cache(base) => (0u16, base),
                        Source::Staging(base) => (1u16, base),
                    };
                    row_pieces.push(source_index, base + from, out_at, elements, op, 1.0);
                    out_at += elements * op.out_bytes();
                }
            }
            match corrupt {
                None => {
                    for piece in row_pieces.pieces() {
                        plan.push_piece(*piece);
                    }
                }
                Some(message) => match self.plan.on_corrupt {
                    CorruptPolicy::Fail => return Err(FillError::Corrupt(message)),
                    CorruptPolicy::Replace => corrupt_rows.push(row),
                },
            }
        }
        let table = plan.encode();
        let count = plan.pieces().len();
        assert!(count <= self.pieces_max, "plan_round bounds the pieces");
        self.pieces.write(0, &table).map_err(device_error)?;
        // SAFETY: the table, the sources and the outcome belong to this assembler and are not
        // rewritten before the next round synchronises the stream; the slot is this filler's (its
        // lease is Filling and the consumer's release event was waited on); the sources do not
        // overlap the slot.
        unsafe {
            self.kernels.gather.gather_async(
                &self.stream,
                &self.pieces,
                count as u32,
                &[&self.cache, &self.staging],
                slot,
                &self.gather_outcome,
            )
        }
        .map_err(device_error)?;
        // The substitute for a corrupt sample is all zeros in every field, as on the CPU backend.
        for &row in &corrupt_rows {
            for field in fields {
                // SAFETY: as for the gather; the range lies in the slot (validated plan).
                unsafe {
                    fill_async(
                        &self.stream,
                        slot,
                        field.offset + row * field.sample_bytes_out,
                        field.sample_bytes_out,
                        0,
                    )
                }
                .map_err(device_error)?;
            }
        }
        if count > 0 {
            self.stream.synchronize().map_err(device_error)?;
            let mut bytes = [0u8; GATHER_OUTCOME_BYTES];
            self.gather_outcome
                .read(0, &mut bytes)
                .map_err(device_error)?;
            let outcome = GatherOutcome::decode(&bytes);
            if outcome.faulted_pieces > 0 {
                return Err(FillError::Device(format!(
                    "the gather kernel refused {} pieces (last {}): a bug in the batch plan",
                    outcome.faulted_pieces,
                    outcome.last_faulted_plus_1 - 1
                )));
            }
        }
        self.metrics.add_gather_time(gather_started.elapsed());
        self.timings.gather_s += gather_started.elapsed().as_secs_f64();
        Ok(corrupt_rows.len() as u32)
    }
}
