//! Batch assembly on the CPU backend: read the blocks a batch needs, decode them, gather and convert
//! each sample into the slot.
//!
//! The same plan ([`StreamPlan`]) drives the GPU backend (`pipeline::gpu`), where reads land in device
//! memory and the kernels decode and gather; only [`Assembler`] is CPU-specific.

use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;

use super::stream_plan::{
    BlockKey, CorruptBlock, CorruptPolicy, CorruptReason, FillError, FillReport, Placement,
    StreamLimits, StreamPlan,
};
use crate::decode::{self, BlockRef};
use crate::format::Codec;
use crate::metrics::{Metrics, ReadPath};
use crate::storage::mapped::MappedFile;
use crate::storage::residency::ResidencyMap;
use crate::storage::{
    AlignedBuffer, AnyQueue, DirectIo, EngineLimits, Extent, FileId, FileTable, ReadEngine,
    StorageError, IO_ALIGN_BYTES,
};

/// Rows ahead of the one being converted whose in-place bytes the CPU backend prefetches.
const PREFETCH_ROWS_AHEAD: usize = 8;

/// A hint to start loading the cache line holding `byte` (nothing on targets without one).
#[inline(always)]
fn prefetch(byte: &u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch only hints the cache; `byte` is a valid reference.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            (byte as *const u8).cast(),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = byte;
}

/// A decoded block, or the reason it could not be decoded.
#[derive(Clone)]
enum CachedBlock {
    Decoded(Arc<Vec<u8>>),
    Corrupt(Arc<CorruptBlock>),
}

/// Fills slots on the CPU: reads blocks with the storage engine, decodes them with the CPU path and
/// gathers samples into the slot in the stream's order.
pub struct Assembler {
    plan: Arc<StreamPlan>,
    files: FileTable,
    engine: ReadEngine<AnyQueue>,
    /// Why io_uring is not used, when it is not.
    pub engine_note: Option<String>,
    cache: HashMap<BlockKey, (u64, CachedBlock)>,
    cache_bytes: usize,
    cache_bytes_max: usize,
    batch_stamp: u64,
    staging: AlignedBuffer,
    scratch: Vec<u8>,
    decode_threads: usize,
    sample: Vec<u8>,
    metrics: Arc<Metrics>,
    read_path: ReadPath,
    /// Read-only maps of the shards, made on first use, for raw blocks read in place, with the
    /// shard's residency map. A shard truncated while mapped reads zeros instead of killing the
    /// daemon (see [`MappedFile`]); `fill` checks the maps it read before it returns the slot.
    maps: Vec<Option<(MappedFile, ResidencyMap)>>,
    /// The shards read in place by the batch being filled, each once (`in_place_stamp` holds the
    /// batch that last added a shard).
    in_place_shards: Vec<u32>,
    in_place_stamp: Vec<u64>,
}

/// Share of a raw block's bytes below which the CPU backend copies a batch's rows straight from the
/// shard's page cache (a memory map) instead of reading and caching the whole block: shuffled orders
/// touch a few rows of many blocks, and reading each block whole per batch multiplies the bytes read.
/// Blocks a batch uses more of are read in place too when their pages are cached (copying from the
/// page cache beats reading the disk again with O_DIRECT); otherwise the read engine reads them.
const IN_PLACE_COVERAGE_MAX: f64 = 0.5;
/// Fraction of a dense block's pages that must be cached for it to be read in place.
const IN_PLACE_RESIDENT_MIN: f64 = 0.95;

