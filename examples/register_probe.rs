//! How fast page-cache data beyond the registration budget can reach the device: windows of a warm
//! file are page-locked (`cuMemHostRegister`, read-only), copied to device memory by the copy
//! engines, and unlocked again, by 1..N threads at once (each on its own stream), so that one
//! thread's registration overlaps another's copy. Prints one JSON line per thread count: GB/s, CPU
//! cores over the run, and the seconds spent registering, copying and unregistering per window.
//!
//! `--processes` measures the same work spread over 1..N processes, each with its own CUDA context
//! running the pipelined schedule (`--process-depth` windows in flight) over every N-th window: the
//! driver serialises registration within a process and unregistering waits for the context's queued
//! work, so this shows whether separate contexts register and copy side by side. The processes set
//! up (context, map, buffers) before the timer starts; the run ends at the last process's report,
//! and a process that finishes early frees its buffers and exits while the others still copy.
//! CPU cores are each process's own over its copies, summed.
//!
//! ```sh
//! cargo run --release --example register_probe -- --file /var/tmp/probe.bin --gib 8 --threads 1,2,3,4,6
//! cargo run --release --example register_probe -- --file /var/tmp/probe.bin --threads --pipelined \
//!     --grouped --processes 1,2,3,4
//! ```

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use gpufeed::device::{ffi, Device};

#[path = "support/bench.rs"]
#[allow(dead_code)]
mod bench;

#[derive(Parser)]
struct Args {
    /// The file to read (made, with pseudo-random bytes, when missing or of another size).
    #[arg(long)]
    file: std::path::PathBuf,
    /// Size of the file in GiB.
    #[arg(long, default_value_t = 8)]
    gib: u64,
    /// Window size in MiB.
    #[arg(long, default_value_t = 256)]
    window_mib: usize,
    /// Thread counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "1,2,3,4")]
    threads: Vec<usize>,
    /// Passes per thread count.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Also measure one thread that registers the next window while earlier copies run, and
    /// unregisters each window once its copy is complete, with this many windows in flight.
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "2,4")]
    pipelined: Vec<usize>,
    /// Also measure one thread that registers a group of this many windows while the previous
    /// group's copies run, then unregisters the previous group once its copies are done and only
    /// then queues the new group's copies (unregistering waits for the device).
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "1,2,4")]
    grouped: Vec<usize>,
    /// Process counts to measure, comma-separated (none by default).
    #[arg(long, value_delimiter = ',')]
    processes: Vec<usize>,
    /// Windows each process keeps registered and in flight (`--processes`).
    #[arg(long, default_value_t = 2)]
    process_depth: usize,
    /// Internal: run as process K of N (`K/N`) of a `--processes` measurement.
    #[arg(long, hide = true)]
    child: Option<String>,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
}

fn make_file(path: &std::path::Path, bytes: u64) -> Result<()> {
    if std::fs::metadata(path).map(|m| m.len()).ok() == Some(bytes) {
        return Ok(());
    }
    let mut file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut block = vec![0u8; 8 << 20];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut written = 0u64;
    while written < bytes {
        for chunk in block.chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.copy_from_slice(&state.to_le_bytes());
        }
        let n = block.len().min((bytes - written) as usize);
        file.write_all(&block[..n])?;
        written += n as u64;
    }
    file.sync_all()?;
    Ok(())
}

