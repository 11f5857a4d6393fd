//! The block cache: decoded LZ4 blocks kept in fixed device entries between rounds and batches, the
//! least recently used evicted first, and the blocks found unusable, so that later rounds skip them.

use std::collections::VecDeque;
use std::sync::Arc;

use foldhash::{HashMap, HashMapExt};

use crate::pipeline::stream_plan::{BlockKey, CorruptBlock};

/// A decoded LZ4 block in the cache, or the reason a block is unusable.
#[derive(Clone)]
pub(super) enum CacheEntry {
    /// In cache entry `index`; `stamp` is the round that last used it. Its decode may still be in
    /// flight (stream order makes it visible to later rounds) and its checks pending until the round
    /// that decoded it completes.
    Decoded { index: u32, stamp: u64 },
    /// Corrupt or unreadable.
    Corrupt(Arc<CorruptBlock>),
}

/// Which block each cache entry holds, and the order in which entries are evicted. The entries'
/// device memory belongs to the assembler; this is the bookkeeping only.
///
/// The eviction order is a queue of (round, block) in the order blocks were used, the least recently
/// used first; a block used again is queued again, and an item whose round is no longer its block's
/// last use is skipped when it comes up. A window shuffle uses thousands of cached blocks per round,
/// so using a block costs a map update and a push, not an ordered-set removal and insertion.
pub(super) struct BlockCache {
    blocks: HashMap<BlockKey, CacheEntry>,
    /// (round that used the block, block), in the order of use: rounds never decrease.
    lru: VecDeque<(u64, BlockKey)>,
    free_entries: Vec<u32>,
    /// Entries in the cache.
    pub(super) entries: u32,
    /// Count of cached blocks found corrupt so far.
    pub(super) corrupt_marks: u64,
}

impl BlockCache {
    /// An empty cache of `entries` entries.
    pub(super) fn new(entries: u32) -> BlockCache {
        BlockCache {
            blocks: HashMap::new(),
            lru: VecDeque::new(),
            free_entries: (0..entries).rev().collect(),
            entries,
            corrupt_marks: 0,
        }
    }

    /// What the cache knows of `key`.
    pub(super) fn get(&self, key: &BlockKey) -> Option<&CacheEntry> {
        self.blocks.get(key)
    }

    /// Why `key` is unusable, if it is known to be.
    pub(super) fn corrupt(&self, key: &BlockKey) -> Option<&Arc<CorruptBlock>> {
        match self.blocks.get(key) {
            Some(CacheEntry::Corrupt(bad)) => Some(bad),
            _ => None,
        }
    }

    /// Marks the decoded block `key` as used by round `stamp` (the latest round): that round will
    /// not evict it.
    pub(super) fn pin(&mut self, key: BlockKey, stamp: u64) {
        if let Some(CacheEntry::Decoded { stamp: s, .. }) = self.blocks.get_mut(&key) {
            *s = stamp;
            self.queue(stamp, key);
        }
    }

    /// Gives the new block `key` of round `stamp` a cache entry and returns its index.
    pub(super) fn insert(&mut self, key: BlockKey, stamp: u64) -> u32 {
        let index = self.take_entry(stamp);
        self.blocks
            .insert(key, CacheEntry::Decoded { index, stamp });
        self.queue(stamp, key);
        index
    }

    /// Whether the queued use (`stamp`, `key`) is the block's last use.
    fn is_last_use(&self, stamp: u64, key: &BlockKey) -> bool {
        matches!(self.blocks.get(key), Some(CacheEntry::Decoded { stamp: s, .. }) if *s == stamp)
    }

    /// Queues a use; drops the stale items once they outnumber the live ones, which keeps the queue
    /// within twice the entries (plus a little), whatever the run length.
    fn queue(&mut self, stamp: u64, key: BlockKey) {
        self.lru.push_back((stamp, key));
        if self.lru.len() > 2 * self.entries as usize + 1024 {
            let mut lru = std::mem::take(&mut self.lru);
            lru.retain(|(stamp, key)| self.is_last_use(*stamp, key));
            self.lru = lru;
        }
    }

