//! What makes a [`StreamSpec`] valid on its own, before any dataset is looked at: one set of checks and
//! messages for the client (which checks before it sends), the daemon's socket server (which checks
//! every `OpenStream` it decodes) and the pipeline (which checks its own requests, built from a spec
//! or by a benchmark). Checks that need the dataset or the daemon's limits (field names, conversions,
//! the start cursor, `batch_size_max`) stay with the daemon.

use crate::protocol::{
    mixture_extension_bytes, variable_extension_bytes, Device, MixtureSource, Shuffle, StreamSpec,
    DEVICE_UUID_BYTES, FRAME_BYTES_MAX, FRAME_HEADER_BYTES, MIXTURE_SOURCES_MAX, SLOTS_MAX,
    STREAM_FIELDS_MAX, STRING_BYTES_MAX,
};
use crate::protocol::{CorruptPolicy, Tail};

/// Default number of slots a stream asks the daemon to fill ahead of the consumer.
pub const PREFETCH_DEFAULT: u32 = 4;
/// The most slots a stream has (the protocol's `SLOTS_MAX`): the bound of `prefetch`, and of the
/// slots a daemon gives a stream of small batches.
pub const PREFETCH_MAX: u32 = SLOTS_MAX;

/// Field offsets within a slot are multiples of this (a page): the daemon lays fields out on it, the
/// client refuses a layout that is not; mappings of slots stay aligned for any element type, and
/// device copies stay aligned for 16-byte vector access.
pub const FIELD_OFFSET_ALIGN_BYTES: u64 = 4096;

/// Bytes of an `OpenStream` payload after the dataset name and the field list (`docs/PROTOCOL.md`).
pub const OPEN_STREAM_FIXED_BYTES: usize = 51;

/// Why a stream spec is invalid; the message names the field at fault and its bounds.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SpecError(pub String);

/// `batch_size` is at least 1.
pub fn check_batch_size(batch_size: u32) -> Result<(), SpecError> {
    if batch_size == 0 {
        return Err(SpecError("batch_size must be at least 1".to_string()));
    }
    Ok(())
}

/// `world_size` is at least 1 and `rank` is below it.
pub fn check_rank(rank: u32, world_size: u32) -> Result<(), SpecError> {
    if world_size == 0 || rank >= world_size {
        return Err(SpecError(format!(
            "rank {rank} is not below world_size {world_size}"
        )));
    }
    Ok(())
}

/// `prefetch` is 1 to [`SLOTS_MAX`].
pub fn check_prefetch(prefetch: u32) -> Result<(), SpecError> {
    if prefetch == 0 || prefetch > SLOTS_MAX {
        return Err(SpecError(format!(
            "prefetch must be 1 to {SLOTS_MAX}, not {prefetch}"
        )));
    }
    Ok(())
}

/// A shuffle window holds at least one shard.
pub fn check_window_shards(shards: u32) -> Result<(), SpecError> {
    if shards == 0 {
        return Err(SpecError(
            "a shuffle window must hold at least one shard".to_string(),
        ));
    }
    Ok(())
}

/// Bytes the `OpenStream` frame of `spec` takes, header included.
pub fn open_stream_frame_bytes(spec: &StreamSpec) -> usize {
    let fields: usize = spec
        .fields
        .iter()
        .map(|field| 2 + field.name.len() + 1)
        .sum();
    let mixture = !spec.sources.is_empty();
    let variable = !spec.variable.is_empty();
    // A CUDA stream with extension records writes a UUID's place even without one.
    let uuid = match (spec.device, spec.device_uuid) {
        (_, Some(_)) => DEVICE_UUID_BYTES,
        (Device::Cuda(_), None) if mixture || variable => DEVICE_UUID_BYTES,
        _ => 0,
    };
    let mut extensions = 0;
    if mixture {
        extensions += mixture_extension_bytes(&spec.sources);
    }
    if variable {
        extensions += variable_extension_bytes(&spec.variable);
    }
    FRAME_HEADER_BYTES
        + 2
        + spec.dataset.len()
        + 2
        + OPEN_STREAM_FIXED_BYTES
        + fields
        + uuid
        + extensions
}

