//! What a stream is, shared by both backends: the request ([`StreamRequest`]) validated into a plan
//! ([`StreamPlan`]: order, rank share, field geometry in the slot), the bounds every stream obeys
//! ([`StreamLimits`]), where a sample's bytes live ([`Placement`], [`PlacementRuns`]), and what filling
//! a slot reports or fails with ([`FillReport`], [`FillError`], [`CorruptBlock`]).
//!
//! The CPU backend (`pipeline::cpu`) and the GPU backend (`pipeline::gpu`) both fill slots from one
//! plan; nothing here reads a block.

use std::sync::{Arc, Mutex};

use gpufeed_proto::spec::{self, FIELD_OFFSET_ALIGN_BYTES};
use gpufeed_proto::DType;

use super::mixture::{Drawn, MixtureOrder, MixtureSource};
use super::order::{EpochOrder, RankPlan, ShuffleMode, Tail};
use super::varlen::{self, VariableForm, VariablePlan, VariableRows, VariableSelection};
use crate::decode::{self, BlockRef};
use crate::device::DeviceError;
use crate::format::Dataset;
use crate::kernels::Lz4Status;
use crate::storage::gpu::GpuReadError;
use crate::storage::StorageError;

/// Bounds applied to every stream.
#[derive(Clone, Copy, Debug)]
pub struct StreamLimits {
    /// Largest batch size.
    pub batch_size_max: u32,
    /// Largest world size.
    pub world_size_max: u32,
    /// Largest slot in bytes.
    pub slot_bytes_max: u64,
    /// Decoded blocks kept by a CPU assembler made with a cache of its own (`Assembler::new`:
    /// benchmarks and tools), in bytes. The daemon's host streams share one cache within
    /// `--slot-memory-max` instead (`pipeline::block_cache`).
    pub cache_bytes_max: usize,
    /// Bytes of rows a host stream in a shuffled order over compressed blocks of several rows takes
    /// out of each decoded block ahead of their batches (`pipeline::lookahead`), reserved in the
    /// daemon's host memory budget beside its slots when the stream opens (a stream the budget cannot
    /// give it to opens without one). A row kept ahead costs its own bytes where a cached block
    /// costs the block's, so in a shuffled order over a dataset larger than the budget this memory
    /// serves more rows from the look-ahead than from the decoded-block cache.
    pub lookahead_bytes_max: u64,
    /// Reads in flight per stream.
    pub queue_depth: usize,
    /// Threads decoding the blocks of one batch on the CPU backend.
    pub decode_threads: usize,
    /// Slot bytes a stream of small batches gets in flight: a stream has `prefetch` slots, or more,
    /// up to `PREFETCH_MAX` (64), while they fit in this many bytes, so that a consumer of small batches is
    /// not held up by a round trip per few kilobytes.
    pub ring_bytes: u64,
}

/// The default [`StreamLimits::lookahead_bytes_max`]: 192 MiB. Over 1 GiB of LZ4 tokens with 256 MiB
/// for the stream, these 192 MiB to the look-ahead (the cache keeping the rest) cut a full shuffle's
/// decodes from 6.25 to 2.39 a block (`docs/benchmarks/cpu-lz4-2026-11-28.md`); it is 2.3 % of the
/// default `--slot-memory-max`, so about 40 shuffled host streams get one before the budget runs out
/// for them (the next open without).
pub const LOOKAHEAD_BYTES_MAX_DEFAULT: u64 = 192 << 20;

/// The default [`StreamLimits::ring_bytes`]: 32 MiB, 64 slots of batches up to 512 KiB, 16 of 2 MiB.
pub const RING_BYTES_DEFAULT: u64 = 32 << 20;

/// Slots of a stream: the requested `prefetch`, raised while `slot_bytes` more still fit in
/// `ring_bytes`, at most [`spec::PREFETCH_MAX`] and no more than the stream's `steps` (a slot that
/// could never be filled is memory for nothing).
pub fn slot_count(prefetch: u32, slot_bytes: usize, ring_bytes: u64, steps: u64) -> u32 {
    let by_bytes = (ring_bytes / slot_bytes.max(1) as u64)
        .min(u64::from(spec::PREFETCH_MAX))
        .min(steps) as u32;
    prefetch.max(by_bytes)
}

impl StreamLimits {
    /// Bounds suited to a training node: batches up to 1 Mi samples and 1 GiB a slot.
    pub fn node_defaults() -> StreamLimits {
        StreamLimits {
            batch_size_max: 1 << 20,
            world_size_max: 1 << 16,
            slot_bytes_max: 1 << 30,
            cache_bytes_max: 256 << 20,
            lookahead_bytes_max: LOOKAHEAD_BYTES_MAX_DEFAULT,
            queue_depth: 64,
            decode_threads: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(8),
            ring_bytes: RING_BYTES_DEFAULT,
        }
    }
}

/// What a stream asks for, in the pipeline's terms. The socket server converts the consumer's wire
/// request into it (`ipc`), so that the pipeline knows nothing of the wire format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamRequest {
    /// The fields to deliver, in slot order; empty for every field of the dataset in its order.
    pub fields: Vec<FieldSelection>,
    /// Samples per batch.
    pub batch_size: u32,
    /// Ranks sharing the epoch.
    pub world_size: u32,
    /// This stream's rank.
    pub rank: u32,
    /// Seed of the epoch's order.
    pub seed: u64,
    /// The epoch.
    pub epoch: u64,
    /// Position in the global order to start at (resume).
    pub start_cursor: u64,
    /// The order of the epoch.
    pub shuffle: ShuffleMode,
    /// What happens to the samples that do not fill a last step.
    pub tail: Tail,
    /// Slots in the stream's ring: how many batches may be filled ahead of the consumer.
    pub prefetch: u32,
    /// What to do with a sample whose block is corrupt.
    pub on_corrupt: CorruptPolicy,
    /// Where the slots live.
    pub device: StreamDevice,
    /// How the batch holds each variable-length field; a variable-length field not named here is
    /// padded, without a cap.
    pub variable: Vec<VariableSelection>,
}

