//! Streams whose order is computed on the device: a stream whose every row is read from a region
//! table fixed for its life (its dataset whole in the device-memory tier, or every window of the
//! dataset registered and mapped for the stream's life and read in place), whose fields lie back
//! to back in every shard and with no corrupt block, has no per-row plan at all. Its tables (the
//! epoch's order, the shards' first samples and first regions, each field's offset in each
//! shard) go to the device once when it opens, and each round is one launch of the ordered gather
//! (`kernels::ordered`) for one batch or a group of consecutive ones: the host computes nothing
//! per row, and the planning threads are never started. (Streams that copy shards ahead into
//! device memory, fill the tier, or copy rows into staging change their regions round by round,
//! and plan on the host.)
//!
//! `GPUFEED_DEVICE_ORDER=off` in the daemon's environment plans every row on the host instead
//! (for comparisons).

use std::sync::Arc;

use super::open::Resident;
use super::planner::RowGeometry;
use crate::device::{Device, DeviceBuffer, DeviceError, DeviceMemory};
use crate::kernels::{
    FeistelSpec, GatherOp, GatherRegion, Gatherer, OrderSpec, OrderedField, OrderedLaunch,
    OrderedTables, WindowSpec,
};
use crate::pipeline::order::{OrderTables, Permutation};
use crate::pipeline::stream_plan::StreamPlan;

fn feistel(permutation: &Permutation) -> FeistelSpec {
    FeistelSpec {
        n: permutation.len(),
        half_bits: permutation.half_bits(),
        keys: permutation.keys(),
    }
}

/// An epoch's order (`EpochOrder::tables`) for the ordered gather.
fn order_spec(tables: &OrderTables) -> OrderSpec {
    match tables {
        OrderTables::Identity => OrderSpec::Identity,
        OrderTables::Full(permutation) => OrderSpec::Full(feistel(permutation)),
        OrderTables::Windows(windows) => OrderSpec::Windows(
            windows
                .iter()
                .map(|(start, permutation, shards)| WindowSpec {
                    start: *start,
                    permutation: feistel(permutation),
                    shards: shards.clone(),
                })
                .collect(),
        ),
    }
}

/// A stream's order on the device, and the batches waiting to be gathered together.
pub(in crate::pipeline::gpu) struct DeviceOrder {
    /// The first sample of each shard, and the sample count after the last.
    shard_first: Vec<u64>,
    /// Per shard, per field: where the field starts in the shard.
    linear: Vec<Vec<u64>>,
    /// Per field: a sample's stored bytes.
    field_bytes: Vec<u64>,
    tables: OrderedTables,
    /// `tables`' bytes on the device.
    device_tables: DeviceBuffer,
    /// The stream's region table on the device, its regions, and the bytes of each shard's
    /// windows.
    regions: u64,
    region_count: u32,
    window_bytes: u64,
    /// Whether rows are read in place from host memory (counted as read bytes), not the tier.
    in_place: bool,
    /// Stored bytes of one row (every field).
    row_bytes_in: u64,
    /// Consecutive batches whose slots follow one another, not queued yet.
    pub(super) group: Option<OrderedGroup>,
    /// The region table `regions` points at when it is not the stream's own: the tier's, for a
    /// stream that opened while its dataset filled the tier (see [`DeviceOrder::over_filled_tier`]).
    _own_regions: Option<DeviceBuffer>,
}

/// Consecutive batches (`steps`) whose slots lie back to back from `base` to `end`, `slot_bytes`
/// each, gathered by one launch.
pub(super) struct OrderedGroup {
    pub(super) steps: std::ops::Range<u64>,
    pub(super) base: u64,
    pub(super) end: u64,
    pub(super) slot_bytes: u64,
}

impl OrderedGroup {
    /// Whether the group holds step `step`.
    pub(super) fn contains(&self, step: u64) -> bool {
        self.steps.contains(&step)
    }
}

/// Where a stream's rows lie, for [`RowLayout::region_bytes`].
struct RowLayout<'a> {
    shard_first: &'a [u64],
    linear: &'a [Vec<u64>],
    field_bytes: &'a [u64],
    window_bytes: u64,
    region_count: usize,
}

