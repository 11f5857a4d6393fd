//! The gather + convert kernel (`kernels/gather.cu`): piece table, conversion ops, launch.

use std::ffi::c_void;

use gpufeed_proto::DType;

use crate::device::{
    fill_async, CacheDir, CompileOptions, Device, DeviceError, DeviceMemory, Kernel, KernelSource,
    ModuleOrigin, Stream,
};

use super::launch::check_table;

/// The kernel source.
pub const GATHER_SOURCE: KernelSource = KernelSource {
    name: "gather",
    source: include_str!("../../kernels/gather.cu"),
};

/// Bytes of one [`GatherPiece`] in the device table.
pub const GATHER_PIECE_BYTES: usize = 32;
/// Bytes of the [`GatherOutcome`] the kernel writes.
pub const GATHER_OUTCOME_BYTES: usize = 8;
/// Most source buffers one launch may read from (passed by value); a piece's source index at or above
/// it names a [`GatherRegion`] of the launch's region table instead.
pub const GATHER_SOURCES_MAX: usize = 4;
/// Most pieces one launch of the inline gather carries in its parameters (`GF_GATHER_INLINE_LARGE`);
/// [`Gatherer::gather_inline_async`] splits longer tables into several launches.
pub const GATHER_INLINE_PIECES_MAX: usize = 1016;
/// Pieces of the smaller inline launches (`GF_GATHER_INLINE_SMALL`, `GF_GATHER_INLINE_MEDIUM`): 2 and
/// 8 KiB of parameters instead of 32.
const GATHER_INLINE_PIECES_SMALL: usize = 64;
const GATHER_INLINE_PIECES_MEDIUM: usize = 256;
/// The least driver version (1000 * major + 10 * minor) taking kernel parameters over 4 KiB.
const INLINE_DRIVER_VERSION_MIN: i32 = 12010;
/// Bytes of one [`GatherRegion`] in the device table.
pub const GATHER_REGION_BYTES: usize = 16;
/// Most regions one launch may read from (the source index is 16 bits wide).
pub const GATHER_REGIONS_MAX: usize = u16::MAX as usize + 1 - GATHER_SOURCES_MAX;

/// A region of host memory mapped for the device (a registered page-cache window) that gather pieces
/// read from directly, over PCIe. Mirrors `struct GatherRegion` of `kernels/gather.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherRegion {
    /// Device address of the mapping.
    pub ptr: u64,
    /// Its length in bytes.
    pub bytes: u64,
}

impl GatherRegion {
    /// The source index pieces use to read region `index` of a launch's region table.
    pub fn source_index(index: usize) -> u16 {
        assert!(
            index < GATHER_REGIONS_MAX,
            "at most {GATHER_REGIONS_MAX} regions"
        );
        (GATHER_SOURCES_MAX + index) as u16
    }

    /// The little-endian device encoding of `regions`, in order.
    pub fn encode_all(regions: &[GatherRegion]) -> Vec<u8> {
        let mut out = Vec::with_capacity(regions.len() * GATHER_REGION_BYTES);
        Self::encode_into(regions, &mut out);
        out
    }

    /// [`Self::encode_all`], appended to `out`.
    pub fn encode_into(regions: &[GatherRegion], out: &mut Vec<u8>) {
        out.reserve(regions.len() * GATHER_REGION_BYTES);
        for region in regions {
            out.extend_from_slice(&region.ptr.to_le_bytes());
            out.extend_from_slice(&region.bytes.to_le_bytes());
        }
    }
}
/// Threads per block of the gather kernel (its `__launch_bounds__`).
pub const GATHER_BLOCK_THREADS: u32 = 256;
/// Largest output of one piece: [`GatherPlan::push`] splits longer runs so that one thread block's
/// share stays small and many blocks work on a large sample at once.
pub const GATHER_PIECE_OUT_BYTES_MAX: u64 = 256 << 10;