/// One field a stream asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldSelection {
    /// The field's name in the dataset.
    pub name: String,
    /// The dtype to deliver; `None` for the stored one.
    pub dtype: Option<DType>,
}

/// What to do with a sample whose block turns out corrupt while a stream is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CorruptPolicy {
    /// End the stream with an error naming the block.
    Fail,
    /// Deliver an all-zero sample instead, counted in the batch's report.
    Replace,
}

/// Where a stream's slots live, which decides the backend that fills them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamDevice {
    /// Host memory, filled by the CPU backend.
    Host,
    /// Memory of this CUDA device, filled by the GPU backend.
    Cuda(u32),
}

/// A stream request that cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The request breaks a rule or a bound; the message names the field of the request.
    #[error("{0}")]
    Invalid(String),
}

impl PlanError {
    fn spec(error: spec::SpecError) -> PlanError {
        PlanError::Invalid(error.0)
    }
}

/// Where one field goes in a slot.
#[derive(Clone, Debug)]
pub struct FieldPlan {
    /// Index of the field in the dataset.
    pub field_index: usize,
    /// Field name.
    pub name: String,
    /// Stored dtype.
    pub stored: DType,
    /// Delivered dtype.
    pub out: DType,
    /// Per-sample shape (of a variable-length field: per element).
    pub sample_shape: Vec<u64>,
    /// Stored bytes per sample (of a variable-length field: per element).
    pub sample_bytes_in: usize,
    /// Delivered bytes per sample (of a variable-length field: per element).
    pub sample_bytes_out: usize,
    /// Offset of the field's batch within a slot.
    pub offset: usize,
    /// Of a variable-length field: its batch form, bound and offsets.
    pub variable: Option<VariablePlan>,
}

impl FieldPlan {
    /// The bytes of row `row` of this variable-length field in the slot, as `rows` place it.
    pub fn row_place(&self, rows: &VariableRows, row: usize) -> std::ops::Range<usize> {
        rows.place(self.offset, self.sample_bytes_out, row)
    }

    /// Stored bytes a sample of the field may take at most: of a variable-length field, its length
    /// bound's.
    pub fn sample_bytes_in_max(&self) -> u64 {
        match &self.variable {
            Some(variable) => variable.length_bound * self.sample_bytes_in as u64,
            None => self.sample_bytes_in as u64,
        }
    }
}

/// Everything a stream needs to produce its batches: validated request, order, geometry.
#[derive(Debug)]
pub struct StreamPlan {
    /// The dataset.
    pub dataset: Arc<Dataset>,
    /// The epoch.
    pub epoch: u64,
    /// Global order of the epoch.
    pub order: EpochOrder,
    /// This rank's share.
    pub rank: RankPlan,
    /// Start position in the global order.
    pub start_cursor: u64,
    /// Batches this stream will produce.
    pub steps: u64,
    /// Fields in slot order.
    pub fields: Vec<FieldPlan>,
    /// Bytes of one slot.
    pub slot_bytes: usize,
    /// Slots in the stream's ring.
    pub slot_count: u32,
    /// What to do with corrupt blocks.
    pub on_corrupt: CorruptPolicy,
    /// For a dataset whose shards arrive while the stream runs (object storage, host streams):
    /// what the host assembler asks before it opens a shard. `None`: every shard is on disk.
    pub shard_gate: Option<Arc<dyn super::shard_gate::ShardGate>>,
    /// A mixture stream's sources ([`StreamPlan::mixture`]): then `dataset` is the first source's
    /// and `order` the identity over the mixture epoch's positions, and the host assembler fills
    /// each batch source by source through the plans in [`MixturePlan::sources`].
    pub mixture: Option<Arc<MixturePlan>>,
    /// In the plan of one source of a mixture: the mixture's draws and this source's index. Its
    /// batches are the rows of the mixture's batches that draw from it (see
    /// [`StreamPlan::slot_rows`]), the rest of the plan (steps, cursor, slot layout) the mixture's.
    pub source_of: Option<(Arc<MixtureDraws>, u32)>,
}

/// A mixture stream's draws for its rank, shared by its plan and its sources' plans: the source and
/// sample of each row of each step, computed once per step for all of them.
#[derive(Debug)]
pub struct MixtureDraws {
    /// The mixture's order of the epoch.
    pub order: MixtureOrder,
    rank: RankPlan,
    start_cursor: u64,
    /// The last step's draws: the sources' plans ask for the same step one after another.
    last: Mutex<Option<(u64, Arc<[Drawn]>)>>,
}

impl MixtureDraws {
    /// The source and sample of every row of stream step `step`, in row order.
    pub fn step(&self, step: u64) -> Arc<[Drawn]> {
        let mut last = self.last.lock().expect("mixture draws lock poisoned");
        if let Some((at, draws)) = last.as_ref() {
            if *at == step {
                return Arc::clone(draws);
            }
        }
        let positions = self
            .rank
            .batch_positions(self.order.len(), self.start_cursor, step);
        let draws: Arc<[Drawn]> = self.order.draws(positions).into();
        *last = Some((step, Arc::clone(&draws)));
        draws
    }
}

/// What a mixture stream's plan holds beyond a single dataset's: its draws and a plan per source.
#[derive(Debug)]
pub struct MixturePlan {
    /// The draws of the stream's steps.
    pub draws: Arc<MixtureDraws>,
    /// One plan per source, in the request's order: the source's dataset, its own field indices at
    /// the mixture's slot offsets, its rows of each batch.
    pub sources: Vec<Arc<StreamPlan>>,
}

