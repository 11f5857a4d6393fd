//! The LZ4 block decoder kernel (`kernels/lz4.cu`): job table, per-block outcomes, launch.

use std::ffi::c_void;

use crate::device::{
    CacheDir, Device, DeviceError, DeviceMemory, Kernel, KernelSource, ModuleOrigin, Stream,
};
use crate::format::{BlockEntry, Codec, Filter};

use super::launch::{check_table, load_kernel};

/// The kernel source.
pub const LZ4_SOURCE: KernelSource = KernelSource {
    name: "lz4",
    source: include_str!("../../kernels/lz4.cu"),
};

/// Bytes of one [`Lz4Job`] in the device table.
pub const LZ4_JOB_BYTES: usize = 40;
/// Bytes of one [`Lz4Outcome`] in the device table.
pub const LZ4_OUTCOME_BYTES: usize = 8;
/// Widest element the kernel's unshuffle accepts (wider jobs fail with [`Lz4Status::BadJob`]).
pub const SHUFFLE_BYTES_MAX: u32 = 16;

/// One block for the decoder: where its stored bytes are, where its output goes.
///
/// Offsets are relative to the source and destination buffers given at launch; the kernel checks
/// every job's extents against those buffers' lengths before touching them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lz4Job {
    /// First stored byte in the source buffer.
    pub src_offset: u64,
    /// Stored length.
    pub src_bytes: u32,
    /// First output byte in the destination buffer.
    pub dst_offset: u64,
    /// Length the block must decode to.
    pub raw_bytes: u32,
    /// The byte-shuffle filter to undo, if any.
    pub unshuffle: Option<Unshuffle>,
}

/// Undoing a byte shuffle needs the block's shuffled bytes somewhere first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unshuffle {
    /// Element width of the filter, in bytes (2 to 16).
    pub element_bytes: u32,
    /// Where, in the destination buffer, the shuffled bytes are decoded to before the unshuffle writes
    /// the final bytes at `dst_offset`; `raw_bytes` long, not overlapping the output.
    pub scratch_offset: u64,
}

impl Lz4Job {
    /// The job for one block of the shard format, or `None` for a raw block, which the decoder never
    /// touches (the gather reads it where it was staged). `element_bytes` is the field's element width;
    /// `scratch_offset` is used only when the block is byte-shuffled.
    pub fn for_block(
        block: &BlockEntry,
        element_bytes: u32,
        src_offset: u64,
        dst_offset: u64,
        scratch_offset: u64,
    ) -> Option<Lz4Job> {
        match block.codec {
            Codec::Raw => None,
            Codec::Lz4 => Some(Lz4Job {
                src_offset,
                src_bytes: block.stored_bytes,
                dst_offset,
                raw_bytes: block.raw_bytes,
                unshuffle: match block.filter {
                    Filter::ByteShuffle if element_bytes > 1 => Some(Unshuffle {
                        element_bytes,
                        scratch_offset,
                    }),
                    _ => None,
                },
            }),
        }
    }

    /// Appends the job's 40-byte device encoding (the layout of `struct Lz4Job` in the kernel).
    pub fn encode(&self, out: &mut Vec<u8>) {
        let (scratch, width) = match self.unshuffle {
            Some(u) => (u.scratch_offset, u.element_bytes),
            None => (0, 0),
        };
        out.extend_from_slice(&self.src_offset.to_le_bytes());
        out.extend_from_slice(&self.dst_offset.to_le_bytes());
        out.extend_from_slice(&scratch.to_le_bytes());
        out.extend_from_slice(&self.src_bytes.to_le_bytes());
        out.extend_from_slice(&self.raw_bytes.to_le_bytes());
        out.extend_from_slice(&width.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
    }

    /// The device encoding of a whole table.
    pub fn encode_all(jobs: &[Lz4Job]) -> Vec<u8> {
        let mut out = Vec::with_capacity(jobs.len() * LZ4_JOB_BYTES);
        for job in jobs {
            job.encode(&mut out);
        }
        out
    }
}

/// What the decoder made of one block. The codes are those of `kernels/lz4.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lz4Status {
    /// Decoded to exactly `raw_bytes` (and unshuffled, when filtered).
    Ok,
    /// The input ended inside a sequence, or a literal run reached past it.
    InputOverrun,
    /// A literal run or match would have written past `raw_bytes`.
    OutputOverrun,
    /// A match offset of zero or one reaching before the start of the output.
    BadOffset,
    /// The block decoded to fewer bytes than `raw_bytes`.
    SizeMismatch,
    /// The job itself was invalid (extents outside the buffers, bad filter width, scratch overlapping
    /// the output); nothing was read or written.
    BadJob,
    /// A code this build does not know (never produced by the matching kernel).
    Unknown(u32),
}