/// A conversion the gather applies to each element. The codes are those of `kernels/gather.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GatherOp {
    /// Bytes copied as they are (identity for any dtype; elements count bytes).
    Copy,
    /// IEEE half to f32, exact (`half` semantics, NaN quietened).
    F16ToF32,
    /// bfloat16 to f32, exact (`half` semantics, NaN quietened).
    Bf16ToF32,
    /// u8 to f32, then multiplied by the piece's scale (1.0: exact).
    U8ToF32,
    /// i8 to f32, exact.
    I8ToF32,
    /// u16 to f32, exact.
    U16ToF32,
    /// i16 to f32, exact.
    I16ToF32,
    /// u32 to f32, rounded to nearest even.
    U32ToF32,
    /// i32 to f32, rounded to nearest even.
    I32ToF32,
    /// u64 to f32, rounded to nearest even.
    U64ToF32,
    /// i64 to f32, rounded to nearest even.
    I64ToF32,
    /// f64 to f32, rounded to nearest even (NaN as x86 converts it).
    F64ToF32,
    /// u8 widened to i64.
    U8ToI64,
    /// i8 widened to i64.
    I8ToI64,
    /// u16 widened to i64.
    U16ToI64,
    /// i16 widened to i64.
    I16ToI64,
    /// u32 widened to i64.
    U32ToI64,
    /// i32 widened to i64.
    I32ToI64,
}

impl GatherOp {
    /// Every op, in code order.
    pub const ALL: [GatherOp; 18] = [
        GatherOp::Copy,
        GatherOp::F16ToF32,
        GatherOp::Bf16ToF32,
        GatherOp::U8ToF32,
        GatherOp::I8ToF32,
        GatherOp::U16ToF32,
        GatherOp::I16ToF32,
        GatherOp::U32ToF32,
        GatherOp::I32ToF32,
        GatherOp::U64ToF32,
        GatherOp::I64ToF32,
        GatherOp::F64ToF32,
        GatherOp::U8ToI64,
        GatherOp::I8ToI64,
        GatherOp::U16ToI64,
        GatherOp::I16ToI64,
        GatherOp::U32ToI64,
        GatherOp::I32ToI64,
    ];

    /// The op converting `from` to `to`, as [`crate::decode::convert`] defines them; `None` where
    /// that conversion is not offered.
    pub fn for_dtypes(from: DType, to: DType) -> Option<GatherOp> {
        use DType::*;
        if from == to {
            return Some(GatherOp::Copy);
        }
        Some(match (from, to) {
            (F16, F32) => GatherOp::F16ToF32,
            (BF16, F32) => GatherOp::Bf16ToF32,
            (U8, F32) => GatherOp::U8ToF32,
            (I8, F32) => GatherOp::I8ToF32,
            (U16, F32) => GatherOp::U16ToF32,
            (I16, F32) => GatherOp::I16ToF32,
            (U32, F32) => GatherOp::U32ToF32,
            (I32, F32) => GatherOp::I32ToF32,
            (U64, F32) => GatherOp::U64ToF32,
            (I64, F32) => GatherOp::I64ToF32,
            (F64, F32) => GatherOp::F64ToF32,
            (U8, I64) => GatherOp::U8ToI64,
            (I8, I64) => GatherOp::I8ToI64,
            (U16, I64) => GatherOp::U16ToI64,
            (I16, I64) => GatherOp::I16ToI64,
            (U32, I64) => GatherOp::U32ToI64,
            (I32, I64) => GatherOp::I32ToI64,
            _ => return None,
        })
    }

    /// The (stored, converted) dtypes, or `None` for [`GatherOp::Copy`], which works on bytes.
    pub fn dtypes(self) -> Option<(DType, DType)> {
        use DType::*;
        Some(match self {
            GatherOp::Copy => return None,
            GatherOp::F16ToF32 => (F16, F32),
            GatherOp::Bf16ToF32 => (BF16, F32),
            GatherOp::U8ToF32 => (U8, F32),
            GatherOp::I8ToF32 => (I8, F32),
            GatherOp::U16ToF32 => (U16, F32),
            GatherOp::I16ToF32 => (I16, F32),
            GatherOp::U32ToF32 => (U32, F32),
            GatherOp::I32ToF32 => (I32, F32),
            GatherOp::U64ToF32 => (U64, F32),
            GatherOp::I64ToF32 => (I64, F32),
            GatherOp::F64ToF32 => (F64, F32),
            GatherOp::U8ToI64 => (U8, I64),
            GatherOp::I8ToI64 => (I8, I64),
            GatherOp::U16ToI64 => (U16, I64),
            GatherOp::I16ToI64 => (I16, I64),
            GatherOp::U32ToI64 => (U32, I64),
            GatherOp::I32ToI64 => (I32, I64),
        })
    }

    /// The kernel's code.
    pub fn code(self) -> u8 {
        GatherOp::ALL
            .iter()
            .position(|&op| op == self)
            .expect("every op is in ALL") as u8
    }

