//! Batch assembly on the GPU backend: blocks are read into device memory (page-cache DMA, the io_uring
//! bounce path or cuFile, per [`GpuReader`](crate::storage::gpu::GpuReader)), verified (xxh3
//! kernel), LZ4 blocks are decoded by the LZ4 kernel into a device block cache, and the gather
//! kernel converts every sample of the batch, in the stream's order, into the slot, which is
//! exportable device memory that the consumer maps.
//!
//! A batch is built in one or more *rounds*. A round reads the blocks its rows need into a staging
//! buffer (raw blocks) or decodes them into the block cache (LZ4 blocks, kept for later batches), then
//! gathers its rows into the slot. Rows join a round until the staging buffer, the cache, the shuffle
//! scratch or the gather table would overflow; the next rows go to the next round. So every size is
//! fixed at stream open, whatever the batch size or the order, and nothing is allocated on the device
//! per batch.
//!
//! Rounds are pipelined: [`GpuStreamLimits::rounds_in_flight`] sets of round buffers (staging, job and piece tables in
//! pinned host memory and on the device, outcomes) are used in turn, so the reads of the next round
//! are queued while the device still verifies, decodes and gathers the previous one, and the host
//! plans ahead instead of waiting. The host waits for a round (one event, sleeping, no spin) only
//! when its buffers are needed again or its batch is handed off. A round's outcomes (checksums, LZ4
//! status, gather faults) are read when it completes: a sample whose block turns out to be corrupt
//! then is zeroed (policy `replace`) or ends the stream (policy `fail`) before its batch is handed
//! off, so nothing corrupt is ever served.
//!
//! Ordering: all device work of a stream runs on its compute stream, which waits on the reader's
//! copy stream for each round's reads. The first write into a slot waits on the slot's `released`
//! event, which the consumer recorded on its own stream when it released the slot. Block cache
//! entries are reused in stream order, so a gather queued before a decode that overwrites its source
//! entry has read it first.
//!
//! Two assemblers fill a stream's slots ([`GpuAssembler`], chosen when the stream opens): the staged
//! one (`staged`) reads, verifies and decodes blocks round by round; the resident one (`resident`)
//! serves a stream whose blocks are all raw from page-cache windows mapped for its life or from
//! shards copied ahead into device memory, every row one gather piece read in place. Both run on
//! one round engine (`engine`: the round buffers, the rounds and batches in flight, completion).
//! Their limits and figures are in `limits`.

mod assembler;
mod engine;
mod limits;
mod resident;
mod shard_pool;
mod staged;
pub mod tier;

pub use self::assembler::GpuAssembler;
pub use self::engine::buffers::RoundBufferPool;
pub use self::limits::{
    GpuFillTimings, GpuStreamLimits, ZeroCopy, BATCH_GROUP_DEFAULT, BATCH_GROUP_MAX,
    BATCH_GROUP_MIN, DEVICE_SHARD_BYTES_DEFAULT, GATHER_PIECE_OUT_BYTES_DEFAULT,
    GATHER_PIECE_OUT_BYTES_MAX, GATHER_PIECE_OUT_BYTES_MIN, INLINE_GATHER_LAUNCHES_DEFAULT,
    INLINE_GATHER_LAUNCHES_MAX, LOADER_COPY_THREADS_DEFAULT, LOADER_COPY_THREADS_MAX,
    PLAN_THREADS_DEFAULT, PLAN_THREADS_MAX, ROUNDS_IN_FLIGHT_DEFAULT, ROUNDS_IN_FLIGHT_MAX,
    ROUNDS_IN_FLIGHT_MIN, WAIT_SPIN_DEFAULT, WAIT_SPIN_MAX,
};
pub use self::shard_pool::{
    ShardSlotPool, DEVICE_POOL_IDLE_RELEASE_DEFAULT, DEVICE_POOL_IDLE_RELEASE_MAX,
    DEVICE_POOL_IDLE_RELEASE_MIN,
};
pub use self::tier::DeviceTier;
