//! The CPU backend's decoded-block cache: one per daemon, shared by every host stream, inside the
//! daemon's one budget of host memory for streams.
//!
//! # What it holds
//!
//! Decoded blocks (and blocks found corrupt, so that every stream reading them reports the same
//! fault without decoding them again), keyed by the dataset's identity, the shard, the field and the
//! block. A block decoded for one stream is served to every other stream of the same dataset that
//! reads it while it is kept: two streams over one dataset decode each block once between them.
//!
//! # The budget
//!
//! One number bounds the host memory the daemon holds for streams: `--slot-memory-max`. Slots come
//! first (a stream that cannot reserve its slots does not open, as before); each host stream also
//! reserves a bounded working set ([`working_set_bytes`]) beside its slots, for the blocks of the
//! part of a batch it is filling. The cache keeps what is left:
//!
//! ```text
//! kept <= budget - reserved (slots and working sets of open streams)
//! ```
//!
//! A block a stream is using is never freed under it: entries are `Arc`s, and eviction skips an
//! entry another holder still uses. A block that cannot be kept (the cache is full of blocks in use)
//! stays the stream's own, inside its reserved working set, until the stream is done with it. So all
//! decoded bytes alive (`held`) stay within the budget less the slots.
//!
//! # Eviction
//!
//! CLOCK (second chance) per lock shard: an insertion or a hit sets the entry's reference bit; the
//! hand clears set bits and evicts the first entry whose bit is clear and which no stream uses. CLOCK costs O(1) per
//! hit (no list to reorder under the lock, unlike LRU) and keeps the blocks a window of the window
//! shuffle keeps coming back to.
//!
//! # Closing
//!
//! When the last stream of a dataset closes, its blocks are dropped; when any stream closes, the
//! allocator is asked to return freed memory to the system (mimalloc keeps the freed pages of exited
//! threads' heaps otherwise: the daemon's RSS stayed gigabytes above its baseline after every stream
//! had closed; measured in `docs/benchmarks/cpu-block-cache-2026-11-28.md`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::stream_plan::CorruptBlock;
use crate::metrics::Metrics;

/// Lock shards of the cache: enough that streams filling at once rarely wait on one another.
const LOCK_SHARDS: usize = 16;

/// Working set a host stream reserves beside its slots at least: the decoded blocks of the part of a
/// batch it fills at once. 4 MiB holds 64 blocks of 64 KiB, enough for the decode threads to share
/// (a thread takes 4 blocks at least), and 200 streams reserve 800 MiB of the budget for it.
pub const WORKING_SET_BYTES_MIN: u64 = 4 << 20;

/// Identifies a cached block: the dataset (see [`BlockCache::open`]), shard, field and block index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CacheKey {
    /// The dataset's identity while a stream of it is open.
    pub dataset: u64,
    /// Shard index.
    pub shard: u32,
    /// Field index.
    pub field: u32,
    /// Block index within the field.
    pub block: u32,
}

/// A block's decoded bytes, counted in the cache's `held` figure for as long as they are alive,
/// wherever they are (kept in the cache, or used by a stream only).
pub struct DecodedBlock {
    bytes: Vec<u8>,
    ledger: Arc<Metrics>,
}

impl DecodedBlock {
    /// Wraps `bytes`, counting them as held.
    pub fn new(bytes: Vec<u8>, ledger: Arc<Metrics>) -> DecodedBlock {
        ledger.block_cache().held_changed(bytes.len() as i64);
        DecodedBlock { bytes, ledger }
    }

    /// The decoded bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for DecodedBlock {
    fn drop(&mut self) {
        self.ledger
            .block_cache()
            .held_changed(-(self.bytes.len() as i64));
    }
}

/// A cached block: decoded, or the reason it could not be decoded.
#[derive(Clone)]
pub enum CachedBlock {
    /// Its decoded bytes.
    Decoded(Arc<DecodedBlock>),
    /// Why it is unusable.
    Corrupt(Arc<CorruptBlock>),
}

impl CachedBlock {
    fn bytes(&self) -> u64 {
        match self {
            CachedBlock::Decoded(block) => block.bytes.len() as u64,
            CachedBlock::Corrupt(_) => 0,
        }
    }

    /// Whether a holder besides the cache uses it.
    fn in_use(&self) -> bool {
        match self {
            CachedBlock::Decoded(block) => Arc::strong_count(block) > 1,
            CachedBlock::Corrupt(bad) => Arc::strong_count(bad) > 1,
        }
    }
}

struct Entry {
    key: CacheKey,
    block: CachedBlock,
    referenced: bool,
}

