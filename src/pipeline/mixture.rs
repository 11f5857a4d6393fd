//! The order of a mixture: one stream over several datasets (its **sources**), each drawn with a
//! weight.
//!
//! # The rule
//!
//! A mixture is one endless sequence of **draws** `g = 0, 1, 2, …`, a pure function of the
//! sources' weights and sample counts, the seed and the shuffle mode; like a single dataset's order
//! it does not depend on the world size, the batch size or the rank.
//!
//! - **Which source** draw `g` takes from follows the [`MixtureSchedule`]: the weights are turned
//!   into whole draws per period of at most [`PERIOD_DRAWS_MAX`] draws (largest remainders, then
//!   divided by their common divisor), laid out by smooth weighted round-robin (the deterministic,
//!   error-minimising interleaving Megatron-LM's blended datasets use), and the draws of each chunk
//!   of [`CHUNK_DRAWS`] consecutive draws are then permuted by a Feistel permutation keyed by the
//!   seed and the chunk. After any number of draws each source's count is within
//!   [`CHUNK_DRAWS`] + 1 of its share of the resolved weights (the round-robin keeps it within
//!   about one draw of it at every chunk's end, and exactly on it at every period's end), whatever
//!   the seed; within a chunk the sources come in a seeded, well-mixed order.
//! - **Which sample**: each source is an endless sequence of its own epochs. Source `s`'s `k`-th
//!   draw is position `k mod n_s` of its epoch `k / n_s` (`n_s` its sample count), ordered as a
//!   single-dataset stream over it with seed `seed + s` (wrapping) and that epoch would be, in the
//!   mixture's shuffle mode.
//! - **Epochs**: the mixture's epoch `E` is the draws `E × L .. (E + 1) × L`, where `L` is the
//!   mixture's epoch length (by default the sum of the sources' sample counts, as MosaicML
//!   Streaming's `epoch_size` defaults to). Positions, the cursor, ranks and the tail policy are
//!   those of a single dataset (`pipeline::order`) over these `L` positions: position `p` of epoch
//!   `E` is draw `E × L + p`.
//!
//! # When a source's epoch ends
//!
//! Never does a source end the mixture, nor does the mixture's epoch end a source's: a source
//! whose epoch runs out inside a mixture epoch starts its next epoch at once, reshuffled (it is
//! upsampled: a source of weight 0.5 and a tenth of the samples is seen five times a mixture epoch,
//! each time in a new order), and a source whose epoch outlasts the mixture's carries on where it
//! was in the next mixture epoch (it is downsampled, without repeats: every one of its samples is
//! served once before any is served again). This is Megatron-LM's `BlendedDataset` (each dataset
//! sampled as many epochs as its weight asks, a fresh shuffle each epoch) with MosaicML Streaming's
//! default epoch size; it differs from Streaming's downsampling, which picks a subset of a stream
//! afresh each epoch, because carrying on covers every sample of a large source before repeating
//! one. The weights, not the datasets' sizes, decide the proportions.
//!
//! # Resume
//!
//! Every draw is a pure function of `(epoch, position)`, so a mixture resumes from the same
//! `(epoch, cursor)` state as a single dataset, at any world size: the sources' own positions and
//! epochs follow from the draw counts, which [`MixtureSchedule`] computes directly for any draw.

use super::order::{EpochOrder, Permutation, ShuffleMode};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Draws of one period of the schedule at most, before the counts are divided by their common
/// divisor: weights are resolved to one part in this many.
pub const PERIOD_DRAWS_MAX: u64 = 1 << 16;

/// Draws permuted together: the sources of each chunk of this many consecutive draws come in a
/// seeded order. A power of four, so the chunk's Feistel permutation never walks a cycle.
pub const CHUNK_DRAWS: u64 = 256;

/// Positions of the period between two stored prefix counts.
const CHECKPOINT_DRAWS: u64 = 64;