impl StreamPlan {
    /// Validates `spec` against `dataset` and `limits`.
    pub fn new(
        dataset: Arc<Dataset>,
        spec: &StreamRequest,
        limits: &StreamLimits,
    ) -> Result<StreamPlan, PlanError> {
        let invalid = |s: String| Err(PlanError::Invalid(s));
        check_request(spec, limits)?;
        let sample_count = dataset.manifest.sample_count;
        if spec.start_cursor > sample_count {
            return invalid(format!(
                "start cursor {} is past the epoch's {sample_count} samples",
                spec.start_cursor
            ));
        }
        let (fields, slot_end) = plan_fields(&dataset, spec, limits)?;
        let rank = rank_plan(spec, sample_count, "the dataset's")?;
        let shard_samples: Vec<u64> = dataset
            .manifest
            .shards
            .iter()
            .map(|s| s.sample_count)
            .collect();
        let order = EpochOrder::new(&shard_samples, spec.seed, spec.epoch, spec.shuffle);
        Ok(StreamPlan::assemble(
            dataset, spec, limits, order, rank, fields, slot_end,
        ))
    }

    /// Validates a mixture stream: `spec` over `sources` (datasets and their weights, in the
    /// request's order), `epoch_samples` positions an epoch (`None`: the sum of the sources'
    /// samples; see `pipeline::mixture`). Every source must have the fields the request asks for
    /// (every field of the first source when it names none, and no other) in the same stored dtype
    /// and per-sample shape; the error names the source and the field.
    pub fn mixture(
        sources: Vec<(Arc<Dataset>, f64)>,
        epoch_samples: Option<u64>,
        spec: &StreamRequest,
        limits: &StreamLimits,
    ) -> Result<StreamPlan, PlanError> {
        check_request(spec, limits)?;
        let Some((first, _)) = sources.first() else {
            return Err(PlanError::Invalid("a mixture has no sources".to_string()));
        };
        check_mixture_fixed_shape(&sources, spec)?;
        let (fields, slot_end) = plan_fields(first, spec, limits)?;
        let mut source_fields = Vec::with_capacity(sources.len());
        for (dataset, _) in &sources {
            source_fields.push(agreeing_fields(
                first,
                dataset,
                &fields,
                spec.fields.is_empty(),
            )?);
        }
        let (weights, layouts): (Vec<f64>, Vec<MixtureSource>) = sources
            .iter()
            .map(|(dataset, weight)| {
                let shard_samples: Vec<u64> = dataset
                    .manifest
                    .shards
                    .iter()
                    .map(|s| s.sample_count)
                    .collect();
                let layout = MixtureSource {
                    sample_count: shard_samples.iter().sum(),
                    shard_samples,
                };
                (*weight, layout)
            })
            .unzip();
        if let Some(empty) = layouts.iter().position(|l| l.sample_count == 0) {
            return Err(PlanError::Invalid(format!(
                "mixture source '{}' has no samples",
                sources[empty].0.manifest.name
            )));
        }
        let order = MixtureOrder::new(
            layouts,
            &weights,
            spec.seed,
            spec.shuffle,
            spec.epoch,
            epoch_samples,
        )
        .map_err(|e| PlanError::Invalid(format!("mixture: {e}")))?;
        let positions = order.len();
        if spec.start_cursor > positions {
            return Err(PlanError::Invalid(format!(
                "start cursor {} is past the mixture epoch's {positions} positions",
                spec.start_cursor
            )));
        }
        let rank = rank_plan(spec, positions, "the mixture epoch's")?;
        // The mixture's positions in order: which source and sample each draws is the draws'.
        let identity = EpochOrder::new(&[positions], spec.seed, spec.epoch, ShuffleMode::None);
        let draws = Arc::new(MixtureDraws {
            order,
            rank,
            start_cursor: spec.start_cursor,
            last: Mutex::new(None),
        });
        let plans = sources
            .iter()
            .zip(source_fields)
            .enumerate()
            .map(|(index, ((dataset, _), fields))| {
                let mut plan = StreamPlan::assemble(
                    Arc::clone(dataset),
                    spec,
                    limits,
                    identity.clone(),
                    rank,
                    fields,
                    slot_end,
                );
                plan.source_of = Some((Arc::clone(&draws), index as u32));
                Arc::new(plan)
            })
            .collect();
        let mut plan = StreamPlan::assemble(
            Arc::clone(first),
            spec,
            limits,
            identity,
            rank,
            fields,
            slot_end,
        );
        plan.mixture = Some(Arc::new(MixturePlan {
            draws,
            sources: plans,
        }));
        Ok(plan)
    }

    /// The first sample of each shard of the dataset, and the sample count after the last.
    pub fn shard_first_samples(&self) -> Vec<u64> {
        let mut first_sample = 0u64;
        let mut firsts: Vec<u64> = self
            .dataset
            .manifest
            .shards
            .iter()
            .map(|shard| {
                let first = first_sample;
                first_sample += shard.sample_count;
                first
            })
            .collect();
        firsts.push(first_sample);
        firsts
    }

    /// For the plan of one source of a mixture: the rows of the batch of stream step `step` that
    /// draw from this source, in order (the slot row of each of [`Self::batch_samples`]); `None`
    /// for any other plan, whose batch is all its own.
    pub fn slot_rows(&self, step: u64) -> Option<Vec<usize>> {
        let (draws, source) = self.source_of.as_ref()?;
        let draws = draws.step(step);
        Some(
            draws
                .iter()
                .enumerate()
                .filter(|(_, d)| d.source == *source)
                .map(|(row, _)| row)
                .collect(),
        )
    }
}

/// The rules of a request that need no dataset: the spec's own (shared with the client and the
/// socket server), then the daemon's limits.
fn check_request(spec: &StreamRequest, limits: &StreamLimits) -> Result<(), PlanError> {
    let invalid = |s: String| Err(PlanError::Invalid(s));
    spec::check_batch_size(spec.batch_size).map_err(PlanError::spec)?;
    spec::check_rank(spec.rank, spec.world_size).map_err(PlanError::spec)?;
    spec::check_prefetch(spec.prefetch).map_err(PlanError::spec)?;
    if let ShuffleMode::Window { shards } = spec.shuffle {
        spec::check_window_shards(shards).map_err(PlanError::spec)?;
    }
    if spec.batch_size > limits.batch_size_max {
        return invalid(format!(
            "batch_size {} is above the daemon's limit of {}",
            spec.batch_size, limits.batch_size_max
        ));
    }
    if spec.world_size > limits.world_size_max {
        return invalid(format!(
            "world_size {} is above the daemon's limit of {}",
            spec.world_size, limits.world_size_max
        ));
    }
    Ok(())
}