impl RowLayout<'_> {
    /// The bytes `launch` reads of each region in dataset order (samples are positions).
    fn region_bytes(
        &self,
        launch: &OrderedLaunch,
        first_region: impl Fn(usize) -> usize,
    ) -> Vec<u64> {
        let samples = *self.shard_first.last().expect("the sample count");
        let mut bytes = vec![0u64; self.region_count];
        if samples == 0 {
            return bytes;
        }
        for batch in 0..launch.batches as u64 {
            // The batch's positions, wrapping at the epoch's end, in runs within one shard.
            let mut start = (launch.pos_base + batch * launch.step_samples) % samples;
            let mut left = launch.batch_rows as u64;
            while left > 0 {
                let shard = self.shard_first.partition_point(|&s| s <= start) - 1;
                let run = left
                    .min(self.shard_first[shard + 1] - start)
                    .min(samples - start);
                let local = start - self.shard_first[shard];
                for (field, &base) in self.linear[shard].iter().enumerate() {
                    let per = self.field_bytes[field];
                    let (from, to) = (base + local * per, base + (local + run) * per);
                    if from == to {
                        continue;
                    }
                    let (w0, w1) = (from / self.window_bytes, (to - 1) / self.window_bytes);
                    for window in w0..=w1 {
                        let lo = from.max(window * self.window_bytes);
                        let hi = to.min((window + 1) * self.window_bytes);
                        if let Some(b) = bytes.get_mut(first_region(shard) + window as usize) {
                            *b += hi - lo;
                        }
                    }
                }
                left -= run;
                start = (start + run) % samples;
            }
        }
        bytes
    }
}

/// Whether the daemon's environment turned the device order off.
pub(in crate::pipeline::gpu) fn turned_off() -> bool {
    std::env::var("GPUFEED_DEVICE_ORDER").is_ok_and(|v| v.eq_ignore_ascii_case("off"))
}

impl DeviceOrder {
    /// The device order of a stream over `resident`, if it qualifies (see the module
    /// documentation): `None` otherwise, and the stream plans its rows on the host.
    pub(in crate::pipeline::gpu) fn new(
        plan: &StreamPlan,
        resident: &Resident,
        gatherer: &Gatherer,
        device: &Device,
    ) -> Result<Option<DeviceOrder>, DeviceError> {
        // The region table is fixed for the stream's life: the tier whole, or every window in
        // place (no shards copied ahead, no tier filling, no rows copied into staging).
        // In dataset order inside the budget the shards copied ahead redirect a round's table
        // to their device copies: each round's regions are then derived from its positions
        // ([`DeviceOrder::region_bytes`]).
        let copies_ahead = resident
            .device_shards
            .as_ref()
            .is_some_and(|d| !d.is_streamed())
            && plan.order.is_identity();
        let fixed = resident.reads_tier_only()
            || (resident.tier.is_none()
                && (resident.device_shards.is_none() || copies_ahead)
                && resident.row_copies.is_none());
        if turned_off() || !gatherer.has_ordered() || !fixed {
            return Ok(None);
        }
        let in_place = !resident.reads_tier_only();
        Self::build(
            plan,
            resident,
            device,
            (resident.regions.device_ptr(), None),
            in_place,
        )
    }

    /// The device order of a stream that opened while its dataset filled the device-memory tier,
    /// once the fill is complete (or waited for on the stream's compute stream, see
    /// `TierRead::filled_since_open`): every row read in the tier, through a region table of its
    /// own. `None` if the stream does not qualify (as for [`Self::new`]) or the fill is not done.
    /// The rows are the ones the host would plan: the device computes the same order.
    pub(in crate::pipeline::gpu) fn over_filled_tier(
        plan: &StreamPlan,
        resident: &Resident,
        gatherer: &Gatherer,
        device: &Device,
    ) -> Result<Option<DeviceOrder>, DeviceError> {
        let Some(tier) = resident.tier.as_ref().filter(|t| t.filled_since_open()) else {
            return Ok(None);
        };
        let dataset = &tier.dataset;
        if turned_off()
            || !gatherer.has_ordered()
            || resident.device_shards.is_some()
            || resident.row_copies.is_some()
            || resident.host_regions.len() != dataset.window_count()
        {
            return Ok(None);
        }
        let own = DeviceBuffer::from_host(device, &GatherRegion::encode_all(&dataset.regions()))?;
        Self::build(plan, resident, device, (own.device_ptr(), Some(own)), false)
    }

