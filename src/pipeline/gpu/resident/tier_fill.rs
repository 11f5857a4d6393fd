//! Datasets with compressed blocks in the device-memory tier: decoded once, when a stream admits
//! the dataset, and then read by every stream and epoch of the device like a raw dataset in the
//! tier (the same gather kernel, rows planned by arithmetic). Raw datasets larger than the
//! registration budget are filled the same way (their blocks copied, not decoded): the raw tier's
//! own fill copies from windows registered for the stream's life, which such datasets do not get.
//!
//! What the tier holds is each shard's blocks decoded (every field, LZ4 blocks decoded and
//! un-shuffled, raw blocks as they are), one after another in file order, each at a 16-byte
//! aligned offset ([`DecodedLayout`]): a single-field shard is then its field's raw bytes back to
//! back, and a row's address is one addition. The fill reads the shard files' stored bytes in
//! chunks of at most [`FILL_CHUNK_BYTES`] through the stream's reader (registered page cache,
//! io_uring bounce buffers or cuFile, as any read), decodes each chunk's LZ4 blocks with the LZ4
//! kernel into a scratch buffer and copies the chunk's decoded bytes into the tier with one
//! device-to-device copy; two chunks are in flight, so that one is read while the other decodes.
//! It is a whole pass made before the stream's first batch (about what reading the compressed
//! bytes once costs), not a fill while the first epoch streams: a compressed dataset has no raw
//! bytes to read in place meanwhile. Other streams of the dataset that open during the fill wait
//! for it.
//!
//! Checksums are verified as for every resident stream (on the host, once per dataset, before
//! its first batch); a block whose checksum matched but which the kernel could not decode is
//! recorded with the dataset and is corrupt for every stream (its rows zeroed or the stream failed,
//! by the stream's policy).

use std::sync::Arc;

use crate::device::{Device, DeviceBuffer, DeviceError, DeviceMemory, Event, EventTiming};
use crate::format::{Codec, Dataset};
use crate::kernels::{Lz4Decoder, Lz4Job, Lz4Outcome, Lz4Status, LZ4_JOB_BYTES, LZ4_OUTCOME_BYTES};
use crate::pipeline::gpu::tier::TierDataset;
use crate::pipeline::stream_plan::{BlockKey, CorruptBlock, CorruptReason, FillError, StreamPlan};
use crate::storage::gpu::{GpuReader, PathChoice};
use crate::storage::{Extent, FileId, FileTable, IO_ALIGN_BYTES};

/// Most stored bytes one chunk of a fill reads, and most decoded bytes it writes. Two chunks are
/// in flight, each with its stored bytes, its decoded bytes and the decoder's shuffle scratch:
/// a fill holds up to six times this (768 MiB) in device memory besides the tier, for its
/// duration.
pub(in crate::pipeline::gpu) const FILL_CHUNK_BYTES: u64 = 128 << 20;

/// Alignment of each block's decoded bytes in the tier.
const DECODED_ALIGN: u64 = 16;

/// Where each block of a dataset lies once decoded in the tier (see the module documentation).
pub(in crate::pipeline::gpu) struct DecodedLayout {
    /// Per shard: its decoded bytes.
    pub(in crate::pipeline::gpu) shard_bytes: Vec<u64>,
    /// Per shard, per field of the dataset, per block of the field: where the block's decoded
    /// bytes start in the shard's decoded bytes.
    block_offsets: Vec<Vec<Vec<u64>>>,
    /// Per shard: its blocks (field, index within the field) in file order.
    file_order: Vec<Vec<(u16, u32)>>,
}

/// The decoded bytes of each shard of `dataset` as [`DecodedLayout::of`] lays them out, without
/// laying them out (no sort, no allocation per block): each block takes its raw size rounded up to
/// the alignment, whatever its place. For deciding whether a dataset fits the tier before paying
/// for its layout (a dataset of millions of blocks takes a while to sort).
pub(in crate::pipeline::gpu) fn decoded_bytes(dataset: &Dataset) -> u64 {
    dataset
        .shards
        .iter()
        .flat_map(|s| s.metadata.blocks.iter())
        .map(|b| (b.raw_bytes as u64).next_multiple_of(DECODED_ALIGN))
        .sum()
}