#[derive(Default)]
struct LockShard {
    index: HashMap<CacheKey, usize>,
    entries: Vec<Entry>,
    hand: usize,
}

impl LockShard {
    fn remove_at(&mut self, at: usize) -> Entry {
        let entry = self.entries.swap_remove(at);
        self.index.remove(&entry.key);
        if let Some(moved) = self.entries.get(at) {
            self.index.insert(moved.key, at);
        }
        entry
    }

    /// Evicts one entry by CLOCK, skipping entries in use; none when every entry is in use.
    fn evict_one(&mut self) -> Option<Entry> {
        // Two sweeps: the first clears reference bits, the second then finds an unreferenced entry
        // unless all are in use.
        for _ in 0..2 * self.entries.len() {
            if self.hand >= self.entries.len() {
                self.hand = 0;
            }
            let entry = &mut self.entries[self.hand];
            if entry.block.in_use() {
                self.hand += 1;
                continue;
            }
            if entry.referenced {
                entry.referenced = false;
                self.hand += 1;
                continue;
            }
            return Some(self.remove_at(self.hand));
        }
        None
    }
}

/// The daemon's decoded-block cache for host streams (see the module's documentation).
pub struct BlockCache {
    shards: Box<[Mutex<LockShard>]>,
    /// Open streams per dataset identity.
    streams: Mutex<HashMap<u64, usize>>,
    /// Bytes kept in the cache (entries in the shards).
    kept: AtomicU64,
    /// The budget of host memory for streams: slots, working sets and the cache.
    budget: u64,
    metrics: Arc<Metrics>,
}

/// A stream's hold on the cache: its dataset's identity, and its reserved working set. Dropping it
/// (the stream closed) drops the dataset's blocks when no other stream of the dataset is open.
pub struct CacheHandle {
    cache: Arc<BlockCache>,
    dataset: u64,
}

impl CacheHandle {
    /// The cache.
    pub fn cache(&self) -> &BlockCache {
        &self.cache
    }

    /// The key of block `block` of `field` in `shard` of this stream's dataset.
    pub fn key(&self, shard: u32, field: u32, block: u32) -> CacheKey {
        CacheKey {
            dataset: self.dataset,
            shard,
            field,
            block,
        }
    }
}

impl Drop for CacheHandle {
    fn drop(&mut self) {
        self.cache.stream_closed(self.dataset);
    }
}

/// Bytes a host stream whose rows read up to `row_block_bytes` of blocks (over all its fields)
/// reserves beside its slots for the blocks it is using.
pub fn working_set_bytes(row_block_bytes: u64) -> u64 {
    row_block_bytes.max(WORKING_SET_BYTES_MIN)
}

impl BlockCache {
    /// A cache within `budget` bytes of host memory for streams (slots included), counting into
    /// `metrics` (the slot reservations it leaves room for are read from there too).
    pub fn new(budget: u64, metrics: Arc<Metrics>) -> Arc<BlockCache> {
        metrics.block_cache().set_budget(budget);
        Arc::new(BlockCache {
            shards: (0..LOCK_SHARDS)
                .map(|_| Mutex::new(LockShard::default()))
                .collect(),
            streams: Mutex::new(HashMap::new()),
            kept: AtomicU64::new(0),
            budget,
            metrics,
        })
    }

    /// A stream of `dataset` opens. The identity is the dataset's address, unique while any stream
    /// of it is open; its blocks are dropped when the last one closes, before the dataset can be
    /// freed and its address reused.
    pub fn open<T>(self: &Arc<Self>, dataset: &Arc<T>) -> CacheHandle {
        let id = Arc::as_ptr(dataset) as *const u8 as usize as u64;
        *self
            .streams
            .lock()
            .expect("cache stream table poisoned")
            .entry(id)
            .or_default() += 1;
        CacheHandle {
            cache: Arc::clone(self),
            dataset: id,
        }
    }

    fn stream_closed(&self, dataset: u64) {
        let last = {
            let mut streams = self.streams.lock().expect("cache stream table poisoned");
            let count = streams.get_mut(&dataset).expect("opened before closing");
            *count -= 1;
            if *count == 0 {
                streams.remove(&dataset);
                true
            } else {
                false
            }
        };
        if last {
            self.drop_dataset(dataset);
        }
        // On every close, not only the last of a dataset: the closing stream's filler thread is
        // about to exit, and the pages its heap freed (working sets, evicted blocks) would stay
        // with the process otherwise.
        release_free_memory();
    }

