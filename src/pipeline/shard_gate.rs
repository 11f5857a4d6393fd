//! Shards that arrive while a stream runs: a dataset in object storage, whose shard files the host
//! assembler opens only once its [`ShardGate`] says they are readable.
//!
//! The assembler asks, before each batch, for the shards the batch reads ([`ShardGate::hold`],
//! which blocks until they are complete and keeps them for the stream), names the shards of the
//! next batches ([`ShardGate::ahead`], fetched meanwhile within the gate's bound) and lets go of
//! those it no longer reads ([`ShardGate::release`], after closing them).

/// How the host assembler learns which shards it may open (see the module documentation).
pub trait ShardGate: Send + Sync + std::fmt::Debug {
    /// Blocks until every shard in `shards` (indices in the dataset) is complete on local disk at
    /// its path, and keeps it there until released. The error, naming the shard's source, ends
    /// the stream.
    fn hold(&self, shards: &[usize]) -> Result<(), String>;

    /// The shards the stream reads after the current batch, soonest first: made ready meanwhile,
    /// as many as the gate allows. Never blocks.
    fn ahead(&self, shards: &[usize]);

    /// Shards the stream has closed and may not read again before it holds them again.
    fn release(&self, shards: &[usize]);
}

/// A stream's steps as [`ShardLookahead`] scans them: how many, their samples, and the shards
/// each reads (sorted).
#[derive(Clone, Copy)]
pub struct StreamSteps<'a> {
    /// Steps in the stream.
    pub count: u64,
    /// Samples a step reads.
    pub batch: u64,
    /// The shards step N reads.
    pub shards: &'a dyn Fn(u64) -> Vec<usize>,
}

/// The shards a stream reads next, found by scanning its steps once, as it goes: each shard is
/// noted at the step where a run of steps reading it starts (in dataset order, a shard's one run;
/// in a window shuffle, its window's; in a full shuffle every shard at the first step).
#[derive(Debug, Default)]
pub struct ShardLookahead {
    /// The next step to scan.
    scanned_to: u64,
    /// The shards of the step before `scanned_to`.
    previous: Vec<usize>,
    /// Runs that start after the step being filled: (step, shard), in step order.
    starts: std::collections::VecDeque<(u64, usize)>,
}

impl ShardLookahead {
    /// Up to `count` shards, soonest first, that steps after `step` start reading and that
    /// `current` (sorted: the shards step `step` reads) leaves out, where the stream's `steps.count`
    /// steps of `steps.batch` samples each read the shards `steps.shards` names (sorted). Scans at
    /// most `samples_max` samples' worth of steps per call; every step is scanned once in the
    /// stream's life.
    pub fn ahead(
        &mut self,
        steps: StreamSteps<'_>,
        step: u64,
        current: &[usize],
        count: usize,
        samples_max: u64,
    ) -> Vec<usize> {
        while self.starts.front().is_some_and(|&(at, _)| at <= step) {
            self.starts.pop_front();
        }
        if self.scanned_to <= step {
            self.scanned_to = step + 1;
            self.previous = current.to_vec();
        }
        let batch = steps.batch.max(1);
        let mut scanned = 0u64;
        while self.scanned_to < steps.count
            && scanned < samples_max
            && self.found(current, count).len() < count
        {
            let shards = (steps.shards)(self.scanned_to);
            for &shard in &shards {
                if self.previous.binary_search(&shard).is_err() {
                    self.starts.push_back((self.scanned_to, shard));
                }
            }
            self.previous = shards;
            self.scanned_to += 1;
            scanned += batch;
        }
        self.found(current, count)
    }

    fn found(&self, current: &[usize], count: usize) -> Vec<usize> {
        let mut found: Vec<usize> = Vec::new();
        for &(_, shard) in &self.starts {
            if current.binary_search(&shard).is_err() && !found.contains(&shard) {
                found.push(shard);
                if found.len() >= count {
                    break;
                }
            }
        }
        found
    }
}