/// A mixture serves fixed-shape fields only: the batch layout of a variable-length field (its rows'
/// places, its index tensor) depends on every row's length, and a mixture's rows are filled by one
/// plan per source. Refuses a batch form asked for, and a variable-length field the request would
/// serve in any source (every field when it names none), naming the source and the field.
fn check_mixture_fixed_shape(
    sources: &[(Arc<Dataset>, f64)],
    spec: &StreamRequest,
) -> Result<(), PlanError> {
    if let Some(selection) = spec.variable.first() {
        return Err(PlanError::Invalid(format!(
            "a batch form is asked for field '{}', but a mixture serves fixed-shape fields only \
             (variable-length fields are not mixed)",
            selection.name
        )));
    }
    for (dataset, _) in sources {
        let served =
            |name: &str| spec.fields.is_empty() || spec.fields.iter().any(|f| f.name == name);
        if let Some(field) = dataset
            .manifest
            .fields
            .iter()
            .find(|f| f.is_variable() && served(&f.name))
        {
            return Err(PlanError::Invalid(format!(
                "mixture source '{}': field '{}' is variable-length, and a mixture serves \
                 fixed-shape fields only (name the fixed-shape fields to serve)",
                dataset.manifest.name, field.name
            )));
        }
    }
    Ok(())
}

/// The rank's share of an epoch of `sample_count` positions (`what`: whose, for the message),
/// refused when a tail drop would serve nothing.
fn rank_plan(spec: &StreamRequest, sample_count: u64, what: &str) -> Result<RankPlan, PlanError> {
    let rank = RankPlan {
        world_size: spec.world_size,
        rank: spec.rank,
        batch_size: spec.batch_size,
        tail: spec.tail,
    };
    if spec.start_cursor == 0 && rank.tail == Tail::Drop && rank.step_samples() > sample_count {
        // Nothing would be served: say so rather than end the epoch at once, silently.
        return Err(PlanError::Invalid(format!(
            "batch_size {} x world_size {} is more than {what} {sample_count} samples: \
             with tail drop no batch would be served (lower the batch size, or use tail pad)",
            spec.batch_size, spec.world_size
        )));
    }
    Ok(rank)
}

/// `fields` (planned from mixture source `first`) as source `dataset` holds them: the same slot
/// places with `dataset`'s own field indices. Each must exist there with the same stored dtype and
/// per-sample shape; with `every` (the request named no fields) `dataset` must hold no other.
fn agreeing_fields(
    first: &Dataset,
    dataset: &Dataset,
    fields: &[FieldPlan],
    every: bool,
) -> Result<Vec<FieldPlan>, PlanError> {
    let (name, first_name) = (&dataset.manifest.name, &first.manifest.name);
    let mut agreed = Vec::with_capacity(fields.len());
    for field in fields {
        let Some(index) = dataset.field_index(&field.name) else {
            return Err(PlanError::Invalid(format!(
                "mixture source '{name}' has no field '{}', which source '{first_name}' has: the \
                 sources of a mixture serve the same fields (name the fields they share)",
                field.name
            )));
        };
        let own = &dataset.manifest.fields[index];
        if own.dtype != field.stored || own.shape != field.sample_shape {
            return Err(PlanError::Invalid(format!(
                "mixture source '{name}': field '{}' is {} of per-sample shape {:?}, in source \
                 '{first_name}' {} of shape {:?}: the sources of a mixture must agree",
                field.name, own.dtype, own.shape, field.stored, field.sample_shape
            )));
        }
        agreed.push(FieldPlan {
            field_index: index,
            ..field.clone()
        });
    }
    if every {
        if let Some(extra) = dataset
            .manifest
            .fields
            .iter()
            .find(|f| !fields.iter().any(|planned| planned.name == f.name))
        {
            return Err(PlanError::Invalid(format!(
                "mixture source '{name}' has field '{}', which source '{first_name}' lacks: the \
                 sources of a mixture serve the same fields (name the fields they share)",
                extra.name
            )));
        }
    }
    Ok(agreed)
}

