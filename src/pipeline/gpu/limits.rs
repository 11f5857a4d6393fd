//! The GPU backend's settings and figures: the device memory and tuning of one stream
//! ([`GpuStreamLimits`], with its defaults and bounds), the zero-copy policy ([`ZeroCopy`]), and where
//! a stream's fill time goes ([`GpuFillTimings`]).

/// The default [`GpuStreamLimits::rounds_in_flight`].
pub const ROUNDS_IN_FLIGHT_DEFAULT: usize = 3;
/// Fewest [`GpuStreamLimits::rounds_in_flight`]: one round queued while the host plans the next.
pub const ROUNDS_IN_FLIGHT_MIN: usize = 2;
/// Most sets of round buffers a stream may ask for (see [`GpuStreamLimits::rounds_in_flight`]).
pub const ROUNDS_IN_FLIGHT_MAX: usize = 8;

/// The default [`GpuStreamLimits::inline_gather_launches`]: a dataset-order round of up to 8 MiB out
/// in 16 KiB pieces.
pub const INLINE_GATHER_LAUNCHES_DEFAULT: usize = 2;
/// Most [`GpuStreamLimits::inline_gather_launches`] (the fewest is 0: never inline).
pub const INLINE_GATHER_LAUNCHES_MAX: usize = 8;

/// The default [`GpuStreamLimits::batch_group_max`]: the most.
pub const BATCH_GROUP_DEFAULT: usize = BATCH_GROUP_MAX;
/// Fewest [`GpuStreamLimits::batch_group_max`]: a round per batch.
pub const BATCH_GROUP_MIN: usize = 1;
/// Most batches one round of a resident stream gathers (see [`GpuStreamLimits::batch_group_max`]).
pub const BATCH_GROUP_MAX: usize = 16;

/// The default [`GpuStreamLimits::wait_spin`]: none, the filler sleeps at once.
pub const WAIT_SPIN_DEFAULT: std::time::Duration = std::time::Duration::ZERO;
/// Longest spin of [`GpuStreamLimits::wait_spin`].
pub const WAIT_SPIN_MAX: std::time::Duration = std::time::Duration::from_millis(1);

/// The default [`GpuStreamLimits::gather_piece_out_bytes`]: small enough that a batch of
/// consecutive samples spreads over many thread blocks. A thread block converts one piece at a time,
/// and on the H100 a piece of 64 KiB took one block about 20 µs: a batch of 1024 rows of 2 KiB in
/// dataset order (64 such pieces, so 64 of the 132 multiprocessors busy) took 22 µs of gather, a
/// third of the round.
pub const GATHER_PIECE_OUT_BYTES_DEFAULT: u64 = 16 << 10;
/// Smallest [`GpuStreamLimits::gather_piece_out_bytes`].
pub const GATHER_PIECE_OUT_BYTES_MIN: u64 = 4 << 10;
/// Largest [`GpuStreamLimits::gather_piece_out_bytes`].
pub const GATHER_PIECE_OUT_BYTES_MAX: u64 = 1 << 20;

/// The default [`GpuStreamLimits::plan_threads`]: 0, chosen by the stream (twelve, at most the
/// host's CPU count).
pub const PLAN_THREADS_DEFAULT: usize = 0;
/// Most [`GpuStreamLimits::plan_threads`].
pub const PLAN_THREADS_MAX: usize = 32;