/// A mixture's sources: 2 to [`MIXTURE_SOURCES_MAX`], each named (1 to [`STRING_BYTES_MAX`] bytes)
/// once, each weight positive and finite; an epoch length, if given, at least 1.
pub fn check_mixture(
    sources: &[MixtureSource],
    epoch_samples: Option<u64>,
) -> Result<(), SpecError> {
    if sources.len() < 2 || sources.len() > MIXTURE_SOURCES_MAX {
        return Err(SpecError(format!(
            "a mixture has 2 to {MIXTURE_SOURCES_MAX} sources, not {}",
            sources.len()
        )));
    }
    for (index, source) in sources.iter().enumerate() {
        if source.dataset.is_empty() || source.dataset.len() > STRING_BYTES_MAX {
            return Err(SpecError(format!(
                "mixture source {index}: the dataset name must be 1 to {STRING_BYTES_MAX} bytes, \
                 not {}",
                source.dataset.len()
            )));
        }
        if !(source.weight.is_finite() && source.weight > 0.0) {
            return Err(SpecError(format!(
                "mixture source '{}': weight {} is not a positive finite number",
                source.dataset, source.weight
            )));
        }
        if sources[..index].iter().any(|s| s.dataset == source.dataset) {
            return Err(SpecError(format!(
                "mixture source '{}' is given twice (give it one weight)",
                source.dataset
            )));
        }
    }
    if epoch_samples == Some(0) {
        return Err(SpecError(
            "a mixture's epoch holds at least one sample".to_string(),
        ));
    }
    Ok(())
}

/// The sources of a mixture as the bindings show them: `web (0.7), code (0.3)`.
pub fn mixture_name(sources: &[MixtureSource]) -> String {
    let named: Vec<String> = sources
        .iter()
        .map(|s| format!("{} ({})", s.dataset, s.weight))
        .collect();
    named.join(", ")
}

impl StreamSpec {
    /// A spec for `batch_size` samples a step from `dataset`, with the defaults: every field in its
    /// stored dtype, seed 0, epoch 0, dataset order, rank 0 of a world of 1, the tail dropped, starting
    /// at the beginning of the epoch, [`PREFETCH_DEFAULT`] slots, failing on corrupt blocks, host memory.
    pub fn new(dataset: impl Into<String>, batch_size: u32) -> StreamSpec {
        StreamSpec {
            dataset: dataset.into(),
            fields: Vec::new(),
            batch_size,
            seed: 0,
            epoch: 0,
            shuffle: Shuffle::None,
            rank: 0,
            world_size: 1,
            tail: Tail::Drop,
            start_cursor: 0,
            prefetch: PREFETCH_DEFAULT,
            on_corrupt: CorruptPolicy::Fail,
            device: Device::Cpu,
            device_uuid: None,
            sources: Vec::new(),
            mixture_epoch_samples: None,
            variable: Vec::new(),
        }
    }

    /// A spec for `batch_size` samples a step drawn from `sources` with their weights (a mixture;
    /// `dataset` stays empty), with the defaults of [`StreamSpec::new`].
    pub fn mixture(sources: Vec<MixtureSource>, batch_size: u32) -> StreamSpec {
        StreamSpec {
            sources,
            ..StreamSpec::new(String::new(), batch_size)
        }
    }

    /// What the stream reads, for messages: the dataset, or the mixture's sources.
    pub fn source_name(&self) -> String {
        if self.sources.is_empty() {
            format!("'{}'", self.dataset)
        } else {
            format!("mixture of {}", mixture_name(&self.sources))
        }
    }

    /// Starts the stream at `step` of the epoch: `start_cursor = step × world_size × batch_size`.
    ///
    /// The cursor is computed from the current `world_size` and `batch_size`, so call this after setting
    /// them. A product that overflows saturates; the daemon refuses a cursor past the end of the epoch
    /// (`BadRequest`).
    pub fn start_at_step(&mut self, step: u64) -> &mut StreamSpec {
        self.start_cursor = step
            .saturating_mul(u64::from(self.world_size))
            .saturating_mul(u64::from(self.batch_size));
        self
    }