/// Most sources of a mixture (source indices are stored in a byte).
pub const SOURCES_MAX: usize = 64;

/// Which source each draw of a mixture takes from (see the module documentation).
#[derive(Clone, Debug)]
pub struct MixtureSchedule {
    /// Draws of each source per period.
    counts: Vec<u64>,
    /// Draws in one period: the sum of `counts`.
    period: u64,
    /// The source of each draw of a period, before chunks are permuted.
    table: Vec<u8>,
    /// Draws of each source before every [`CHECKPOINT_DRAWS`]-th position of a period
    /// (`sources` entries per checkpoint).
    checkpoints: Vec<u64>,
    seed: u64,
}

/// Greatest common divisor.
fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl MixtureSchedule {
    /// The schedule of sources with these weights (positive and finite; they need not sum to 1).
    /// An error names the weight at fault.
    pub fn new(weights: &[f64], seed: u64) -> Result<MixtureSchedule, String> {
        if weights.len() < 2 || weights.len() > SOURCES_MAX {
            return Err(format!(
                "a mixture has 2 to {SOURCES_MAX} sources, not {}",
                weights.len()
            ));
        }
        if let Some((index, weight)) = weights
            .iter()
            .enumerate()
            .find(|(_, w)| !(w.is_finite() && **w > 0.0))
        {
            return Err(format!(
                "source {index}'s weight {weight} is not a positive finite number"
            ));
        }
        let total: f64 = weights.iter().sum();
        // Whole draws per period: floors, then the draws left to the largest remainders (ties to
        // the first source), so that the counts sum to the period exactly.
        let exact: Vec<f64> = weights
            .iter()
            .map(|w| w / total * PERIOD_DRAWS_MAX as f64)
            .collect();
        let mut counts: Vec<u64> = exact.iter().map(|e| e.floor() as u64).collect();
        let mut left = PERIOD_DRAWS_MAX.saturating_sub(counts.iter().sum());
        let mut by_remainder: Vec<usize> = (0..weights.len()).collect();
        by_remainder.sort_by(|&a, &b| {
            let (ra, rb) = (exact[a] - exact[a].floor(), exact[b] - exact[b].floor());
            rb.total_cmp(&ra).then(a.cmp(&b))
        });
        for &index in by_remainder.iter().cycle() {
            if left == 0 {
                break;
            }
            counts[index] += 1;
            left -= 1;
        }
        if let Some(index) = counts.iter().position(|&c| c == 0) {
            return Err(format!(
                "source {index}'s weight {} is below one part in {PERIOD_DRAWS_MAX} of the \
                 weights' sum {total}: it would never be drawn",
                weights[index]
            ));
        }
        let divisor = counts.iter().copied().fold(0, gcd);
        for count in &mut counts {
            *count /= divisor;
        }
        let period: u64 = counts.iter().sum();
        // Smooth weighted round-robin: each draw goes to the source furthest behind its share.
        let mut credit = vec![0i64; counts.len()];
        let mut table = Vec::with_capacity(period as usize);
        let sources = counts.len();
        let mut checkpoints =
            Vec::with_capacity((period / CHECKPOINT_DRAWS + 1) as usize * sources);
        let mut drawn = vec![0u64; sources];
        for position in 0..period {
            if position % CHECKPOINT_DRAWS == 0 {
                checkpoints.extend_from_slice(&drawn);
            }
            for (c, &count) in credit.iter_mut().zip(&counts) {
                *c += count as i64;
            }
            let chosen = (0..sources)
                .max_by(|&a, &b| credit[a].cmp(&credit[b]).then(b.cmp(&a)))
                .expect("at least two sources");
            credit[chosen] -= period as i64;
            drawn[chosen] += 1;
            table.push(chosen as u8);
        }
        Ok(MixtureSchedule {
            counts,
            period,
            table,
            checkpoints,
            seed,
        })
    }

    /// Sources of the mixture.
    pub fn sources(&self) -> usize {
        self.counts.len()
    }

    /// Draws per period, and each source's share of them.
    pub fn period(&self) -> (u64, &[u64]) {
        (self.period, &self.counts)
    }

    /// Draws of each source among the first `g` draws of the round-robin layout (before chunks are
    /// permuted), into `out`.
    fn layout_counts(&self, g: u64, out: &mut [u64]) {
        let (periods, offset) = (g / self.period, g % self.period);
        let checkpoint = offset / CHECKPOINT_DRAWS;
        let sources = self.sources();
        let stored = &self.checkpoints[checkpoint as usize * sources..][..sources];
        for ((out, &count), &before) in out.iter_mut().zip(&self.counts).zip(stored) {
            *out = periods * count + before;
        }
        for position in checkpoint * CHECKPOINT_DRAWS..offset {
            out[self.table[position as usize] as usize] += 1;
        }
    }

    /// The permutation of the draws of chunk `chunk`.
    fn chunk_permutation(&self, chunk: u64) -> Permutation {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&self.seed.to_le_bytes());
        bytes[8..].copy_from_slice(&chunk.to_le_bytes());
        Permutation::new(
            CHUNK_DRAWS,
            xxh3_64_with_seed(&bytes, 0x6d69_7874_7572_6573),
        )
    }

    /// A walker over the schedule, at draw 0.
    pub fn walker(&self) -> ScheduleWalker<'_> {
        ScheduleWalker {
            schedule: self,
            next: u64::MAX,
            chunk: Permutation::new(CHUNK_DRAWS, 0),
            drawn: vec![0; self.sources()],
        }
    }
}

