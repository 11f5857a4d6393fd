//! The sample order of an epoch and each rank's share of it.
//!
//! # The rule
//!
//! The **global order** of an epoch is a sequence of every sample index exactly once. It is a pure
//! function of the dataset's shard layout (the sample count of each shard), the seed, the epoch and the
//! shuffle mode, and nothing else: in particular not of the world size, the batch size or the rank.
//!
//! A training step of `world_size` ranks with `batch_size` samples each consumes the next
//! `world_size × batch_size` positions of the global order; rank `r` takes the `r`-th run of
//! `batch_size` consecutive positions. The **cursor** is the number of positions consumed since the
//! start of the epoch; after `k` steps it is `k × world_size × batch_size`.
//!
//! A checkpoint records `(epoch, cursor)`. Resuming at any world size and batch size continues the same
//! global order at the cursor, so within the epoch no sample is repeated or skipped (**elastic resume**);
//! resuming with the same configuration at step `k` is the special case `cursor = k × world_size ×
//! batch_size` and yields exactly the batches an uninterrupted run would have.
//!
//! When the samples left after the cursor are not a multiple of `world_size × batch_size`, the tail
//! policy decides, identically on every rank so that all ranks take the same number of steps:
//! [`Tail::Drop`] leaves the last partial step out (its samples are not served this epoch);
//! [`Tail::Pad`] serves one more full step whose positions past the end wrap to the start of the
//! epoch's order (those samples are served twice this epoch).
//!
//! # Shuffles
//!
//! - [`ShuffleMode::None`]: sample order.
//! - [`ShuffleMode::Full`]: a pseudo-random permutation of all samples.
//! - [`ShuffleMode::Window`]: the shard order is shuffled, consecutive shards are grouped into windows
//!   of `shards` shards, and samples are shuffled within each window. Reads stay within a bounded set of
//!   shards at a time, so I/O is near-sequential while the order is still well mixed.
//!
//! Permutations are computed per position with a keyed Feistel network (cycle-walking over the next
//! power of four), so an order costs O(shards) memory whatever the sample count, and any position can be
//! looked up directly, which is what makes resuming at an arbitrary cursor cheap.

use std::ops::Range;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// How an epoch's samples are ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShuffleMode {
    /// Dataset order.
    None,
    /// Shuffle shards, then samples within windows of this many consecutive shards (at least 1).
    Window {
        /// Shards per window.
        shards: u32,
    },
    /// Shuffle all samples.
    Full,
}

/// The kind of an epoch's order, without its parameters: what the GPU backend plans its reads by
/// (which shards the next batches draw from, whether consecutive rows read consecutive samples).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShuffleKind {
    /// Dataset order: the next batches draw from the rest of the dataset, in order.
    None,
    /// A window shuffle: the next batches draw from the current window's shards, then the next
    /// window's.
    Window,
    /// A full shuffle: every batch may draw from anywhere in the dataset.
    Full,
}

/// What happens to the samples that do not fill a whole step at the end of an epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tail {
    /// Leave them out.
    Drop,
    /// Serve one more full step, wrapping to the start of the epoch's order.
    Pad,
}

/// Rounds of the Feistel network; 6 rounds of a strong round function mix well beyond what a data
/// loader needs.
const FEISTEL_ROUNDS: usize = 6;

/// A keyed pseudo-random permutation of `0..n`, evaluated per index.
#[derive(Clone, Debug)]
pub struct Permutation {
    n: u64,
    half_bits: u32,
    keys: [u64; FEISTEL_ROUNDS],
}

impl Permutation {
    /// The permutation of `0..n` selected by `key`.
    pub fn new(n: u64, key: u64) -> Permutation {
        // The smallest even number of bits covering n, so the domain splits into two equal halves and
        // is at most 4n: cycle-walking then takes fewer than 4 steps on average.
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        let mut keys = [0u64; FEISTEL_ROUNDS];
        for (round, slot) in keys.iter_mut().enumerate() {
            *slot = xxh3_64_with_seed(&(round as u64).to_le_bytes(), key);
        }
        Permutation { n, half_bits, keys }
    }