    /// A cache entry for a new block of round `stamp`: a free one, else the least recently used one
    /// that the round does not use. An entry whose old block is still read by a queued round is safe
    /// to reuse: the decode into it is queued after that round's gather, on the same stream.
    fn take_entry(&mut self, stamp: u64) -> u32 {
        if let Some(index) = self.free_entries.pop() {
            return index;
        }
        loop {
            let (used, key) = self
                .lru
                .pop_front()
                .expect("plan_round checked that an entry can be evicted");
            if !self.is_last_use(used, &key) {
                continue;
            }
            assert!(
                used != stamp,
                "plan_round checked that an entry can be evicted"
            );
            match self.blocks.remove(&key) {
                Some(CacheEntry::Decoded { index, .. }) => return index,
                _ => unreachable!("checked above"),
            }
        }
    }

    /// Records that an LZ4 block is unusable, releasing its cache entry if it still holds the block.
    /// Returns false, and records nothing, if the block was evicted and decoded again into another
    /// entry since: the round that did so reports on its own copy.
    pub(super) fn mark_corrupt(
        &mut self,
        key: BlockKey,
        entry_index: u32,
        bad: Arc<CorruptBlock>,
    ) -> bool {
        if let Some(CacheEntry::Decoded { index, .. }) = self.blocks.get(&key) {
            if *index != entry_index {
                return false;
            }
            // Its queued uses are stale from now on (the block is no longer `Decoded`).
            self.free_entries.push(entry_index);
        }
        self.blocks.insert(key, CacheEntry::Corrupt(bad));
        self.corrupt_marks += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(block: u32) -> BlockKey {
        BlockKey {
            shard: 0,
            field: 0,
            block,
        }
    }

    /// The least recently used block not used by the current round is evicted, however often the
    /// others were used, and the queue stays bounded over a long run.
    #[test]
    fn evicts_the_least_recently_used_and_stays_bounded() {
        let mut cache = BlockCache::new(3);
        assert_eq!(cache.insert(key(0), 1), 0);
        assert_eq!(cache.insert(key(1), 1), 1);
        assert_eq!(cache.insert(key(2), 2), 2);
        // Block 0 used again by round 3: block 1 is now the least recently used.
        cache.pin(key(0), 3);
        assert_eq!(cache.insert(key(3), 4), 1);
        assert!(cache.get(&key(1)).is_none());
        // Many uses of the cached blocks: the queue is compacted, the order kept.
        for stamp in 5..20_000u64 {
            cache.pin(key(0), stamp);
            cache.pin(key(3), stamp);
        }
        assert!(cache.lru.len() <= 2 * 3 + 1024 + 1);
        cache.pin(key(2), 20_000);
        // Block 0 and 3 were last used by round 19 999, block 2 by round 20 000: 0 or 3 goes first
        // (3 was queued after 0 in the same round, so 0 is older).
        assert_eq!(cache.insert(key(4), 20_001), 0);
        assert!(cache.get(&key(0)).is_none());
        // A block found corrupt frees its entry; its queued uses are skipped.
        let bad = Arc::new(CorruptBlock {
            block: crate::decode::BlockRef {
                shard: "s.shard".into(),
                field: "x".into(),
                block: 3,
                stored_offset: 4096,
            },
            reason: crate::pipeline::stream_plan::CorruptReason::Checksum {
                expected: 1,
                computed: 2,
            },
        });
        assert!(cache.mark_corrupt(key(3), 1, bad));
        assert!(cache.corrupt(&key(3)).is_some());
        assert_eq!(cache.insert(key(5), 20_002), 1);
        // Evicting now: block 2 (round 20 000) before block 4 (20 001); 5 is this round's.
        assert_eq!(cache.insert(key(6), 20_003), 2);
        assert!(cache.get(&key(2)).is_none());
    }
}