/// Walks a [`MixtureSchedule`] draw by draw: consecutive draws cost one permutation look-up each;
/// a jump costs at most [`CHUNK_DRAWS`] + 64 look-ups (the chunk's draws before it, and the layout's
/// since its last stored count).
pub struct ScheduleWalker<'a> {
    schedule: &'a MixtureSchedule,
    /// The draw the walker is at (`u64::MAX` before the first).
    next: u64,
    /// The permutation of the chunk holding `next`.
    chunk: Permutation,
    /// Draws of each source before `next`.
    drawn: Vec<u64>,
}

impl ScheduleWalker<'_> {
    /// Draw `g`: its source, and how many draws of that source come before it.
    pub fn draw(&mut self, g: u64) -> (usize, u64) {
        if g != self.next {
            self.seek(g);
        } else if g % CHUNK_DRAWS == 0 {
            self.chunk = self.schedule.chunk_permutation(g / CHUNK_DRAWS);
        }
        let source = self.source_of(g);
        let before = self.drawn[source];
        self.drawn[source] += 1;
        self.next = g + 1;
        (source, before)
    }

    /// The source of draw `g`, whose chunk's permutation is `self.chunk`.
    fn source_of(&self, g: u64) -> usize {
        let chunk_start = g - g % CHUNK_DRAWS;
        let layout = chunk_start + self.chunk.apply(g % CHUNK_DRAWS);
        self.schedule.table[(layout % self.schedule.period) as usize] as usize
    }

    /// Places the walker at draw `g`: the counts at its chunk's start come from the layout (a
    /// chunk's permutation moves draws within the chunk only), then the chunk's draws before `g`.
    fn seek(&mut self, g: u64) {
        let chunk_start = g - g % CHUNK_DRAWS;
        self.schedule.layout_counts(chunk_start, &mut self.drawn);
        self.chunk = self.schedule.chunk_permutation(g / CHUNK_DRAWS);
        for before in chunk_start..g {
            let source = self.source_of(before);
            self.drawn[source] += 1;
        }
        self.next = g;
    }
}

/// One source of a [`MixtureOrder`]: the layout and order parameters of its dataset.
#[derive(Clone, Debug)]
pub struct MixtureSource {
    /// Sample count of each shard, in dataset order.
    pub shard_samples: Vec<u64>,
    /// Samples in the dataset (the sum of `shard_samples`, at least 1).
    pub sample_count: u64,
}

