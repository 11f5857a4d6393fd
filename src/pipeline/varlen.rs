//! Variable-length fields (format version 2) in a stream: their offsets, read and checked when the
//! stream is planned, and the two batch forms a slot holds them in.
//!
//! **Padded**: the batch's samples as `[samples, L]` elements (each sample's element shape
//! after), `L` the batch's longest sample (after the stream's cap), shorter samples zero-filled,
//! with a lengths tensor (`int32 [samples]`). **Packed**: the samples' values back to back
//! (`[total, ...]`) with cumulative offsets (`int32 [samples + 1]`, starting at 0: FlashAttention's
//! `cu_seqlens`). Both are bounded by the stream's length bound (its cap, else the dataset's longest
//! sample): a slot reserves `batch_size × bound` elements, which the stream's slot limit bounds.

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use crate::decode::{self, BlockRef};
use crate::format::{self, Dataset, OFFSET_BYTES};

/// Offsets a stream holds in memory at most, in bytes (8 a sample of each variable-length field it
/// serves): 1 GiB, the offsets of 128 Mi samples. A stream over more is refused. Streams of one
/// dataset share them ([`shared_offsets`]).
pub const OFFSETS_BYTES_MAX: u64 = 1 << 30;

/// The offsets of one field of one opened dataset, per shard.
pub type FieldOffsets = Arc<Vec<Vec<u64>>>;

/// Offsets read for the streams open now, by dataset directory and field, with the manifest they
/// were read under: the streams of a dataset (its ranks on a node, a stream reopened each epoch)
/// share one copy instead of reading and holding their own. Entries are weak: the offsets go when
/// the last stream holding them closes, and the table is pruned of such entries as it is used, so
/// it holds no more entries than there are open streams' fields.
static SHARED_OFFSETS: std::sync::Mutex<Vec<SharedEntry>> = std::sync::Mutex::new(Vec::new());

struct SharedEntry {
    dir: std::path::PathBuf,
    manifest: format::FileIdentity,
    field: usize,
    offsets: std::sync::Weak<Vec<Vec<u64>>>,
}

/// The offsets of variable-length field `field_index` of `dataset`: those another open stream of
/// the same dataset (same directory, same manifest file) read, or read now ([`read_offsets`]).
pub fn shared_offsets(dataset: &Dataset, field_index: usize) -> Result<FieldOffsets, String> {
    let same = |entry: &SharedEntry| {
        entry.dir == dataset.dir
            && entry.manifest == dataset.manifest_identity
            && entry.field == field_index
    };
    {
        let mut table = SHARED_OFFSETS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        table.retain(|entry| entry.offsets.strong_count() > 0);
        if let Some(offsets) = table
            .iter()
            .find(|e| same(e))
            .and_then(|e| e.offsets.upgrade())
        {
            return Ok(offsets);
        }
    }
    // Read without the lock (it may take a while); two streams opening at once may both read, and
    // the second's copy replaces the first's in the table.
    let offsets = Arc::new(read_offsets(dataset, field_index)?);
    let mut table = SHARED_OFFSETS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    table.retain(|entry| entry.offsets.strong_count() > 0 && !same(entry));
    table.push(SharedEntry {
        dir: dataset.dir.clone(),
        manifest: dataset.manifest_identity,
        field: field_index,
        offsets: Arc::downgrade(&offsets),
    });
    Ok(offsets)
}

/// How a batch holds a variable-length field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VariableForm {
    /// Padded to the batch's longest sample, with a lengths tensor.
    Padded,
    /// Values back to back, with cumulative offsets (`cu_seqlens`).
    Packed,
}

/// How a stream asks for one variable-length field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VariableSelection {
    /// The field's name in the dataset.
    pub name: String,
    /// The batch form.
    pub form: VariableForm,
    /// Elements a sample keeps at most (longer ones are truncated); `None`: all of them.
    pub cap: Option<u32>,
}

/// A variable-length field in a stream's plan.
#[derive(Clone, Debug)]
pub struct VariablePlan {
    /// The batch form.
    pub form: VariableForm,
    /// Elements a sample keeps at most in the slot: the cap, or the dataset's longest sample.
    pub length_bound: u64,
    /// The cap asked for, if any.
    pub cap: Option<u64>,
    /// Offset in the slot of the lengths (padded) or the cumulative offsets (packed), `int32`.
    pub index_offset: usize,
    /// Per shard, the end of each sample's values in elements (the shard's offsets, checked),
    /// shared with the dataset's other streams.
    pub ends: FieldOffsets,
}

