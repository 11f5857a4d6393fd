//! The block checksum kernel (`kernels/xxh3.cu`): xxh3-64 of stored blocks in device memory, checked
//! against the checksums of the block table before anything decodes them.
//!
//! Every stored block carries `crate::format::checksum` (xxh3-64, seed 0, default secret) of its stored
//! bytes. On the GPU backend those bytes reach device memory without the CPU reading them, so the
//! device checks them: one job per block, one outcome per job.

use std::ffi::c_void;

use crate::device::{
    CacheDir, Device, DeviceError, DeviceMemory, Kernel, KernelSource, ModuleOrigin, Stream,
};
use crate::format::BlockEntry;

use super::launch::{check_table, load_kernel};

/// The kernel source.
pub const XXH3_SOURCE: KernelSource = KernelSource {
    name: "xxh3",
    source: include_str!("../../kernels/xxh3.cu"),
};

/// Bytes of one [`Xxh3Job`] in the device table.
pub const XXH3_JOB_BYTES: usize = 24;
/// Bytes of one [`Xxh3Outcome`] in the device table.
pub const XXH3_OUTCOME_BYTES: usize = 16;

/// One extent to check: its stored bytes in the source buffer and the checksum they must have.
///
/// The offset is relative to the source buffer given at launch; the kernel checks every job's extent
/// against that buffer's length before reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Xxh3Job {
    /// First stored byte in the source buffer.
    pub src_offset: u64,
    /// Stored length.
    pub bytes: u32,
    /// The xxh3-64 checksum the bytes must have.
    pub expected: u64,
}

impl Xxh3Job {
    /// The job for one block of the shard format whose stored bytes were staged at `src_offset`.
    pub fn for_block(block: &BlockEntry, src_offset: u64) -> Xxh3Job {
        Xxh3Job {
            src_offset,
            bytes: block.stored_bytes,
            expected: block.checksum,
        }
    }

    /// Appends the job's 24-byte device encoding (the layout of `struct Xxh3Job` in the kernel):
    /// `src_offset: u64`, `bytes: u32`, 4 reserved zero bytes, `expected: u64`, little-endian.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.src_offset.to_le_bytes());
        out.extend_from_slice(&self.bytes.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.expected.to_le_bytes());
    }

    /// The device encoding of a whole table.
    pub fn encode_all(jobs: &[Xxh3Job]) -> Vec<u8> {
        let mut out = Vec::with_capacity(jobs.len() * XXH3_JOB_BYTES);
        for job in jobs {
            job.encode(&mut out);
        }
        out
    }
}

/// What the kernel made of one job. The codes are those of `kernels/xxh3.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Xxh3Status {
    /// The bytes have the expected checksum.
    Ok,
    /// The bytes were hashed and the checksum differs: the block is corrupt.
    Mismatch,
    /// The job's extent does not fit the source buffer; nothing was read.
    BadJob,
    /// A code this build does not know (never produced by the matching kernel).
    Unknown(u32),
}

impl Xxh3Status {
    /// The status for a kernel code.
    pub fn from_code(code: u32) -> Xxh3Status {
        match code {
            0 => Xxh3Status::Ok,
            1 => Xxh3Status::Mismatch,
            2 => Xxh3Status::BadJob,
            other => Xxh3Status::Unknown(other),
        }
    }

    /// The kernel code.
    pub fn code(self) -> u32 {
        match self {
            Xxh3Status::Ok => 0,
            Xxh3Status::Mismatch => 1,
            Xxh3Status::BadJob => 2,
            Xxh3Status::Unknown(code) => code,
        }
    }
}

/// The kernel's report on one job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Xxh3Outcome {
    /// The status.
    pub status: Xxh3Status,
    /// The computed xxh3-64 of the job's bytes; 0 for [`Xxh3Status::BadJob`].
    pub hash: u64,
}

