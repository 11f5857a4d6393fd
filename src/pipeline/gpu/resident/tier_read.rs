//! A resident stream's view of its dataset in the device's memory tier (see `gpu::tier`): whole
//! (every region of its table points into the tier from the start), or filling (each round waits
//! for the copies of the regions it reads and points them at the tier; the stream computes its order
//! on the device once every copy is done or waited for).

use std::sync::Arc;

use crate::device::{DeviceError, Stream};
use crate::kernels::GatherRegion;
use crate::pipeline::gpu::tier::{DeviceTier, TierDataset, TierEntry};

/// How a stream reads a dataset in the tier.
pub(in crate::pipeline::gpu) struct TierRead {
    pub(super) dataset: Arc<TierDataset>,
    tier: Arc<DeviceTier>,
    /// Per region: rounds queued from now on may read it in the tier.
    usable: Vec<bool>,
    usable_count: usize,
    /// Regions whose copies were queued, in the order they were (copies on one stream complete in
    /// that order), and how many of them are known complete.
    fill_order: Vec<usize>,
    polled: usize,
    /// The dataset was whole when the stream opened: the stream's own table points into the tier.
    whole_at_open: bool,
}

impl TierRead {
    /// A stream reading `dataset`, complete when the stream opened: every region is in the tier.
    pub(super) fn whole(dataset: Arc<TierDataset>, tier: &Arc<DeviceTier>) -> TierRead {
        let regions = dataset.window_count();
        TierRead {
            dataset,
            tier: Arc::clone(tier),
            usable: vec![true; regions],
            usable_count: regions,
            fill_order: Vec::new(),
            polled: 0,
            whole_at_open: true,
        }
    }

    /// A stream reading `dataset` while it fills, its copies queued in `fill_order`.
    pub(super) fn filling(
        dataset: Arc<TierDataset>,
        tier: &Arc<DeviceTier>,
        fill_order: Vec<usize>,
    ) -> TierRead {
        let regions = dataset.window_count();
        TierRead {
            dataset,
            tier: Arc::clone(tier),
            usable: vec![false; regions],
            usable_count: 0,
            fill_order,
            polled: 0,
            whole_at_open: false,
        }
    }

    /// Whether the dataset was whole in the tier when the stream opened (its region table points
    /// there; rounds need not redirect it).
    pub(super) fn is_whole_at_open(&self) -> bool {
        self.whole_at_open
    }

    /// Whether every region is read in the tier (and none in place).
    pub(super) fn is_whole(&self) -> bool {
        self.usable_count == self.usable.len()
    }

    /// Whether the dataset, filling when the stream opened, may now be read whole in the tier by
    /// work queued on the stream's compute stream: every copy is complete or waited for there.
    pub(super) fn filled_since_open(&self) -> bool {
        !self.whole_at_open && self.is_whole() && self.dataset.usable()
    }

    /// Points the regions of `table` that a round may read in the tier there, after noting the
    /// copies completed since the last round and making `compute`
    /// wait for those of the regions the round reads (`region_bytes`, bytes per region). Returns
    /// whether any region points into the tier.
    pub(super) fn redirect(
        &mut self,
        table: &mut [GatherRegion],
        region_bytes: &[u64],
        compute: &Stream,
    ) -> Result<bool, DeviceError> {
        if !self.dataset.usable() {
            // A copy into the tier could not be confirmed: the stream reads in place.
            return Ok(false);
        }
        if !self.is_whole() {
            while self.polled < self.fill_order.len() {
                let region = self.fill_order[self.polled];
                if !self.dataset.window_complete(region)? {
                    break;
                }
                self.mark(region);
                self.polled += 1;
            }
            for (region, &bytes) in region_bytes.iter().enumerate() {
                if bytes > 0
                    && !self.usable[region]
                    && self.dataset.wait_for_window(region, compute)?
                {
                    self.mark(region);
                }
            }
        }
        let mut any = false;
        for (region, entry) in table.iter_mut().enumerate() {
            if self.usable.get(region) == Some(&true) {
                entry.ptr = self.dataset.window_ptr(region);
                any = true;
            }
        }
        Ok(any)
    }

    fn mark(&mut self, region: usize) {
        if !self.usable[region] {
            self.usable[region] = true;
            self.usable_count += 1;
        }
    }

    /// Waits for the copies queued into the tier (before the windows they read are unpinned).
    pub(super) fn synchronize(&self) {
        if !self.dataset.is_complete() {
            let _ = self.dataset.synchronize();
        }
    }
}

impl Drop for TierRead {
    fn drop(&mut self) {
        // The copies read the stream's pinned windows: done before those are unpinned (this field
        // is dropped before the stream's windows).
        self.synchronize();
        self.tier
            .stream_closed(self.dataset.key(), self.dataset.place());
    }
}
