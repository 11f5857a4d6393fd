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