    /// Bytes of one stored element.
    pub fn in_bytes(self) -> u64 {
        self.dtypes()
            .map_or(1, |(from, _)| from.size_bytes() as u64)
    }

    /// Bytes of one converted element.
    pub fn out_bytes(self) -> u64 {
        self.dtypes().map_or(1, |(_, to)| to.size_bytes() as u64)
    }
}

/// One run of elements to copy from a source buffer into the slot, converting on the way.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GatherPiece {
    /// Index of the source buffer (given at launch).
    pub source: u16,
    /// Byte offset of the first element in the source.
    pub src_offset: u64,
    /// Byte offset of the first converted element in the slot.
    pub dst_offset: u64,
    /// Elements (bytes, for [`GatherOp::Copy`]).
    pub elements: u32,
    /// The conversion.
    pub op: GatherOp,
    /// Multiplier for [`GatherOp::U8ToF32`] (1.0 for an exact conversion); ignored by other ops.
    pub scale: f32,
}

impl GatherPiece {
    /// Appends the piece's 32-byte device encoding (the layout of `struct GatherPiece`).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_bytes());
    }

    /// The piece's 32-byte device encoding, built in place: the planning threads of a shuffled
    /// stream encode a piece per row, and one copy of a whole array costs less than eight growing
    /// appends.
    pub fn to_bytes(&self) -> [u8; GATHER_PIECE_BYTES] {
        let mut bytes = [0u8; GATHER_PIECE_BYTES];
        bytes[0..8].copy_from_slice(&self.src_offset.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.dst_offset.to_le_bytes());
        bytes[16..20].copy_from_slice(&self.elements.to_le_bytes());
        bytes[20..22].copy_from_slice(&self.source.to_le_bytes());
        bytes[22] = self.op.code();
        bytes[24..28].copy_from_slice(&self.scale.to_le_bytes());
        bytes
    }
}

/// A batch's piece table, built on the host in the order the pipeline chose.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GatherPlan {
    pieces: Vec<GatherPiece>,
}

impl GatherPlan {
    /// An empty plan.
    pub fn new() -> GatherPlan {
        GatherPlan::default()
    }

    /// An empty plan with room for `pieces` pieces.
    pub fn with_capacity(pieces: usize) -> GatherPlan {
        GatherPlan {
            pieces: Vec::with_capacity(pieces),
        }
    }

    /// Adds a run of `elements` elements, split into pieces of at most
    /// [`GATHER_PIECE_OUT_BYTES_MAX`] output bytes.
    pub fn push(
        &mut self,
        source: u16,
        src_offset: u64,
        dst_offset: u64,
        elements: u64,
        op: GatherOp,
        scale: f32,
    ) {
        let per_piece = (GATHER_PIECE_OUT_BYTES_MAX / op.out_bytes()).max(1);
        let mut done = 0u64;
        while done < elements {
            let n = (elements - done).min(per_piece);
            self.pieces.push(GatherPiece {
                source,
                src_offset: src_offset + done * op.in_bytes(),
                dst_offset: dst_offset + done * op.out_bytes(),
                elements: n as u32,
                op,
                scale,
            });
            done += n;
        }
    }

    /// As [`GatherPlan::push`], but first extends the last piece when the run continues it (same source,
    /// conversion and scale; contiguous in the source and in the slot), up to `merged_out_bytes_max`
    /// output bytes per piece: consecutive samples of one block become one piece.
    #[allow(clippy::too_many_arguments)]
    pub fn push_merged(
        &mut self,
        source: u16,
        src_offset: u64,
        dst_offset: u64,
        elements: u64,
        op: GatherOp,
        scale: f32,
        merged_out_bytes_max: u64,
    ) {
        let (mut src_offset, mut dst_offset, mut elements) = (src_offset, dst_offset, elements);
        if let Some(last) = self.pieces.last_mut() {
            let continues = last.source == source
                && last.op == op
                && last.scale.to_bits() == scale.to_bits()
                && last.src_offset + last.elements as u64 * op.in_bytes() == src_offset
                && last.dst_offset + last.elements as u64 * op.out_bytes() == dst_offset;
            if continues {
                let room =
                    (merged_out_bytes_max / op.out_bytes()).saturating_sub(last.elements as u64);
                let n = room.min(elements);
                last.elements += n as u32;
                src_offset += n * op.in_bytes();
                dst_offset += n * op.out_bytes();
                elements -= n;
            }
        }
        if elements > 0 {
            self.push(source, src_offset, dst_offset, elements, op, scale);
        }
    }