impl std::fmt::Display for Lz4Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lz4Status::Ok => f.write_str("decoded"),
            Lz4Status::InputOverrun => f.write_str("the input ends inside a sequence"),
            Lz4Status::OutputOverrun => f.write_str("a sequence writes past the block's raw size"),
            Lz4Status::BadOffset => f.write_str("a match offset reaches before the block's start"),
            Lz4Status::SizeMismatch => f.write_str("fewer bytes than the block's raw size"),
            Lz4Status::BadJob => f.write_str("the decode job was refused"),
            Lz4Status::Unknown(code) => write!(f, "unknown decoder status {code}"),
        }
    }
}

impl Lz4Status {
    /// The status for a kernel code.
    pub fn from_code(code: u32) -> Lz4Status {
        match code {
            0 => Lz4Status::Ok,
            1 => Lz4Status::InputOverrun,
            2 => Lz4Status::OutputOverrun,
            3 => Lz4Status::BadOffset,
            4 => Lz4Status::SizeMismatch,
            5 => Lz4Status::BadJob,
            other => Lz4Status::Unknown(other),
        }
    }

    /// The kernel code.
    pub fn code(self) -> u32 {
        match self {
            Lz4Status::Ok => 0,
            Lz4Status::InputOverrun => 1,
            Lz4Status::OutputOverrun => 2,
            Lz4Status::BadOffset => 3,
            Lz4Status::SizeMismatch => 4,
            Lz4Status::BadJob => 5,
            Lz4Status::Unknown(code) => code,
        }
    }
}

/// The decoder's report on one job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lz4Outcome {
    /// The status.
    pub status: Lz4Status,
    /// Bytes decoded before the end or the fault.
    pub produced: u32,
}

impl Lz4Outcome {
    /// Decodes a table of outcomes copied back from the device (8 bytes each).
    pub fn decode_all(bytes: &[u8]) -> Vec<Lz4Outcome> {
        bytes
            .chunks_exact(LZ4_OUTCOME_BYTES)
            .map(|c| Lz4Outcome {
                status: Lz4Status::from_code(u32::from_le_bytes(
                    c[0..4].try_into().expect("4 bytes"),
                )),
                produced: u32::from_le_bytes(c[4..8].try_into().expect("4 bytes")),
            })
            .collect()
    }
}

/// Which sequence decoder the kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SequencePath {
    /// One sequence per warp step (`gf_lz4_decode`): a fast path for sequences that lie wholly in
    /// the staged window (no per-byte checks), the general path for the rest. Same results, fewer
    /// instructions.
    FastThenGeneral,
    /// One sequence per warp step, the general path only (every byte checked as it is read).
    GeneralOnly,
    /// The two-phase decoder (`gf_lz4_decode_two_phase`): the warp parses up to 32 sequences into
    /// records held one per lane, validates them all at once, then writes their output 32 bytes per
    /// warp step, whatever the sequences' lengths. Same results, statuses and bounds as the others,
    /// about half their instructions on short sequences (`docs/KERNELS.md`).
    TwoPhase,
}