impl VariablePlan {
    /// Elements of the index tensor of a batch of `samples`: lengths, or cumulative offsets.
    pub fn index_elements(&self, samples: usize) -> usize {
        match self.form {
            VariableForm::Padded => samples,
            VariableForm::Packed => samples + 1,
        }
    }

    /// Sample `local` of shard `shard`: its values' first element and element count, within the
    /// shard's values region (count truncated to the cap).
    pub fn locate(&self, shard: usize, local: u64) -> (u64, u64) {
        let ends = &self.ends[shard];
        let start = local.checked_sub(1).map_or(0, |p| ends[p as usize]);
        let length = ends[local as usize] - start;
        (start, self.cap.map_or(length, |cap| length.min(cap)))
    }
}

/// Where the rows of one variable-length field of a batch go in the slot, and the index tensor
/// that describes them, as both backends fill it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VariableRows {
    /// Per row, its first element in the field's values.
    pub starts: Vec<u64>,
    /// Per row, its elements (after the cap).
    pub lengths: Vec<u64>,
    /// The index tensor's bytes: int32 lengths (padded) or cumulative offsets from 0 (packed),
    /// little-endian.
    pub index: Vec<u8>,
    /// Elements the batch's values take: rows × the longest (padded), or their sum (packed).
    pub values_elements: u64,
}

impl VariableRows {
    /// The rows of a batch of `lengths` (elements per row, after the cap) in `variable`'s form.
    pub fn new(variable: &VariablePlan, lengths: Vec<u64>) -> VariableRows {
        let mut index = Vec::with_capacity(4 * variable.index_elements(lengths.len()));
        // The plan bounds batch_size × length_bound by i32::MAX, so every entry fits an int32.
        let mut push = |value: u64| index.extend_from_slice(&(value as i32).to_le_bytes());
        let (starts, values_elements) = match variable.form {
            VariableForm::Padded => {
                let longest = lengths.iter().copied().max().unwrap_or(0);
                lengths.iter().for_each(|&length| push(length));
                let starts = (0..lengths.len() as u64).map(|row| row * longest).collect();
                (starts, lengths.len() as u64 * longest)
            }
            VariableForm::Packed => {
                let mut total = 0u64;
                push(0);
                let starts = lengths
                    .iter()
                    .map(|&length| {
                        let start = total;
                        total += length;
                        push(total);
                        start
                    })
                    .collect();
                (starts, total)
            }
        };
        VariableRows {
            starts,
            lengths,
            index,
            values_elements,
        }
    }

    /// The bytes of row `row`'s values in the slot, for a field whose batch starts at byte `offset`
    /// of the slot, of `element_bytes` delivered bytes an element.
    pub fn place(&self, offset: usize, element_bytes: usize, row: usize) -> std::ops::Range<usize> {
        let start = offset + self.starts[row] as usize * element_bytes;
        start..start + self.lengths[row] as usize * element_bytes
    }

    /// Bytes the batch's values take in the slot, of `element_bytes` delivered bytes an element.
    pub fn values_bytes(&self, element_bytes: usize) -> usize {
        self.values_elements as usize * element_bytes
    }
}

/// Reads bytes `range` of shard `index` of a dataset whose shards are not all on this node (a
/// dataset in object storage: ranged GETs), for the offsets a stream needs when it opens.
pub type RangeReader =
    Arc<dyn Fn(usize, std::ops::Range<u64>) -> Result<Vec<u8>, String> + Send + Sync>;

/// Per dataset directory, the reader of its shards' bytes where they are not on this node
/// ([`register_range_reader`]); a handful of datasets at most.
static RANGE_READERS: std::sync::Mutex<Vec<(std::path::PathBuf, RangeReader)>> =
    std::sync::Mutex::new(Vec::new());

/// Makes [`read_offsets`] read the offsets of the dataset at `dir` with `reader` where a shard file
/// is not on this node (a dataset registered from object storage, whose shards are fetched as
/// streams read them); replaces an earlier reader of `dir`.
pub fn register_range_reader(dir: std::path::PathBuf, reader: RangeReader) {
    let mut readers = RANGE_READERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    readers.retain(|(known, _)| *known != dir);
    readers.push((dir, reader));
}

fn range_reader(dir: &std::path::Path) -> Option<RangeReader> {
    RANGE_READERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .find(|(known, _)| known == dir)
        .map(|(_, reader)| Arc::clone(reader))
}

