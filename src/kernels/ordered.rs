//! The ordered gather (`gf_gather_ordered` in `kernels/gather.cu`): a stream's rows gathered in its
//! epoch's order computed on the device, from fields that lie back to back in device memory. The
//! host encodes the order and the fields once per stream ([`OrderedTables`]) and passes each launch
//! its first position and its batches ([`OrderedLaunch`]); nothing per row is planned on the host
//! or crosses PCIe.

use std::ffi::c_void;

use super::gather::{prepare_outcome, GatherOp, Gatherer, GATHER_BLOCK_THREADS};
use crate::device::{DeviceError, DeviceMemory, Stream};

/// Bytes of one field entry (`struct OrderedField`).
const FIELD_BYTES: usize = 40;
/// Bytes of one window entry (`struct OrderedWindow`).
const WINDOW_BYTES: usize = 80;
/// Bytes of one window member (`struct OrderedMember`).
const MEMBER_BYTES: usize = 24;

/// One field of a stream for the ordered gather.
#[derive(Clone, Copy, Debug)]
pub struct OrderedField {
    /// The field's offset within a slot.
    pub out_offset: u64,
    /// A sample's converted bytes.
    pub out_sample_bytes: u64,
    /// A sample's stored bytes.
    pub in_sample_bytes: u64,
    /// The conversion.
    pub op: GatherOp,
}

/// A stream's order and fields, encoded for the device once.
#[derive(Clone, Debug)]
pub struct OrderedTables {
    bytes: Vec<u8>,
    /// The kernel's parameters that the tables decide (order, counts, offsets); a launch fills in
    /// the rest.
    params: OrderedParams,
}

/// What one launch gathers: `batches` batches of `batch_rows` rows, batch `b` from position
/// `pos_base + b * step_samples` on (wrapping at the epoch's end), into slots `slot_stride` bytes
/// apart, reading the stream's `region_count` regions (`GatherRegion`s at device address
/// `regions`; each shard's windows are `window_bytes` long, the last maybe shorter).
#[derive(Clone, Copy, Debug)]
pub struct OrderedLaunch {
    /// Position of the first batch's first row.
    pub pos_base: u64,
    /// Positions from one batch to the next.
    pub step_samples: u64,
    /// Rows per batch.
    pub batch_rows: u32,
    /// Batches.
    pub batches: u32,
    /// Bytes from one batch's slot to the next.
    pub slot_stride: u64,
    /// The region table's device address.
    pub regions: u64,
    /// Its regions.
    pub region_count: u32,
    /// Bytes of each shard's windows.
    pub window_bytes: u64,
}

/// The kernel's parameters (`struct OrderedParams`), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct OrderedParams {
    tables: u64,
    regions: u64,
    window_bytes: u64,
    sample_count: u64,
    pos_base: u64,
    step_samples: u64,
    slot_stride: u64,
    keys: [u64; 6],
    half_bits: u32,
    mode: u32,
    batch_rows: u32,
    batches: u32,
    shard_count: u32,
    field_count: u32,
    window_count: u32,
    off_fields: u32,
    off_bases: u32,
    off_windows: u32,
    off_members: u32,
    off_first_regions: u32,
    region_count: u32,
    pad: u32,
}

/// A keyed permutation of `0..n` as `pipeline::order` defines it (a Feistel network of six rounds
/// over halves of `half_bits` bits, cycle-walked).
#[derive(Clone, Copy, Debug)]
pub struct FeistelSpec {
    /// Size of the permuted range.
    pub n: u64,
    /// Bits of each half of the network's domain.
    pub half_bits: u32,
    /// The round keys.
    pub keys: [u64; 6],
}

/// One window of a window shuffle: where it starts among the positions, its permutation, and its
/// shards (first sample, sample count, offset within the window).
#[derive(Clone, Debug)]
pub struct WindowSpec {
    /// First position.
    pub start: u64,
    /// The permutation of its positions.
    pub permutation: FeistelSpec,
    /// Its shards.
    pub shards: Vec<(u64, u64, u64)>,
}

/// An epoch's order for the ordered gather.
#[derive(Clone, Debug)]
pub enum OrderSpec {
    /// Dataset order.
    Identity,
    /// One permutation of every sample.
    Full(FeistelSpec),
    /// A window shuffle.
    Windows(Vec<WindowSpec>),
}