    /// Continues from a checkpoint: takes the seed, epoch and shuffle that define the epoch's order,
    /// and the cursor, from `state`. The rank, world size and batch size stay as set here: the order
    /// does not depend on them, so a checkpoint resumes at any world size (elastic resume).
    ///
    /// The spec's dataset must be the state's, and a seed, epoch or shuffle set here (any value but
    /// the one [`StreamSpec::new`] gives) must be the state's too: a checkpoint never silently
    /// replaces what the caller asked for. The error names the field and both values.
    pub fn resume(&mut self, state: &StreamState) -> Result<&mut StreamSpec, SpecError> {
        let unset = StreamSpec::new(String::new(), 1);
        if self.dataset != state.dataset || self.sources != state.sources {
            let name = |dataset: &str, sources: &[MixtureSource]| {
                if sources.is_empty() {
                    format!("'{dataset}'")
                } else {
                    format!("mixture of {}", mixture_name(sources))
                }
            };
            return Err(resume_mismatch(
                "dataset",
                &name(&self.dataset, &self.sources),
                &name(&state.dataset, &state.sources),
            ));
        }
        check_resumed(
            "mixture epoch length",
            &EpochSamples(self.mixture_epoch_samples),
            &EpochSamples(state.mixture_epoch_samples),
            Some(&EpochSamples(None)),
        )?;
        check_resumed("seed", &self.seed, &state.seed, Some(&unset.seed))?;
        check_resumed("epoch", &self.epoch, &state.epoch, Some(&unset.epoch))?;
        check_resumed(
            "shuffle",
            &ShuffleName(self.shuffle),
            &ShuffleName(state.shuffle),
            Some(&ShuffleName(unset.shuffle)),
        )?;
        self.seed = state.seed;
        self.epoch = state.epoch;
        self.shuffle = state.shuffle;
        self.mixture_epoch_samples = state.mixture_epoch_samples;
        self.start_cursor = state.cursor;
        Ok(self)
    }

    /// Every check that needs nothing but the spec: string and frame bounds (what the encoder would
    /// otherwise panic on), batch size, rank and world size, prefetch, shuffle window, device ordinal.
    pub fn validate(&self) -> Result<(), SpecError> {
        if !self.sources.is_empty() || self.mixture_epoch_samples.is_some() {
            if !self.dataset.is_empty() {
                return Err(SpecError(format!(
                    "a mixture names its datasets in its sources: leave the dataset ('{}') empty",
                    self.dataset
                )));
            }
            check_mixture(&self.sources, self.mixture_epoch_samples)?;
        } else if self.dataset.is_empty() || self.dataset.len() > STRING_BYTES_MAX {
            return Err(SpecError(format!(
                "the dataset name must be 1 to {STRING_BYTES_MAX} bytes, not {}",
                self.dataset.len()
            )));
        }
        if self.fields.len() > STREAM_FIELDS_MAX {
            return Err(SpecError(format!(
                "{} fields requested, at most {STREAM_FIELDS_MAX}",
                self.fields.len()
            )));
        }
        if let Some(field) = self
            .fields
            .iter()
            .find(|field| field.name.is_empty() || field.name.len() > STRING_BYTES_MAX)
        {
            return Err(SpecError(format!(
                "field names must be 1 to {STRING_BYTES_MAX} bytes, not {}",
                field.name.len()
            )));
        }
        if self.variable.len() > STREAM_FIELDS_MAX {
            return Err(SpecError(format!(
                "{} batch forms requested, at most {STREAM_FIELDS_MAX}",
                self.variable.len()
            )));
        }
        if let Some(variable) = self
            .variable
            .iter()
            .find(|v| v.name.is_empty() || v.name.len() > STRING_BYTES_MAX)
        {
            return Err(SpecError(format!(
                "field names must be 1 to {STRING_BYTES_MAX} bytes, not {}",
                variable.name.len()
            )));
        }
        if let Some(variable) = self.variable.iter().find(|v| v.cap == Some(0)) {
            return Err(SpecError(format!(
                "field '{}': a cap of 0 elements would serve nothing",
                variable.name
            )));
        }
        let frame_bytes = open_stream_frame_bytes(self);
        if frame_bytes > FRAME_BYTES_MAX {
            return Err(SpecError(format!(
                "the request takes {frame_bytes} bytes, more than a frame's {FRAME_BYTES_MAX}"
            )));
        }
        check_batch_size(self.batch_size)?;
        check_rank(self.rank, self.world_size)?;
        check_prefetch(self.prefetch)?;
        if let Shuffle::Window(shards) = self.shuffle {
            check_window_shards(shards)?;
        }
        if self.device == Device::Cpu && self.device_uuid.is_some() {
            return Err(SpecError(
                "a device UUID names a GPU: it is given only for a stream on a CUDA device"
                    .to_string(),
            ));
        }
        if self.device == Device::Cuda(u32::MAX) {
            return Err(SpecError(
                "CUDA ordinal u32::MAX is reserved for host memory on the wire".to_string(),
            ));
        }
        Ok(())
    }
}