    /// Adds one piece as it is (no splitting; for tests of the kernel's checks).
    pub fn push_piece(&mut self, piece: GatherPiece) {
        self.pieces.push(piece);
    }

    /// The pieces.
    pub fn pieces(&self) -> &[GatherPiece] {
        &self.pieces
    }

    /// The device encoding of the table.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.pieces.len() * GATHER_PIECE_BYTES];
        for (piece, bytes) in self
            .pieces
            .iter()
            .zip(out.chunks_exact_mut(GATHER_PIECE_BYTES))
        {
            bytes.copy_from_slice(&piece.to_bytes());
        }
        out
    }
}

/// What the kernel reports for a launch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GatherOutcome {
    /// Pieces skipped because they did not fit their source or the slot (or named no source).
    pub faulted_pieces: u32,
    /// One more than the index of the last skipped piece; 0 when none was.
    pub last_faulted_plus_1: u32,
}

impl GatherOutcome {
    /// Decodes the 8 bytes copied back from the device.
    pub fn decode(bytes: &[u8]) -> GatherOutcome {
        GatherOutcome {
            faulted_pieces: u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes")),
            last_faulted_plus_1: u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes")),
        }
    }
}

/// Rewrites the encoded piece table `table`, whose pieces read regions of `regions`, for
/// [`Gatherer::gather_inline_async`]: into `out` (cleared first), each piece with its `src_offset`
/// made the device address it reads. Returns false, leaving `out` unspecified, when a piece reads
/// no region of the table, has an unknown op, or reaches past its region: such a table goes to the
/// kernel that checks each piece against its source and reports the fault.
pub fn resolve_inline(table: &[u8], regions: &[GatherRegion], out: &mut Vec<u8>) -> bool {
    out.clear();
    if table.len() % GATHER_PIECE_BYTES != 0 {
        return false;
    }
    for piece in table.chunks_exact(GATHER_PIECE_BYTES) {
        let src_offset = u64::from_le_bytes(piece[0..8].try_into().expect("8 bytes"));
        let elements = u32::from_le_bytes(piece[16..20].try_into().expect("4 bytes"));
        let source = u16::from_le_bytes(piece[20..22].try_into().expect("2 bytes")) as usize;
        let Some(op) = GatherOp::ALL.get(piece[22] as usize) else {
            return false;
        };
        let Some(region) = source
            .checked_sub(GATHER_SOURCES_MAX)
            .and_then(|index| regions.get(index))
        else {
            return false;
        };
        let fits = (elements as u64)
            .checked_mul(op.in_bytes())
            .and_then(|bytes| bytes.checked_add(src_offset))
            .is_some_and(|end| end <= region.bytes);
        let Some(address) = region.ptr.checked_add(src_offset) else {
            return false;
        };
        if !fits || region.ptr == 0 {
            return false;
        }
        out.extend_from_slice(&address.to_le_bytes());
        out.extend_from_slice(&piece[8..]);
    }
    true
}

/// Checks that `outcome` holds a [`GatherOutcome`] and, unless the caller zeroed it (`zeroed`),
/// queues its zeroing on `stream` before the launch.
///
/// # Safety
/// `outcome` stays allocated, and nothing else uses it, until the launch after the zeroing has
/// completed on `stream`.
pub(super) unsafe fn prepare_outcome(
    stream: &Stream,
    outcome: &dyn DeviceMemory,
    zeroed: bool,
) -> Result<(), DeviceError> {
    check_table("gather outcome", outcome, 1, GATHER_OUTCOME_BYTES)?;
    if !zeroed {
        // SAFETY: the caller's contract.
        unsafe { fill_async(stream, outcome, 0, GATHER_OUTCOME_BYTES, 0) }?;
    }
    Ok(())
}

/// `struct GatherSources` of the kernel, passed by value.
#[repr(C)]
struct GatherSourcesParam {
    ptr: [u64; GATHER_SOURCES_MAX],
    bytes: [u64; GATHER_SOURCES_MAX],
    count: u32,
    reserved: u32,
}

/// How the gather kernel lays out each thread's memory accesses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GatherLayout {
    /// One 16-byte store per thread and step, loading just the inputs it needs: every warp-wide
    /// store covers 512 contiguous bytes.
    CoalescedStores,
    /// One or two 16-byte loads per thread and step, storing every output they make (strided
    /// 16-byte stores when the output is wider than the input).
    WideLoads,
}