fn put(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn get(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// `ordered_xxh3_u64` of the kernel: xxh3-64 of the 8 little-endian bytes of `v` with `seed`,
/// written as the kernel computes it (its test checks it against the xxh3 crate).
pub fn xxh3_u64_model(v: u64, seed: u64) -> u64 {
    let seed = seed ^ (((seed as u32).swap_bytes() as u64) << 32);
    let flip = (0x1cad_21f7_2c81_017c_u64 ^ 0xdb97_9083_e96d_d4de_u64).wrapping_sub(seed);
    let mut h = (v >> 32).wrapping_add((v & 0xffff_ffff) << 32) ^ flip;
    h ^= h.rotate_left(49) ^ h.rotate_left(24);
    h = h.wrapping_mul(0x9FB2_1C65_1E98_DF25);
    h ^= (h >> 35).wrapping_add(8);
    h = h.wrapping_mul(0x9FB2_1C65_1E98_DF25);
    h ^ (h >> 28)
}

/// `ordered_permute` of the kernel.
fn permute_model(n: u64, half_bits: u32, keys: &[u64; 6], i: u64) -> u64 {
    if n <= 1 {
        return 0;
    }
    let mask = (1u64 << half_bits) - 1;
    let mut value = i;
    loop {
        let (mut left, mut right) = (value >> half_bits, value & mask);
        for key in keys {
            let mixed = xxh3_u64_model(right, *key) & mask;
            (left, right) = (right, left ^ mixed);
        }
        value = (left << half_bits) | right;
        if value < n {
            return value;
        }
    }
}

impl OrderedTables {
    /// The tables of an epoch's `order` over shards whose first samples are `shard_first` (and
    /// the sample count after the last), for `fields`, each field of shard `s` starting at offset
    /// `bases[s * fields.len() + f]` of the shard, whose first window is region `first_regions[s]`
    /// of the stream's region table.
    pub fn new(
        order: &OrderSpec,
        shard_first: &[u64],
        fields: &[OrderedField],
        bases: &[u64],
        first_regions: &[u64],
    ) -> OrderedTables {
        let shard_count = shard_first.len() - 1;
        assert_eq!(bases.len(), shard_count * fields.len());
        let mut bytes = Vec::new();
        for &first in shard_first {
            put(&mut bytes, first);
        }
        let off_fields = bytes.len();
        for field in fields {
            put(&mut bytes, field.out_offset);
            put(&mut bytes, field.out_sample_bytes);
            put(&mut bytes, field.in_sample_bytes);
            bytes.extend_from_slice(&(field.op.code() as u32).to_le_bytes());
            let elements = field.in_sample_bytes / field.op.in_bytes();
            bytes.extend_from_slice(&(elements as u32).to_le_bytes());
            bytes.extend_from_slice(&1.0f32.to_le_bytes());
            bytes.extend_from_slice(&0u32.to_le_bytes());
        }
        debug_assert_eq!(bytes.len() - off_fields, fields.len() * FIELD_BYTES);
        let off_bases = bytes.len();
        for &base in bases {
            put(&mut bytes, base);
        }
        let off_windows = bytes.len();
        let (mut mode, mut half_bits, mut keys, mut window_count) = (0u32, 0u32, [0u64; 6], 0u32);
        let mut members = Vec::new();
        match order {
            OrderSpec::Identity => {}
            OrderSpec::Full(permutation) => {
                mode = 1;
                half_bits = permutation.half_bits;
                keys = permutation.keys;
            }
            OrderSpec::Windows(windows) => {
                mode = 2;
                window_count = windows.len() as u32;
                let mut member_first = 0u32;
                for window in windows {
                    put(&mut bytes, window.start);
                    put(&mut bytes, window.permutation.n);
                    for key in window.permutation.keys {
                        put(&mut bytes, key);
                    }
                    bytes.extend_from_slice(&window.permutation.half_bits.to_le_bytes());
                    bytes.extend_from_slice(&member_first.to_le_bytes());
                    bytes.extend_from_slice(&(window.shards.len() as u32).to_le_bytes());
                    bytes.extend_from_slice(&0u32.to_le_bytes());
                    for &(first_sample, count, offset) in &window.shards {
                        put(&mut members, first_sample);
                        put(&mut members, count);
                        put(&mut members, offset);
                    }
                    member_first += window.shards.len() as u32;
                }
            }
        }
        debug_assert_eq!(
            bytes.len() - off_windows,
            window_count as usize * WINDOW_BYTES
        );
        let off_members = bytes.len();
        bytes.extend_from_slice(&members);
        assert_eq!(first_regions.len(), shard_count);
        let off_first_regions = bytes.len();
        for &region in first_regions {
            put(&mut bytes, region);
        }
        OrderedTables {
            bytes,
            params: OrderedParams {
                sample_count: *shard_first.last().expect("the sample count"),
                mode,
                half_bits,
                keys,
                shard_count: shard_count as u32,
                field_count: fields.len() as u32,
                window_count,
                off_fields: off_fields as u32,
                off_bases: off_bases as u32,
                off_windows: off_windows as u32,
                off_members: off_members as u32,
                off_first_regions: off_first_regions as u32,
                ..OrderedParams::default()
            },
        }
    }

    /// The encoded tables, for the device.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Samples of the epoch.
    pub fn sample_count(&self) -> u64 {
        self.params.sample_count
    }

    /// The sample at `position` and its shard, read from the encoded tables as the kernel reads
    /// them (a model of `ordered_sample` and the kernel's shard search, for tests).
    pub fn sample_model(&self, position: u64) -> (u64, u32) {
        let (b, p) = (&self.bytes, &self.params);
        let sample = match p.mode {
            1 => permute_model(p.sample_count, p.half_bits, &p.keys, position),
            2 => {
                let window = |w: usize| p.off_windows as usize + w * WINDOW_BYTES;
                let (mut lo, mut hi) = (0usize, p.window_count as usize);
                while lo < hi {
                    let mid = (lo + hi) / 2;
                    if get(b, window(mid)) + get(b, window(mid) + 8) <= position {
                        lo = mid + 1;
                    } else {
                        hi = mid;
                    }
                }
                let w = window(lo);
                let keys: [u64; 6] = std::array::from_fn(|k| get(b, w + 16 + 8 * k));
                let word = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4"));
                let (half_bits, member_first, member_count) =
                    (word(w + 64), word(w + 68) as usize, word(w + 72) as usize);
                let within = permute_model(get(b, w + 8), half_bits, &keys, position - get(b, w));
                let member = |m: usize| p.off_members as usize + (member_first + m) * MEMBER_BYTES;
                let (mut a, mut z) = (0usize, member_count);
                while a < z {
                    let mid = (a + z) / 2;
                    if get(b, member(mid) + 16) + get(b, member(mid) + 8) <= within {
                        a = mid + 1;
                    } else {
                        z = mid;
                    }
                }
                get(b, member(a)) + (within - get(b, member(a) + 16))
            }
            _ => position,
        };
        let (mut lo, mut hi) = (0usize, p.shard_count as usize + 1);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if get(b, mid * 8) <= sample {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        (sample, lo as u32 - 1)
    }
}

impl Gatherer {
    /// Queues the ordered gather of `launch` with the stream's `tables` (their bytes in device
    /// memory at `device_tables`) into `dst`; the outcome is as for
    /// [`Gatherer::gather_regions_async`], a fault counting the row (from 1 at the launch's first).
    ///
    /// # Safety
    /// `device_tables` holds `tables.bytes()`, and `launch.regions` the stream's region table, whose
    /// every region is device memory, or host memory mapped for the device, that stays allocated
    /// and unmodified until the launch has completed on `stream`; `dst` and `outcome` are as for
    /// [`Gatherer::gather_async`].
    pub unsafe fn gather_ordered_async(
        &self,
        stream: &Stream,
        device_tables: &dyn DeviceMemory,
        tables: &OrderedTables,
        launch: OrderedLaunch,
        dst: &dyn DeviceMemory,
        (outcome, outcome_zeroed): (&dyn DeviceMemory, bool),
    ) -> Result<(), DeviceError> {
        let (kernel, grid_max) = self
            .ordered
            .as_ref()
            .expect("gather_ordered_async needs has_ordered()");
        assert!(device_tables.len() >= tables.bytes.len());
        // SAFETY: the outcome is the caller's, as for the launch.
        unsafe { prepare_outcome(stream, outcome, outcome_zeroed) }?;
        let rows = launch.batch_rows as u64 * launch.batches as u64;
        if rows == 0 || tables.params.sample_count == 0 {
            return Ok(());
        }
        let mut params = OrderedParams {
            tables: device_tables.device_ptr(),
            regions: launch.regions,
            window_bytes: launch.window_bytes,
            pos_base: launch.pos_base,
            step_samples: launch.step_samples,
            slot_stride: launch.slot_stride,
            batch_rows: launch.batch_rows,
            batches: launch.batches,
            region_count: launch.region_count,
            ..tables.params
        };
        let mut dst_ptr = dst.device_ptr();
        let mut dst_capacity = dst.len() as u64;
        let mut outcome_ptr = outcome.device_ptr();
        let mut args: [*mut c_void; 4] = [
            &mut params as *mut OrderedParams as *mut c_void,
            &mut dst_ptr as *mut u64 as *mut c_void,
            &mut dst_capacity as *mut u64 as *mut c_void,
            &mut outcome_ptr as *mut u64 as *mut c_void,
        ];
        // One wave of blocks: each takes rows blockIdx.x, + gridDim.x, ... (several at once on
        // the fast path), rather than a second wave waiting for the first's blocks to end.
        let grid = rows.min(*grid_max as u64) as u32;
        // SAFETY: the parameters match gf_gather_ordered's signature (OrderedParams by value with
        // the same #[repr(C)] layout, pointer, u64, pointer); the rest is the caller's contract.
        unsafe { kernel.launch(stream, grid, GATHER_BLOCK_THREADS, &mut args) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_hash_is_xxh3_of_eight_bytes() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..2000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let seed = x.rotate_left(17) ^ 0x5bd1_e995;
            assert_eq!(
                xxh3_u64_model(x, seed),
                xxhash_rust::xxh3::xxh3_64_with_seed(&x.to_le_bytes(), seed),
                "value {x:#x} seed {seed:#x}"
            );
        }
    }
}