impl SequencePath {
    /// The kernel's entry point.
    pub fn entry_point(self) -> &'static str {
        match self {
            SequencePath::FastThenGeneral | SequencePath::GeneralOnly => "gf_lz4_decode",
            SequencePath::TwoPhase => "gf_lz4_decode_two_phase",
        }
    }
}

/// How the decoder kernel is compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Lz4Config {
    /// Warps (blocks decoded at once) per thread block; 1 to 32.
    pub warps_per_block: u32,
    /// The sequence decoder.
    pub sequences: SequencePath,
    /// Thread blocks per multiprocessor the compiler is asked to fit (it caps registers to do so);
    /// 0 for no cap.
    pub min_blocks_per_sm: u32,
}

impl Lz4Config {
    /// The one-pass decoder's best configuration (`docs/benchmarks/gpu-kernels-2026-11-22.md`:
    /// registers capped at 40 so that 48 warps fit on a multiprocessor, 5 % faster than 48 registers
    /// and 40 warps). The daemon loads [`Lz4Config::SERVING`]; this one is the oracle the GPU tests
    /// check the two-phase decoder against (`docs/KERNELS.md`, "Why two decoders").
    pub const STANDARD: Lz4Config = Lz4Config {
        warps_per_block: 4,
        sequences: SequencePath::FastThenGeneral,
        min_blocks_per_sm: 12,
    };

    /// The two-phase decoder's candidate configuration, benchmarked beside [`Lz4Config::STANDARD`]
    /// and tested like it: 4 warps per block, registers capped at 40 (48 resident warps per
    /// multiprocessor).
    pub const TWO_PHASE: Lz4Config = Lz4Config {
        warps_per_block: 4,
        sequences: SequencePath::TwoPhase,
        min_blocks_per_sm: 12,
    };

    /// The decoder the daemon loads ([`crate::kernels::Kernels::load`]): the two-phase decoder, 4 warps
    /// per block, registers uncapped. On the H100 (2026-11-23, `docs/benchmarks/gpu-kernels-2026-11-23.md`)
    /// it decoded 64 KiB blocks of zipf int32 tokens at 136 GB/s and ReLU fp16 at 176 GB/s (the one-pass
    /// [`Lz4Config::STANDARD`]: 65 and 94; nvCOMP in the same run: 113 and 113), and passed the full
    /// exactness suite and the sanitizers.
    pub const SERVING: Lz4Config = Lz4Config {
        warps_per_block: 4,
        sequences: SequencePath::TwoPhase,
        min_blocks_per_sm: 0,
    };

    /// The NVRTC `-D` settings that compile this configuration.
    pub fn defines(&self) -> Vec<(String, String)> {
        let mut defines = vec![
            ("GF_LZ4_WARPS".into(), self.warps_per_block.to_string()),
            (
                "GF_LZ4_FAST".into(),
                match self.sequences {
                    SequencePath::FastThenGeneral | SequencePath::TwoPhase => "1",
                    SequencePath::GeneralOnly => "0",
                }
                .into(),
            ),
            (
                "GF_LZ4_MIN_BLOCKS".into(),
                self.min_blocks_per_sm.to_string(),
            ),
        ];
        // Only the two-phase build names it, so that the other builds' options (and cache files)
        // stay as they were.
        if self.sequences == SequencePath::TwoPhase {
            defines.push(("GF_LZ4_TWO_PHASE".into(), "1".into()));
        }
        defines
    }
}

/// The compiled decoder for one device.
pub struct Lz4Decoder {
    kernel: Kernel,
    warps_per_block: u32,
}

impl Lz4Decoder {
    /// Loads (compiling if needed) the decoder with [`Lz4Config::STANDARD`] but `warps_per_block`
    /// warps per thread block (1 to 32), still aiming at 48 resident warps per multiprocessor.
    pub fn new(
        device: &Device,
        warps_per_block: u32,
        cache: CacheDir,
    ) -> Result<(Lz4Decoder, ModuleOrigin), DeviceError> {
        Lz4Decoder::with_config(
            device,
            Lz4Config {
                warps_per_block,
                min_blocks_per_sm: (48 / warps_per_block.max(1)).max(1),
                ..Lz4Config::STANDARD
            },
            cache,
        )
    }