#[derive(Default)]
struct Times {
    register: f64,
    copy: f64,
    unregister: f64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let bytes = args.gib << 30;
    if let Some(child) = &args.child {
        return run_child(&args, child);
    }
    make_file(&args.file, bytes)?;
    // Warm the page cache.
    std::io::copy(&mut std::fs::File::open(&args.file)?, &mut std::io::sink())?;
    let device = Arc::new(Device::open(args.device)?);
    let file = std::fs::File::open(&args.file)?;
    // SAFETY: the file is not modified while mapped.
    let map = Arc::new(unsafe { memmap2::Mmap::map(&file)? });
    let window = args.window_mib << 20;
    let windows = bytes as usize / window;
    let all: Vec<usize> = (0..windows).collect();
    for &processes in &args.processes {
        for run in 1..=args.runs {
            measure_processes(&args, processes, run)?;
        }
    }
    for &depth in &args.pipelined {
        for run in 1..=args.runs {
            let (cpu0, _) = bench::cpu_seconds();
            let start = Instant::now();
            let times = pipelined(&device, &map, window, &all, depth)?;
            let seconds = start.elapsed().as_secs_f64();
            let (cpu1, _) = bench::cpu_seconds();
            let per = |s: f64| s / windows as f64 * 1e3;
            println!(
                "{{\"pipelined_depth\":{depth},\"run\":{run},\"window_mib\":{},\"gb_per_s\":{:.2},\"cores\":{:.2},\"register_ms_per_window\":{:.2},\"wait_ms_per_window\":{:.2},\"unregister_ms_per_window\":{:.2}}}",
                args.window_mib,
                bytes as f64 / seconds / 1e9,
                (cpu1 - cpu0) / seconds,
                per(times.register),
                per(times.copy),
                per(times.unregister),
            );
        }
    }
    for &group in &args.grouped {
        for run in 1..=args.runs {
            let (cpu0, _) = bench::cpu_seconds();
            let start = Instant::now();
            let times = grouped(&device, &map, window, windows, group)?;
            let seconds = start.elapsed().as_secs_f64();
            let (cpu1, _) = bench::cpu_seconds();
            let per = |s: f64| s / windows as f64 * 1e3;
            println!(
                "{{\"grouped\":{group},\"run\":{run},\"window_mib\":{},\"gb_per_s\":{:.2},\"cores\":{:.2},\"register_ms_per_window\":{:.2},\"wait_ms_per_window\":{:.2},\"unregister_ms_per_window\":{:.2}}}",
                args.window_mib,
                bytes as f64 / seconds / 1e9,
                (cpu1 - cpu0) / seconds,
                per(times.register),
                per(times.copy),
                per(times.unregister),
            );
        }
    }
    for &threads in &args.threads {
        for run in 1..=args.runs {
            let next = Arc::new(AtomicUsize::new(0));
            let (cpu0, _) = bench::cpu_seconds();
            let start = Instant::now();
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    let (device, map, next) =
                        (Arc::clone(&device), Arc::clone(&map), Arc::clone(&next));
                    std::thread::spawn(move || -> Result<Times> {
                        device.bind()?;
                        let mut times = Times::default();
                        // SAFETY: a context is current; freed below.
                        let stream = unsafe { ffi::stream_create()? };
                        // SAFETY: as above.
                        let dst = unsafe { ffi::mem_alloc(window)? };
                        loop {
                            let index = next.fetch_add(1, Ordering::Relaxed);
                            if index >= windows {
                                break;
                            }
                            let src = map[index * window..].as_ptr();
                            let t0 = Instant::now();
                            // SAFETY: the window is a live page-aligned part of the mapping, unregistered below.
                            unsafe { ffi::mem_host_register_read_only(src, window)? };
                            let t1 = Instant::now();
                            // SAFETY: dst holds `window` bytes; src stays registered until the stream is synchronized.
                            unsafe {
                                ffi::memcpy_htod_async(dst, src, window, stream)?;
                                ffi::stream_synchronize(stream)?;
                            }
                            let t2 = Instant::now();
                            // SAFETY: registered above; the copy has completed.
                            unsafe { ffi::mem_host_unregister(src)? };
                            let t3 = Instant::now();
                            times.register += (t1 - t0).as_secs_f64();
                            times.copy += (t2 - t1).as_secs_f64();
                            times.unregister += (t3 - t2).as_secs_f64();
                        }
                        // SAFETY: made above; no work is pending.
                        unsafe {
                            ffi::mem_free(dst)?;
                            ffi::stream_destroy(stream)?;
                        }
                        Ok(times)
                    })
                })
                .collect();
            let mut total = Times::default();
            for handle in handles {
                let times = handle.join().expect("probe thread panicked")?;
                total.register += times.register;
                total.copy += times.copy;
                total.unregister += times.unregister;
            }
            let seconds = start.elapsed().as_secs_f64();
            let (cpu1, _) = bench::cpu_seconds();
            let per = |s: f64| s / windows as f64 * 1e3;
            println!(
                "{{\"threads\":{threads},\"run\":{run},\"window_mib\":{},\"gb_per_s\":{:.2},\"cores\":{:.2},\"register_ms_per_window\":{:.2},\"copy_ms_per_window\":{:.2},\"unregister_ms_per_window\":{:.2}}}",
                args.window_mib,
                bytes as f64 / seconds / 1e9,
                (cpu1 - cpu0) / seconds,
                per(total.register),
                per(total.copy),
                per(total.unregister),
            );
        }
    }
    Ok(())
}

/// One thread: register each window of `indices` in turn, queue its copy, and unregister windows
/// whose copies are done, keeping at most `depth` windows registered.
fn pipelined(
    device: &Device,
    map: &memmap2::Mmap,
    window: usize,
    indices: &[usize],
    depth: usize,
) -> Result<Times> {
    let staged = Staged::new(device, window, depth)?;
    let times = staged.run(map, window, indices);
    staged.free()?;
    times
}

/// A stream with `depth` device buffers of a window and an event each, for [`Staged::run`].
struct Staged {
    stream: cudarc::driver::sys::CUstream,
    buffers: Vec<cudarc::driver::sys::CUdeviceptr>,
    events: Vec<cudarc::driver::sys::CUevent>,
}