    /// The device order of a stream over `resident` reading its rows through the region table at
    /// `regions.0` (held by the order itself when `regions.1` is given); `in_place`: rows are read
    /// from host memory (counted as read bytes). `None` when the rows do not lie back to back
    /// (corrupt blocks, fields not linear) or a field's conversion has no ordered gather.
    fn build(
        plan: &StreamPlan,
        resident: &Resident,
        device: &Device,
        regions: (u64, Option<DeviceBuffer>),
        in_place: bool,
    ) -> Result<Option<DeviceOrder>, DeviceError> {
        let geometry: &Arc<RowGeometry> = &resident.geometry;
        let Some(linear) = geometry.linear_bases() else {
            return Ok(None);
        };
        let shard_count = plan.dataset.shards.len();
        let bases: Vec<u64> = linear.iter().flatten().copied().collect();
        let first_regions: Vec<u64> = (0..shard_count)
            .map(|shard| geometry.first_region(shard) as u64)
            .collect();
        let mut fields = Vec::with_capacity(plan.fields.len());
        for field in &plan.fields {
            let Some(op) = GatherOp::for_dtypes(field.stored, field.out) else {
                return Ok(None);
            };
            fields.push(OrderedField {
                out_offset: field.offset as u64,
                out_sample_bytes: field.sample_bytes_out as u64,
                in_sample_bytes: field.sample_bytes_in as u64,
                op,
            });
        }
        let shard_first = geometry.shard_first_samples().to_vec();
        let tables = OrderedTables::new(
            &order_spec(&plan.order.tables()),
            &shard_first,
            &fields,
            &bases,
            &first_regions,
        );
        let device_tables = DeviceBuffer::from_host(device, tables.bytes())?;
        tracing::info!(
            "stream computes its order on the device ({} bytes of tables, rows read {}): no rows \
             planned on the host",
            tables.bytes().len(),
            if in_place {
                "in place"
            } else {
                "from the device-memory tier"
            }
        );
        Ok(Some(DeviceOrder {
            shard_first,
            linear: linear.clone(),
            field_bytes: plan
                .fields
                .iter()
                .map(|f| f.sample_bytes_in as u64)
                .collect(),
            tables,
            device_tables,
            regions: regions.0,
            region_count: resident.region_count,
            window_bytes: geometry.window_bytes(),
            in_place,
            row_bytes_in: plan.fields.iter().map(|f| f.sample_bytes_in as u64).sum(),
            group: None,
            _own_regions: regions.1,
        }))
    }

    /// Whether step `step` with slot `slot` (`ptr`, `bytes`) joins the group waiting, which holds
    /// fewer than `batches_max` batches.
    pub(super) fn joins(&self, step: u64, ptr: u64, bytes: u64, batches_max: usize) -> bool {
        self.group.as_ref().is_some_and(|g| {
            g.steps.end == step
                && g.end == ptr
                && g.slot_bytes == bytes
                && ((g.steps.end - g.steps.start) as usize) < batches_max
        })
    }

    /// Adds step `step` with slot (`ptr`, `bytes`) to the group waiting (a new one if none); returns
    /// how many batches it holds.
    pub(super) fn add(&mut self, step: u64, ptr: u64, bytes: u64) -> usize {
        let group = self.group.get_or_insert(OrderedGroup {
            steps: step..step,
            base: ptr,
            end: ptr,
            slot_bytes: bytes,
        });
        group.steps.end = step + 1;
        group.end = ptr + bytes;
        (group.steps.end - group.steps.start) as usize
    }

    /// The launch of `group` for `plan`.
    pub(super) fn launch(&self, plan: &StreamPlan, group: &OrderedGroup) -> OrderedLaunch {
        let rank = &plan.rank;
        OrderedLaunch {
            pos_base: plan.start_cursor
                + group.steps.start * rank.step_samples()
                + rank.rank as u64 * rank.batch_size as u64,
            step_samples: rank.step_samples(),
            batch_rows: rank.batch_size,
            batches: (group.steps.end - group.steps.start) as u32,
            slot_stride: group.slot_bytes,
            regions: self.regions,
            region_count: self.region_count,
            window_bytes: self.window_bytes,
        }
    }

    /// Bytes a launch of `batches` batches of `rows` rows reads from host memory in place (0 from
    /// the tier).
    pub(super) fn bytes_read_in_place(&self, batches: u64, rows: u64) -> u64 {
        if self.in_place {
            batches * rows * self.row_bytes_in
        } else {
            0
        }
    }

    /// The bytes a launch of `group` reads of each region of the stream's table (of
    /// `region_count` regions, each shard's windows `window_bytes` long from region
    /// `first_region(shard)`), for a stream in dataset order: which shards and windows a round
    /// whose shards are copied ahead reads.
    pub(super) fn region_bytes(
        &self,
        plan: &StreamPlan,
        group: &OrderedGroup,
        first_region: impl Fn(usize) -> usize,
    ) -> Vec<u64> {
        let layout = RowLayout {
            shard_first: &self.shard_first,
            linear: &self.linear,
            field_bytes: &self.field_bytes,
            window_bytes: self.window_bytes,
            region_count: self.region_count as usize,
        };
        layout.region_bytes(&self.launch(plan, group), first_region)
    }