impl StreamPlan {
    /// The plan's parts put together: the steps from the cursor and the slots.
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        dataset: Arc<Dataset>,
        spec: &StreamRequest,
        limits: &StreamLimits,
        order: EpochOrder,
        rank: RankPlan,
        fields: Vec<FieldPlan>,
        slot_end: u64,
    ) -> StreamPlan {
        let steps = rank.steps_from(order.len(), spec.start_cursor);
        let slot_bytes = slot_end.max(FIELD_OFFSET_ALIGN_BYTES) as usize;
        StreamPlan {
            epoch: spec.epoch,
            steps,
            order,
            rank,
            start_cursor: spec.start_cursor,
            fields,
            slot_bytes,
            slot_count: slot_count(spec.prefetch, slot_bytes, limits.ring_bytes, steps),
            on_corrupt: spec.on_corrupt,
            dataset,
            shard_gate: None,
            mixture: None,
            source_of: None,
        }
    }

    /// The global-order cursor once step `step` (counted from the stream's start) is consumed.
    pub fn cursor_after(&self, step: u64) -> u64 {
        (self.start_cursor + (step + 1) * self.rank.step_samples()).min(self.order.len())
    }

    /// The epoch step number of stream step `step`.
    pub fn epoch_step(&self, step: u64) -> u64 {
        self.start_cursor / self.rank.step_samples() + step
    }

    /// The samples of stream step `step` for this rank; in the plan of one source of a mixture,
    /// those of the batch's rows that draw from it ([`Self::slot_rows`]). Boxed: a plan is one or
    /// the other, and a batch asks once.
    pub fn batch_samples(&self, step: u64) -> Box<dyn Iterator<Item = u64> + '_> {
        if let Some((draws, source)) = &self.source_of {
            let draws = draws.step(step);
            let source = *source;
            return Box::new((0..draws.len()).filter_map(move |row| {
                (draws[row].source == source).then_some(draws[row].sample)
            }));
        }
        Box::new(
            self.rank
                .batch_positions(self.order.len(), self.start_cursor, step)
                .map(|position| self.order.sample_at(position)),
        )
    }

    /// Where every (sample, field) of stream step `step` lives, row by row (`fields.len()` entries
    /// per sample, in field order).
    pub fn placements(&self, step: u64) -> Vec<Placement> {
        let samples: Vec<u64> = self.batch_samples(step).collect();
        samples
            .iter()
            .flat_map(|&sample| self.fields.iter().map(move |field| (sample, field)))
            .map(|(sample, field)| {
                let (shard, start, end) = self.locate(sample, field.field_index);
                let blocks = self.blocks_for(shard, field.field_index, start, end);
                Placement {
                    shard,
                    start,
                    end,
                    blocks,
                }
            })
            .collect()
    }

    /// The rows of stream step `step` grouped into runs: consecutive rows whose samples are consecutive
    /// in one shard, at most `run_out_bytes_max` delivered bytes per field (at least one row). A run's
    /// bytes are contiguous in each field's stream and in the slot, so it is read, checked and gathered
    /// like one large sample. Without shuffling a batch is a few runs; fully shuffled, one run per row.
    pub fn placement_runs(&self, step: u64, run_out_bytes_max: usize) -> PlacementRuns {
        let widest = self
            .fields
            .iter()
            .map(|f| f.sample_bytes_out)
            .max()
            .unwrap_or(1)
            .max(1);
        // Rows of a variable-length field differ in length: a run is one row.
        let rows_max = if self.has_variable() {
            1
        } else {
            (run_out_bytes_max / widest).max(1)
        };
        let shards = &self.dataset.manifest.shards;
        // (first row, rows, first sample, shard)
        let mut spans: Vec<(usize, usize, u64, usize)> = Vec::new();
        for (row, sample) in self.batch_samples(step).enumerate() {
            if let Some(last) = spans.last_mut() {
                let shard = &shards[last.3];
                if sample == last.2 + last.1 as u64
                    && sample < shard.first_sample + shard.sample_count
                    && last.1 < rows_max
                {
                    last.1 += 1;
                    continue;
                }
            }
            let shard = shards.partition_point(|s| s.first_sample + s.sample_count <= sample);
            spans.push((row, 1, sample, shard));
        }
        let mut hints: Vec<(usize, u32)> = vec![(usize::MAX, 0); self.fields.len()];
        let mut placements = Vec::with_capacity(spans.len() * self.fields.len());
        for &(_, rows, sample, _) in &spans {
            for (field, hint) in self.fields.iter().zip(hints.iter_mut()) {
                let (shard, start, end) = self.locate(sample, field.field_index);
                let end = end + (rows as u64 - 1) * (end - start);
                let blocks = self.blocks_for_hinted(shard, field.field_index, start, end, hint);
                placements.push(Placement {
                    shard,
                    start,
                    end,
                    blocks,
                });
            }
        }
        PlacementRuns {
            runs: spans
                .iter()
                .map(|&(first, rows, ..)| (first, rows))
                .collect(),
            placements,
        }
    }

    /// As [`Self::blocks_for`], trying first the block where the previous range of the same field
    /// ended (`hint`: shard and block), which is where consecutive ranges usually start.
    fn blocks_for_hinted(
        &self,
        shard: usize,
        field: usize,
        start: u64,
        end: u64,
        hint: &mut (usize, u32),
    ) -> std::ops::Range<u32> {
        let blocks = self.dataset.shards[shard].metadata.field_blocks(field);
        let covers = |i: usize| {
            blocks
                .get(i)
                .is_some_and(|b| b.raw_offset <= start && start < b.raw_offset + b.raw_bytes as u64)
        };
        let first = if hint.0 == shard && covers(hint.1 as usize) {
            hint.1 as usize
        } else if hint.0 == shard && covers(hint.1 as usize + 1) {
            hint.1 as usize + 1
        } else {
            return {
                let range = self.blocks_for(shard, field, start, end);
                *hint = (shard, range.end.saturating_sub(1));
                range
            };
        };
        let mut last = first;
        while last < blocks.len() && blocks[last].raw_offset < end {
            last += 1;
        }
        *hint = (shard, (last.max(first + 1) - 1) as u32);
        first as u32..last as u32
    }

    /// Locates `sample` of dataset field `field`: the shard and the byte range within the field's
    /// stream in that shard.
    /// The shards step `step` reads, sorted, each once.
    pub fn step_shards(&self, step: u64) -> Vec<usize> {
        let mut shards: Vec<usize> = self
            .batch_samples(step)
            .map(|sample| self.locate(sample, 0).0)
            .collect();
        shards.sort_unstable();
        shards.dedup();
        shards
    }

    pub(crate) fn locate(&self, sample: u64, field: usize) -> (usize, u64, u64) {
        let shards = &self.dataset.manifest.shards;
        let shard = shards.partition_point(|s| s.first_sample + s.sample_count <= sample);
        let local = sample - shards[shard].first_sample;
        let sample_bytes = self.dataset.manifest.fields[field].sample_bytes();
        if let Some(variable) = self
            .fields
            .iter()
            .find(|f| f.field_index == field)
            .and_then(|f| f.variable.as_ref())
        {
            // The sample's values (truncated to the cap), past the shard's offsets region.
            let (first, length) = variable.locate(shard, local);
            let base = self.dataset.shards[shard].metadata.offsets_bytes(field);
            let start = base + first * sample_bytes;
            return (shard, start, start + length * sample_bytes);
        }
        (shard, local * sample_bytes, (local + 1) * sample_bytes)
    }

    /// Whether a field of the stream is variable-length.
    pub fn has_variable(&self) -> bool {
        self.fields.iter().any(|f| f.variable.is_some())
    }

    /// For each field (`None` for fixed-shape ones), the rows of a batch of `samples` whose
    /// placement in row `row` of field `at` (its position in the stream) `placement` gives: each
    /// row's length is its placement's (truncated to the cap by [`Self::locate`]).
    pub fn variable_rows<'a>(
        &self,
        samples: usize,
        placement: impl Fn(usize, usize) -> &'a Placement,
    ) -> Vec<Option<VariableRows>> {
        self.fields
            .iter()
            .enumerate()
            .map(|(at, field)| {
                let variable = field.variable.as_ref()?;
                let lengths = (0..samples)
                    .map(|row| {
                        let placement = placement(at, row);
                        (placement.end - placement.start) / field.sample_bytes_in as u64
                    })
                    .collect();
                Some(VariableRows::new(variable, lengths))
            })
            .collect()
    }

    /// The blocks of `shard`/`field` overlapping raw bytes `start..end`, as indices within the field.
    pub(crate) fn blocks_for(
        &self,
        shard: usize,
        field: usize,
        start: u64,
        end: u64,
    ) -> std::ops::Range<u32> {
        let blocks = self.dataset.shards[shard].metadata.field_blocks(field);
        // Blocks of a field hold the same raw size but the last, so the first block is found by a
        // division: one look-up instead of a binary search whose steps miss the cache when rows are
        // shuffled over a large block table.
        if let Some(size) = blocks
            .first()
            .map(|b| b.raw_bytes as u64)
            .filter(|&s| s > 0)
        {
            let guess = (start / size) as usize;
            if blocks
                .get(guess)
                .is_some_and(|b| b.raw_offset <= start && start < b.raw_offset + b.raw_bytes as u64)
            {
                let mut last = guess + 1;
                while last < blocks.len() && blocks[last].raw_offset < end {
                    last += 1;
                }
                return guess as u32..last as u32;
            }
        }
        let first = blocks.partition_point(|b| b.raw_offset + b.raw_bytes as u64 <= start);
        let last = blocks.partition_point(|b| b.raw_offset < end);
        first as u32..last as u32
    }
}