    /// Size of the permuted range.
    pub fn len(&self) -> u64 {
        self.n
    }

    /// True for the empty range.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Where index `i` goes (`i < n`).
    pub fn apply(&self, i: u64) -> u64 {
        assert!(i < self.n, "index {i} outside 0..{}", self.n);
        if self.n == 1 {
            return 0;
        }
        let mut value = i;
        // Cycle-walking: the network permutes the whole power-of-four domain; stepping again while the
        // result is outside 0..n restricts it to a permutation of 0..n.
        loop {
            value = self.network(value);
            if value < self.n {
                return value;
            }
        }
    }

    /// Bits of each half of the network's domain.
    pub fn half_bits(&self) -> u32 {
        self.half_bits
    }

    /// The round keys of the network.
    pub fn keys(&self) -> [u64; FEISTEL_ROUNDS] {
        self.keys
    }

    fn network(&self, value: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut left, mut right) = (value >> self.half_bits, value & mask);
        for key in &self.keys {
            let mixed = xxh3_64_with_seed(&right.to_le_bytes(), *key) & mask;
            (left, right) = (right, left ^ mixed);
        }
        (left << self.half_bits) | right
    }
}

/// One window of the window shuffle: a run of positions served from a set of shards.
#[derive(Clone, Debug)]
struct Window {
    /// First position of the window in the global order.
    start: u64,
    /// Samples in the window.
    len: u64,
    /// The window's shards as (first sample, sample count), in shuffled shard order, and the position
    /// within the window at which each begins.
    shards: Vec<(u64, u64, u64)>,
    permutation: Permutation,
}

/// The global order of one epoch.
#[derive(Clone, Debug)]
pub struct EpochOrder {
    sample_count: u64,
    kind: OrderKind,
}

#[derive(Clone, Debug)]
enum OrderKind {
    Identity,
    Full(Permutation),
    Windows(Vec<Window>),
}

/// Derives the key of one permutation from the order's inputs, so different epochs, seeds, modes and
/// windows get independent permutations.
fn derive_key(seed: u64, epoch: u64, purpose: u64, index: u64) -> u64 {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    bytes[8..16].copy_from_slice(&epoch.to_le_bytes());
    bytes[16..24].copy_from_slice(&purpose.to_le_bytes());
    bytes[24..].copy_from_slice(&index.to_le_bytes());
    xxh3_64_with_seed(&bytes, 0x6770_7566_6565_6400)
}

impl EpochOrder {
    /// The order of `epoch` over shards with these sample counts (in dataset order).
    pub fn new(shard_samples: &[u64], seed: u64, epoch: u64, mode: ShuffleMode) -> EpochOrder {
        let sample_count: u64 = shard_samples.iter().sum();
        let kind = match mode {
            ShuffleMode::None => OrderKind::Identity,
            ShuffleMode::Full => OrderKind::Full(Permutation::new(
                sample_count,
                derive_key(seed, epoch, 1, sample_count),
            )),
            ShuffleMode::Window { shards } => {
                assert!(shards > 0, "a window holds at least one shard");
                let mut first_samples = Vec::with_capacity(shard_samples.len());
                let mut next = 0u64;
                for &count in shard_samples {
                    first_samples.push(next);
                    next += count;
                }
                let shard_order = Permutation::new(
                    shard_samples.len() as u64,
                    derive_key(seed, epoch, 2, shard_samples.len() as u64),
                );
                let shuffled: Vec<usize> = (0..shard_samples.len() as u64)
                    .map(|i| shard_order.apply(i) as usize)
                    .collect();
                let mut windows = Vec::new();
                let mut start = 0u64;
                for (window_index, group) in shuffled.chunks(shards as usize).enumerate() {
                    let mut members = Vec::with_capacity(group.len());
                    let mut len = 0u64;
                    for &shard in group {
                        members.push((first_samples[shard], shard_samples[shard], len));
                        len += shard_samples[shard];
                    }
                    windows.push(Window {
                        start,
                        len,
                        shards: members,
                        permutation: Permutation::new(
                            len,
                            derive_key(seed, epoch, 3, window_index as u64),
                        ),
                    });
                    start += len;
                }
                OrderKind::Windows(windows)
            }
        };
        EpochOrder { sample_count, kind }
    }