    /// Loads (compiling if needed) the decoder compiled as `config` says.
    pub fn with_config(
        device: &Device,
        config: Lz4Config,
        cache: CacheDir,
    ) -> Result<(Lz4Decoder, ModuleOrigin), DeviceError> {
        assert!(
            (1..=32).contains(&config.warps_per_block),
            "1 to 32 warps per block"
        );
        let (kernel, origin) = load_kernel(
            device,
            &LZ4_SOURCE,
            config.defines(),
            cache,
            config.sequences.entry_point(),
        )?;
        Ok((
            Lz4Decoder {
                kernel,
                warps_per_block: config.warps_per_block,
            },
            origin,
        ))
    }

    /// Warps (blocks decoded at once) per thread block.
    pub fn warps_per_block(&self) -> u32 {
        self.warps_per_block
    }

    /// The kernel, for occupancy queries.
    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    /// Queues the decoding of `job_count` jobs, encoded in `jobs` ([`Lz4Job::encode_all`]), reading
    /// stored bytes from `src` and writing into `dst`; one [`Lz4Outcome`] per job goes to `outcomes`.
    ///
    /// The kernel writes nothing outside the extents of valid jobs in `dst` and the outcome table, and
    /// reads nothing outside the jobs' extents in `src` and the job table, whatever the stored bytes.
    ///
    /// # Safety
    /// All four buffers stay allocated until the launch has completed on `stream`; nothing else writes
    /// `jobs` or `src`, or touches `dst` or `outcomes`, meanwhile. `src` and `dst` are different
    /// allocations (the kernel reads `src` through the read-only cache).
    pub unsafe fn decode_async(
        &self,
        stream: &Stream,
        jobs: &dyn DeviceMemory,
        job_count: u32,
        src: &dyn DeviceMemory,
        dst: &dyn DeviceMemory,
        outcomes: &dyn DeviceMemory,
    ) -> Result<(), DeviceError> {
        check_table("LZ4 job table", jobs, job_count, LZ4_JOB_BYTES)?;
        check_table("LZ4 outcome table", outcomes, job_count, LZ4_OUTCOME_BYTES)?;
        let (src_start, dst_start) = (src.device_ptr(), dst.device_ptr());
        assert!(
            src_start + src.len() as u64 <= dst_start || dst_start + dst.len() as u64 <= src_start,
            "the LZ4 source and destination buffers overlap"
        );
        if job_count == 0 {
            return Ok(());
        }
        let grid = job_count.div_ceil(self.warps_per_block);
        let mut jobs_ptr = jobs.device_ptr();
        let mut count = job_count;
        let mut src_ptr = src_start;
        let mut src_capacity = src.len() as u64;
        let mut dst_ptr = dst_start;
        let mut dst_capacity = dst.len() as u64;
        let mut outcomes_ptr = outcomes.device_ptr();
        let mut params: [*mut c_void; 7] = [
            &mut jobs_ptr as *mut u64 as *mut c_void,
            &mut count as *mut u32 as *mut c_void,
            &mut src_ptr as *mut u64 as *mut c_void,
            &mut src_capacity as *mut u64 as *mut c_void,
            &mut dst_ptr as *mut u64 as *mut c_void,
            &mut dst_capacity as *mut u64 as *mut c_void,
            &mut outcomes_ptr as *mut u64 as *mut c_void,
        ];
        // SAFETY: the parameters match the signature of both entry points, gf_lz4_decode and
        // gf_lz4_decode_two_phase (pointer, u32, pointer, u64, pointer, u64, pointer); the tables were
        // checked to hold job_count entries; buffer lifetimes are the caller's contract.
        self.kernel
            .launch(stream, grid, self.warps_per_block * 32, &mut params)
    }
}