impl DecodedLayout {
    /// The layout of `dataset`.
    pub(in crate::pipeline::gpu) fn of(dataset: &Dataset) -> DecodedLayout {
        let mut shard_bytes = Vec::with_capacity(dataset.shards.len());
        let mut block_offsets = Vec::with_capacity(dataset.shards.len());
        let mut file_order = Vec::with_capacity(dataset.shards.len());
        for shard in &dataset.shards {
            let fields = shard.metadata.fields.len();
            let mut order: Vec<(u64, u16, u32)> = (0..fields)
                .flat_map(|f| {
                    shard
                        .metadata
                        .field_blocks(f)
                        .iter()
                        .enumerate()
                        .map(move |(i, b)| (b.stored_offset, f as u16, i as u32))
                })
                .collect();
            order.sort_unstable();
            let mut offsets: Vec<Vec<u64>> = (0..fields)
                .map(|f| vec![0; shard.metadata.field_blocks(f).len()])
                .collect();
            let mut at = 0u64;
            for &(_, field, block) in &order {
                let raw = shard.metadata.field_blocks(field as usize)[block as usize].raw_bytes;
                offsets[field as usize][block as usize] = at;
                at = (at + raw as u64).next_multiple_of(DECODED_ALIGN);
            }
            shard_bytes.push(at);
            block_offsets.push(offsets);
            file_order.push(order.into_iter().map(|(_, f, b)| (f, b)).collect());
        }
        DecodedLayout {
            shard_bytes,
            block_offsets,
            file_order,
        }
    }

    /// Where block `block` of field `field` (the dataset's field index) of shard `shard` starts
    /// decoded.
    pub(in crate::pipeline::gpu) fn block_offset(
        &self,
        shard: usize,
        field: usize,
        block: u32,
    ) -> u64 {
        self.block_offsets[shard][field][block as usize]
    }

    /// The field's decoded start and block size in the shard when its blocks lie back to back
    /// (every block but the last of one raw size), so that a row's offset is one addition.
    pub(in crate::pipeline::gpu) fn linear(
        &self,
        dataset: &Dataset,
        shard: usize,
        field: usize,
    ) -> Option<(u64, u64)> {
        let blocks = dataset.shards[shard].metadata.field_blocks(field);
        let offsets = &self.block_offsets[shard][field];
        let first = blocks.first()?;
        let size = first.raw_bytes as u64;
        let base = offsets[0];
        let linear = blocks.iter().enumerate().all(|(i, b)| {
            let last = i + 1 == blocks.len();
            b.raw_offset == i as u64 * size
                && offsets[i] == base + i as u64 * size
                && (last || b.raw_bytes as u64 == size)
        });
        (linear && size > 0).then_some((base, size))
    }

    /// The chunks of shard `shard` a fill reads one at a time: ranges of its file order whose
    /// stored span and decoded bytes stay within `chunk_bytes` (a block larger than that is a
    /// chunk of its own).
    fn chunks(
        &self,
        dataset: &Dataset,
        shard: usize,
        chunk_bytes: u64,
    ) -> Vec<std::ops::Range<usize>> {
        let metadata = &dataset.shards[shard].metadata;
        let order = &self.file_order[shard];
        let mut chunks = Vec::new();
        let mut start = 0;
        while start < order.len() {
            let (f, b) = order[start];
            let first = &metadata.field_blocks(f as usize)[b as usize];
            let decoded_start = self.block_offsets[shard][f as usize][b as usize];
            let mut end = start + 1;
            while end < order.len() {
                let (f, b) = order[end];
                let block = &metadata.field_blocks(f as usize)[b as usize];
                let stored_span =
                    block.stored_offset + block.stored_bytes as u64 - first.stored_offset;
                let decoded_span = self.block_offsets[shard][f as usize][b as usize]
                    + block.raw_bytes as u64
                    - decoded_start;
                if stored_span > chunk_bytes || decoded_span > chunk_bytes {
                    break;
                }
                end += 1;
            }
            chunks.push(start..end);
            start = end;
        }
        chunks
    }
}