/// The order of a mixture: for each position of an epoch, the source and the sample of that source
/// it serves (see the module documentation).
#[derive(Clone, Debug)]
pub struct MixtureOrder {
    schedule: MixtureSchedule,
    sources: Vec<MixtureSource>,
    seed: u64,
    mode: ShuffleMode,
    epoch: u64,
    epoch_samples: u64,
}

/// One position of a mixture: the source and the sample within it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Drawn {
    /// Index of the source.
    pub source: u32,
    /// Sample of the source's dataset.
    pub sample: u64,
}

impl MixtureOrder {
    /// The order of `epoch` of a mixture of `sources` with `weights`, `epoch_samples` positions an
    /// epoch (`None`: the sum of the sources' sample counts). An error names the source or the
    /// value at fault.
    pub fn new(
        sources: Vec<MixtureSource>,
        weights: &[f64],
        seed: u64,
        mode: ShuffleMode,
        epoch: u64,
        epoch_samples: Option<u64>,
    ) -> Result<MixtureOrder, String> {
        assert_eq!(sources.len(), weights.len(), "one weight per source");
        if let Some(index) = sources.iter().position(|s| s.sample_count == 0) {
            return Err(format!("source {index} has no samples"));
        }
        let schedule = MixtureSchedule::new(weights, seed)?;
        let epoch_samples = match epoch_samples {
            Some(0) => return Err("a mixture's epoch holds at least one sample".to_string()),
            Some(samples) => samples,
            None => sources.iter().map(|s| s.sample_count).sum(),
        };
        if epoch.checked_mul(epoch_samples).is_none() {
            return Err(format!(
                "epoch {epoch} of {epoch_samples} samples is past the last draw a mixture counts"
            ));
        }
        Ok(MixtureOrder {
            schedule,
            sources,
            seed,
            mode,
            epoch,
            epoch_samples,
        })
    }

    /// Positions in the epoch.
    pub fn len(&self) -> u64 {
        self.epoch_samples
    }

    /// Never true: a mixture's epoch holds at least one position.
    pub fn is_empty(&self) -> bool {
        self.epoch_samples == 0
    }

    /// The schedule of sources.
    pub fn schedule(&self) -> &MixtureSchedule {
        &self.schedule
    }

    /// The seed of source `source`'s own order.
    pub fn source_seed(&self, source: usize) -> u64 {
        self.seed.wrapping_add(source as u64)
    }