    /// The tables, and their bytes on the device.
    pub(super) fn tables(&self) -> (&OrderedTables, &DeviceBuffer) {
        (&self.tables, &self.device_tables)
    }
}

impl DeviceMemory for OrderedGroup {
    fn device_ptr(&self) -> u64 {
        self.base
    }
    fn len(&self) -> usize {
        (self.end - self.base) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::order::{EpochOrder, ShuffleMode};

    /// The regions a dataset-order launch reads are the windows its rows lie in, byte for byte,
    /// for batches that wrap at the epoch's end and cross shards and windows, several fields.
    #[test]
    fn region_bytes_are_the_rows_windows() {
        let shard_first = [0u64, 50, 50, 130, 200];
        // Two fields: 12 and 40 bytes a sample, the second after the first's bytes in its shard.
        let field_bytes = [12u64, 40];
        let linear: Vec<Vec<u64>> = shard_first
            .windows(2)
            .map(|w| vec![0, (w[1] - w[0]) * 12])
            .collect();
        let window_bytes = 256u64;
        let regions_of = |shard: usize| {
            let bytes = (shard_first[shard + 1] - shard_first[shard]) * 52;
            bytes.div_ceil(window_bytes) as usize
        };
        let first: Vec<usize> = (0..4)
            .scan(0usize, |next, s| {
                let at = *next;
                *next += regions_of(s);
                Some(at)
            })
            .collect();
        let region_count = first[3] + regions_of(3);
        let layout = RowLayout {
            shard_first: &shard_first,
            linear: &linear,
            field_bytes: &field_bytes,
            window_bytes,
            region_count,
        };
        let launch = OrderedLaunch {
            pos_base: 170,
            step_samples: 45,
            batch_rows: 30,
            batches: 3,
            slot_stride: 0,
            regions: 0,
            region_count: region_count as u32,
            window_bytes,
        };
        let got = layout.region_bytes(&launch, |s| first[s]);
        let mut want = vec![0u64; region_count];
        for batch in 0..3u64 {
            for row in 0..30u64 {
                let sample = (170 + batch * 45 + row) % 200;
                let shard = shard_first.partition_point(|&s| s <= sample) - 1;
                let local = sample - shard_first[shard];
                for (field, &per) in field_bytes.iter().enumerate() {
                    for byte in 0..per {
                        let at = linear[shard][field] + local * per + byte;
                        want[first[shard] + (at / window_bytes) as usize] += 1;
                    }
                }
            }
        }
        assert_eq!(got, want);
    }

    /// The encoded tables, read as the kernel reads them, give every position the sample and the
    /// shard `EpochOrder` gives it, in every mode, empty shards included.
    #[test]
    fn the_encoded_order_is_the_epochs_order() {
        for shards in [
            &[40u64, 25, 60, 33, 50, 12][..],
            &[40, 0, 25, 0, 0, 60, 33],
            &[1],
            &[7, 1],
        ] {
            let mut firsts = vec![0u64];
            for count in shards {
                firsts.push(firsts.last().unwrap() + count);
            }
            let modes = [
                ShuffleMode::None,
                ShuffleMode::Full,
                ShuffleMode::Window { shards: 1 },
                ShuffleMode::Window { shards: 2 },
                ShuffleMode::Window { shards: 4 },
            ];
            for mode in modes {
                for epoch in [0u64, 3] {
                    let order = EpochOrder::new(shards, 11, epoch, mode);
                    let field = OrderedField {
                        out_offset: 0,
                        out_sample_bytes: 8,
                        in_sample_bytes: 4,
                        op: GatherOp::F16ToF32,
                    };
                    let bases = vec![0u64; shards.len()];
                    let tables = OrderedTables::new(
                        &order_spec(&order.tables()),
                        &firsts,
                        &[field],
                        &bases,
                        &bases,
                    );
                    for position in 0..order.len() {
                        let sample = order.sample_at(position);
                        let shard = firsts.partition_point(|&s| s <= sample) - 1;
                        assert_eq!(
                            tables.sample_model(position),
                            (sample, shard as u32),
                            "{mode:?} epoch {epoch} shards {shards:?} position {position}"
                        );
                    }
                }
            }
        }
    }
}