/// The device memory of one chunk in flight.
struct ChunkBuffers {
    /// The chunk's stored bytes, as read.
    stored: DeviceBuffer,
    /// Its decoded bytes, then the decoder's shuffle scratch.
    decoded: DeviceBuffer,
    jobs: DeviceBuffer,
    outcomes: DeviceBuffer,
    /// Recorded after the chunk's decode and its copy into the tier.
    done: Event,
    /// The chunk queued with these buffers and not checked yet: its shard and LZ4 blocks.
    pending: Option<(usize, Vec<(u16, u32)>)>,
}

impl ChunkBuffers {
    fn new(device: &Device, chunk_bytes: u64) -> Result<ChunkBuffers, DeviceError> {
        // Blocks start on pages of the file: at most one block per page of a chunk's span.
        let jobs_max = (chunk_bytes / IO_ALIGN_BYTES + 1) as usize;
        Ok(ChunkBuffers {
            stored: DeviceBuffer::new(device, chunk_bytes as usize)?,
            decoded: DeviceBuffer::new(device, 2 * chunk_bytes as usize)?,
            jobs: DeviceBuffer::new(device, jobs_max * LZ4_JOB_BYTES)?,
            outcomes: DeviceBuffer::new(device, jobs_max * LZ4_OUTCOME_BYTES)?,
            done: Event::new(device, EventTiming::Disabled)?,
            pending: None,
        })
    }
}

/// What a fill read and decoded, for the log and the metrics.
pub(in crate::pipeline::gpu) struct FillSummary {
    /// Stored bytes read.
    pub(in crate::pipeline::gpu) stored_bytes: u64,
    /// Blocks decoded by the LZ4 kernel.
    pub(in crate::pipeline::gpu) lz4_blocks: u64,
    /// Blocks whose checksum matched (or was not checked) that did not decode.
    pub(in crate::pipeline::gpu) undecodable: Vec<(BlockKey, Arc<CorruptBlock>)>,
}

/// Fills `dataset` (admitted decoded, of `layout`) from the shard files of `plan`: reads every
/// chunk through `reader`, decodes its LZ4 blocks with `lz4` and copies it into the tier. Every
/// copy and decode is complete when this returns, whether it succeeded or not.
#[allow(clippy::too_many_arguments)]
pub(in crate::pipeline::gpu) fn fill_decoded(
    plan: &StreamPlan,
    files: &FileTable,
    layout: &DecodedLayout,
    dataset: &TierDataset,
    reader: &mut GpuReader,
    choice: PathChoice,
    lz4: &Lz4Decoder,
    device: &Device,
) -> Result<FillSummary, FillError> {
    let largest = layout.shard_bytes.iter().copied().max().unwrap_or(0);
    let chunk_bytes = FILL_CHUNK_BYTES.min(largest.max(IO_ALIGN_BYTES));
    // The largest block decides the least a chunk must hold.
    let block_max = plan
        .dataset
        .shards
        .iter()
        .flat_map(|s| s.metadata.blocks.iter())
        .map(|b| (b.stored_bytes as u64).max(b.raw_bytes as u64))
        .max()
        .unwrap_or(0);
    let chunk_bytes = chunk_bytes.max(block_max.next_multiple_of(IO_ALIGN_BYTES));
    let mut sets = [
        ChunkBuffers::new(device, chunk_bytes)?,
        ChunkBuffers::new(device, chunk_bytes)?,
    ];
    let result = fill_chunks(
        plan,
        files,
        layout,
        dataset,
        reader,
        choice,
        lz4,
        chunk_bytes,
        &mut sets,
    );
    // Nothing may still read or write the chunk buffers when they are freed.
    let synced = dataset.copy_stream().synchronize();
    let mut summary = result?;
    synced?;
    for set in &mut sets {
        check_chunk(plan, set, &mut summary.undecodable)?;
    }
    Ok(summary)
}