impl Staged {
    fn new(device: &Device, window: usize, depth: usize) -> Result<Staged> {
        device.bind()?;
        // SAFETY: a context is current; everything made here is freed in `free`.
        let stream = unsafe { ffi::stream_create()? };
        let buffers = (0..depth)
            // SAFETY: as above.
            .map(|_| unsafe { ffi::mem_alloc(window) })
            .collect::<Result<_, _>>()?;
        let events = (0..depth)
            // SAFETY: as above.
            .map(|_| unsafe { ffi::event_create(false) })
            .collect::<Result<_, _>>()?;
        Ok(Staged {
            stream,
            buffers,
            events,
        })
    }

    fn free(self) -> Result<()> {
        // SAFETY: no work is pending (`run` retires every copy).
        unsafe {
            for buffer in self.buffers {
                ffi::mem_free(buffer)?;
            }
            for event in self.events {
                ffi::event_destroy(event)?;
            }
            ffi::stream_destroy(self.stream)?;
        }
        Ok(())
    }

    fn run(&self, map: &memmap2::Mmap, window: usize, indices: &[usize]) -> Result<Times> {
        let (stream, buffers, events) = (self.stream, &self.buffers, &self.events);
        let depth = buffers.len();
        let mut times = Times::default();
        let mut in_flight: std::collections::VecDeque<(usize, usize)> = Default::default();
        let retire = |times: &mut Times, (index, slot): (usize, usize)| -> Result<()> {
            let t0 = Instant::now();
            // SAFETY: the event was recorded after the window's copy.
            unsafe { ffi::event_synchronize(events[slot])? };
            let t1 = Instant::now();
            // SAFETY: registered in the loop below; its copy is complete.
            unsafe { ffi::mem_host_unregister(map[index * window..].as_ptr())? };
            times.copy += (t1 - t0).as_secs_f64();
            times.unregister += t1.elapsed().as_secs_f64();
            Ok(())
        };
        for (k, &index) in indices.iter().enumerate() {
            if in_flight.len() == depth {
                let oldest = in_flight.pop_front().expect("depth > 0");
                retire(&mut times, oldest)?;
            }
            let slot = k % depth;
            let src = map[index * window..].as_ptr();
            let t0 = Instant::now();
            // SAFETY: a live page-aligned part of the mapping, unregistered in `retire`; the buffer's
            // previous copy was retired above.
            unsafe {
                ffi::mem_host_register_read_only(src, window)?;
                times.register += t0.elapsed().as_secs_f64();
                ffi::memcpy_htod_async(buffers[slot], src, window, stream)?;
                ffi::event_record(events[slot], stream)?;
            }
            in_flight.push_back((index, slot));
        }
        while let Some(oldest) = in_flight.pop_front() {
            retire(&mut times, oldest)?;
        }
        Ok(times)
    }
}

/// One `--processes` measurement: `processes` children set up, then all start at once; the line
/// printed has the wall time from the start to the last child's end.
fn measure_processes(args: &Args, processes: usize, run: usize) -> Result<()> {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for k in 0..processes {
        let child = Command::new(&exe)
            .arg("--file")
            .arg(&args.file)
            .args(["--gib", &args.gib.to_string()])
            .args(["--window-mib", &args.window_mib.to_string()])
            .args(["--process-depth", &args.process_depth.to_string()])
            .args(["--device", &args.device.to_string()])
            .args(["--child", &format!("{k}/{processes}")])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting a probe process")?;
        children.push(child);
    }
    let mut lines = Vec::new();
    for child in &mut children {
        let mut reader = BufReader::new(child.stdout.take().expect("piped"));
        let mut ready = String::new();
        reader.read_line(&mut ready)?;
        anyhow::ensure!(
            ready.trim() == "ready",
            "a probe process failed to set up: {ready:?}"
        );
        lines.push(reader);
    }
    let start = Instant::now();
    for child in &mut children {
        writeln!(child.stdin.as_mut().expect("piped"), "go")?;
    }
    let mut reports = Vec::new();
    for mut reader in lines {
        let mut report = String::new();
        reader.read_line(&mut report)?;
        reports.push(serde_json::from_str::<serde_json::Value>(&report)?);
    }
    // The last report ends the run: tearing the contexts down comes after.
    let seconds = start.elapsed().as_secs_f64();
    for child in &mut children {
        let status = child.wait()?;
        anyhow::ensure!(status.success(), "a probe process failed: {status}");
    }
    let windows = (args.gib << 30) as usize / (args.window_mib << 20);
    let sum = |key: &str| reports.iter().filter_map(|r| r[key].as_f64()).sum::<f64>();
    let per = |s: f64| s / windows as f64 * 1e3;
    println!(
        "{{\"processes\":{processes},\"process_depth\":{},\"run\":{run},\"window_mib\":{},\"gb_per_s\":{:.2},\"cores\":{:.2},\"register_ms_per_window\":{:.2},\"wait_ms_per_window\":{:.2},\"unregister_ms_per_window\":{:.2},\"process_seconds\":{:?}}}",
        args.process_depth,
        args.window_mib,
        (args.gib << 30) as f64 / seconds / 1e9,
        sum("cpu_s") / seconds,
        per(sum("register_s")),
        per(sum("wait_s")),
        per(sum("unregister_s")),
        reports
            .iter()
            .map(|r| r["seconds"].as_f64().unwrap_or(0.0))
            .collect::<Vec<_>>(),
    );
    Ok(())
}