    /// Drops every entry of `dataset` (entries in use stay alive with their users, counted as held).
    fn drop_dataset(&self, dataset: u64) {
        for shard in self.shards.iter() {
            let mut shard = shard.lock().expect("cache shard poisoned");
            let mut at = 0;
            while at < shard.entries.len() {
                if shard.entries[at].key.dataset == dataset {
                    let entry = shard.remove_at(at);
                    self.kept.fetch_sub(entry.block.bytes(), Ordering::SeqCst);
                } else {
                    at += 1;
                }
            }
            shard.hand = 0;
        }
        self.publish_kept();
    }

    /// The lock shard of `key`: consecutive blocks of a field go to different ones.
    fn shard_index(key: &CacheKey) -> usize {
        let spread = (key.block as u64)
            .wrapping_add((key.shard as u64) << 20)
            .wrapping_add((key.field as u64) << 40)
            .wrapping_add(key.dataset >> 4);
        (spread.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 60) as usize % LOCK_SHARDS
    }

    fn lock_shard(&self, key: &CacheKey) -> std::sync::MutexGuard<'_, LockShard> {
        self.shards[Self::shard_index(key)]
            .lock()
            .expect("cache shard poisoned")
    }

    /// The block under `key`, counting a hit or a miss.
    pub fn get(&self, key: &CacheKey) -> Option<CachedBlock> {
        let found = self.peek(key);
        if found.is_none() {
            self.record(false);
        }
        found
    }

    /// The block under `key`, counting a hit if found and nothing otherwise (for a block that may
    /// be read another way, such as a raw block read in place: [`BlockCache::record`] counts the
    /// miss if it is decoded after all).
    pub fn peek(&self, key: &CacheKey) -> Option<CachedBlock> {
        let mut shard = self.lock_shard(key);
        let at = shard.index.get(key).copied()?;
        let entry = &mut shard.entries[at];
        entry.referenced = true;
        let block = entry.block.clone();
        drop(shard);
        self.record(true);
        Some(block)
    }

    /// Counts a look-up that found its block (`hit`) or did not.
    pub fn record(&self, hit: bool) {
        let counters = self.metrics.block_cache();
        match hit {
            true => counters.hits.fetch_add(1, Ordering::Relaxed),
            false => counters.misses.fetch_add(1, Ordering::Relaxed),
        };
    }

    /// Bytes the cache may keep now: the budget less what open streams reserved.
    pub fn capacity(&self) -> u64 {
        self.budget
            .saturating_sub(self.metrics.serving().slot_bytes_allocated)
    }

    /// Bytes kept now.
    pub fn kept_bytes(&self) -> u64 {
        self.kept.load(Ordering::SeqCst)
    }

    /// The budget of host memory for streams.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Offers `block` for `key`. It is kept if room can be made by evicting entries no stream uses;
    /// otherwise it stays its caller's alone. Returns whether it was kept.
    pub fn insert(&self, key: CacheKey, block: CachedBlock) -> bool {
        let bytes = block.bytes();
        if bytes > self.capacity() {
            self.count_refused();
            return false;
        }
        if !self.make_room(bytes, Some(&key)) {
            self.count_refused();
            return false;
        }
        let mut shard = self.lock_shard(&key);
        if shard.index.contains_key(&key) {
            // Another stream decoded it meanwhile: its copy is kept, ours goes with our caller.
            drop(shard);
            self.kept.fetch_sub(bytes, Ordering::SeqCst);
            self.publish_kept();
            return false;
        }
        let at = shard.entries.len();
        // Inserted referenced, as a page loaded under CLOCK: an entry inserted unreferenced is the
        // hand's first victim, before its second use, and a window shuffle whose window fits the
        // cache then decoded blocks more than once.
        shard.entries.push(Entry {
            key,
            block,
            referenced: true,
        });
        shard.index.insert(key, at);
        drop(shard);
        self.publish_kept();
        true
    }

    /// Reserves `bytes` in `kept`, evicting entries no stream uses (starting with `key`'s lock
    /// shard, then the others) until the reservation fits the capacity. False, with nothing
    /// reserved, when it cannot fit.
    fn make_room(&self, bytes: u64, key: Option<&CacheKey>) -> bool {
        let mut shard_at = key.map_or(0, Self::shard_index);
        let mut fruitless = 0;
        loop {
            let capacity = self.capacity();
            let reserved = self
                .kept
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |kept| {
                    kept.checked_add(bytes).filter(|&total| total <= capacity)
                })
                .is_ok();
            if reserved {
                return true;
            }
            if fruitless >= LOCK_SHARDS {
                return false;
            }
            if self.evict_one_from(shard_at) {
                fruitless = 0;
            } else {
                fruitless += 1;
                shard_at = (shard_at + 1) % LOCK_SHARDS;
            }
        }
    }

    /// Evicts one entry no stream uses from lock shard `shard_at`, counting it: false when that
    /// shard has none to evict. The entry is freed after the shard's lock is released.
    fn evict_one_from(&self, shard_at: usize) -> bool {
        let evicted = self.shards[shard_at]
            .lock()
            .expect("cache shard poisoned")
            .evict_one();
        let Some(entry) = evicted else {
            return false;
        };
        self.kept.fetch_sub(entry.block.bytes(), Ordering::SeqCst);
        self.metrics
            .block_cache()
            .evictions
            .fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Evicts entries no stream uses until the cache fits its capacity (after a stream reserved
    /// slots); entries in use stay until their users are done.
    pub fn shrink_to_capacity(&self) {
        let mut fruitless = 0;
        let mut shard_at = 0;
        while self.kept_bytes() > self.capacity() && fruitless < LOCK_SHARDS {
            if self.evict_one_from(shard_at) {
                fruitless = 0;
            } else {
                fruitless += 1;
                shard_at = (shard_at + 1) % LOCK_SHARDS;
            }
        }
        self.publish_kept();
    }

    fn count_refused(&self) {
        self.metrics
            .block_cache()
            .refused
            .fetch_add(1, Ordering::Relaxed);
    }

    fn publish_kept(&self) {
        self.metrics
            .block_cache()
            .kept_bytes
            .store(self.kept_bytes(), Ordering::Relaxed);
    }
}

// The daemon's allocator (see `main.rs`); linked here for `mi_collect`.
extern crate mimalloc as _;

extern "C" {
    fn mi_collect(force: bool);
}

/// Asks the allocator to return the memory freed so far to the system.
fn release_free_memory() {
    // SAFETY: `mi_collect` only walks and purges mimalloc's own free lists (it is linked whether or
    // not it is the global allocator); `force` also collects the abandoned heaps of threads that
    // exited, such as the decode threads of a batch.
    unsafe { mi_collect(true) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoded(metrics: &Arc<Metrics>, bytes: usize, fill: u8) -> CachedBlock {
        CachedBlock::Decoded(Arc::new(DecodedBlock::new(
            vec![fill; bytes],
            Arc::clone(metrics),
        )))
    }

    fn counters(metrics: &Metrics) -> (u64, u64, u64, u64, u64) {
        let c = metrics.block_cache().snapshot();
        (c.held_bytes, c.kept_bytes, c.hits, c.misses, c.evictions)
    }

    /// A stream reads what another decoded: one decode, a hit counted.
    #[test]
    fn two_streams_of_a_dataset_share_blocks() {
        let metrics = Arc::new(Metrics::new());
        let cache = BlockCache::new(1 << 20, Arc::clone(&metrics));
        let dataset = Arc::new(1u8);
        let (a, b) = (cache.open(&dataset), cache.open(&dataset));
        let key = a.key(0, 0, 3);
        assert!(a.cache().get(&key).is_none());
        assert!(a.cache().insert(key, decoded(&metrics, 4096, 7)));
        match b.cache().get(&b.key(0, 0, 3)) {
            Some(CachedBlock::Decoded(block)) => assert_eq!(block.bytes(), &[7u8; 4096][..]),
            _ => panic!("the second stream does not see the block the first decoded"),
        }
        let (held, kept, hits, misses, _) = counters(&metrics);
        assert_eq!((held, kept, hits, misses), (4096, 4096, 1, 1));
    }

    /// Eviction skips a block a stream still uses, and the cache never keeps more than its capacity.
    #[test]
    fn a_block_in_use_is_not_freed() {
        let metrics = Arc::new(Metrics::new());
        let cache = BlockCache::new(8192, Arc::clone(&metrics));
        let dataset = Arc::new(2u8);
        let handle = cache.open(&dataset);
        assert!(cache.insert(handle.key(0, 0, 0), decoded(&metrics, 4096, 1)));
        let in_use = cache.get(&handle.key(0, 0, 0)).expect("just kept");
        assert!(cache.insert(handle.key(0, 0, 1), decoded(&metrics, 4096, 2)));
        // Full: the third block evicts the second (not in use), never the first.
        assert!(cache.insert(handle.key(0, 0, 2), decoded(&metrics, 4096, 3)));
        assert!(cache.kept_bytes() <= 8192);
        assert!(cache.get(&handle.key(0, 0, 0)).is_some());
        assert!(cache.get(&handle.key(0, 0, 1)).is_none());
        let CachedBlock::Decoded(block) = in_use else {
            panic!("kept as decoded")
        };
        assert_eq!(block.bytes(), &[1u8; 4096][..]);
        assert_eq!(metrics.block_cache().snapshot().evictions, 1);
    }

    /// Every block in use: a new block is not kept, and stays its caller's.
    #[test]
    fn a_full_cache_of_blocks_in_use_refuses() {
        let metrics = Arc::new(Metrics::new());
        let cache = BlockCache::new(4096, Arc::clone(&metrics));
        let dataset = Arc::new(3u8);
        let handle = cache.open(&dataset);
        assert!(cache.insert(handle.key(0, 0, 0), decoded(&metrics, 4096, 1)));
        let _in_use = cache.get(&handle.key(0, 0, 0));
        let mine = decoded(&metrics, 4096, 2);
        assert!(!cache.insert(handle.key(0, 0, 1), mine.clone()));
        assert_eq!(cache.kept_bytes(), 4096);
        assert_eq!(metrics.block_cache().snapshot().refused, 1);
        drop(mine);
        assert_eq!(metrics.block_cache().snapshot().held_bytes, 4096);
    }

    /// Memory counted returns to zero once the last stream of the dataset closes.
    #[test]
    fn closing_the_last_stream_frees_its_blocks() {
        let metrics = Arc::new(Metrics::new());
        let cache = BlockCache::new(1 << 20, Arc::clone(&metrics));
        let dataset = Arc::new(4u8);
        let (a, b) = (cache.open(&dataset), cache.open(&dataset));
        for block in 0..8 {
            assert!(cache.insert(a.key(0, 0, block), decoded(&metrics, 4096, 1)));
        }
        drop(a);
        assert_eq!(counters(&metrics).1, 8 * 4096, "b still reads the dataset");
        drop(b);
        let (held, kept, ..) = counters(&metrics);
        assert_eq!((held, kept), (0, 0));
    }

    /// Slots reserved by streams shrink what the cache may keep.
    #[test]
    fn slots_come_first() {
        let metrics = Arc::new(Metrics::new());
        let cache = BlockCache::new(16384, Arc::clone(&metrics));
        let dataset = Arc::new(5u8);
        let handle = cache.open(&dataset);
        for block in 0..4 {
            assert!(cache.insert(handle.key(0, 0, block), decoded(&metrics, 4096, 1)));
        }
        assert!(metrics.reserve_slot_bytes(8192, 16384));
        cache.shrink_to_capacity();
        assert_eq!(cache.kept_bytes(), 8192);
        assert_eq!(metrics.block_cache().snapshot().held_bytes, 8192);
    }

    /// Many threads inserting and reading at once: what is kept never exceeds the capacity, and
    /// what is held never exceeds the capacity plus the blocks the threads hold themselves.
    #[test]
    fn the_budget_holds_under_many_streams() {
        let metrics = Arc::new(Metrics::new());
        let budget = 64 * 4096;
        let cache = BlockCache::new(budget, Arc::clone(&metrics));
        let dataset = Arc::new(6u8);
        let threads = 8;
        let held_each_max = 2 * 4096;
        std::thread::scope(|scope| {
            for t in 0..threads {
                let cache = &cache;
                let metrics = &metrics;
                let handle = cache.open(&dataset);
                scope.spawn(move || {
                    let mut state = 0x9e37_79b9u64 + t;
                    let mut mine: Vec<CachedBlock> = Vec::new();
                    for _ in 0..4000 {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        let key = handle.key(0, 0, (state % 256) as u32);
                        let block = match cache.get(&key) {
                            Some(block) => block,
                            None => {
                                let block = decoded(metrics, 4096, key.block as u8);
                                cache.insert(key, block.clone());
                                block
                            }
                        };
                        if let CachedBlock::Decoded(bytes) = &block {
                            assert!(bytes.bytes().iter().all(|&b| b == key.block as u8));
                        }
                        mine.push(block);
                        if mine.len() * 4096 > held_each_max {
                            mine.remove(0);
                        }
                        let snapshot = metrics.block_cache().snapshot();
                        assert!(cache.kept_bytes() <= budget);
                        // Each thread holds its blocks, one more just decoded, and one more
                        // decoded but not yet offered.
                        assert!(
                            snapshot.held_bytes
                                <= budget + threads * (held_each_max as u64 + 2 * 4096),
                            "{} held",
                            snapshot.held_bytes
                        );
                    }
                    drop(handle);
                });
            }
        });
        let (held, kept, hits, misses, _) = counters(&metrics);
        assert_eq!((held, kept), (0, 0));
        assert_eq!(hits + misses, threads * 4000);
    }
}