/// `field` of a spec being resumed: `given` (the spec's value) must equal `state` (the checkpoint's),
/// unless it is `unset` (the value [`StreamSpec::new`] gives, which the state fills in).
fn check_resumed<T: PartialEq + std::fmt::Display>(
    field: &str,
    given: &T,
    state: &T,
    unset: Option<&T>,
) -> Result<(), SpecError> {
    if given == state || unset == Some(given) {
        return Ok(());
    }
    Err(resume_mismatch(field, given, state))
}

/// The error of a resume whose `field` was given as `given` while the resume state holds `state`.
/// (The Python binding, which knows which arguments were passed, reports with it too.)
pub fn resume_mismatch(
    field: &str,
    given: &dyn std::fmt::Display,
    state: &dyn std::fmt::Display,
) -> SpecError {
    SpecError(format!(
        "{field} {given} was asked for, but the resume state is of {field} {state}: a checkpoint \
         continues the stream it was taken from (leave {field} unset, or give the state's value)"
    ))
}

/// A mixture's epoch length as messages show it: a number, or `the default`.
#[derive(PartialEq)]
struct EpochSamples(Option<u64>);

impl std::fmt::Display for EpochSamples {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(samples) => write!(f, "{samples}"),
            None => write!(f, "the default"),
        }
    }
}

/// A shuffle as the bindings name it: `none`, `window of N shards`, `full`.
#[derive(PartialEq)]
pub struct ShuffleName(pub Shuffle);

impl std::fmt::Display for ShuffleName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Shuffle::None => write!(f, "none"),
            Shuffle::Window(shards) => write!(f, "window ({shards} shards)"),
            Shuffle::Full => write!(f, "full"),
        }
    }
}