    /// The source and sample at each of `positions` of the epoch (each below [`Self::len`]), in
    /// order. Consecutive positions cost a permutation look-up each.
    pub fn draws(&self, positions: impl Iterator<Item = u64>) -> Vec<Drawn> {
        let mut walker = self.schedule.walker();
        // Each source's order of the epoch it is in, made once per epoch a batch reaches.
        let mut orders: Vec<Option<(u64, EpochOrder)>> = vec![None; self.sources.len()];
        positions
            .map(|position| {
                assert!(
                    position < self.epoch_samples,
                    "position {position} outside the epoch"
                );
                let g = self.epoch * self.epoch_samples + position;
                let (source, k) = walker.draw(g);
                let info = &self.sources[source];
                let (epoch, at) = (k / info.sample_count, k % info.sample_count);
                if orders[source]
                    .as_ref()
                    .is_none_or(|(cached, _)| *cached != epoch)
                {
                    orders[source] = Some((
                        epoch,
                        EpochOrder::new(
                            &info.shard_samples,
                            self.source_seed(source),
                            epoch,
                            self.mode,
                        ),
                    ));
                }
                let (_, order) = orders[source].as_ref().expect("made above");
                Drawn {
                    source: source as u32,
                    sample: order.sample_at(at),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// The draws of each source counted by brute force, draw by draw from 0, agree with a walker
    /// that jumps to any draw (resume), for awkward weights.
    #[test]
    fn a_walker_that_jumps_agrees_with_one_that_walks() {
        for weights in [
            &[0.7, 0.3][..],
            &[1.0, 2.0, 3.5],
            &[0.01, 0.99],
            &[5.0, 5.0],
        ] {
            let schedule = MixtureSchedule::new(weights, 11).unwrap();
            let mut walking = schedule.walker();
            let sequence: Vec<(usize, u64)> = (0..5000).map(|g| walking.draw(g)).collect();
            for start in [0u64, 1, 255, 256, 257, 1000, 4095, 4999] {
                let mut jumping = schedule.walker();
                for g in start..(start + 300).min(5000) {
                    assert_eq!(jumping.draw(g), sequence[g as usize], "{weights:?} g {g}");
                }
            }
        }
    }

    /// Each source's count after any number of draws stays within a chunk and a draw of its share
    /// of the resolved weights (the round-robin keeps every count within about one draw of its
    /// share; a chunk's permutation moves draws within the chunk only); the proportions over 100 000
    /// draws are within 0.1 % of the weights. Three sources, and eight of uneven weights.
    #[test]
    fn counts_follow_the_weights_at_every_draw() {
        let eight = [5.0, 0.3, 1.7, 0.01, 2.2, 9.0, 0.6, 3.3];
        for weights in [&[0.7, 0.2, 0.1][..], &eight] {
            let schedule = MixtureSchedule::new(weights, 3).unwrap();
            let (period, resolved) = schedule.period();
            let total: f64 = weights.iter().sum();
            let mut walker = schedule.walker();
            let mut counts = vec![0u64; weights.len()];
            let mut worst = 0f64;
            for g in 0..100_000u64 {
                let (source, before) = walker.draw(g);
                assert_eq!(before, counts[source], "draw {g}");
                counts[source] += 1;
                for (s, &n) in resolved.iter().enumerate() {
                    let share = n as f64 * (g + 1) as f64 / period as f64;
                    worst = worst.max((counts[s] as f64 - share).abs());
                }
            }
            assert!(worst <= (CHUNK_DRAWS + 1) as f64, "{weights:?}: {worst}");
            for (s, w) in weights.iter().enumerate() {
                let realised = counts[s] as f64 / 100_000.0;
                assert!(
                    (realised - w / total).abs() < 0.001,
                    "source {s}: {realised} vs {}",
                    w / total
                );
            }
        }
    }

    /// Another seed mixes the sources differently (the chunks' orders), with the same counts at
    /// every chunk's end.
    #[test]
    fn the_seed_orders_each_chunk() {
        let a = MixtureSchedule::new(&[0.5, 0.5], 1).unwrap();
        let b = MixtureSchedule::new(&[0.5, 0.5], 2).unwrap();
        let (mut wa, mut wb) = (a.walker(), b.walker());
        let sa: Vec<usize> = (0..1024).map(|g| wa.draw(g).0).collect();
        let sb: Vec<usize> = (0..1024).map(|g| wb.draw(g).0).collect();
        assert_ne!(sa, sb);
        for end in (CHUNK_DRAWS as usize..=1024).step_by(CHUNK_DRAWS as usize) {
            let ones = |s: &[usize]| s[..end].iter().filter(|&&x| x == 1).count();
            assert_eq!(ones(&sa), ones(&sb), "after {end} draws");
        }
    }

    #[test]
    fn bad_weights_are_refused_naming_the_source() {
        for (weights, expected) in [
            (&[1.0][..], "2 to 64 sources"),
            (&[1.0, 0.0], "source 1's weight 0"),
            (&[f64::NAN, 1.0], "source 0's weight NaN"),
            (&[1.0, -2.0], "source 1's weight -2"),
            (&[1e-9, 1.0], "source 0's weight"),
        ] {
            let error = MixtureSchedule::new(weights, 0).unwrap_err();
            assert!(error.contains(expected), "{error} lacks {expected:?}");
        }
    }

    fn sources(counts: &[&[u64]]) -> Vec<MixtureSource> {
        counts
            .iter()
            .map(|shards| MixtureSource {
                shard_samples: shards.to_vec(),
                sample_count: shards.iter().sum(),
            })
            .collect()
    }

    /// A small source is upsampled, a new order each of its epochs, and every sample of a large
    /// one is served once before any is served again, across mixture epochs.
    #[test]
    fn a_source_whose_epoch_ends_starts_its_next_one() {
        let sources = sources(&[&[40, 60], &[7, 3]]);
        let small = 10u64;
        let mut served: Vec<Drawn> = Vec::new();
        for epoch in 0..4 {
            let order = MixtureOrder::new(
                sources.clone(),
                &[0.5, 0.5],
                9,
                ShuffleMode::Full,
                epoch,
                None,
            )
            .unwrap();
            assert_eq!(order.len(), 110);
            served.extend(order.draws(0..order.len()));
        }
        // Source 1, drawn about 220 times: each run of 10 of its draws is a permutation of it,
        // and the runs differ.
        let source1: Vec<u64> = served
            .iter()
            .filter(|d| d.source == 1)
            .map(|d| d.sample)
            .collect();
        let runs: Vec<&[u64]> = source1.chunks_exact(small as usize).collect();
        assert!(runs.len() >= 20);
        for run in &runs {
            let mut sorted = run.to_vec();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..small).collect::<Vec<_>>());
        }
        assert_ne!(runs[0], runs[1], "each epoch of a source is a new order");
        // Source 0 (100 samples, about 220 draws): its first 100 draws are each sample once.
        let source0: Vec<u64> = served
            .iter()
            .filter(|d| d.source == 0)
            .map(|d| d.sample)
            .take(100)
            .collect();
        let mut sorted = source0.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
    }

    /// Source `s`'s draws follow a single-dataset order of it with seed `seed + s`.
    #[test]
    fn each_source_keeps_its_own_order() {
        let shards: &[u64] = &[30, 20, 50];
        let sources = sources(&[shards, &[64]]);
        let order = MixtureOrder::new(
            sources,
            &[3.0, 1.0],
            21,
            ShuffleMode::Window { shards: 2 },
            0,
            Some(120),
        )
        .unwrap();
        let draws = order.draws(0..120);
        let source0: Vec<u64> = draws
            .iter()
            .filter(|d| d.source == 0)
            .map(|d| d.sample)
            .collect();
        let single = EpochOrder::new(shards, 21, 0, ShuffleMode::Window { shards: 2 });
        let expected: Vec<u64> = (0..source0.len() as u64)
            .map(|k| single.sample_at(k))
            .collect();
        assert_eq!(source0, expected);
        let counts: HashMap<u32, usize> = draws.iter().fold(HashMap::new(), |mut m, d| {
            *m.entry(d.source).or_default() += 1;
            m
        });
        assert_eq!(counts[&0], 90);
        assert_eq!(counts[&1], 30);
    }

    /// Positions of a later epoch continue the draws: epoch 1's first position is draw `L`.
    #[test]
    fn epochs_continue_the_draws() {
        let sources = sources(&[&[13], &[17]]);
        let order = |epoch| {
            MixtureOrder::new(
                sources.clone(),
                &[0.3, 0.7],
                5,
                ShuffleMode::Full,
                epoch,
                None,
            )
            .unwrap()
        };
        let mut both = order(0).draws(0..30);
        both.extend(order(1).draws(0..30));
        let long = MixtureOrder::new(
            sources.clone(),
            &[0.3, 0.7],
            5,
            ShuffleMode::Full,
            0,
            Some(60),
        )
        .unwrap()
        .draws(0..60);
        assert_eq!(both, long);
    }
}