/// The offsets of variable-length field `field_index` of `dataset`, shard by shard, read with
/// positional reads (or, for a shard not on this node, with its dataset's [`RangeReader`]: only
/// the offset blocks' bytes), decoded, and checked ([`format::check_offsets`],
/// [`format::check_values_blocks`]): an error names the shard file, the field and the sample or
/// block at fault.
pub fn read_offsets(dataset: &Dataset, field_index: usize) -> Result<Vec<Vec<u64>>, String> {
    let listed = &dataset.manifest.fields[field_index];
    let length_max = listed
        .length_max
        .expect("read_offsets is given variable-length fields");
    let mut all = Vec::with_capacity(dataset.shards.len());
    let (mut stored, mut scratch, mut raw) = (Vec::new(), Vec::new(), Vec::new());
    for (shard_index, shard) in dataset.shards.iter().enumerate() {
        let metadata = &shard.metadata;
        let field = &metadata.fields[field_index];
        let offset_blocks = field.offset_blocks.expect("a variable-length field");
        let blocks = metadata.field_blocks(field_index);
        let file = format::open_regular(&shard.path);
        // A shard not on this node (a dataset in object storage fetches its shards as streams read
        // them; the offsets are needed before the first batch): its offset blocks, fetched.
        let fetched = match &file {
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                let Some(reader) = range_reader(&dataset.dir) else {
                    return Err(format!(
                        "{}: the shard is not on this node, and the offsets of variable-length \
                         field '{}' are read when a stream opens: variable-length fields are \
                         served from datasets whose shards are local or in object storage",
                        shard.path.display(),
                        field.name
                    ));
                };
                let taken = &blocks[..offset_blocks as usize];
                let start = taken.first().map_or(0, |b| b.stored_offset);
                let end = taken
                    .iter()
                    .map(|b| b.stored_offset + b.stored_bytes as u64)
                    .max()
                    .unwrap_or(start);
                let bytes = reader(shard_index, start..end).map_err(|error| {
                    format!(
                        "{}: fetching the offsets of field '{}': {error}",
                        shard.path.display(),
                        field.name
                    )
                })?;
                Some((start, bytes))
            }
            Err(error) => return Err(format!("{}: {error}", shard.path.display())),
            Ok(_) => None,
        };
        let mut ends = Vec::with_capacity(metadata.header.sample_count as usize);
        for (index, block) in blocks.iter().enumerate().take(offset_blocks as usize) {
            let at = || BlockRef {
                shard: shard.path.clone(),
                field: field.name.clone(),
                block: index as u32,
                stored_offset: block.stored_offset,
            };
            stored.clear();
            match (&fetched, &file) {
                (Some((start, bytes)), _) => {
                    let from = (block.stored_offset - start) as usize;
                    let piece = bytes
                        .get(from..from + block.stored_bytes as usize)
                        .ok_or_else(|| format!("{}: the fetched offsets are short", at()))?;
                    stored.extend_from_slice(piece);
                }
                (None, Ok(file)) => {
                    stored.resize(block.stored_bytes as usize, 0);
                    file.read_exact_at(&mut stored, block.stored_offset)
                        .map_err(|error| format!("{}: read failed: {error}", at()))?;
                }
                (None, Err(_)) => {
                    unreachable!("a shard that cannot be opened was fetched or refused")
                }
            }
            raw.clear();
            raw.resize(block.raw_bytes as usize, 0);
            decode::decode_block(
                &stored,
                block,
                field.dtype.size_bytes(),
                &mut scratch,
                &mut raw,
                at,
            )
            .map_err(|error| error.to_string())?;
            ends.extend(
                raw.chunks_exact(OFFSET_BYTES as usize)
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))),
            );
        }
        let element_bytes = field.sample_bytes();
        let values_elements = (metadata.field_stream_bytes(field_index)
            - metadata.offsets_bytes(field_index))
            / element_bytes;
        let first_sample = metadata.header.first_sample;
        format::check_offsets(
            &shard.path,
            &field.name,
            first_sample,
            &ends,
            values_elements,
            length_max,
        )
        .map_err(|error| error.to_string())?;
        format::check_values_blocks(
            &shard.path,
            &field.name,
            first_sample,
            &ends,
            blocks,
            offset_blocks,
            element_bytes,
        )
        .map_err(|error| error.to_string())?;
        all.push(ends);
    }
    Ok(all)
}