impl Xxh3Outcome {
    /// Decodes a table of outcomes copied back from the device (16 bytes each: `status: u32`, 4
    /// reserved bytes, `hash: u64`, little-endian).
    pub fn decode_all(bytes: &[u8]) -> Vec<Xxh3Outcome> {
        bytes
            .chunks_exact(XXH3_OUTCOME_BYTES)
            .map(|c| Xxh3Outcome {
                status: Xxh3Status::from_code(u32::from_le_bytes(
                    c[0..4].try_into().expect("4 bytes"),
                )),
                hash: u64::from_le_bytes(c[8..16].try_into().expect("8 bytes")),
            })
            .collect()
    }
}

/// How the checksum kernel is compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Xxh3Config {
    /// Warps (jobs checked at once) per thread block; 1 to 32.
    pub warps_per_block: u32,
    /// Whole 1 KiB input blocks whose loads a warp issues together before reducing them; 1 to 8.
    pub blocks_per_step: u32,
}

impl Xxh3Config {
    /// The configuration gpufeed uses (see `docs/KERNELS.md` and the benchmark page for the others).
    pub const STANDARD: Xxh3Config = Xxh3Config {
        warps_per_block: 4,
        blocks_per_step: 4,
    };

    fn defines(&self) -> Vec<(String, String)> {
        vec![
            ("GF_XXH3_WARPS".into(), self.warps_per_block.to_string()),
            ("GF_XXH3_GROUP".into(), self.blocks_per_step.to_string()),
        ]
    }
}

/// The compiled checksum kernel for one device.
pub struct ChecksumVerifier {
    kernel: Kernel,
    warps_per_block: u32,
}

impl ChecksumVerifier {
    /// Loads (compiling if needed) the kernel with [`Xxh3Config::STANDARD`].
    pub fn new(
        device: &Device,
        cache: CacheDir,
    ) -> Result<(ChecksumVerifier, ModuleOrigin), DeviceError> {
        ChecksumVerifier::with_config(device, Xxh3Config::STANDARD, cache)
    }

    /// Loads (compiling if needed) the kernel compiled as `config` says.
    pub fn with_config(
        device: &Device,
        config: Xxh3Config,
        cache: CacheDir,
    ) -> Result<(ChecksumVerifier, ModuleOrigin), DeviceError> {
        assert!(
            (1..=32).contains(&config.warps_per_block),
            "1 to 32 warps per block"
        );
        assert!(
            (1..=8).contains(&config.blocks_per_step),
            "1 to 8 input blocks per step"
        );
        let (kernel, origin) = load_kernel(
            device,
            &XXH3_SOURCE,
            config.defines(),
            cache,
            "gf_xxh3_verify",
        )?;
        Ok((
            ChecksumVerifier {
                kernel,
                warps_per_block: config.warps_per_block,
            },
            origin,
        ))
    }

    /// Warps (jobs checked at once) per thread block.
    pub fn warps_per_block(&self) -> u32 {
        self.warps_per_block
    }