/// Process K of N: sets up, says "ready", waits for "go", copies every N-th window from the K-th and
/// prints its times as one JSON line.
fn run_child(args: &Args, child: &str) -> Result<()> {
    use std::io::BufRead;
    let (k, n) = child
        .split_once('/')
        .and_then(|(k, n)| Some((k.parse::<usize>().ok()?, n.parse::<usize>().ok()?)))
        .context("--child takes K/N")?;
    let window = args.window_mib << 20;
    let windows = (args.gib << 30) as usize / window;
    let indices: Vec<usize> = (k..windows).step_by(n.max(1)).collect();
    let device = Device::open(args.device)?;
    let file = std::fs::File::open(&args.file)?;
    // SAFETY: the file is not modified while mapped.
    let map = unsafe { memmap2::Mmap::map(&file)? };
    let staged = Staged::new(&device, window, args.process_depth.max(1))?;
    println!("ready");
    std::io::stdout().flush()?;
    let mut go = String::new();
    std::io::stdin().lock().read_line(&mut go)?;
    let (cpu0, _) = bench::cpu_seconds();
    let start = Instant::now();
    let times = staged.run(&map, window, &indices)?;
    let seconds = start.elapsed().as_secs_f64();
    let (cpu1, _) = bench::cpu_seconds();
    println!(
        "{{\"seconds\":{seconds},\"cpu_s\":{},\"register_s\":{},\"wait_s\":{},\"unregister_s\":{}}}",
        cpu1 - cpu0,
        times.register,
        times.copy,
        times.unregister
    );
    std::io::stdout().flush()?;
    staged.free()?;
    Ok(())
}

/// One thread, windows in groups of `group`: register group k+1 while group k's copies run, wait for
/// them, unregister group k, then queue group k+1's copies.
fn grouped(
    device: &Device,
    map: &memmap2::Mmap,
    window: usize,
    windows: usize,
    group: usize,
) -> Result<Times> {
    device.bind()?;
    let mut times = Times::default();
    // SAFETY: a context is current; freed below.
    let stream = unsafe { ffi::stream_create()? };
    // SAFETY: as above.
    let dst = unsafe { ffi::mem_alloc(window * group)? };
    let groups: Vec<Vec<usize>> = (0..windows)
        .collect::<Vec<_>>()
        .chunks(group)
        .map(|c| c.to_vec())
        .collect();
    let mut previous: Option<&Vec<usize>> = None;
    for members in &groups {
        let t0 = Instant::now();
        for &index in members {
            // SAFETY: a live page-aligned part of the mapping, unregistered below.
            unsafe { ffi::mem_host_register_read_only(map[index * window..].as_ptr(), window)? };
        }
        times.register += t0.elapsed().as_secs_f64();
        if let Some(done) = previous {
            let t1 = Instant::now();
            // SAFETY: a live stream.
            unsafe { ffi::stream_synchronize(stream)? };
            let t2 = Instant::now();
            for &index in done {
                // SAFETY: registered above; its copy has completed.
                unsafe { ffi::mem_host_unregister(map[index * window..].as_ptr())? };
            }
            times.copy += (t2 - t1).as_secs_f64();
            times.unregister += t2.elapsed().as_secs_f64();
        }
        for (k, &index) in members.iter().enumerate() {
            // SAFETY: dst holds `group` windows; the source stays registered until unregistered
            // after the stream is synchronized.
            unsafe {
                ffi::memcpy_htod_async(
                    dst + (k * window) as u64,
                    map[index * window..].as_ptr(),
                    window,
                    stream,
                )?;
            }
        }
        previous = Some(members);
    }
    // SAFETY: a live stream.
    unsafe { ffi::stream_synchronize(stream)? };
    for &index in previous.into_iter().flatten() {
        // SAFETY: registered above; its copy has completed.
        unsafe { ffi::mem_host_unregister(map[index * window..].as_ptr())? };
    }
    // SAFETY: no work is pending.
    unsafe {
        ffi::mem_free(dst)?;
        ffi::stream_destroy(stream)?;
    }
    Ok(times)
}