    /// Samples in the epoch.
    pub fn len(&self) -> u64 {
        self.sample_count
    }

    /// The kind of shuffle the order is, for the code that plans reads by it.
    pub fn shuffle_kind(&self) -> ShuffleKind {
        match self.kind {
            OrderKind::Identity => ShuffleKind::None,
            OrderKind::Windows(_) => ShuffleKind::Window,
            OrderKind::Full(_) => ShuffleKind::Full,
        }
    }

    /// Whether the order is the dataset's own (no shuffle).
    pub fn is_identity(&self) -> bool {
        matches!(self.kind, OrderKind::Identity)
    }

    /// True when the dataset has no samples.
    pub fn is_empty(&self) -> bool {
        self.sample_count == 0
    }

    /// The samples the positions from `position` on draw from, soonest first, as at most
    /// `ranges_max` ranges of sample indices; `None` for a full shuffle, whose next positions may draw
    /// from anywhere. In dataset order that is the rest of the dataset; in a window shuffle, the shards
    /// of the window holding `position`, then those of the windows after it. For reading ahead.
    pub fn samples_ahead(&self, position: u64, ranges_max: usize) -> Option<Vec<Range<u64>>> {
        let position = position.min(self.sample_count);
        match &self.kind {
            OrderKind::Identity => Some(std::iter::once(position..self.sample_count).collect()),
            OrderKind::Full(_) => None,
            OrderKind::Windows(windows) => {
                let first = windows.partition_point(|w| w.start + w.len <= position);
                Some(
                    windows[first..]
                        .iter()
                        .flat_map(|w| w.shards.iter())
                        .map(|&(first_sample, count, _)| first_sample..first_sample + count)
                        .take(ranges_max)
                        .collect(),
                )
            }
        }
    }

    /// The most shards that `span` consecutive positions of the order draw from, positions past the
    /// end wrapping to the start as padding does (an upper bound in a window shuffle: every shard of
    /// each window the positions reach); `None` for a full shuffle. `shard_first_samples` holds the
    /// first sample of each shard and the sample count after the last.
    pub fn shards_per_span_max(&self, span: u64, shard_first_samples: &[u64]) -> Option<usize> {
        // Runs of positions, each drawing from a known number of shards.
        let units: Vec<(u64, u64, usize)> = match &self.kind {
            OrderKind::Full(_) => return None,
            OrderKind::Identity => shard_first_samples
                .windows(2)
                .filter(|w| w[1] > w[0])
                .map(|w| (w[0], w[1] - w[0], 1))
                .collect(),
            OrderKind::Windows(windows) => windows
                .iter()
                .filter(|w| w.len > 0)
                .map(|w| (w.start, w.len, w.shards.len()))
                .collect(),
        };
        let shard_count = shard_first_samples.len().saturating_sub(1);
        let count = units.len();
        let mut most = 0;
        for first in 0..count {
            let (start, len, _) = units[first];
            // Positions from anywhere in unit `first` reach up to (not including) `reach`.
            let reach = start + len - 1 + span.max(1);
            let mut shards = 0;
            for k in first..first + count {
                let (unit_start, _, unit_shards) = units[k % count];
                let unwrapped = unit_start + (k / count) as u64 * self.sample_count;
                if unwrapped >= reach {
                    break;
                }
                shards += unit_shards;
            }
            most = most.max(shards.min(shard_count));
        }
        Some(most)
    }