impl Assembler {
    /// Opens the dataset's shards and sets up the engine.
    pub fn new(
        plan: Arc<StreamPlan>,
        limits: &StreamLimits,
        metrics: Arc<Metrics>,
    ) -> Result<Assembler, StorageError> {
        let mut files = FileTable::new(plan.dataset.shards.len());
        for shard in &plan.dataset.shards {
            files.open(&shard.path, DirectIo::Prefer)?;
        }
        let plan_shards = plan.dataset.shards.len();
        let (queue, engine_note) = AnyQueue::best(limits.queue_depth);
        let read_path = match queue {
            AnyQueue::Uring(_) => ReadPath::Uring,
            AnyQueue::Pread(_) => ReadPath::Pread,
        };
        metrics.set_read_queue_depth(limits.queue_depth as u64);
        let engine = ReadEngine::new(queue, EngineLimits::node_defaults());
        Ok(Assembler {
            plan,
            files,
            engine,
            engine_note,
            cache: HashMap::new(),
            cache_bytes: 0,
            cache_bytes_max: limits.cache_bytes_max,
            batch_stamp: 0,
            staging: AlignedBuffer::new(1 << 20),
            scratch: Vec::new(),
            decode_threads: limits.decode_threads,
            metrics,
            read_path,
            sample: Vec::new(),
            maps: (0..plan_shards).map(|_| None).collect(),
            in_place_shards: Vec::new(),
            in_place_stamp: vec![0; plan_shards],
        })
    }

    /// Fills `slot` with stream step `step`.
    pub fn fill(&mut self, step: u64, slot: &mut [u8]) -> Result<FillReport, FillError> {
        assert!(slot.len() >= self.plan.slot_bytes);
        self.batch_stamp += 1;
        let plan = Arc::clone(&self.plan);
        // Where every (sample, field) of the batch lives, row by row, located once for both passes.
        let placements = plan.placements(step);
        let sample_count = placements.len() / plan.fields.len();
        // The blocks the batch needs that are not decoded yet; raw blocks the batch uses little of
        // are read in place instead (see IN_PLACE_COVERAGE_MAX).
        let mut missing: Vec<BlockKey> = Vec::new();
        let mut sparse: HashMap<BlockKey, u64> = HashMap::new();
        for (placement, field) in placements.iter().zip(plan.fields.iter().cycle()) {
            for block in placement.blocks.clone() {
                let key = BlockKey {
                    shard: placement.shard as u32,
                    field: field.field_index as u32,
                    block,
                };
                if let Some((stamp, _)) = self.cache.get_mut(&key) {
                    *stamp = self.batch_stamp;
                    continue;
                }
                let entry = self.entry(&key);
                if entry.codec == Codec::Raw {
                    let block_end = entry.raw_offset + entry.raw_bytes as u64;
                    let used = placement.end.min(block_end) - placement.start.max(entry.raw_offset);
                    *sparse.entry(key).or_default() += used;
                } else {
                    missing.push(key);
                }
            }
        }
        self.in_place_shards.clear();
        for (key, used) in sparse {
            let dense = used as f64 >= self.entry(&key).raw_bytes as f64 * IN_PLACE_COVERAGE_MAX;
            if !self.map_in_place(&key, dense)? {
                missing.push(key);
            }
        }
        missing.sort_unstable();
        missing.dedup();
        self.load(&missing)?;

        let gather_started = std::time::Instant::now();
        let mut replaced = 0u32;
        let mut in_place_bytes = 0u64;
        let width = plan.fields.len();
        for (row, row_placements) in placements.chunks_exact(width).enumerate() {
            let ahead = (row + PREFETCH_ROWS_AHEAD) * width;
            if let Some(ahead) = placements.get(ahead..ahead + width) {
                self.prefetch_in_place(ahead);
            }
            let mut corrupt: Option<Arc<CorruptBlock>> = None;
            for (field, placement) in plan.fields.iter().zip(row_placements) {
                let (shard, start, end) = (placement.shard, placement.start, placement.end);
                self.sample.clear();
                for block_index in placement.blocks.clone() {
                    let key = BlockKey {
                        shard: shard as u32,
                        field: field.field_index as u32,
                        block: block_index,
                    };
                    let entry = &self.plan.dataset.shards[shard]
                        .metadata
                        .field_blocks(field.field_index)[block_index as usize];
                    let from = start.max(entry.raw_offset) - entry.raw_offset;
                    let to = end.min(entry.raw_offset + entry.raw_bytes as u64) - entry.raw_offset;
                    match self.cache.get(&key).map(|(_, cached)| cached) {
                        Some(CachedBlock::Decoded(bytes)) => {
                            self.sample
                                .extend_from_slice(&bytes[from as usize..to as usize]);
                        }
                        Some(CachedBlock::Corrupt(bad)) => corrupt = Some(Arc::clone(bad)),
                        None => {
                            // Read in place: a raw block (stored bytes are the raw bytes) whose
                            // checksum map_in_place verified.
                            let (map, _) =
                                self.maps[shard].as_ref().expect("mapped in map_in_place");
                            let at = entry.stored_offset as usize;
                            self.sample.extend_from_slice(
                                &map.bytes()[at + from as usize..at + to as usize],
                            );
                            in_place_bytes += to - from;
                        }
                    }
                }
                if corrupt.is_some() {
                    break;
                }
                let out = &mut slot[field.offset + row * field.sample_bytes_out..]
                    [..field.sample_bytes_out];
                decode::convert(field.stored, &self.sample, field.out, out)
                    .expect("conversions are validated when the stream is planned");
            }
            if let Some(bad) = corrupt {
                match plan.on_corrupt {
                    CorruptPolicy::Fail => return Err(bad.to_error()),
                    CorruptPolicy::Replace => {
                        // The substitute is an all-zero sample in every field: deterministic, the
                        // same on every rank, and counted so the trainer can see it.
                        for field in &plan.fields {
                            slot[field.offset + row * field.sample_bytes_out..]
                                [..field.sample_bytes_out]
                                .fill(0);
                        }
                        replaced += 1;
                    }
                }
            }
        }
        // Before the slot is handed on: if a shard read in place was truncated or rewritten
        // meanwhile, rows of this batch may hold zeros or another file's bytes.
        for index in 0..self.in_place_shards.len() {
            self.check_in_place(self.in_place_shards[index] as usize)?;
        }
        if in_place_bytes > 0 {
            self.metrics
                .add_read_bytes(ReadPath::PageCache, in_place_bytes);
        }
        self.metrics.add_gather_time(gather_started.elapsed());
        self.evict();
        Ok(FillReport {
            samples: sample_count as u32,
            replaced,
        })
    }