/// Where an epoch stands, enough to resume it: the inputs of the epoch's global order and the cursor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamState {
    /// Dataset name (empty for a mixture).
    pub dataset: String,
    /// A mixture's sources with their weights; empty for a single dataset.
    pub sources: Vec<MixtureSource>,
    /// A mixture's epoch length, if it was given.
    pub mixture_epoch_samples: Option<u64>,
    /// Shuffle seed.
    pub seed: u64,
    /// Epoch.
    pub epoch: u64,
    /// Sample order.
    pub shuffle: Shuffle,
    /// Ranks that consumed the epoch together.
    pub world_size: u32,
    /// Samples per batch on each rank.
    pub batch_size: u32,
    /// Positions of the epoch's global order consumed by all ranks together: the `cursor_after` of
    /// the last batch yielded, or the spec's `start_cursor` before any.
    pub cursor: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{FieldRequest, Message};

    #[test]
    fn the_frame_size_rule_matches_the_encoder() {
        let mut spec = StreamSpec::new("tokens", 32);
        spec.fields = vec![
            FieldRequest {
                name: "ids".to_string(),
                dtype: None,
            },
            FieldRequest {
                name: "mask".to_string(),
                dtype: Some(crate::DType::F32),
            },
        ];
        let encoded = Message::OpenStream(spec.clone()).encode();
        assert_eq!(encoded.len(), open_stream_frame_bytes(&spec));
    }

    #[test]
    fn each_rule_names_the_field_at_fault() {
        let base = StreamSpec::new("tokens", 32);
        type Edit = Box<dyn Fn(&mut StreamSpec)>;
        let cases: Vec<(Edit, &str)> = vec![
            (Box::new(|s| s.dataset.clear()), "dataset name"),
            (Box::new(|s| s.batch_size = 0), "batch_size"),
            (Box::new(|s| s.rank = 1), "rank 1 is not below world_size 1"),
            (Box::new(|s| s.world_size = 0), "world_size 0"),
            (Box::new(|s| s.prefetch = 0), "prefetch"),
            (Box::new(|s| s.prefetch = SLOTS_MAX + 1), "prefetch"),
            (
                Box::new(|s| s.shuffle = Shuffle::Window(0)),
                "at least one shard",
            ),
            (Box::new(|s| s.device = Device::Cuda(u32::MAX)), "reserved"),
            (
                Box::new(|s| s.dataset = "d".repeat(STRING_BYTES_MAX + 1)),
                "dataset name",
            ),
        ];
        assert!(base.validate().is_ok());
        for (break_it, expected) in cases {
            let mut spec = base.clone();
            break_it(&mut spec);
            let error = spec.validate().expect_err(expected);
            assert!(error.0.contains(expected), "{error} lacks {expected:?}");
        }
    }

    fn source(dataset: &str, weight: f64) -> MixtureSource {
        MixtureSource {
            dataset: dataset.into(),
            weight,
        }
    }

    /// A mixture's rules name the source and the value at fault.
    #[test]
    fn each_mixture_rule_names_the_source_at_fault() {
        let good = StreamSpec::mixture(vec![source("web", 0.7), source("code", 0.3)], 8);
        assert!(good.validate().is_ok());
        let cases: Vec<(StreamSpec, &str)> = vec![
            (
                StreamSpec::mixture(vec![source("web", 1.0)], 8),
                "2 to 64 sources, not 1",
            ),
            (
                StreamSpec::mixture(vec![source("web", 1.0), source("code", -1.0)], 8),
                "mixture source 'code': weight -1",
            ),
            (
                StreamSpec::mixture(vec![source("web", 1.0), source("web", 2.0)], 8),
                "'web' is given twice",
            ),
            (
                StreamSpec::mixture(vec![source("web", 1.0), source("", 2.0)], 8),
                "mixture source 1: the dataset name",
            ),
            (
                StreamSpec {
                    dataset: "web".into(),
                    ..good.clone()
                },
                "leave the dataset ('web') empty",
            ),
            (
                StreamSpec {
                    mixture_epoch_samples: Some(0),
                    ..good.clone()
                },
                "at least one sample",
            ),
        ];
        for (spec, expected) in cases {
            let error = spec.validate().expect_err(expected);
            assert!(error.0.contains(expected), "{error} lacks {expected:?}");
        }
    }

    fn checkpoint_of_big() -> StreamState {
        StreamState {
            dataset: "big".into(),
            sources: Vec::new(),
            mixture_epoch_samples: None,
            seed: 0,
            epoch: 2,
            shuffle: Shuffle::None,
            world_size: 4,
            batch_size: 1000,
            cursor: 8000,
        }
    }

    /// A resume state silently overrode explicit arguments: a spec of dataset `ds1` resumed from a
    /// checkpoint of `big` streamed `big`, and a full shuffle of seed 7 resumed from a checkpoint in
    /// dataset order streamed in dataset order. Each mismatch is now an error naming the field and
    /// both values.
    #[test]
    fn a_resume_state_never_overrides_what_the_spec_asks_for() {
        let state = checkpoint_of_big();
        let mut other_dataset = StreamSpec::new("ds1", 500);
        let error = other_dataset.resume(&state).expect_err("another dataset");
        assert!(
            error.0.contains("dataset 'ds1'") && error.0.contains("dataset 'big'"),
            "{error}"
        );
        assert_eq!(other_dataset.dataset, "ds1");

        let mut full = StreamSpec::new("big", 1000);
        full.shuffle = Shuffle::Full;
        full.seed = 7;
        let error = full.resume(&state).expect_err("another seed");
        assert!(
            error.0.contains("seed 7") && error.0.contains("seed 0"),
            "{error}"
        );
        full.seed = 0;
        let error = full.resume(&state).expect_err("another shuffle");
        assert!(
            error.0.contains("shuffle full") && error.0.contains("shuffle none"),
            "{error}"
        );
        assert_eq!(full.start_cursor, 0, "a refused resume changes nothing");

        let mut epoch = StreamSpec::new("big", 1000);
        epoch.epoch = 5;
        let error = epoch.resume(&state).expect_err("another epoch");
        assert!(
            error.0.contains("epoch 5") && error.0.contains("epoch 2"),
            "{error}"
        );
    }

    /// What the spec leaves unset (as [`StreamSpec::new`] gives it) or sets to the state's values is
    /// taken from the state, with its cursor.
    #[test]
    fn a_resume_fills_what_the_spec_leaves_unset() {
        let mut state = checkpoint_of_big();
        state.seed = 7;
        state.shuffle = Shuffle::Window(4);
        let mut spec = StreamSpec::new("big", 250);
        spec.resume(&state).expect("unset fields are the state's");
        assert_eq!(
            (spec.seed, spec.epoch, spec.shuffle, spec.start_cursor),
            (7, 2, Shuffle::Window(4), 8000)
        );
        let mut same = StreamSpec::new("big", 250);
        same.seed = 7;
        same.shuffle = Shuffle::Window(4);
        same.epoch = 2;
        same.resume(&state).expect("the state's own values");
        assert_eq!(same, spec);
    }
}