    /// The sample at `position` of the global order (`position < len()`).
    pub fn sample_at(&self, position: u64) -> u64 {
        assert!(
            position < self.sample_count,
            "position {position} outside the epoch"
        );
        match &self.kind {
            OrderKind::Identity => position,
            OrderKind::Full(permutation) => permutation.apply(position),
            OrderKind::Windows(windows) => {
                let index = windows.partition_point(|w| w.start + w.len <= position);
                let window = &windows[index];
                let within = window.permutation.apply(position - window.start);
                let member = window
                    .shards
                    .partition_point(|&(_, count, offset)| offset + count <= within);
                let (first_sample, _, offset) = window.shards[member];
                first_sample + (within - offset)
            }
        }
    }
}

/// An epoch's order as plain tables, for evaluating it elsewhere (the GPU's ordered gather,
/// `kernels::ordered`): what [`EpochOrder::sample_at`] computes, position by position.
#[derive(Clone, Debug)]
pub enum OrderTables {
    /// Dataset order.
    Identity,
    /// One permutation of every sample.
    Full(Permutation),
    /// Windows: where each starts among the positions, its permutation, and its shards (first
    /// sample, sample count, offset within the window).
    Windows(Vec<WindowTables>),
}

/// One window of [`OrderTables::Windows`]: its first position, its permutation and its shards
/// (first sample, sample count, offset within the window).
pub type WindowTables = (u64, Permutation, Vec<(u64, u64, u64)>);

impl EpochOrder {
    /// The order as plain tables (see [`OrderTables`]).
    pub fn tables(&self) -> OrderTables {
        match &self.kind {
            OrderKind::Identity => OrderTables::Identity,
            OrderKind::Full(permutation) => OrderTables::Full(permutation.clone()),
            OrderKind::Windows(windows) => OrderTables::Windows(
                windows
                    .iter()
                    .map(|w| (w.start, w.permutation.clone(), w.shards.clone()))
                    .collect(),
            ),
        }
    }
}

/// One rank's view of a stream: its place in the world and the batch geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankPlan {
    /// Ranks consuming the epoch together (at least 1).
    pub world_size: u32,
    /// This rank, below `world_size`.
    pub rank: u32,
    /// Samples per batch on each rank (at least 1).
    pub batch_size: u32,
    /// Policy for the last partial step.
    pub tail: Tail,
}

impl RankPlan {
    /// Samples one step consumes over all ranks.
    pub fn step_samples(&self) -> u64 {
        self.world_size as u64 * self.batch_size as u64
    }

    /// Steps left in an epoch of `sample_count` samples from `cursor`; the same on every rank.
    pub fn steps_from(&self, sample_count: u64, cursor: u64) -> u64 {
        let left = sample_count.saturating_sub(cursor);
        match self.tail {
            Tail::Drop => left / self.step_samples(),
            Tail::Pad => left.div_ceil(self.step_samples()),
        }
    }