/// Device memory of one GPU stream, all allocated when the stream opens.
#[derive(Clone, Copy, Debug)]
pub struct GpuStreamLimits {
    /// Stored blocks read in one round (one such buffer per round in flight).
    pub staging_bytes: usize,
    /// Decoded LZ4 blocks kept on the device (the block cache).
    pub cache_bytes: usize,
    /// Room for byte-shuffled blocks to be decoded before they are unshuffled, per round.
    pub scratch_bytes: usize,
    /// Gather pieces per round.
    pub pieces_max: usize,
    /// Rounds queued on the device at once (2 to [`ROUNDS_IN_FLIGHT_MAX`]), each with its own staging
    /// buffer and tables: the next rounds' reads are queued while the device runs the oldest.
    pub rounds_in_flight: usize,
    /// When raw blocks are read by the gather kernel straight from registered page-cache memory
    /// instead of being staged whole.
    pub zero_copy: ZeroCopy,
    /// Device memory a resident stream in dataset order or a window shuffle may fill with copies of
    /// the shards it reads next (see `device_shards`); streams use as many whole-shard slots as fit,
    /// and none when fewer than two do.
    pub device_shard_bytes: u64,
    /// Threads of a stream's loader that copy windows the registration budget has no room for
    /// through pinned buffers (see `copy_helpers`; about a host core each while they copy); 0:
    /// such windows are registered for their copy. In a full shuffle beyond the budget, the
    /// threads (the filler among them) copying the rows of windows not registered (see
    /// `row_copies`); 0 there: eight, at most half the host's CPUs.
    pub loader_copy_threads: usize,
    /// How long the filler polls a round for completion before it sleeps until the device wakes it
    /// (at most [`WAIT_SPIN_MAX`]; zero: it sleeps at once). A sleeping filler wakes some tens of
    /// microseconds after the round is done; polling costs the host core it runs on.
    pub wait_spin: std::time::Duration,
    /// Resident rounds of at most this many launches of [`crate::kernels::GATHER_INLINE_PIECES_MAX`]
    /// pieces pass their piece table in the gather's launch parameters, every piece's region
    /// resolved on the host, instead of the kernel reading the piece and region tables from pinned
    /// memory (over a link the shard copies keep busy); needs a driver taking 32 KiB of parameters
    /// (CUDA 12.1). 0: never; at most [`INLINE_GATHER_LAUNCHES_MAX`].
    pub inline_gather_launches: usize,
    /// Most consecutive small batches of a resident stream one round gathers into their slots (one
    /// launch and one completion for the group instead of one each), within 4 MiB of output and one
    /// launch's inline pieces; 1: a round per batch (at most
    /// [`BATCH_GROUP_MAX`]).
    pub batch_group_max: usize,
    /// Largest output of a gather piece made by merging adjacent samples
    /// ([`GATHER_PIECE_OUT_BYTES_MIN`] to [`GATHER_PIECE_OUT_BYTES_MAX`]; see
    /// [`GATHER_PIECE_OUT_BYTES_DEFAULT`]).
    pub gather_piece_out_bytes: u64,
    /// Threads planning a resident stream's steps ahead of its filler (1 to [`PLAN_THREADS_MAX`]);
    /// 0: twelve, at most the host's CPU count.
    pub plan_threads: usize,
}

/// When the gather kernel reads rows of raw blocks straight from page-cache memory registered and
/// mapped for the device (zero-copy, over PCIe, row by row) instead of staging whole blocks in device
/// memory first. Either way every byte is verified before its batch is handed off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroCopy {
    /// Always stage whole blocks.
    Off,
    /// Read a block's rows in place when a run uses less than half of it (shuffled orders), stage it
    /// when a run uses most of it (in order: the copy engines move whole blocks at the PCIe limit).
    Auto,
    /// Read every raw block in place when its window can be mapped.
    Always,
}

impl ZeroCopy {
    /// The name used in configuration and status.
    pub fn name(self) -> &'static str {
        match self {
            ZeroCopy::Off => "off",
            ZeroCopy::Auto => "auto",
            ZeroCopy::Always => "always",
        }
    }
}

impl std::str::FromStr for ZeroCopy {
    type Err = String;

    fn from_str(text: &str) -> Result<ZeroCopy, String> {
        match text {
            "off" => Ok(ZeroCopy::Off),
            "auto" => Ok(ZeroCopy::Auto),
            "always" => Ok(ZeroCopy::Always),
            other => Err(format!("{other:?} is not auto, always or off")),
        }
    }
}

/// Default [`GpuStreamLimits::device_shard_bytes`]: room for two windows of four shards of 512 MiB
/// (the window being served and the next) with their headers, 6 % of an 80 GiB GPU. With 4 GiB
/// (seven such slots) the next window's last shard could not be copied before its window began.
pub const DEVICE_SHARD_BYTES_DEFAULT: u64 = 5 << 30;

/// Default [`GpuStreamLimits::loader_copy_threads`]: none. Copy threads move more than registering
/// beyond the budget on the H100 test machine, but on several host cores against one (figures in
/// `copy_helpers`), and the host's cores belong to the training processes first.
pub const LOADER_COPY_THREADS_DEFAULT: usize = 0;