#[allow(clippy::too_many_arguments)]
fn fill_chunks(
    plan: &StreamPlan,
    files: &FileTable,
    layout: &DecodedLayout,
    dataset: &TierDataset,
    reader: &mut GpuReader,
    choice: PathChoice,
    lz4: &Lz4Decoder,
    chunk_bytes: u64,
    sets: &mut [ChunkBuffers; 2],
) -> Result<FillSummary, FillError> {
    let mut summary = FillSummary {
        stored_bytes: 0,
        lz4_blocks: 0,
        undecodable: Vec::new(),
    };
    let stream = dataset.copy_stream();
    let mut shard_base = 0u64;
    let mut next = 0usize;
    for shard in 0..plan.dataset.shards.len() {
        let metadata = &plan.dataset.shards[shard].metadata;
        let order = &layout.file_order[shard];
        for chunk in layout.chunks(&plan.dataset, shard, chunk_bytes) {
            let set = &mut sets[next % 2];
            next += 1;
            // The set's previous chunk is decoded and copied: check it, then reuse its buffers.
            set.done.synchronize()?;
            check_chunk(plan, set, &mut summary.undecodable)?;
            let block = |i: usize| {
                let (f, b) = order[i];
                (f, b, &metadata.field_blocks(f as usize)[b as usize])
            };
            let (f0, b0, first) = block(chunk.start);
            let (_, _, last) = block(chunk.end - 1);
            let stored_start = first.stored_offset;
            let stored_span = last.stored_offset + last.stored_bytes as u64 - stored_start;
            let decoded_start = layout.block_offset(shard, f0 as usize, b0);
            let extent = Extent {
                file: FileId(shard as u32),
                offset: stored_start,
                len: stored_span as usize,
                dest_offset: 0,
            };
            let results = reader.read(files, &[extent], &set.stored, choice)?;
            if let Some(Err(error)) = results.into_iter().next() {
                return Err(FillError::ShardCopy {
                    shard: plan.dataset.shards[shard].path.clone(),
                    source: Arc::new(std::io::Error::other(format!(
                        "reading its blocks into the device-memory tier: {error:?}"
                    ))),
                });
            }
            summary.stored_bytes += stored_span;
            let mut jobs = Vec::new();
            let mut lz4_blocks = Vec::new();
            let mut decoded_end = decoded_start;
            // Raw blocks back to back in both layouts are copied as one run.
            let mut raw_run: Option<(u64, u64, u64)> = None;
            for i in chunk.clone() {
                let (f, b, entry) = block(i);
                let src = entry.stored_offset - stored_start;
                let dst = layout.block_offset(shard, f as usize, b) - decoded_start;
                decoded_end = decoded_end.max(decoded_start + dst + entry.raw_bytes as u64);
                let element_bytes =
                    plan.dataset.manifest.fields[f as usize].dtype.size_bytes() as u32;
                match entry.codec {
                    Codec::Raw => {
                        let bytes = entry.raw_bytes as u64;
                        raw_run = match raw_run {
                            Some((s, d, n)) if s + n == src && d + n == dst => {
                                Some((s, d, n + bytes))
                            }
                            Some(run) => {
                                copy_raw_run(set, run, stream)?;
                                Some((src, dst, bytes))
                            }
                            None => Some((src, dst, bytes)),
                        };
                    }
                    Codec::Lz4 => {
                        let job =
                            Lz4Job::for_block(entry, element_bytes, src, dst, chunk_bytes + dst)
                                .expect("an LZ4 block has a decode job");
                        jobs.push(job);
                        lz4_blocks.push((f, b));
                    }
                }
            }
            if let Some(run) = raw_run {
                copy_raw_run(set, run, stream)?;
            }
            if !jobs.is_empty() {
                set.jobs.write(0, &Lz4Job::encode_all(&jobs))?;
                // SAFETY: the tables hold the jobs; the buffers are the set's, not touched until
                // its event says the decode is done.
                unsafe {
                    lz4.decode_async(
                        stream,
                        &set.jobs,
                        jobs.len() as u32,
                        &set.stored,
                        &set.decoded,
                        &set.outcomes,
                    )
                }?;
            }
            summary.lz4_blocks += jobs.len() as u64;
            // SAFETY: the source lies within the set's decoded bytes, which are not reused before
            // the set's event says this copy is done.
            unsafe {
                dataset.queue_fill_write(
                    shard_base + decoded_start,
                    set.decoded.device_ptr(),
                    (decoded_end - decoded_start) as usize,
                )
            }?;
            set.done.record(stream)?;
            set.pending = Some((shard, lz4_blocks));
        }
        shard_base += layout.shard_bytes[shard];
    }
    Ok(summary)
}