    /// The positions of the global order that this rank's batch `step` (counted from `cursor`) holds.
    /// Positions past the end of the epoch (padding) wrap to its start.
    pub fn batch_positions(
        &self,
        sample_count: u64,
        cursor: u64,
        step: u64,
    ) -> impl Iterator<Item = u64> {
        assert!(self.rank < self.world_size && self.batch_size > 0);
        let first = cursor + step * self.step_samples() + self.rank as u64 * self.batch_size as u64;
        (first..first + self.batch_size as u64).map(move |p| p % sample_count.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// The bound on the shards a run of positions draws from holds for every run, in order and in a
    /// window shuffle, also with shards (and so windows) that hold no sample.
    #[test]
    fn shards_per_span_bound_every_run_of_positions() {
        for shards in [&[40u64, 25, 60, 33, 50, 12][..], &[40, 0, 25, 0, 0, 60, 33]] {
            shards_per_span_bound_holds(shards);
        }
        let shards = [40u64, 25, 60, 33, 50, 12];
        let full = EpochOrder::new(&shards, 7, 1, ShuffleMode::Full);
        assert!(full.shards_per_span_max(8, &[0, 40, 65]).is_none());
    }

    fn shards_per_span_bound_holds(shards: &[u64]) {
        let mut firsts = vec![0u64];
        for count in shards {
            firsts.push(firsts.last().unwrap() + count);
        }
        let shard_of = |sample: u64| firsts.partition_point(|&s| s <= sample) - 1;
        let modes = [
            ShuffleMode::None,
            ShuffleMode::Window { shards: 1 },
            ShuffleMode::Window { shards: 2 },
        ];
        for mode in modes {
            let order = EpochOrder::new(shards, 7, 1, mode);
            for span in [1u64, 12, 13, 30, 64, 100, 220, 500] {
                let bound = order.shards_per_span_max(span, &firsts).unwrap();
                for start in 0..order.len() {
                    let touched: HashSet<usize> = (start..start + span)
                        .map(|p| shard_of(order.sample_at(p % order.len())))
                        .collect();
                    assert!(
                        touched.len() <= bound,
                        "{mode:?} span {span} from {start}: {} shards, bound {bound}",
                        touched.len()
                    );
                }
            }
        }
    }

    #[test]
    fn permutations_are_bijections_for_awkward_sizes() {
        for n in [1u64, 2, 3, 5, 16, 17, 255, 1000, 4097] {
            let permutation = Permutation::new(n, 42);
            let image: HashSet<u64> = (0..n).map(|i| permutation.apply(i)).collect();
            assert_eq!(image.len() as u64, n, "n = {n}");
            assert!(image.iter().all(|&v| v < n));
        }
    }

    /// Reading ahead relies on it: every position from `p` on draws from the ranges
    /// `samples_ahead(p)` lists, in the order they come up (dataset order and windows), and a full
    /// shuffle names none.
    #[test]
    fn samples_ahead_cover_the_positions_that_follow() {
        let shards = [40u64, 25, 60, 33, 50, 12];
        for mode in [ShuffleMode::None, ShuffleMode::Window { shards: 2 }] {
            let order = EpochOrder::new(&shards, 7, 1, mode);
            for start in [0u64, 39, 40, 100, 219] {
                let ranges = order.samples_ahead(start, usize::MAX).unwrap();
                let mut range = 0usize;
                for position in start..order.len() {
                    let sample = order.sample_at(position);
                    // Positions move through the ranges in order and never back.
                    while !ranges[range].contains(&sample) {
                        assert!(
                            ranges[range + 1..].iter().any(|r| r.contains(&sample)),
                            "{mode:?}: position {position} (sample {sample}) is in no range ahead"
                        );
                        if mode == ShuffleMode::None {
                            range += 1;
                        } else {
                            break;
                        }
                    }
                }
            }
        }
        let full = EpochOrder::new(&shards, 7, 1, ShuffleMode::Full);
        assert!(full.samples_ahead(0, 8).is_none());
    }

    /// The GPU backend plans by `shuffle_kind`, which stands for the order's own tests it used to
    /// make: dataset order is the identity, only a full shuffle has no samples ahead.
    #[test]
    fn shuffle_kind_names_the_mode_as_the_order_behaves() {
        let shards = [40u64, 25, 60, 33];
        for (mode, kind) in [
            (ShuffleMode::None, ShuffleKind::None),
            (ShuffleMode::Window { shards: 2 }, ShuffleKind::Window),
            (ShuffleMode::Full, ShuffleKind::Full),
        ] {
            let order = EpochOrder::new(&shards, 7, 1, mode);
            assert_eq!(order.shuffle_kind(), kind, "{mode:?}");
            assert_eq!(order.is_identity(), kind == ShuffleKind::None, "{mode:?}");
            assert_eq!(
                order.samples_ahead(0, 1).is_none(),
                kind == ShuffleKind::Full,
                "{mode:?}"
            );
        }
    }
}