    /// Asks the CPU to start loading the first bytes each field of a later row reads in place from
    /// a shard's memory map. In a shuffled order every row lies in another page: its address
    /// translation and first cache line then load while earlier rows are converted, instead of one
    /// after another (on a VM, where a page walk is costly, shuffled epochs ran at half the rate of
    /// dataset order without it).
    fn prefetch_in_place(&self, row_placements: &[Placement]) {
        for (field, placement) in self.plan.fields.iter().zip(row_placements) {
            let Some((map, _)) = self.maps[placement.shard].as_ref() else {
                continue;
            };
            let block = placement.blocks.start;
            let blocks = self.plan.dataset.shards[placement.shard]
                .metadata
                .field_blocks(field.field_index);
            let Some(entry) = blocks.get(block as usize) else {
                continue;
            };
            let at = entry.stored_offset + placement.start.saturating_sub(entry.raw_offset);
            if let Some(byte) = map.bytes().get(at as usize) {
                prefetch(byte);
            }
        }
    }

    fn entry(&self, key: &BlockKey) -> crate::format::BlockEntry {
        self.plan.dataset.shards[key.shard as usize]
            .metadata
            .field_blocks(key.field as usize)[key.block as usize]
    }

    /// Fails, naming the shard, if shard `shard`'s map was read beyond the end of the file or the
    /// file's length or modification time changed since it was mapped (`cp` or `rsync --inplace` over
    /// a served dataset): what was read from it may be zeros or another version's bytes.
    fn check_in_place(&self, shard: usize) -> Result<(), StorageError> {
        let Some((map, _)) = self.maps[shard].as_ref() else {
            return Ok(());
        };
        map.check(self.files.get(FileId(shard as u32)).file())
            .map_err(|reason| StorageError::Changed {
                path: self.plan.dataset.shards[shard].path.clone(),
                reason,
            })
    }