/// The fields `spec` asks of `dataset`, in slot order, and the end of the last one's batch in the
/// slot (its offsets rounded up to [`FIELD_OFFSET_ALIGN_BYTES`]). A variable-length field takes its
/// values then its index tensor (see [`variable_field_plan`]), whose offsets are read here.
fn plan_fields(
    dataset: &Arc<Dataset>,
    spec: &StreamRequest,
    limits: &StreamLimits,
) -> Result<(Vec<FieldPlan>, u64), PlanError> {
    let invalid = |s: String| Err(PlanError::Invalid(s));
    let manifest = &dataset.manifest;
    let requested: Vec<(usize, Option<DType>)> = if spec.fields.is_empty() {
        (0..manifest.fields.len()).map(|i| (i, None)).collect()
    } else {
        let mut out = Vec::with_capacity(spec.fields.len());
        for request in &spec.fields {
            let Some(index) = dataset.field_index(&request.name) else {
                let names: Vec<&str> = manifest.fields.iter().map(|f| f.name.as_str()).collect();
                return invalid(format!(
                    "dataset '{}' has no field '{}' (fields: {})",
                    manifest.name,
                    request.name,
                    names.join(", ")
                ));
            };
            if out.iter().any(|&(i, _)| i == index) {
                return invalid(format!("field '{}' is requested twice", request.name));
            }
            out.push((index, request.dtype));
        }
        out
    };
    check_variable_selections(spec, manifest, &requested)?;
    let mut fields = Vec::with_capacity(requested.len());
    let mut offset = 0u64;
    let mut offsets_bytes = 0u64;
    for (index, dtype) in requested {
        let field = &manifest.fields[index];
        let out = dtype.unwrap_or(field.dtype);
        if !decode::convert_supported(field.dtype, out) {
            return invalid(format!(
                "field '{}': cannot convert {} to {out}",
                field.name, field.dtype
            ));
        }
        let elements: u64 = field.shape.iter().product();
        let sample_bytes_out = elements * out.size_bytes() as u64;
        let Some(length_max) = field.length_max else {
            let batch_bytes = sample_bytes_out * spec.batch_size as u64;
            fields.push(FieldPlan {
                field_index: index,
                name: field.name.clone(),
                stored: field.dtype,
                out,
                sample_shape: field.shape.clone(),
                sample_bytes_in: field.sample_bytes() as usize,
                sample_bytes_out: sample_bytes_out as usize,
                offset: offset as usize,
                variable: None,
            });
            offset = (offset + batch_bytes).div_ceil(FIELD_OFFSET_ALIGN_BYTES)
                * FIELD_OFFSET_ALIGN_BYTES;
            if offset > limits.slot_bytes_max {
                return invalid(format!(
                    "a batch of {} samples needs more than the {}-byte slot limit",
                    spec.batch_size, limits.slot_bytes_max
                ));
            }
            continue;
        };
        let (plan, end) = variable_field_plan(
            dataset,
            spec,
            limits,
            VariableField {
                index,
                out,
                offset,
                length_max,
            },
            &mut offsets_bytes,
        )?;
        fields.push(plan);
        offset = end;
    }
    check_index_names(&fields)?;
    Ok((fields, offset))
}

/// A variable-length field being planned: its index in the dataset, its delivered dtype, and where
/// its batch starts in the slot.
struct VariableField {
    index: usize,
    out: DType,
    offset: u64,
    length_max: u64,
}

/// Checks the batch forms `spec` asks for against the fields the stream serves (`requested`):
/// each names one of them, a variable-length one, once, with a cap of at least one element.
fn check_variable_selections(
    spec: &StreamRequest,
    manifest: &crate::format::Manifest,
    requested: &[(usize, Option<DType>)],
) -> Result<(), PlanError> {
    let invalid = |s: String| Err(PlanError::Invalid(s));
    for selection in &spec.variable {
        let Some(&(index, _)) = requested
            .iter()
            .find(|&&(i, _)| manifest.fields[i].name == selection.name)
        else {
            return invalid(format!(
                "a batch form is asked for field '{}', which the stream does not serve",
                selection.name
            ));
        };
        if !manifest.fields[index].is_variable() {
            return invalid(format!(
                "field '{}' has a fixed shape: a batch form (padded or packed) applies only to variable-length fields",
                selection.name
            ));
        }
        if spec
            .variable
            .iter()
            .filter(|s| s.name == selection.name)
            .count()
            > 1
        {
            return invalid(format!(
                "field '{}' is given a batch form twice",
                selection.name
            ));
        }
        if selection.cap == Some(0) {
            return invalid(format!(
                "field '{}': a cap of 0 elements would serve nothing",
                selection.name
            ));
        }
    }
    Ok(())
}

