//! Read benchmark for the GPU read paths: reads a file into device memory through one path and prints
//! one JSON line with GB/s and the host CPU time spent.
//!
//! ```text
//! read_bench --file F --path page_cache|bounce|cufile|auto --temperature cold|warm [--extent-mib 16]
//! ```
//! `cold` drops the file's pages first (posix_fadvise DONTNEED, which needs the pages to be clean);
//! `warm` reads the file once through the page cache first. Needs a CUDA GPU.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use gpufeed::device::{Device, DeviceBuffer};
use gpufeed::storage::gpu::{GpuReader, GpuReaderLimits, PathChoice, ReadPath};
use gpufeed::storage::windows::PageCacheWindows;
use gpufeed::storage::{DirectIo, Extent, FileId, FileTable};

#[derive(Parser)]
struct Args {
    /// The file to read.
    #[arg(long)]
    file: PathBuf,
    /// page_cache, bounce, cufile or auto.
    #[arg(long)]
    path: String,
    /// cold or warm.
    #[arg(long)]
    temperature: String,
    /// Size of each read extent in MiB.
    #[arg(long, default_value_t = 16)]
    extent_mib: usize,
    /// Size of each pinned bounce buffer in MiB (default: the reader's node default).
    #[arg(long)]
    bounce_mib: Option<usize>,
    /// Threads issuing cuFile reads (default: the reader's node default).
    #[arg(long)]
    cufile_threads: Option<usize>,
    /// Times to repeat the read (warm only); the median is reported.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

fn cpu_seconds() -> f64 {
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we own.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let choice = match args.path.as_str() {
        "page_cache" => PathChoice::Force(ReadPath::PageCache),
        "bounce" => PathChoice::Force(ReadPath::Bounce),
        "cufile" => PathChoice::Force(ReadPath::CuFile),
        "auto" => PathChoice::Auto,
        other => bail!("unknown path {other}"),
    };
    let len = std::fs::metadata(&args.file)
        .with_context(|| args.file.display().to_string())?
        .len();
    let device = Device::open(0)?;
    let buffer = DeviceBuffer::new(&device, len as usize)?;
    let mut files = FileTable::new(1);
    files.open(&args.file, DirectIo::Prefer)?;
    let mut limits = GpuReaderLimits::node_defaults();
    if let Some(mib) = args.bounce_mib {
        limits.bounce_buffer_bytes = mib << 20;
    }
    if let Some(threads) = args.cufile_threads {
        limits.cufile_threads = threads;
    }
    // 64 MiB windows within an 8 GiB registration budget: the file's windows stay registered
    // between repeats.
    let windows = std::sync::Arc::new(PageCacheWindows::new(&device, 64 << 20, 8 << 30));
    let mut reader = GpuReader::with_windows(&device, limits, windows)?;
    let extent_bytes = (args.extent_mib << 20) as u64;
    let extents: Vec<Extent> = (0..len.div_ceil(extent_bytes))
        .map(|i| {
            let offset = i * extent_bytes;
            Extent {
                file: FileId(0),
                offset,
                len: extent_bytes.min(len - offset) as usize,
                dest_offset: offset as usize,
            }
        })
        .collect();
    let file = File::open(&args.file)?;
    let repeats = if args.temperature == "cold" {
        1
    } else {
        args.repeat.max(1)
    };
    let mut runs = Vec::new();
    let mut served = std::collections::BTreeMap::new();
    for _ in 0..repeats {
        match args.temperature.as_str() {
            "cold" => {
                // SAFETY: plain syscall on an open descriptor.
                unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            }
            "warm" => {
                let mut chunk = vec![0u8; 64 << 20];
                let mut offset = 0;
                while offset < len {
                    offset += file.read_at(&mut chunk, offset)? as u64;
                }
            }
            other => bail!("unknown temperature {other}"),
        }
        let cpu_before = cpu_seconds();
        let started = Instant::now();
        let results = reader.read(&files, &extents, &buffer, choice)?;
        let seconds = started.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu_before;
        served.clear();
        for result in results {
            *served.entry(result?.name()).or_insert(0u64) += 1;
        }
        runs.push((seconds, cpu));
    }
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (seconds, cpu) = runs[runs.len() / 2];
    println!(
        "{}",
        serde_json::json!({
            "path": match (args.bounce_mib, args.cufile_threads) {
                (Some(mib), _) => format!("{}-{mib}MiB", args.path),
                (None, Some(threads)) => format!("{}-{threads}t", args.path),
                (None, None) => args.path.clone(),
            },
            "temperature": args.temperature,
            "bytes": len,
            "seconds": seconds,
            "gb_per_s": len as f64 / seconds / 1e9,
            "cpu_seconds": cpu,
            "host_cores": cpu / seconds,
            "served_by": served,
            "cold_path": reader.cold_path_reason,
        })
    );
    Ok(())
}