    /// The kernel, for occupancy queries.
    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    /// Queues the check of `job_count` jobs, encoded in `jobs` ([`Xxh3Job::encode_all`]), hashing
    /// stored bytes in `src`; one [`Xxh3Outcome`] per job goes to `outcomes` (every entry is written,
    /// so the table needs no clearing).
    ///
    /// The kernel reads nothing outside the job table and the extents of valid jobs in `src`, and
    /// writes nothing but the first `job_count` outcomes.
    ///
    /// # Safety
    /// All three buffers stay allocated until the launch has completed on `stream`; nothing writes
    /// `jobs` or `src`, or touches `outcomes`, meanwhile (the kernel reads `src` through the read-only
    /// cache). `outcomes` is a different allocation from the other two.
    pub unsafe fn verify_async(
        &self,
        stream: &Stream,
        jobs: &dyn DeviceMemory,
        job_count: u32,
        src: &dyn DeviceMemory,
        outcomes: &dyn DeviceMemory,
    ) -> Result<(), DeviceError> {
        check_table("xxh3 job table", jobs, job_count, XXH3_JOB_BYTES)?;
        check_table(
            "xxh3 outcome table",
            outcomes,
            job_count,
            XXH3_OUTCOME_BYTES,
        )?;
        if job_count == 0 {
            return Ok(());
        }
        let grid = job_count.div_ceil(self.warps_per_block);
        let mut jobs_ptr = jobs.device_ptr();
        let mut count = job_count;
        let mut src_ptr = src.device_ptr();
        let mut src_capacity = src.len() as u64;
        let mut outcomes_ptr = outcomes.device_ptr();
        let mut params: [*mut c_void; 5] = [
            &mut jobs_ptr as *mut u64 as *mut c_void,
            &mut count as *mut u32 as *mut c_void,
            &mut src_ptr as *mut u64 as *mut c_void,
            &mut src_capacity as *mut u64 as *mut c_void,
            &mut outcomes_ptr as *mut u64 as *mut c_void,
        ];
        // SAFETY: the parameters match gf_xxh3_verify's signature (pointer, u32, pointer, u64,
        // pointer); the tables were checked to hold job_count entries; buffer lifetimes are the
        // caller's contract.
        self.kernel
            .launch(stream, grid, self.warps_per_block * 32, &mut params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_encoding_is_the_kernels_layout() {
        let job = Xxh3Job {
            src_offset: 0x0102_0304_0506_0708,
            bytes: 0x1122_3344,
            expected: 0xa1a2_a3a4_a5a6_a7a8,
        };
        let table = Xxh3Job::encode_all(&[job, job]);
        assert_eq!(table.len(), 2 * XXH3_JOB_BYTES);
        assert_eq!(XXH3_JOB_BYTES % 8, 0, "8-byte aligned entries");
        assert_eq!(&table[0..8], &job.src_offset.to_le_bytes());
        assert_eq!(&table[8..12], &job.bytes.to_le_bytes());
        assert_eq!(&table[12..16], &[0, 0, 0, 0]);
        assert_eq!(&table[16..24], &job.expected.to_le_bytes());
        assert_eq!(&table[24..48], &table[0..24]);
    }

    #[test]
    fn outcomes_decode_status_and_hash() {
        let mut bytes = Vec::new();
        for (code, hash) in [(0u32, 7u64), (1, u64::MAX), (2, 0), (9, 3)] {
            bytes.extend_from_slice(&code.to_le_bytes());
            bytes.extend_from_slice(&0u32.to_le_bytes());
            bytes.extend_from_slice(&hash.to_le_bytes());
        }
        let outcomes = Xxh3Outcome::decode_all(&bytes);
        let statuses: Vec<Xxh3Status> = outcomes.iter().map(|o| o.status).collect();
        assert_eq!(
            statuses,
            [
                Xxh3Status::Ok,
                Xxh3Status::Mismatch,
                Xxh3Status::BadJob,
                Xxh3Status::Unknown(9)
            ]
        );
        assert_eq!(outcomes[1].hash, u64::MAX);
        for status in statuses {
            assert_eq!(Xxh3Status::from_code(status.code()), status);
        }
    }

    #[test]
    fn a_job_for_a_block_takes_its_stored_length_and_checksum() {
        let block = BlockEntry {
            stored_offset: 8192,
            stored_bytes: 5000,
            raw_bytes: 9000,
            codec: crate::format::Codec::Lz4,
            filter: crate::format::Filter::None,
            field: 0,
            raw_offset: 0,
            first_sample: 0,
            checksum: 0xdead_beef,
        };
        assert_eq!(
            Xxh3Job::for_block(&block, 64),
            Xxh3Job {
                src_offset: 64,
                bytes: 5000,
                expected: 0xdead_beef
            }
        );
    }
}