/// The plan of variable-length field `variable` and where the slot's next field may start: its
/// values (`batch_size` × its length bound) then its index tensor, each page-aligned. Refuses a
/// stream beyond the slot limit, int32 offsets, or the offsets a stream holds
/// (`offsets_bytes`: those of the fields planned before, to which this one's are added); reads
/// and checks the field's offsets.
fn variable_field_plan(
    dataset: &Arc<Dataset>,
    spec: &StreamRequest,
    limits: &StreamLimits,
    variable: VariableField,
    offsets_bytes: &mut u64,
) -> Result<(FieldPlan, u64), PlanError> {
    let invalid = |s: String| Err(PlanError::Invalid(s));
    let VariableField {
        index,
        out,
        offset,
        length_max,
    } = variable;
    let field = &dataset.manifest.fields[index];
    let sample_bytes_out = field.shape.iter().product::<u64>() * out.size_bytes() as u64;
    let selection = spec.variable.iter().find(|s| s.name == field.name);
    let form = selection.map_or(VariableForm::Padded, |s| s.form);
    let cap = selection.and_then(|s| s.cap).map(u64::from);
    // A slot holds every sample at its bound: the cap, else the dataset's longest.
    let length_bound = cap.map_or(length_max, |cap| cap.min(length_max));
    let elements_max = length_bound.saturating_mul(u64::from(spec.batch_size));
    if elements_max > i32::MAX as u64 {
        return invalid(format!(
                "field '{}': a batch of {} samples of up to {length_bound} elements may hold {elements_max} elements, more than int32 lengths and offsets count; ask for a cap or a smaller batch",
                field.name, spec.batch_size
            ));
    }
    let batch_bytes = elements_max * sample_bytes_out;
    let index_offset =
        (offset + batch_bytes).div_ceil(FIELD_OFFSET_ALIGN_BYTES) * FIELD_OFFSET_ALIGN_BYTES;
    let index_bytes = (u64::from(spec.batch_size) + 1) * 4;
    let end =
        (index_offset + index_bytes).div_ceil(FIELD_OFFSET_ALIGN_BYTES) * FIELD_OFFSET_ALIGN_BYTES;
    if end > limits.slot_bytes_max {
        return invalid(format!(
                "field '{}' is variable-length with samples of up to {length_bound} elements{}: a batch of {} samples needs up to {end} bytes of slot, above the {}-byte slot limit; ask for a cap (samples truncated to it) or a smaller batch",
                field.name,
                if cap.is_some() { " (the cap)" } else { " (the dataset's longest)" },
                spec.batch_size,
                limits.slot_bytes_max
            ));
    }
    *offsets_bytes += dataset.manifest.sample_count * crate::format::OFFSET_BYTES;
    if *offsets_bytes > varlen::OFFSETS_BYTES_MAX {
        return invalid(format!(
                "the offsets of the stream's variable-length fields take {} bytes, more than the {}-byte limit a stream holds",
                *offsets_bytes,
            varlen::OFFSETS_BYTES_MAX
            ));
    }
    let ends = varlen::shared_offsets(dataset, index).map_err(PlanError::Invalid)?;
    let plan = FieldPlan {
        field_index: index,
        name: field.name.clone(),
        stored: field.dtype,
        out,
        sample_shape: field.shape.clone(),
        sample_bytes_in: field.sample_bytes() as usize,
        sample_bytes_out: sample_bytes_out as usize,
        offset: offset as usize,
        variable: Some(VariablePlan {
            form,
            length_bound,
            cap,
            index_offset: index_offset as usize,
            ends,
        }),
    };
    Ok((plan, end))
}

/// Refuses a stream that serves a field named as a variable-length field's index tensor
/// (`NAME.lengths`, `NAME.cu_seqlens`), which the layout could then not tell apart.
fn check_index_names(fields: &[FieldPlan]) -> Result<(), PlanError> {
    for field in fields.iter().filter(|f| f.variable.is_some()) {
        for suffix in ["lengths", "cu_seqlens"] {
            let index = format!("{}.{suffix}", field.name);
            if fields.iter().any(|f| f.name == index) {
                return Err(PlanError::Invalid(format!(
                    "field '{index}' is served beside variable-length field '{}', whose index tensor takes that name; leave one of them out",
                    field.name
                )));
            }
        }
    }
    Ok(())
}

/// A batch's rows grouped into runs (see [`StreamPlan::placement_runs`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacementRuns {
    /// First row and number of rows of each run, in row order.
    pub runs: Vec<(usize, usize)>,
    /// Per run, one placement per field (in field order) covering all of the run's rows.
    pub placements: Vec<Placement>,
}

/// Where one field of one sample lives: its shard, its raw byte range in the field's stream there, and
/// the blocks (indices within the field) that hold the range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Shard index.
    pub shard: usize,
    /// First raw byte of the sample in the field's stream.
    pub start: u64,
    /// One past the last raw byte.
    pub end: u64,
    /// The blocks overlapping `start..end`.
    pub blocks: std::ops::Range<u32>,
}

/// Identifies a block: shard, field and block index within the field (ordered by file position).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct BlockKey {
    pub(crate) shard: u32,
    pub(crate) field: u32,
    pub(crate) block: u32,
}

/// What filling one slot produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FillReport {
    /// Samples in the batch.
    pub samples: u32,
    /// Samples zero-filled because a block was corrupt.
    pub replaced: u32,
}