/// Queues the copy of a run of raw blocks (`src` in the chunk's stored bytes, `dst` in its decoded
/// bytes, `bytes` long) on `stream`.
fn copy_raw_run(
    set: &ChunkBuffers,
    (src, dst, bytes): (u64, u64, u64),
    stream: &crate::device::Stream,
) -> Result<(), DeviceError> {
    // SAFETY: both extents lie within the set's buffers (a chunk's spans stay within its size),
    // which outlive the copy (synchronised before they are reused or freed).
    unsafe {
        crate::device::ffi::memcpy_dtod_async(
            set.decoded.device_ptr() + dst,
            set.stored.device_ptr() + src,
            bytes as usize,
            stream.raw(),
        )
    }
    .map_err(DeviceError::from)
}

/// Checks the outcomes of the chunk `set` last decoded (its event complete), recording the blocks
/// that did not decode.
fn check_chunk(
    plan: &StreamPlan,
    set: &mut ChunkBuffers,
    undecodable: &mut Vec<(BlockKey, Arc<CorruptBlock>)>,
) -> Result<(), DeviceError> {
    let Some((shard, blocks)) = set.pending.take() else {
        return Ok(());
    };
    if blocks.is_empty() {
        return Ok(());
    }
    let mut bytes = vec![0u8; blocks.len() * LZ4_OUTCOME_BYTES];
    set.outcomes.read(0, &mut bytes)?;
    let metadata = &plan.dataset.shards[shard].metadata;
    for (outcome, &(field, block)) in Lz4Outcome::decode_all(&bytes).iter().zip(&blocks) {
        if outcome.status == Lz4Status::Ok {
            continue;
        }
        let entry = &metadata.field_blocks(field as usize)[block as usize];
        let corrupt = CorruptBlock {
            block: crate::decode::BlockRef {
                shard: plan.dataset.shards[shard].path.clone(),
                field: metadata.fields[field as usize].name.clone(),
                block,
                stored_offset: entry.stored_offset,
            },
            reason: CorruptReason::Lz4Kernel {
                status: outcome.status,
                produced: outcome.produced,
            },
        };
        tracing::warn!(
            "decoding into the device-memory tier: {}: {}",
            corrupt.block,
            corrupt.reason
        );
        let key = BlockKey {
            shard: shard as u32,
            field: field as u32,
            block,
        };
        undecodable.push((key, Arc::new(corrupt)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::FieldSource;
    use crate::pack::{self, CodecChoice, OnExisting, PackOptions, Quiet, ShuffleChoice};
    use gpufeed_proto::DType;

    fn pack(dir: &std::path::Path, fields: Vec<FieldSource>, codec: CodecChoice) -> Dataset {
        let options = PackOptions {
            name: "t".to_string(),
            block_bytes: 16 << 10,
            samples_per_shard: Some(700),
            codec,
            shuffle: ShuffleChoice::Auto,
            on_existing: OnExisting::Refuse,
            threads: 1,
        };
        pack::pack(dir, &fields, &options, &Quiet).unwrap();
        Dataset::open(dir).unwrap()
    }

    fn i32_field(name: &str, width: u64, samples: u64) -> FieldSource {
        let bytes: Vec<u8> = (0..samples * width)
            .flat_map(|i| ((i % 89) as i32).to_le_bytes())
            .collect();
        FieldSource::from_bytes(name, DType::I32, vec![width], bytes).unwrap()
    }

    /// Every block of every shard gets its own aligned, non-overlapping place within its shard's
    /// decoded bytes; a single-field shard is its field's bytes back to back (one addition per
    /// row); chunks cover every block once, in file order, within the chunk size.
    #[test]
    fn decoded_layout_places_every_block_once() {
        let root = tempfile::tempdir().unwrap();
        let mixed = pack(
            &root.path().join("mixed"),
            vec![i32_field("tok", 64, 2000), i32_field("pos", 3, 2000)],
            CodecChoice::Lz4,
        );
        let single = pack(
            &root.path().join("single"),
            vec![i32_field("tok", 64, 2000)],
            CodecChoice::Lz4,
        );
        for dataset in [&mixed, &single] {
            let layout = DecodedLayout::of(dataset);
            assert_eq!(layout.shard_bytes.len(), dataset.shards.len());
            assert_eq!(
                decoded_bytes(dataset),
                layout.shard_bytes.iter().sum::<u64>()
            );
            for (s, shard) in dataset.shards.iter().enumerate() {
                let mut spans = Vec::new();
                for f in 0..shard.metadata.fields.len() {
                    for (b, block) in shard.metadata.field_blocks(f).iter().enumerate() {
                        assert_eq!(block.codec, Codec::Lz4);
                        let at = layout.block_offset(s, f, b as u32);
                        assert_eq!(at % DECODED_ALIGN, 0);
                        spans.push((at, at + block.raw_bytes as u64));
                    }
                }
                spans.sort_unstable();
                assert!(
                    spans.windows(2).all(|w| w[0].1 <= w[1].0),
                    "overlap: {spans:?}"
                );
                assert!(spans.last().unwrap().1 <= layout.shard_bytes[s]);
                let chunk_bytes = 40 << 10;
                let chunks = layout.chunks(dataset, s, chunk_bytes);
                assert_eq!(chunks.first().unwrap().start, 0);
                assert_eq!(chunks.last().unwrap().end, layout.file_order[s].len());
                assert!(chunks.windows(2).all(|w| w[0].end == w[1].start));
                for chunk in chunks {
                    let block = |i: usize| {
                        let (f, b) = layout.file_order[s][i];
                        (f, b, shard.metadata.field_blocks(f as usize)[b as usize])
                    };
                    let (f0, b0, first) = block(chunk.start);
                    let (fl, bl, last) = block(chunk.end - 1);
                    let stored =
                        last.stored_offset + last.stored_bytes as u64 - first.stored_offset;
                    let decoded = layout.block_offset(s, fl as usize, bl) + last.raw_bytes as u64
                        - layout.block_offset(s, f0 as usize, b0);
                    assert!(chunk.len() == 1 || (stored <= chunk_bytes && decoded <= chunk_bytes));
                }
            }
        }
        // One field: linear; the token field of the mixed dataset is interleaved with the other.
        let layout = DecodedLayout::of(&single);
        let (base, size) = layout
            .linear(&single, 0, 0)
            .expect("a single field is linear");
        assert_eq!(base, 0);
        assert_eq!(
            size,
            single.shards[0].metadata.field_blocks(0)[0].raw_bytes as u64
        );
        // Where a field is linear, every block is where one addition puts it.
        let layout = DecodedLayout::of(&mixed);
        for f in 0..mixed.manifest.fields.len() {
            if let Some((base, size)) = layout.linear(&mixed, 0, f) {
                for b in 0..mixed.shards[0].metadata.field_blocks(f).len() {
                    assert_eq!(layout.block_offset(0, f, b as u32), base + b as u64 * size);
                }
            }
        }
    }
}