impl GatherLayout {
    /// The layout gpufeed uses (chosen by `examples/kernel_bench.rs`, see `docs/benchmarks/`).
    pub const STANDARD: GatherLayout = GatherLayout::CoalescedStores;
}

/// `struct GatherInlinePieces<N>` of the kernel, passed by value.
#[repr(C)]
struct GatherInlineParam<const N: usize> {
    count: u32,
    first: u32,
    pieces: [[u8; GATHER_PIECE_BYTES]; N],
}

/// The compiled gather + convert kernel for one device.
pub struct Gatherer {
    kernel: Kernel,
    pub(super) grid_max: u32,
    /// The launches taking their pieces in their parameters (small, medium, large), where the driver
    /// takes parameters that large.
    inline: Option<[Kernel; 3]>,
    /// The ordered gather (`super::ordered`), which takes its parameters by value too, and the
    /// most blocks of it the device runs at once (one wave).
    pub(super) ordered: Option<(Kernel, u32)>,
}

impl Gatherer {
    /// Loads (compiling if needed) the kernel with the given access layout.
    pub fn new(
        device: &Device,
        layout: GatherLayout,
        cache: CacheDir,
    ) -> Result<(Gatherer, ModuleOrigin), DeviceError> {
        let coalesced = match layout {
            GatherLayout::CoalescedStores => "1",
            GatherLayout::WideLoads => "0",
        };
        let mut defines = vec![("GF_GATHER_COALESCED_STORES".into(), coalesced.into())];
        // Rows the ordered gather moves at once (see `ordered_rows_fast` in kernels/gather.cu):
        // `GPUFEED_ORDERED_ROWS` (1 to 8) in the daemon's environment overrides the default of
        // 4, for comparisons.
        if let Some(rows) = std::env::var("GPUFEED_ORDERED_ROWS")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .filter(|r| (1..=8).contains(r))
        {
            defines.push(("GF_ORDERED_ROWS".into(), format!("{rows}u")));
        }
        let options = CompileOptions { defines, cache };
        let (module, origin) = device.load_module(&GATHER_SOURCE, &options)?;
        let kernel = module.kernel(device, "gf_gather_convert")?;
        let per_sm = kernel
            .blocks_per_multiprocessor(GATHER_BLOCK_THREADS)?
            .max(1);
        let grid_max = per_sm * device.properties().multiprocessors.max(1);
        let by_value = device.properties().driver_version >= INLINE_DRIVER_VERSION_MIN;
        let inline = if by_value {
            Some([
                module.kernel(device, "gf_gather_convert_inline_small")?,
                module.kernel(device, "gf_gather_convert_inline_medium")?,
                module.kernel(device, "gf_gather_convert_inline_large")?,
            ])
        } else {
            None
        };
        let ordered = if by_value {
            let ordered = module.kernel(device, "gf_gather_ordered")?;
            let per_sm = ordered
                .blocks_per_multiprocessor(GATHER_BLOCK_THREADS)?
                .max(1);
            Some((ordered, per_sm * device.properties().multiprocessors.max(1)))
        } else {
            None
        };
        Ok((
            Gatherer {
                kernel,
                grid_max,
                inline,
                ordered,
            },
            origin,
        ))
    }

    /// Whether [`Self::gather_inline_async`] can run here (the driver takes kernel parameters of up
    /// to 32 KiB: CUDA 12.1 and later).
    pub fn has_inline(&self) -> bool {
        self.inline.is_some()
    }

    /// Whether [`Self::gather_ordered_async`] can run here (as [`Self::has_inline`]).
    pub fn has_ordered(&self) -> bool {
        self.ordered.is_some()
    }