    /// Prepares raw block `key` to be read in place from its shard's memory map (`dense`: the batch
    /// uses most of it, so only if its pages are cached): maps the shard if needed and verifies the
    /// block's checksum unless a reader of the dataset has (a corrupt block goes into the cache as
    /// such, for the rows that read it). False when the shard cannot be mapped: read the block whole
    /// instead, as when a dense block is not cached. Fails if the shard changed under its map.
    fn map_in_place(&mut self, key: &BlockKey, dense: bool) -> Result<bool, StorageError> {
        let shard = key.shard as usize;
        if self.maps[shard].is_none() {
            let file = self.files.get(FileId(key.shard)).file();
            match (MappedFile::map(file), ResidencyMap::new(file)) {
                (Ok(map), Ok(residency)) => self.maps[shard] = Some((map, residency)),
                _ => return Ok(false),
            }
        }
        if self.in_place_stamp[shard] != self.batch_stamp {
            self.in_place_stamp[shard] = self.batch_stamp;
            self.in_place_shards.push(key.shard);
        }
        let entry = self.entry(key);
        if dense {
            let (_, residency) = self.maps[shard].as_ref().expect("mapped above");
            let cached = residency
                .resident_fraction(entry.stored_offset as usize, entry.stored_bytes as usize)
                .is_ok_and(|f| f >= IN_PLACE_RESIDENT_MIN);
            if !cached {
                return Ok(false);
            }
        }
        let verified = &self.plan.dataset.verified;
        if verified.contains(shard, key.field as usize, key.block) {
            return Ok(true);
        }
        let (map, _) = self.maps[shard].as_ref().expect("mapped above");
        let at = entry.stored_offset as usize;
        if at + entry.stored_bytes as usize > map.len() {
            return Ok(false);
        }
        let stored = &map.bytes()[at..at + entry.stored_bytes as usize];
        let shard_ref = &self.plan.dataset.shards[shard];
        let checked = decode::check_block(stored, &entry, || BlockRef {
            shard: shard_ref.path.clone(),
            field: shard_ref.metadata.fields[key.field as usize].name.clone(),
            block: key.block,
            stored_offset: entry.stored_offset,
        });
        // Verifying reads the whole block, once per dataset.
        self.metrics
            .add_read_bytes(ReadPath::PageCache, entry.stored_bytes as u64);
        match checked {
            Ok(()) => {
                self.plan
                    .dataset
                    .verified
                    .insert(shard, key.field as usize, key.block);
            }
            Err(error) => {
                // A block that reads wrong because its shard was cut under the map is not corrupt
                // on disk: say what happened instead.
                self.check_in_place(shard)?;
                self.metrics.add_corrupt_blocks(1);
                let bad = CachedBlock::Corrupt(Arc::new(CorruptBlock::from(error)));
                self.cache.insert(*key, (self.batch_stamp, bad));
            }
        }
        Ok(true)
    }