/// Why a block is unusable. Built only when a block is found bad, so the hot path carries none.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CorruptReason {
    /// The stored bytes do not hash to the checksum in the block table.
    #[error("checksum mismatch (table says {expected:016x}, payload hashes to {computed:016x})")]
    Checksum {
        /// Checksum from the block table.
        expected: u64,
        /// Checksum of the bytes read.
        computed: u64,
    },
    /// The LZ4 kernel refused the payload (GPU backend).
    #[error("LZ4 block does not decode ({status} after {produced} bytes)")]
    Lz4Kernel {
        /// The kernel's status.
        status: Lz4Status,
        /// Bytes decoded before the fault.
        produced: u32,
    },
    /// The CPU LZ4 decoder refused the payload.
    #[error("corrupt LZ4 block: {0}")]
    Lz4(String),
    /// The payload decoded to fewer bytes than the table says.
    #[error("decoded to {produced} bytes, the table says {expected}")]
    Size {
        /// `raw_bytes` from the table.
        expected: u32,
        /// Bytes the decoder produced.
        produced: usize,
    },
    /// The payload could not be read; the read error's message.
    #[error("{0}")]
    Unreadable(String),
}

/// A block found unusable, and why.
#[derive(Clone, Debug)]
pub struct CorruptBlock {
    /// The block: shard, field and block index.
    pub block: BlockRef,
    /// What is wrong with it.
    pub reason: CorruptReason,
}

impl CorruptBlock {
    /// The error that ends a stream whose policy is to fail on this block.
    pub fn to_error(&self) -> FillError {
        FillError::Corrupt {
            block: self.block.clone(),
            reason: self.reason.clone(),
        }
    }
}

impl From<decode::BlockError> for CorruptBlock {
    fn from(error: decode::BlockError) -> CorruptBlock {
        let block = error.block().clone();
        let reason = match error {
            decode::BlockError::Checksum {
                expected, computed, ..
            } => CorruptReason::Checksum { expected, computed },
            decode::BlockError::Lz4 { reason, .. } => CorruptReason::Lz4(reason),
            decode::BlockError::Size {
                expected, produced, ..
            } => CorruptReason::Size { expected, produced },
            decode::BlockError::Io { source, .. } => {
                CorruptReason::Unreadable(format!("read failed: {source}"))
            }
        };
        CorruptBlock { block, reason }
    }
}

/// A batch could not be filled.
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    /// A block is corrupt and the policy is to fail.
    #[error("{block}: {reason}")]
    Corrupt {
        /// The block: shard, field and block index.
        block: BlockRef,
        /// What is wrong with it.
        reason: CorruptReason,
    },
    /// The storage engine failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// A device operation failed (GPU backend).
    #[error("{0}")]
    Device(#[from] DeviceError),
    /// The GPU reader failed as a whole (not one block).
    #[error("{0}")]
    Read(#[from] GpuReadError),
    /// One sample needs more device memory than a round of the GPU backend has.
    #[error(
        "sample {sample} of the batch needs more device memory than one round has (staging \
         {staging_bytes} bytes, scratch {scratch_bytes} bytes, {pieces_max} gather pieces, \
         {cache_entries} cache entries of {entry_bytes} bytes): raise the GPU stream limits"
    )]
    RoundTooSmall {
        /// The sample's position in the batch.
        sample: usize,
        /// Staging buffer of a round.
        staging_bytes: usize,
        /// Shuffle scratch.
        scratch_bytes: u64,
        /// Gather pieces of a round.
        pieces_max: usize,
        /// Entries of the block cache.
        cache_entries: u32,
        /// Bytes of one cache entry.
        entry_bytes: u64,
    },
    /// The gather kernel refused pieces of its table: a bug in the batch plan, not bad data.
    #[error("the gather kernel refused {pieces} pieces (last {last}): a bug in the batch plan")]
    GatherRefused {
        /// Pieces refused.
        pieces: u32,
        /// Index of the last piece refused.
        last: u32,
    },
    /// Copying a shard into device memory ahead of the rows that read it failed (a stream whose
    /// dataset is larger than the registration budget).
    #[error("copying {} into device memory: {source}", shard.display())]
    ShardCopy {
        /// The shard.
        shard: std::path::PathBuf,
        /// Why.
        source: std::sync::Arc<std::io::Error>,
    },
    /// Reading a stream's rows from the disk failed (a dataset larger than the daemon's memory:
    /// `pipeline::cold_rows`).
    #[error("reading rows of {} from the disk: {source}", shard.display())]
    RowRead {
        /// The shard (or the dataset's directory when no shard is to blame).
        shard: std::path::PathBuf,
        /// Why.
        source: std::sync::Arc<std::io::Error>,
    },
    /// A stream's rows need more shards on the device at once than its device shard memory holds.
    #[error(
        "a round of this stream reads {needed} shards but the stream's device shard memory holds          {slots}: raise --device-shard-memory"
    )]
    ShardSlotsTooFew {
        /// Shards one round reads.
        needed: usize,
        /// Slots the stream has.
        slots: usize,
    },
    /// Shards a batch reads could not be made ready (a dataset in object storage: the store
    /// failed after its retries, or the cache has no room); the message names the object.
    #[error("{0}")]
    ShardsUnavailable(String),
    /// The thread planning a resident stream's rows stopped before this step (it panicked).
    #[error("the planning thread stopped before step {step}: a bug in the batch plan")]
    PlannerStopped {
        /// The step that was not planned.
        step: u64,
    },
}

impl FillError {
    /// Whether the device ran out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, FillError::Device(DeviceError::Driver(error)) if error.is_out_of_memory())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Consumers read these texts: they say what is wrong in words, not as Rust debug output.
    #[test]
    fn lz4_kernel_faults_are_told_in_words() {
        for status in [
            Lz4Status::InputOverrun,
            Lz4Status::OutputOverrun,
            Lz4Status::BadOffset,
            Lz4Status::SizeMismatch,
            Lz4Status::BadJob,
            Lz4Status::Unknown(9),
        ] {
            let text = CorruptReason::Lz4Kernel {
                status,
                produced: 7,
            }
            .to_string();
            assert!(!text.contains(&format!("{status:?}")), "{text}");
            assert!(text.contains("after 7 bytes"), "{text}");
        }
    }
}