    /// Queues the gather of the pieces encoded in `pieces` ([`GatherPiece::encode`], 32 bytes each),
    /// whose `src_offset` is the device address of the piece's first element, into `dst`, with the
    /// table in the launches' parameters: at most [`GATHER_INLINE_PIECES_MAX`] pieces a launch, so
    /// that the kernel reads no table before its rows. The outcome is as for
    /// [`Self::gather_regions_async`], fault indices counting from the table's first piece.
    ///
    /// # Safety
    /// Every piece's source extent (`elements` of its op's stored size at `src_offset`) is device
    /// memory, or host memory mapped for the device, that stays allocated and unmodified until the
    /// launches have completed on `stream`, and overlaps no part of `dst`; `dst` and `outcome` are as
    /// for [`Self::gather_async`].
    pub unsafe fn gather_inline_async(
        &self,
        stream: &Stream,
        pieces: &[u8],
        dst: &dyn DeviceMemory,
        (outcome, outcome_zeroed): (&dyn DeviceMemory, bool),
    ) -> Result<(), DeviceError> {
        let [small, medium, large] = self
            .inline
            .as_ref()
            .expect("gather_inline_async needs has_inline()");
        assert!(pieces.len() % GATHER_PIECE_BYTES == 0);
        // SAFETY: the outcome is the caller's, as for the launch.
        unsafe { prepare_outcome(stream, outcome, outcome_zeroed) }?;
        let count = pieces.len() / GATHER_PIECE_BYTES;
        // Launches of nearly equal size: a table of 1 100 pieces goes as 550 + 550, not 1 016 + 84.
        let launches = count.div_ceil(GATHER_INLINE_PIECES_MAX);
        let mut first = 0usize;
        for launch in 0..launches {
            let this = (count - first).div_ceil(launches - launch);
            let chunk = &pieces[first * GATHER_PIECE_BYTES..(first + this) * GATHER_PIECE_BYTES];
            // SAFETY: the caller's contract, for this chunk of the table.
            unsafe {
                if this <= GATHER_INLINE_PIECES_SMALL {
                    self.launch_inline::<GATHER_INLINE_PIECES_SMALL>(
                        small, stream, chunk, first, dst, outcome,
                    )
                } else if this <= GATHER_INLINE_PIECES_MEDIUM {
                    self.launch_inline::<GATHER_INLINE_PIECES_MEDIUM>(
                        medium, stream, chunk, first, dst, outcome,
                    )
                } else {
                    self.launch_inline::<GATHER_INLINE_PIECES_MAX>(
                        large, stream, chunk, first, dst, outcome,
                    )
                }
            }?;
            first += this;
        }
        Ok(())
    }

    /// One launch of `kernel` (an inline gather of `N` pieces) for the encoded pieces `chunk`, the
    /// first of which is piece `first` of the round's table.
    ///
    /// # Safety
    /// As for [`Self::gather_inline_async`]; `kernel` takes a `GatherInlinePieces<N>`.
    unsafe fn launch_inline<const N: usize>(
        &self,
        kernel: &Kernel,
        stream: &Stream,
        chunk: &[u8],
        first: usize,
        dst: &dyn DeviceMemory,
        outcome: &dyn DeviceMemory,
    ) -> Result<(), DeviceError> {
        let count = chunk.len() / GATHER_PIECE_BYTES;
        assert!(count <= N);
        if count == 0 {
            return Ok(());
        }
        // The driver copies the parameters when the launch is queued: a value on this thread's
        // stack serves, and no memory of it outlives the call.
        let mut table = GatherInlineParam::<N> {
            count: count as u32,
            first: first as u32,
            pieces: [[0; GATHER_PIECE_BYTES]; N],
        };
        for (out, piece) in table
            .pieces
            .iter_mut()
            .zip(chunk.chunks_exact(GATHER_PIECE_BYTES))
        {
            out.copy_from_slice(piece);
        }
        let mut dst_ptr = dst.device_ptr();
        let mut dst_capacity = dst.len() as u64;
        let mut outcome_ptr = outcome.device_ptr();
        let mut params: [*mut c_void; 4] = [
            &mut table as *mut GatherInlineParam<N> as *mut c_void,
            &mut dst_ptr as *mut u64 as *mut c_void,
            &mut dst_capacity as *mut u64 as *mut c_void,
            &mut outcome_ptr as *mut u64 as *mut c_void,
        ];
        let grid = (count as u32).min(self.grid_max);
        // SAFETY: the parameters match gf_gather_convert_inline_*'s signature (GatherInlinePieces<N>
        // by value with the same #[repr(C)] layout, pointer, u64, pointer); the rest is the caller's
        // contract.
        unsafe { kernel.launch(stream, grid, GATHER_BLOCK_THREADS, &mut params) }
    }