    /// Reads and decodes `keys` into the cache.
    fn load(&mut self, keys: &[BlockKey]) -> Result<(), StorageError> {
        let align = IO_ALIGN_BYTES as usize;
        let mut start = 0;
        while start < keys.len() {
            // Read as many blocks as fit in the staging buffer at once, growing it to hold at least one.
            let mut extents = Vec::new();
            let mut dest = 0usize;
            let mut end = start;
            while end < keys.len() {
                let key = keys[end];
                let entry = &self.plan.dataset.shards[key.shard as usize]
                    .metadata
                    .field_blocks(key.field as usize)[key.block as usize];
                // Round reads up to whole pages: shards are padded to 4096, so this stays in the file
                // and lets the engine use O_DIRECT.
                let len = (entry.stored_bytes as usize).div_ceil(align) * align;
                if dest + len > self.staging.len() {
                    if end == start {
                        self.staging = AlignedBuffer::new(len);
                    } else {
                        break;
                    }
                }
                extents.push(Extent {
                    file: FileId(key.shard),
                    offset: entry.stored_offset,
                    len,
                    dest_offset: dest,
                });
                dest += len;
                end += 1;
            }
            let results = self
                .engine
                .read(&self.files, &extents, self.staging.as_mut_slice())?;
            let read_bytes: usize = extents
                .iter()
                .zip(&results)
                .filter(|(_, r)| r.is_ok())
                .map(|(e, _)| e.len)
                .sum();
            self.metrics
                .add_read_bytes(self.read_path, read_bytes as u64);
            let decode_started = std::time::Instant::now();
            // Decode the blocks of this read on up to `decode_threads` threads: decoding, not
            // reading, is the CPU backend's bottleneck.
            let jobs: Vec<(BlockKey, &Extent, Result<(), crate::storage::ReadError>)> = keys
                [start..end]
                .iter()
                .copied()
                .zip(&extents)
                .zip(results)
                .map(|((key, extent), result)| (key, extent, result))
                .collect();
            let plan = &self.plan;
            let staging = self.staging.as_slice();
            let decode_one = |(key, extent, result): &(
                BlockKey,
                &Extent,
                Result<(), crate::storage::ReadError>,
            ),
                              scratch: &mut Vec<u8>| {
                let shard = &plan.dataset.shards[key.shard as usize];
                let field = &shard.metadata.fields[key.field as usize];
                let entry = shard.metadata.field_blocks(key.field as usize)[key.block as usize];
                let at = || BlockRef {
                    shard: shard.path.clone(),
                    field: field.name.clone(),
                    block: key.block,
                    stored_offset: entry.stored_offset,
                };
                match result {
                    Err(error) => CachedBlock::Corrupt(Arc::new(CorruptBlock {
                        block: at(),
                        reason: CorruptReason::Unreadable(error.to_string()),
                    })),
                    Ok(()) => {
                        let stored = &staging
                            [extent.dest_offset..extent.dest_offset + entry.stored_bytes as usize];
                        let mut raw = vec![0u8; entry.raw_bytes as usize];
                        match decode::decode_block(
                            stored,
                            &entry,
                            field.dtype.size_bytes(),
                            scratch,
                            &mut raw,
                            at,
                        ) {
                            Ok(()) => CachedBlock::Decoded(Arc::new(raw)),
                            Err(error) => CachedBlock::Corrupt(Arc::new(error.into())),
                        }
                    }
                }
            };
            // Spawning threads costs tens of microseconds: only worth it for several blocks each.
            const BLOCKS_PER_THREAD_MIN: usize = 4;
            let threads = self
                .decode_threads
                .min(jobs.len() / BLOCKS_PER_THREAD_MIN)
                .max(1);
            let decoded: Vec<CachedBlock> = if threads == 1 {
                jobs.iter()
                    .map(|job| decode_one(job, &mut self.scratch))
                    .collect()
            } else {
                let per_thread = jobs.len().div_ceil(threads);
                std::thread::scope(|scope| {
                    let handles: Vec<_> = jobs
                        .chunks(per_thread)
                        .map(|chunk| {
                            scope.spawn(move || {
                                let mut scratch = Vec::new();
                                chunk
                                    .iter()
                                    .map(|job| decode_one(job, &mut scratch))
                                    .collect::<Vec<_>>()
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .flat_map(|h| h.join().expect("decoding does not panic"))
                        .collect()
                })
            };
            self.metrics.add_decode_time(decode_started.elapsed());
            let corrupt = decoded
                .iter()
                .filter(|c| matches!(c, CachedBlock::Corrupt(_)))
                .count();
            self.metrics.add_corrupt_blocks(corrupt as u64);
            for ((key, _, _), cached) in jobs.iter().zip(decoded) {
                if let CachedBlock::Decoded(bytes) = &cached {
                    self.cache_bytes += bytes.len();
                }
                self.cache.insert(*key, (self.batch_stamp, cached));
            }
            start = end;
        }
        Ok(())
    }

    /// Drops the least recently used blocks not needed by the current batch until the cache fits.
    fn evict(&mut self) {
        if self.cache_bytes <= self.cache_bytes_max {
            return;
        }
        let mut entries: Vec<(u64, BlockKey)> = self
            .cache
            .iter()
            .filter(|(_, (stamp, _))| *stamp != self.batch_stamp)
            .map(|(key, (stamp, _))| (*stamp, *key))
            .collect();
        entries.sort_unstable_by_key(|&(stamp, key)| (stamp, key.shard, key.field, key.block));
        for (_, key) in entries {
            if self.cache_bytes <= self.cache_bytes_max {
                break;
            }
            if let Some((_, CachedBlock::Decoded(bytes))) = self.cache.remove(&key) {
                self.cache_bytes -= bytes.len();
            }
        }
    }
}