/// The most [`GpuStreamLimits::loader_copy_threads`].
pub const LOADER_COPY_THREADS_MAX: usize = 16;

impl GpuStreamLimits {
    /// Defaults for a GPU node: 64 MiB staging per round in flight, a 256 MiB block cache, 64 MiB of
    /// shuffle scratch, 64 Ki gather pieces (2 MiB of table) per round, three rounds in flight.
    pub fn node_defaults() -> GpuStreamLimits {
        GpuStreamLimits {
            staging_bytes: 64 << 20,
            cache_bytes: 256 << 20,
            scratch_bytes: 64 << 20,
            pieces_max: 64 << 10,
            rounds_in_flight: ROUNDS_IN_FLIGHT_DEFAULT,
            zero_copy: ZeroCopy::Auto,
            device_shard_bytes: DEVICE_SHARD_BYTES_DEFAULT,
            loader_copy_threads: LOADER_COPY_THREADS_DEFAULT,
            wait_spin: WAIT_SPIN_DEFAULT,
            inline_gather_launches: INLINE_GATHER_LAUNCHES_DEFAULT,
            batch_group_max: BATCH_GROUP_DEFAULT,
            gather_piece_out_bytes: GATHER_PIECE_OUT_BYTES_DEFAULT,
            plan_threads: PLAN_THREADS_DEFAULT,
        }
    }
}

/// Host time spent in each phase of filling slots. Device work is asynchronous: `wait_s` is the time
/// the host waited for it; the rest is the host's own work (planning, queueing reads and kernels,
/// reading outcomes).
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuFillTimings {
    /// Planning rounds on the host (resident streams: waiting for the planning threads).
    pub plan_s: f64,
    /// Resident streams: seconds the planning threads spent planning, summed over the threads.
    pub planning_threads_s: f64,
    /// Queueing reads (host-side reads of the bounce path and cuFile included).
    pub read_s: f64,
    /// Queueing checksum verification and LZ4 decoding, and reading their outcomes.
    pub decode_s: f64,
    /// Building and queueing the gather.
    pub gather_s: f64,
    /// Waiting for the device to finish rounds.
    pub wait_s: f64,
    /// Rounds run.
    pub rounds: u64,
    /// Rounds of resident streams that read some shards from their device copies.
    pub rounds_from_device_copies: u64,
    /// Rounds of resident streams whose piece table went in the gather's launch parameters.
    pub rounds_inline: u64,
    /// Batches gathered by a round together with others (see [`GpuStreamLimits::batch_group_max`]).
    pub batches_grouped: u64,
    /// Waiting for the loader of a stream beyond the registration budget to queue the copy of a
    /// shard a round reads.
    pub copy_wait_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Configuration refuses values outside the bounds exported here: the defaults must lie
    /// within them.
    #[test]
    fn node_defaults_lie_within_the_bounds() {
        let limits = GpuStreamLimits::node_defaults();
        assert_eq!(limits.rounds_in_flight, ROUNDS_IN_FLIGHT_DEFAULT);
        assert!((ROUNDS_IN_FLIGHT_MIN..=ROUNDS_IN_FLIGHT_MAX).contains(&limits.rounds_in_flight));
        assert_eq!(limits.wait_spin, WAIT_SPIN_DEFAULT);
        assert!(limits.wait_spin <= WAIT_SPIN_MAX);
        assert_eq!(
            limits.inline_gather_launches,
            INLINE_GATHER_LAUNCHES_DEFAULT
        );
        assert!(limits.inline_gather_launches <= INLINE_GATHER_LAUNCHES_MAX);
        assert_eq!(limits.batch_group_max, BATCH_GROUP_DEFAULT);
        assert!((BATCH_GROUP_MIN..=BATCH_GROUP_MAX).contains(&limits.batch_group_max));
        assert_eq!(
            limits.gather_piece_out_bytes,
            GATHER_PIECE_OUT_BYTES_DEFAULT
        );
        assert!((GATHER_PIECE_OUT_BYTES_MIN..=GATHER_PIECE_OUT_BYTES_MAX)
            .contains(&limits.gather_piece_out_bytes));
        assert_eq!(limits.plan_threads, PLAN_THREADS_DEFAULT);
        assert!(limits.plan_threads <= PLAN_THREADS_MAX);
        assert!(limits.loader_copy_threads <= LOADER_COPY_THREADS_MAX);
    }
}