    /// Queues the gather of `piece_count` pieces encoded in `pieces` ([`GatherPlan::encode`]) from
    /// `sources` into `dst`; the launch's [`GatherOutcome`] goes to `outcome` (zeroed first, on the
    /// same stream).
    ///
    /// The kernel writes only inside `dst` (the extents of pieces that fit) and `outcome`, and reads
    /// only inside the sources and the piece table.
    ///
    /// # Safety
    /// Every buffer stays allocated until the launch has completed on `stream`; nothing else writes the
    /// table or the sources, or touches `dst` or `outcome`, meanwhile. No source overlaps `dst`.
    pub unsafe fn gather_async(
        &self,
        stream: &Stream,
        pieces: &dyn DeviceMemory,
        piece_count: u32,
        sources: &[&dyn DeviceMemory],
        dst: &dyn DeviceMemory,
        outcome: &dyn DeviceMemory,
    ) -> Result<(), DeviceError> {
        // SAFETY: no region table; the rest is the caller's contract, the same as here.
        unsafe {
            self.gather_regions_async(
                stream,
                pieces,
                piece_count,
                sources,
                None,
                dst,
                (outcome, false),
            )
        }
    }

    /// [`Self::gather_async`] with a region table: `regions` is a device buffer holding `count`
    /// encoded [`GatherRegion`]s ([`GatherRegion::encode_all`]), which pieces whose source index is
    /// [`GatherRegion::source_index`] read from.
    ///
    /// `outcome` is the outcome's memory and whether it holds zeros already: the caller may pass
    /// pinned host memory mapped for the device that it zeroed itself, which spares the stream a
    /// memset before the launch and a download after it (the kernel writes the outcome only when a
    /// piece does not fit, with device atomics; the host reads it once the launch has completed).
    ///
    /// # Safety
    /// As for [`Self::gather_async`]; in addition every region of the table is host memory mapped for
    /// the device that stays registered, mapped and unmodified until the launch has completed.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gather_regions_async(
        &self,
        stream: &Stream,
        pieces: &dyn DeviceMemory,
        piece_count: u32,
        sources: &[&dyn DeviceMemory],
        regions: Option<(&dyn DeviceMemory, u32)>,
        dst: &dyn DeviceMemory,
        (outcome, outcome_zeroed): (&dyn DeviceMemory, bool),
    ) -> Result<(), DeviceError> {
        assert!(
            sources.len() <= GATHER_SOURCES_MAX,
            "at most {GATHER_SOURCES_MAX} gather sources"
        );
        check_table(
            "gather piece table",
            pieces,
            piece_count,
            GATHER_PIECE_BYTES,
        )?;
        // SAFETY: the outcome is the caller's, as for the launch.
        unsafe { prepare_outcome(stream, outcome, outcome_zeroed) }?;
        if piece_count == 0 {
            return Ok(());
        }
        let mut table = GatherSourcesParam {
            ptr: [0; GATHER_SOURCES_MAX],
            bytes: [0; GATHER_SOURCES_MAX],
            count: sources.len() as u32,
            reserved: 0,
        };
        for (i, source) in sources.iter().enumerate() {
            table.ptr[i] = source.device_ptr();
            table.bytes[i] = source.len() as u64;
        }
        let (mut regions_ptr, mut region_count) = match regions {
            Some((table, count)) => {
                let table_bytes = count as u64 * GATHER_REGION_BYTES as u64;
                if table_bytes > table.len() as u64 || count as usize > GATHER_REGIONS_MAX {
                    return Err(DeviceError::OutOfBounds {
                        what: "gather region table",
                        offset: 0,
                        bytes: table_bytes,
                        capacity: table.len() as u64,
                    });
                }
                (table.device_ptr(), count)
            }
            None => (0u64, 0u32),
        };
        let grid = piece_count.min(self.grid_max);
        let mut pieces_ptr = pieces.device_ptr();
        let mut count = piece_count;
        let mut dst_ptr = dst.device_ptr();
        let mut dst_capacity = dst.len() as u64;
        let mut outcome_ptr = outcome.device_ptr();
        let mut params: [*mut c_void; 8] = [
            &mut pieces_ptr as *mut u64 as *mut c_void,
            &mut count as *mut u32 as *mut c_void,
            &mut table as *mut GatherSourcesParam as *mut c_void,
            &mut regions_ptr as *mut u64 as *mut c_void,
            &mut region_count as *mut u32 as *mut c_void,
            &mut dst_ptr as *mut u64 as *mut c_void,
            &mut dst_capacity as *mut u64 as *mut c_void,
            &mut outcome_ptr as *mut u64 as *mut c_void,
        ];
        // SAFETY: the parameters match gf_gather_convert's signature (pointer, u32, GatherSources by
        // value with the same #[repr(C)] layout, region table pointer, u32, pointer, u64, pointer);
        // the tables hold piece_count and region_count entries; buffer lifetimes are the caller's
        // contract.
        self.kernel
            .launch(stream, grid, GATHER_BLOCK_THREADS, &mut params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_piece(source: u16, src_offset: u64, elements: u32) -> GatherPiece {
        GatherPiece {
            source,
            src_offset,
            dst_offset: 4096,
            elements,
            op: GatherOp::F16ToF32,
            scale: 1.0,
        }
    }

    #[test]
    fn inline_tables_carry_each_piece_at_its_region_address() {
        let regions = [
            GatherRegion {
                ptr: 0x10_0000,
                bytes: 8192,
            },
            GatherRegion {
                ptr: 0x40_0000,
                bytes: 4096,
            },
        ];
        let mut table = Vec::new();
        f16_piece(GatherRegion::source_index(1), 2048, 1024).encode(&mut table);
        f16_piece(GatherRegion::source_index(0), 0, 4096).encode(&mut table);
        let mut out = Vec::new();
        assert!(resolve_inline(&table, &regions, &mut out));
        let mut expected = Vec::new();
        f16_piece(GatherRegion::source_index(1), 0x40_0000 + 2048, 1024).encode(&mut expected);
        f16_piece(GatherRegion::source_index(0), 0x10_0000, 4096).encode(&mut expected);
        assert_eq!(out, expected);
    }

    #[test]
    fn inline_tables_refuse_pieces_the_checked_kernel_must_see() {
        let regions = [GatherRegion {
            ptr: 0x10_0000,
            bytes: 8192,
        }];
        let refused = |piece: GatherPiece| {
            let mut table = Vec::new();
            f16_piece(GatherRegion::source_index(0), 0, 16).encode(&mut table);
            piece.encode(&mut table);
            !resolve_inline(&table, &regions, &mut Vec::new())
        };
        // One element past the region's end.
        assert!(refused(f16_piece(GatherRegion::source_index(0), 2, 4096)));
        // A region the table does not have.
        assert!(refused(f16_piece(GatherRegion::source_index(1), 0, 1)));
        // A source buffer, not a region.
        assert!(refused(f16_piece(0, 0, 1)));
        // An offset whose end overflows.
        assert!(refused(f16_piece(
            GatherRegion::source_index(0),
            u64::MAX - 1,
            1
        )));
        // An unknown op.
        let mut table = Vec::new();
        f16_piece(GatherRegion::source_index(0), 0, 1).encode(&mut table);
        table[22] = 0xff;
        assert!(!resolve_inline(&table, &regions, &mut Vec::new()));
        // The same pieces inside the region pass.
        assert!(!refused(f16_piece(GatherRegion::source_index(0), 2, 4095)));
    }

    #[test]
    fn merged_pushes_join_contiguous_runs_up_to_the_bound() {
        let op = GatherOp::for_dtypes(gpufeed_proto::DType::F16, gpufeed_proto::DType::F32)
            .expect("f16 -> f32 is a gather op");
        let mut plan = GatherPlan::new();
        // Four consecutive samples of 1 Ki elements (4 KiB out each) with a 12 KiB bound: three join,
        // the fourth starts a new piece.
        for sample in 0..4u64 {
            plan.push_merged(1, sample * 2048, sample * 4096, 1024, op, 1.0, 12 << 10);
        }
        let pieces = plan.pieces();
        assert_eq!(pieces.len(), 2);
        assert_eq!((pieces[0].src_offset, pieces[0].dst_offset), (0, 0));
        assert_eq!(pieces[0].elements, 3072);
        assert_eq!((pieces[1].src_offset, pieces[1].dst_offset), (6144, 12288));
        assert_eq!(pieces[1].elements, 1024);
        // A run that is not contiguous in the source, or comes from another source, is not joined.
        plan.push_merged(1, 100_000, 16384, 8, op, 1.0, 12 << 10);
        plan.push_merged(0, 100_016, 16416, 8, op, 1.0, 12 << 10);
        assert_eq!(plan.pieces().len(), 4);
        // A partly joined run: the remainder becomes a piece of its own.
        let mut plan = GatherPlan::new();
        plan.push_merged(0, 0, 0, 2048, op, 1.0, 12 << 10);
        plan.push_merged(0, 4096, 8192, 2048, op, 1.0, 12 << 10);
        let pieces = plan.pieces();
        assert_eq!(pieces.len(), 2);
        assert_eq!(pieces[0].elements, 3072);
        assert_eq!(
            (
                pieces[1].src_offset,
                pieces[1].dst_offset,
                pieces[1].elements
            ),
            (6144, 12288, 1024)
        );
    }
}
