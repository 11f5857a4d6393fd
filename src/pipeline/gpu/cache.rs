//! The block cache: decoded LZ4 blocks kept in fixed device entries between rounds and batches, the
//! least recently used evicted first, and the blocks found unusable, so that later rounds skip them.

use std::collections::BTreeSet;
use std::sync::Arc;

use foldhash::{HashMap, HashMapExt};

use crate::pipeline::assemble::{BlockKey, CorruptBlock};

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
pub(super) struct BlockCache {
    blocks: HashMap<BlockKey, CacheEntry>,
    /// The decoded blocks by (last round used, key): the least recently used first.
    lru: BTreeSet<(u64, BlockKey)>,
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
            lru: BTreeSet::new(),
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

    /// Marks the decoded block `key`, last used by round `used`, as used by round `stamp`: that round
    /// will not evict it.
    pub(super) fn pin(&mut self, key: BlockKey, used: u64, stamp: u64) {
        self.lru.remove(&(used, key));
        self.lru.insert((stamp, key));
        if let Some(CacheEntry::Decoded { stamp: s, .. }) = self.blocks.get_mut(&key) {
            *s = stamp;
        }
    }

    /// Gives the new block `key` of round `stamp` a cache entry and returns its index.
    pub(super) fn insert(&mut self, key: BlockKey, stamp: u64) -> u32 {
        let index = self.take_entry(stamp);
        self.blocks
            .insert(key, CacheEntry::Decoded { index, stamp });
        self.lru.insert((stamp, key));
        index
    }

    /// A cache entry for a new block of round `stamp`: a free one, else the least recently used one
    /// that the round does not use. An entry whose old block is still read by a queued round is safe
    /// to reuse: the decode into it is queued after that round's gather, on the same stream.
    fn take_entry(&mut self, stamp: u64) -> u32 {
        if let Some(index) = self.free_entries.pop() {
            return index;
        }
        let &(used, key) = self
            .lru
            .first()
            .expect("plan_round checked that an entry can be evicted");
        assert!(
            used != stamp,
            "plan_round checked that an entry can be evicted"
        );
        self.lru.remove(&(used, key));
        match self.blocks.remove(&key) {
            Some(CacheEntry::Decoded { index, .. }) => index,
            _ => unreachable!("the LRU lists decoded blocks only"),
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
        if let Some(CacheEntry::Decoded { index, stamp }) = self.blocks.get(&key) {
            if *index != entry_index {
                return false;
            }
            self.lru.remove(&(*stamp, key));
            self.free_entries.push(entry_index);
        }
        self.blocks.insert(key, CacheEntry::Corrupt(bad));
        self.corrupt_marks += 1;
        true
    }
}
