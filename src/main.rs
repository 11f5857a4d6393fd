//! The `gpufeed` command line: pack, inspect, verify, unpack, list-inputs, serve and demo.

/// `gpufeed consume`, shared with the `consume` example.
mod consume;

/// mimalloc: the daemon's planning threads allocate each planned batch and the filler thread frees it;
/// with the system allocator those frees took the planning threads' arena locks, about 2 µs a batch of
/// 64 rows on the H100 test machine (`docs/benchmarks/handoff-2026-11-24.md`, runs 53 and 54).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use gpufeed::config::{ByteCount, ConfigLayer, Switch};
use gpufeed::daemon::DeviceRequest;
use gpufeed::demo::DemoOptions;
use gpufeed::format::Dataset;
use gpufeed::input::{self, FieldSource};
use gpufeed::pack::{self, CodecChoice, OnExisting, PackObserver, PackOptions, ShuffleChoice};
use gpufeed::tools::{self, ToolProgress};
use gpufeed_proto::DType;
use indicatif::{ProgressBar, ProgressStyle};

/// gpufeed: packs datasets into GPU-friendly shards and serves device-resident batches to training
/// processes.
#[derive(Parser)]
#[command(version, about, long_about = None, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Pack NumPy (.npy), safetensors, Parquet/Arrow IPC or token-file (--tokens) inputs into a dataset
    /// directory of shards.
    ///
    /// Positional .npy files are concatenated along axis 0 into one field named `data`; positional
    /// Parquet or Arrow IPC files are packed as one dataset, each column a field. Each --field
    /// adds a named field; every field must have the same number of samples (the length of axis 0).
    /// The dataset appears at --out only once it is complete: an interrupted pack leaves no manifest.
    Pack(PackArgs),
    /// Print a JSON summary of a dataset: fields, dtypes, shapes, samples, shards, raw and stored bytes,
    /// compression ratio and codec counts per field.
    Inspect {
        /// The dataset directory (the one holding manifest.json).
        dir: PathBuf,
    },
    /// Check every checksum and decode every block of a dataset.
    ///
    /// Exits 0 when the dataset is intact; otherwise prints every problem, naming the shard, field and
    /// block, and exits 1.
    Verify {
        /// The dataset directory.
        dir: PathBuf,
        /// Do not draw a progress bar.
        #[arg(long)]
        quiet: bool,
    },
    /// Decode one field of a dataset on the CPU into a .npy file of shape [samples, ...].
    ///
    /// A variable-length field is written as its values ([elements, ...], every sample's elements
    /// one after the other) at --out and int64 offsets ([samples + 1]) beside it, NAME.offsets.npy:
    /// sample i is values[offsets[i]:offsets[i + 1]]. The file appears at --out only once every
    /// block has decoded: a corrupt dataset leaves nothing there (and an existing file intact).
    Unpack {
        /// The dataset directory.
        dir: PathBuf,
        /// The field to decode.
        #[arg(long)]
        field: String,
        /// The .npy file to write; it must not exist unless --force is given.
        #[arg(long)]
        out: PathBuf,
        /// Replace an existing regular file at --out (only once the new one is complete).
        #[arg(long)]
        force: bool,
        /// Convert elements to this dtype (f16 and bf16 convert to f32 exactly as the GPU path does;
        /// integers of at most 32 bits widen to i64). Default: the stored dtype.
        #[arg(long, value_parser = consume::dtype_parser())]
        dtype: Option<DType>,
        /// Do not draw a progress bar.
        #[arg(long)]
        quiet: bool,
    },
    /// List the arrays of .npy, safetensors, Parquet and Arrow IPC input files: each tensor's or
    /// column's name, dtype and shape (samples first), as `pack --field` needs them.
    ///
    /// The format is recognised from each file's first bytes; only headers are read. Exits 1 if a
    /// file could not be listed (after listing the others).
    ///
    /// Parquet and Arrow IPC files (.parquet, .pq, .arrow, .arrows, .ipc, .feather) are listed with
    /// their row count and, per column, its Arrow type and the field it packs as, or why it cannot
    /// (a variable-length column, a type with no gpufeed dtype); an IPC stream is read through to
    /// count its rows.
    ///
    /// Token files (a Megatron PREFIX.bin or PREFIX.idx, a flat token .bin with --token-dtype, a
    /// .npy with --seq-len) are described as `pack --tokens` reads them: tokens, documents, dtype,
    /// and with --seq-len the sequences a pack would cut.
    ListInputs {
        /// The input files.
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
        /// Describe token files as cut into sequences of N tokens.
        #[arg(long, value_name = "N")]
        seq_len: Option<u64>,
        /// Dtype of a flat token .bin.
        #[arg(long, value_enum)]
        token_dtype: Option<TokenDtypeArg>,
    },
    /// Start the daemon: register every dataset under --data-root and serve batches to consumers
    /// over a Unix socket (see docs/PROTOCOL.md and the gpufeed-client crate).
    ///
    /// Prints `gpufeed: serving N dataset(s) on SOCKET` on stdout once it accepts connections. Under
    /// a service manager ($NOTIFY_SOCKET set, as systemd's Type=notify does) it also sends READY=1
    /// then, STOPPING=1 on SIGTERM, and watchdog pings when $WATCHDOG_USEC is set (docs/DEPLOY.md).
    Serve(Box<ServeArgs>),
    /// Consume one epoch of batches from a running daemon (as a training process would, through
    /// the client crate) and print a JSON summary: batches, samples, bytes, seconds, the cursor to
    /// resume from, and the hand-off latency. For checking a deployment and measuring it.
    Consume(Box<consume::Args>),
    /// Run the whole job on a generated dataset and print what it did and how fast.
    ///
    /// Generates an embedding-like fp16 field and a token-like int32 field, packs them, verifies the
    /// shards, starts the daemon (on the GPU backend where one can be used, else the CPU backend: see
    /// --device), pulls a whole epoch of batches through the client crate (fp16 converted to f32) and
    /// checks every value against the source.
    Demo {
        /// Work directory (default: a fresh temporary directory, removed afterwards).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Samples to generate.
        #[arg(long, default_value_t = 65_536)]
        samples: u64,
        /// Where the daemon serves from: auto (CUDA device 0 when the CUDA driver and NVRTC load and
        /// the device exists, else the CPU backend; the choice and its reason are printed), cpu, or
        /// cuda:N.
        #[arg(long, default_value = "auto")]
        device: DeviceRequest,
    },
}

#[derive(clap::Args)]
struct PackArgs {
    /// The dataset directory to create (its parent must exist), or a URL in object storage
    /// (s3://bucket/prefix, ...): packed in a temporary directory, then uploaded shards first and
    /// manifest last, so that the URL holds a dataset only once it is complete.
    #[arg(long)]
    out: PathBuf,
    /// Dataset name recorded in the manifest (default: the last component of --out).
    #[arg(long)]
    name: Option<String>,
    /// A named field: NAME=FILE.npy, NAME=FILE.safetensors:TENSOR, or NAME=FILE.parquet:COLUMN (also
    /// .arrow, .arrows, .feather: Arrow IPC files and streams; a primitive or fixed-size list
    /// column, without nulls). Repeat a NAME with more .npy, Parquet or Arrow files to concatenate
    /// them along axis 0.
    #[arg(long = "field", value_name = "NAME=PATH")]
    fields: Vec<String>,
    /// Makes the .npy field NAME variable-length (format version 2): FILE.npy holds int64 (or
    /// uint64) offsets, one more than the field's samples, starting at 0, into the field's rows
    /// (its values: sample i is rows offsets[i]..offsets[i + 1]), as `unpack` writes them beside a
    /// variable-length field's values.
    #[arg(long = "offsets", value_name = "NAME=FILE.npy")]
    offsets: Vec<String>,
    /// .npy files concatenated along axis 0 into one field named `data`; or Parquet/Arrow IPC files
    /// (same columns) packed whole, each column a field of its name.
    #[arg(value_name = "PATH")]
    paths: Vec<PathBuf>,
    /// A token file cut into sequences of --seq-len tokens, packed as field `tokens` [N] in the
    /// file's dtype: a Megatron-LM indexed dataset (PREFIX.bin or PREFIX.idx; adds field `doc_start`,
    /// u8 [N], 1 where a document starts), a flat .bin of token ids (give --token-dtype), or a 1-D
    /// .npy. Tokens left over after the last whole sequence are dropped and their count printed.
    /// Repeat --tokens to pack several files of one dtype as one dataset; each is cut on its own.
    /// With --documents instead of --seq-len, Megatron inputs are packed one sample per document.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["fields", "paths"])]
    tokens: Vec<PathBuf>,
    /// Tokens per sequence for --tokens.
    #[arg(long, value_name = "N", conflicts_with = "documents")]
    seq_len: Option<u64>,
    /// For --tokens of Megatron-LM datasets: one sample per document instead of sequences of
    /// --seq-len, field `tokens` variable-length (format version 2), nothing dropped.
    #[arg(long, requires = "tokens")]
    documents: bool,
    /// Dtype of a flat token .bin given with --tokens (a Megatron index names its own).
    #[arg(long, value_enum)]
    token_dtype: Option<TokenDtypeArg>,
    /// Largest raw size of a block: a power of two from 4K to 16M (suffixes K and M are binary).
    /// Blocks hold whole samples where a sample fits. A compressed block is decoded whole for any
    /// of its rows: for datasets read in a shuffled order and larger than the daemon's host memory
    /// for streams, blocks of one or two rows are decoded about once an epoch where 64K blocks of
    /// eight 8 KiB rows are decoded about twice, at a lower ratio (each block is padded to 4 KiB:
    /// int32 tokens 2.3x at 64K, 2.0x at 16K).
    #[arg(long, default_value = "64K", value_parser = parse_bytes)]
    block_bytes: u32,
    /// Samples per shard file (default: about 256 MiB of raw data per shard).
    #[arg(long)]
    samples_per_shard: Option<u64>,
    /// auto: per field, LZ4 for every block if 16 blocks sampled evenly over the field compress to at
    /// most half their raw bytes (ratio >= 2), raw for every block otherwise. It weighs the GPU
    /// backend's read: over the 55 GB/s PCIe link or a warm page cache, decoding costs more than a
    /// smaller saving wins (at ratio r, reading LZ4 beats raw only if the decoder runs r/(r-1) times
    /// the link rate), while on a cold disk any saving pays; so tokens (~2.3x) are stored LZ4 and fp16
    /// data (~1.3x) raw. The ratio is LZ4's own: each block is stored and read in whole 4 KiB pages,
    /// so blocks of a few pages read more than it says. On the CPU backend with the shards in the page
    /// cache, raw serves faster than LZ4 at any ratio (decoding runs below the copy it replaces): pack
    /// such datasets --codec raw. lz4: every block LZ4, whatever it saves; raw: no compression.
    #[arg(long, value_enum, default_value_t = CodecArg::Auto)]
    codec: CodecArg,
    /// Byte-shuffle elements before compressing (a filter for compression, not the sample order a
    /// consumer's --shuffle chooses). auto: per block, whichever is smaller. Also --shuffle-filter.
    #[arg(long = "byte-shuffle", alias = "shuffle-filter", value_enum, default_value_t = ShuffleArg::Auto)]
    byte_shuffle: ShuffleArg,
    /// Replace an existing dataset at --out (only once the new one is complete).
    #[arg(long)]
    force: bool,
    /// Threads reading, encoding and writing blocks, and decoding Parquet row groups (default: the
    /// number of CPUs).
    #[arg(long)]
    threads: Option<usize>,
    /// Do not draw a progress bar.
    #[arg(long)]
    quiet: bool,
}

/// Settings of `gpufeed serve`. Each can also come from the environment (`GPUFEED_` and the flag's
/// name in capitals with `_`, such as `GPUFEED_SLOT_MEMORY_MAX`) or from the TOML file given with
/// --config (the flag's name with `_`, such as `slot_memory_max = "8G"`); flags win over the
/// environment, which wins over the file.
#[derive(clap::Args)]
struct ServeArgs {
    /// How log lines on standard error are written: text (for people) or json (one JSON object per
    /// line, for log collectors) [env: GPUFEED_LOG_FORMAT]. Which lines: GPUFEED_LOG (an
    /// env-filter such as `info` or `gpufeed=debug`). Default: text.
    #[arg(long, value_enum, value_name = "text|json")]
    log_format: Option<LogFormat>,
    /// A TOML configuration file [env: GPUFEED_CONFIG].
    #[arg(long, value_name = "FILE.toml")]
    config: Option<PathBuf>,
    /// Directory whose subdirectories are datasets (each holding a manifest.json); the catalog
    /// (.gpufeed-catalog.json) is kept there too. Required here, in the environment or in the file.
    #[arg(long)]
    data_root: Option<PathBuf>,
    /// Path of the Unix socket consumers connect to (created with mode 0600, or 0666 when
    /// --allow-uid names other users, who are then checked on every connection; a stale socket
    /// left by a daemon that died is replaced). Default: DATA_ROOT/gpufeed.sock.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Where batches live: auto (GPU 0 when the GPU backend is available, else the CPU backend), cpu,
    /// cuda:N, a list of devices (cuda:0,cuda:1), or all (every CUDA device; the registration
    /// budget is shared between the devices). Host-memory streams are served in every case; each
    /// consumer opens its streams on its own GPU. Default: auto.
    #[arg(long)]
    device: Option<String>,
    /// Storage engine: auto, cufile or uring (io_uring, with pread where io_uring is unavailable).
    /// Default: auto.
    #[arg(long)]
    engine: Option<String>,
    /// A uid allowed to connect (repeatable; checked on every connection's peer credentials). The
    /// socket is owner-only while only the daemon's own uid is allowed, else 0666 so that the other
    /// uids can connect at all. Default: the daemon's own uid.
    #[arg(long = "allow-uid", value_name = "UID")]
    allow_uids: Vec<u32>,
    /// Most concurrent consumer sessions. Default: 64.
    #[arg(long)]
    sessions_max: Option<u32>,
    /// Most bytes of slot memory over all streams (at least 4K, one slot; suffixes K, M, G are
    /// binary). Default: 8G, or a quarter of the memory the daemon may use (the RAM, or its memory
    /// cgroup's limit) where that is less.
    #[arg(long, value_parser = parse_byte_count)]
    slot_memory_max: Option<ByteCount>,
    /// The control API's address, IP:PORT (port 0 picks a free one, printed as `gpufeed: http on
    /// ADDR`), or off. A non-loopback address requires --api-token. Default: 127.0.0.1:7070.
    #[arg(long, value_name = "ADDR")]
    http: Option<String>,
    /// Bearer token of the control API (16 to 1024 printable characters): required for requests that
    /// change state, and for every request when --http is not a loopback address. Prefer
    /// GPUFEED_API_TOKEN or the file: flags are visible to other users in the process list.
    #[arg(long, value_name = "TOKEN")]
    api_token: Option<String>,
    /// Largest request body the control API accepts (1K to 64M; suffixes K, M). Default: 1M.
    #[arg(long, value_parser = parse_byte_count)]
    body_limit: Option<ByteCount>,
    /// Most pack jobs running at once. Default: 2.
    #[arg(long)]
    jobs_max: Option<u32>,
    /// Most pack jobs waiting to run; more are refused (429). Default: 16.
    #[arg(long)]
    jobs_queued_max: Option<u32>,
    /// Most job records kept; the oldest finished ones go first. Default: 64.
    #[arg(long)]
    job_records_max: Option<u32>,
    /// Threads compressing blocks in each pack job. Default: the number of CPUs.
    #[arg(long)]
    pack_threads: Option<u32>,
    /// Most raw bytes per second each pack job packs, so that packing leaves disk bandwidth to
    /// serving (suffixes K, M, G). Default: unlimited.
    #[arg(long, value_name = "BYTES_PER_S", value_parser = parse_byte_count)]
    pack_rate_max: Option<ByteCount>,
    /// Most bytes of page cache the daemon keeps registered (locked in memory) so that GPUs read
    /// shards straight from it; data beyond it is read through bounce buffers or cuFile. 0 turns
    /// the page-cache path off (suffixes K, M, G). Default: half the RAM (or of the memory
    /// cgroup's limit, where lower), within RLIMIT_MEMLOCK.
    #[arg(long, value_name = "BYTES", value_parser = parse_byte_count)]
    registered_memory_max: Option<ByteCount>,
    /// Size of one registered page-cache window (a multiple of 4096, 64K to 4G; suffixes K, M, G).
    /// Default: 64M.
    #[arg(long, value_name = "BYTES", value_parser = parse_byte_count)]
    registered_window: Option<ByteCount>,
    /// When GPUs read rows of raw (uncompressed) blocks straight from registered page cache instead
    /// of staging whole blocks: `auto` (when a batch uses less than half a block, as shuffled orders
    /// do), `always` or `off`. Default: auto.
    #[arg(long, value_name = "auto|always|off")]
    zero_copy: Option<String>,
    /// Device memory each GPU stream in dataset order or a window shuffle may fill with whole shards
    /// copied ahead of need, when the whole dataset is registered page cache (suffixes K, M, G; 0
    /// turns the copies off). Default: 5G.
    #[arg(long, value_name = "BYTES", value_parser = parse_byte_count)]
    device_shard_memory: Option<ByteCount>,
    /// Device memory each served GPU keeps for whole datasets (the device-memory tier): a dataset
    /// stored raw whose shard files fit is kept in device memory once its first stream has read
    /// it, and every later stream and epoch on that GPU, from any process, gathers its rows there
    /// instead of across PCIe. Least recently used datasets make room; the HTTP API pins and
    /// evicts (suffixes K, M, G; 0 turns it off). Default: 0, off: the training processes on the
    /// GPU need its memory, and only you know how much they leave.
    #[arg(long, value_name = "BYTES", value_parser = parse_byte_count)]
    device_cache: Option<ByteCount>,
    /// Host memory, for all served GPUs together (split evenly), that datasets with compressed
    /// blocks may take decoded when device memory (--device-cache, --device-shard-memory) does not
    /// take them: such a dataset is decoded once on the GPU into page-locked host memory, shared by
    /// the streams of the GPU reading it, and served in every order at the PCIe link's rate
    /// instead of being read and decoded round by round (suffixes K, M, G; 0: none). Default: a
    /// quarter of the host's RAM (or of the daemon's memory cgroup), within RLIMIT_MEMLOCK.
    #[arg(long, value_name = "BYTES", value_parser = parse_byte_count)]
    host_decoded_memory: Option<ByteCount>,
    /// Threads per GPU stream that copy page cache through pinned buffers when a dataset is larger
    /// than the registration budget (0 to 16; about a host core each while it copies). In dataset
    /// order and a window shuffle they copy whole shards instead of registering each window for its
    /// copy (0: registering, about one host core; threads move more on a host with cores to spare);
    /// in a full shuffle they copy the rows of unregistered windows (0 there: 8, at most half the
    /// CPUs). Default: 0. Figures: docs/benchmarks/README.md.
    #[arg(long, value_name = "N")]
    loader_copy_threads: Option<u32>,
    /// Rounds a GPU stream queues on the device at once (2 to 8); a consumer needs at least one slot
    /// more (prefetch) for the extra rounds to matter. Default: 3.
    #[arg(long, value_name = "N")]
    rounds_in_flight: Option<u32>,
    /// Microseconds a GPU stream's filler polls a round for completion before it sleeps until the
    /// driver wakes it (0 to 1000): batches are handed on sooner, for a host core. Default: 0.
    #[arg(long, value_name = "MICROSECONDS")]
    filler_spin_us: Option<u32>,
    /// Largest output of one gather piece made of consecutive rows, in KiB (4 to 1024; never less
    /// than one row): smaller pieces spread a batch read in dataset order over more thread blocks.
    /// Default: 16.
    #[arg(long, value_name = "KIB")]
    gather_piece_kib: Option<u32>,
    /// Gather launches a round read in place may take with its piece table in the launches'
    /// parameters instead of in pinned host memory (0 to 8; 0: never; needs a CUDA 12.1 driver).
    /// Default: 2.
    #[arg(long, value_name = "N")]
    inline_gather_tables: Option<u32>,
    /// Most consecutive small batches of a resident GPU stream one round gathers into their slots,
    /// within 4 MiB of output (1 to 16; 1: a round per batch). Default: 16.
    #[arg(long, value_name = "N")]
    batch_group_max: Option<u32>,
    /// Threads per GPU stream planning the rows of the next batches ahead of the filler when the
    /// dataset is read in place (0 to 32; 0: 12 or the CPU count, the fewer). Default: 0.
    #[arg(long, value_name = "N")]
    plan_threads: Option<u32>,
    /// Seconds device memory kept between a device's streams (shard slots, block caches, region
    /// tables) may stay idle before it is freed (1 to 86400). Default: 30.
    #[arg(long, value_name = "SECONDS")]
    device_pool_idle_s: Option<u32>,
    /// Whether a GPU stream's threads keep off the CPUs that service the device's interrupts, when
    /// other CPUs are allowed to them: on or off. Default: on.
    #[arg(long, value_name = "on|off", value_parser = parse_switch)]
    avoid_irq_cpus: Option<Switch>,
    /// Directory of the compiled-kernel cache. Default: $XDG_CACHE_HOME/gpufeed/kernels, else
    /// ~/.cache/gpufeed/kernels (no disk cache when neither HOME nor XDG_CACHE_HOME is set).
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// A dataset in object storage to serve, as NAME=URL (s3://bucket/prefix, gs://bucket/prefix,
    /// az://container/prefix, file:///dir); repeatable. Its manifest and shard metadata are read at
    /// start (the start fails naming the URL if they cannot be); its shards are fetched into the
    /// object cache when a stream needs them. Credentials come from the environment (AWS_*,
    /// GOOGLE_*, AZURE_*).
    #[arg(long = "dataset", value_name = "NAME=URL")]
    datasets: Vec<String>,
    /// Directory of the node-local cache of shards fetched from object storage. Default:
    /// DATA_ROOT/.object-cache.
    #[arg(long, value_name = "DIR")]
    object_cache_dir: Option<PathBuf>,
    /// Most bytes of shard files the object cache keeps (least recently used evicted first; never
    /// a shard an open stream reads). Default: 64G.
    #[arg(long, value_name = "BYTES", value_parser = parse_byte_count)]
    object_cache_max: Option<ByteCount>,
    /// Most control API connections served at once (further ones wait to be accepted), so that idle
    /// clients cannot take the descriptors consumers need; never more than a quarter of the open
    /// descriptor limit. Default: 256.
    #[arg(long, value_name = "N")]
    http_connections_max: Option<u32>,
    /// Seconds a control API connection may take to send a request's headers, or its body, and may
    /// stay idle between requests, before the daemon closes it (1 to 86400). Default: 30.
    #[arg(long = "http-idle-timeout", value_name = "SECONDS")]
    http_idle_timeout_s: Option<u32>,
}

fn parse_byte_count(text: &str) -> Result<ByteCount, String> {
    gpufeed::config::parse_byte_count(text).map(ByteCount)
}

fn parse_switch(text: &str) -> Result<Switch, String> {
    text.parse()
}

/// The form of the daemon's log lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    /// Human-readable lines (coloured on a terminal).
    Text,
    /// One JSON object per line: timestamp, level, target and the event's fields.
    Json,
}

/// The environment variable choosing the log format when `--log-format` is not given.
const LOG_FORMAT_ENV_VAR: &str = "GPUFEED_LOG_FORMAT";

#[derive(Clone, Copy, ValueEnum)]
enum CodecArg {
    Auto,
    Lz4,
    Raw,
}

#[derive(Clone, Copy, ValueEnum)]
enum TokenDtypeArg {
    U16,
    U32,
}

impl TokenDtypeArg {
    fn dtype(self) -> DType {
        match self {
            TokenDtypeArg::U16 => DType::U16,
            TokenDtypeArg::U32 => DType::U32,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum ShuffleArg {
    Auto,
    On,
    Off,
}

/// Parses a byte count that must fit in 32 bits.
fn parse_bytes(text: &str) -> Result<u32, String> {
    u32::try_from(gpufeed::config::parse_byte_count(text)?)
        .map_err(|_| format!("{text:?} is too large"))
}

/// Runs the command. A reader that closed the pipe on our output (`gpufeed inspect | head`) ends the
/// command quietly with status 0, as the output simply stops where the reader stopped wanting it:
/// `print_stdout` handles that where this file prints, and [`quiet_on_broken_pipe`] catches the
/// panic of a `println!` or `eprintln!` elsewhere (the demo's report). `serve` is left out: a daemon
/// must not stop, let alone report success, because its start-up line could not be printed.
fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = if matches!(cli.command, Command::Serve(_)) {
        run(cli.command)
    } else {
        match quiet_on_broken_pipe(|| run(cli.command)) {
            Some(outcome) => outcome,
            None => return ExitCode::SUCCESS,
        }
    };
    match outcome {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {}", gpufeed::error_chain(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// Runs `command`; returns `None` if it panicked because standard output or standard error was a
/// pipe whose reader had gone (the panic of `println!` and `eprintln!` on EPIPE), and lets every
/// other panic through with its usual message. Destructors run while unwinding, so the demo's
/// daemon and temporary directory are still cleaned up.
fn quiet_on_broken_pipe<T>(command: impl FnOnce() -> T) -> Option<T> {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !is_broken_pipe_panic(info.payload()) {
            default_hook(info);
        }
    }));
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(command)) {
        Ok(value) => Some(value),
        Err(payload) if is_broken_pipe_panic(payload.as_ref()) => None,
        Err(payload) => std::panic::resume_unwind(payload),
    }
}

/// Whether a panic payload is the standard library's "failed printing to stdout/stderr" for a
/// closed pipe (the message of `print!` and `eprint!` when the write fails).
fn is_broken_pipe_panic(payload: &(dyn std::any::Any + Send)) -> bool {
    let message = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied());
    message.is_some_and(|m| {
        m.starts_with("failed printing to std")
            && m.contains(&std::io::Error::from_raw_os_error(libc::EPIPE).to_string())
    })
}

/// Writes `text` and a newline to standard output. A reader that went away (`gpufeed inspect | head`)
/// is not an error: the output simply ends, as with other Unix tools, instead of a panic.
fn print_stdout(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

fn run(command: Command) -> Result<ExitCode> {
    match command {
        Command::Pack(args) => run_pack(args),
        Command::Inspect { dir } => {
            let dataset = Dataset::open(&dir)?;
            let text = serde_json::to_string_pretty(&tools::inspect(&dataset))?;
            print_stdout(&text)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Verify { dir, quiet } => {
            let bar = Bar::new(quiet, "verify");
            let report = tools::verify(&dir, &bar)?;
            bar.finish();
            for problem in &report.problems {
                // Each starts with its kind: missing, unreadable or corrupt.
                eprintln!("{problem}");
            }
            print_stdout(&format!(
                "{}: {}/{} shards readable, {} blocks intact, {} problems",
                dir.display(),
                report.shards_ok,
                report.shards_total,
                report.blocks_ok,
                report.problems.len()
            ))?;
            Ok(if report.problems.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Unpack {
            dir,
            field,
            out,
            force,
            dtype,
            quiet,
        } => {
            let dataset = Dataset::open(&dir)?;
            let bar = Bar::new(quiet, "unpack");
            let bytes = tools::unpack_to(&dataset, &field, &out, dtype, on_existing(force), &bar)?;
            bar.finish();
            eprintln!("wrote {} ({bytes} bytes of data)", out.display());
            let variable = dataset
                .field_index(&field)
                .is_some_and(|i| dataset.manifest.fields[i].is_variable());
            if variable {
                eprintln!(
                    "wrote {} (its offsets)",
                    tools::offsets_path(&out).display()
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::ListInputs {
            files,
            seq_len,
            token_dtype,
        } => run_list_inputs(&files, seq_len, token_dtype.map(TokenDtypeArg::dtype)),
        Command::Serve(args) => run_serve(*args),
        Command::Consume(args) => Ok(consume::main_with(*args)),
        Command::Demo {
            dir,
            samples,
            device,
        } => {
            gpufeed::demo::run(&DemoOptions {
                dir,
                samples,
                device,
                gpufeed_binary: std::env::current_exe()
                    .context("finding the gpufeed executable (the demo starts it as the daemon)")?,
            })?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn run_pack(args: PackArgs) -> Result<ExitCode> {
    // Timed from before the inputs are opened: Parquet and Arrow inputs are decoded then.
    let started = Instant::now();
    let fields = if args.tokens.is_empty() {
        let fields = open_fields(
            &args.fields,
            &args.paths,
            &args.out,
            args.threads.unwrap_or_else(default_threads),
        )?;
        with_offsets(fields, &args.offsets)?
    } else {
        let dtype = args.token_dtype.map(TokenDtypeArg::dtype);
        let inputs = args
            .tokens
            .iter()
            .map(|path| input::tokens::open_tokens(path, dtype))
            .collect::<Result<Vec<_>, _>>()?;
        if args.documents {
            let field = input::tokens::documents_all(&inputs)?;
            eprintln!(
                "{} tokens from {} file(s) in {} documents",
                field.sample_count(),
                inputs.len(),
                field.samples()
            );
            vec![field]
        } else {
            let seq_len = args
                .seq_len
                .context("--tokens needs --seq-len (or --documents)")?;
            let cut = input::tokens::cut_all(&inputs, seq_len)?;
            eprintln!(
            "{} tokens from {} file(s) cut into {} sequences of {seq_len}; {} remainder tokens dropped",
            inputs.iter().map(|i| i.tokens).sum::<u64>(),
            inputs.len(),
            cut.sequences,
            cut.dropped_tokens
        );
            cut.fields
        }
    };
    let name = match args.name {
        Some(name) => name,
        None => args
            .out
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .context("--out has no final component to name the dataset after; pass --name")?,
    };
    let options = PackOptions {
        name,
        block_bytes: args.block_bytes,
        samples_per_shard: args.samples_per_shard,
        codec: match args.codec {
            CodecArg::Auto => CodecChoice::Auto,
            CodecArg::Lz4 => CodecChoice::Lz4,
            CodecArg::Raw => CodecChoice::Raw,
        },
        shuffle: match args.byte_shuffle {
            ShuffleArg::Auto => ShuffleChoice::Auto,
            ShuffleArg::On => ShuffleChoice::On,
            ShuffleArg::Off => ShuffleChoice::Off,
        },
        on_existing: on_existing(args.force),
        threads: args.threads.unwrap_or_else(default_threads),
    };
    let bar = Bar::new(args.quiet, "pack");
    // `--out s3://...`: packed into a local staging directory, then uploaded, manifest last.
    let url = args.out.to_string_lossy().into_owned();
    let staging = if gpufeed::remote::is_object_url(&url) {
        Some(
            tempfile::Builder::new()
                .prefix("gpufeed-pack-")
                .tempdir()
                .context("cannot create a staging directory for the upload")?,
        )
    } else {
        None
    };
    let out = match &staging {
        Some(dir) => dir.path().join(&options.name),
        None => args.out.clone(),
    };
    let summary = pack::pack(&out, &fields, &options, &bar)?;
    bar.finish();
    if staging.is_some() {
        let replace = if args.force {
            gpufeed::remote::Replace::Existing
        } else {
            gpufeed::remote::Replace::Never
        };
        let uploaded = gpufeed::remote::upload_dataset(&summary.dir, &url, replace)
            .with_context(|| format!("uploading {} to {url}", summary.dir.display()))?;
        eprintln!("uploaded {uploaded} bytes of shards and the manifest to {url}");
    }
    let seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "packed {} samples into {} shard(s) at {}: {} raw bytes stored in {} ({:.3}x) in {:.2} s ({:.2} GB/s)",
        summary.sample_count,
        summary.shard_count,
        summary.dir.display(),
        summary.raw_bytes,
        summary.stored_bytes,
        summary.raw_bytes as f64 / summary.stored_bytes.max(1) as f64,
        seconds,
        summary.raw_bytes as f64 / seconds / 1e9
    );
    Ok(ExitCode::SUCCESS)
}

fn run_list_inputs(
    files: &[PathBuf],
    seq_len: Option<u64>,
    token_dtype: Option<DType>,
) -> Result<ExitCode> {
    let mut failed = false;
    for path in files {
        if input::arrow::is_table_path(path) {
            match input::arrow::describe_table(path) {
                Ok(listing) => print_stdout(&listing.describe(path))?,
                Err(error) => {
                    eprintln!("error: {error}");
                    failed = true;
                }
            }
            continue;
        }
        let as_tokens = input::tokens::is_token_path(path)
            || (seq_len.is_some() && path.extension().is_some_and(|e| e == "npy"));
        if as_tokens {
            match input::tokens::open_tokens(path, token_dtype) {
                Ok(tokens) => print_stdout(&tokens.describe(seq_len))?,
                Err(error) => {
                    eprintln!("error: {error}");
                    failed = true;
                }
            }
            continue;
        }
        let listing = match tools::list_input(path) {
            Ok(listing) => listing,
            Err(error) => {
                eprintln!("error: {error}");
                failed = true;
                continue;
            }
        };
        let mut text = match listing.format {
            tools::InputFormat::Npy => format!("{}: NumPy .npy array", path.display()),
            tools::InputFormat::Safetensors => format!(
                "{}: safetensors, {} tensor(s)",
                path.display(),
                listing.arrays.len()
            ),
        };
        let name_width = listing
            .arrays
            .iter()
            .map(|a| a.name.as_deref().map_or(0, str::len))
            .max()
            .unwrap_or(0);
        let dtype_width = listing
            .arrays
            .iter()
            .map(|a| a.dtype.len())
            .max()
            .unwrap_or(0);
        for array in &listing.arrays {
            let shape: Vec<String> = array.shape.iter().map(u64::to_string).collect();
            let name = array.name.as_deref().unwrap_or("");
            let note = match (&array.problem, array.dtype_supported) {
                (_, false) => "  (gpufeed cannot pack this dtype)".to_string(),
                (Some(problem), true) => format!("  (gpufeed cannot pack this: {problem})"),
                (None, true) => String::new(),
            };
            let line = format!(
                "  {name:name_width$}  {:dtype_width$}  [{}]{note}",
                array.dtype,
                shape.join(", "),
            );
            text.push('\n');
            text.push_str(line.trim_end());
        }
        print_stdout(&text)?;
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// The log format `--log-format` asks for, else `GPUFEED_LOG_FORMAT`, else text.
fn log_format(flag: Option<LogFormat>) -> Result<LogFormat> {
    if let Some(format) = flag {
        return Ok(format);
    }
    match std::env::var(LOG_FORMAT_ENV_VAR) {
        Ok(text) if !text.is_empty() => LogFormat::from_str(&text, true)
            .map_err(|_| anyhow::anyhow!("{LOG_FORMAT_ENV_VAR}={text:?}: expected text or json")),
        _ => Ok(LogFormat::Text),
    }
}

/// Sends the daemon's log to standard error in `format`, filtered by `GPUFEED_LOG` (default `info`).
fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPUFEED_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        // No colour in JSON: escape codes would end up inside the collected strings.
        LogFormat::Json => builder.json().with_ansi(false).init(),
        // Colour only for a terminal, and never with NO_COLOR set (https://no-color.org): a log
        // file or a journal gets plain text.
        LogFormat::Text => builder
            .with_ansi(
                std::io::IsTerminal::is_terminal(&std::io::stderr())
                    && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
            )
            .init(),
    }
}

fn run_serve(args: ServeArgs) -> Result<ExitCode> {
    init_logging(log_format(args.log_format)?);
    let flags = ConfigLayer {
        data_root: args.data_root,
        socket: args.socket,
        device: args.device,
        engine: args.engine,
        allow_uids: (!args.allow_uids.is_empty()).then_some(args.allow_uids),
        sessions_max: args.sessions_max,
        slot_memory_max: args.slot_memory_max,
        http: args.http,
        api_token: args.api_token,
        body_limit: args.body_limit,
        jobs_max: args.jobs_max,
        jobs_queued_max: args.jobs_queued_max,
        job_records_max: args.job_records_max,
        pack_threads: args.pack_threads,
        pack_rate_max: args.pack_rate_max,
        registered_memory_max: args.registered_memory_max,
        registered_window: args.registered_window,
        zero_copy: args.zero_copy,
        device_shard_memory: args.device_shard_memory,
        device_cache: args.device_cache,
        host_decoded_memory: args.host_decoded_memory,
        loader_copy_threads: args.loader_copy_threads,
        http_connections_max: args.http_connections_max,
        http_idle_timeout_s: args.http_idle_timeout_s,
        rounds_in_flight: args.rounds_in_flight,
        filler_spin_us: args.filler_spin_us,
        gather_piece_kib: args.gather_piece_kib,
        inline_gather_tables: args.inline_gather_tables,
        batch_group_max: args.batch_group_max,
        plan_threads: args.plan_threads,
        device_pool_idle_s: args.device_pool_idle_s,
        avoid_irq_cpus: args.avoid_irq_cpus,
        cache_dir: args.cache_dir,
        object_cache_dir: args.object_cache_dir,
        object_cache_max: args.object_cache_max,
        datasets: (!args.datasets.is_empty()).then_some(args.datasets),
    };
    let environment = ConfigLayer::from_env(|key| std::env::var(key).ok())?;
    let config_file = args.config.or_else(|| {
        std::env::var_os(gpufeed::config::CONFIG_FILE_ENV_VAR)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    });
    let file = match &config_file {
        Some(path) => read_config_file(path)?,
        None => ConfigLayer::default(),
    };
    let settings = flags
        .over(environment.over(file))
        .resolve(nix::unistd::getuid().as_raw())?;
    gpufeed::daemon::run(settings)?;
    Ok(ExitCode::SUCCESS)
}

/// Bytes a configuration file may hold: a few dozen settings fit in a few KiB.
const CONFIG_FILE_BYTES_MAX: u64 = 1 << 20;

/// Reads the configuration file at `path`: only a regular file (a FIFO would block the start until
/// a writer came, and `/dev/zero` would be read forever), of at most [`CONFIG_FILE_BYTES_MAX`].
fn read_config_file(path: &Path) -> Result<ConfigLayer> {
    use std::io::Read;
    let file = gpufeed::format::open_regular(path)
        .with_context(|| format!("configuration file {}", path.display()))?;
    let mut text = String::new();
    file.take(CONFIG_FILE_BYTES_MAX + 1)
        .read_to_string(&mut text)
        .with_context(|| format!("reading configuration file {}", path.display()))?;
    if text.len() as u64 > CONFIG_FILE_BYTES_MAX {
        anyhow::bail!(
            "configuration file {}: larger than {CONFIG_FILE_BYTES_MAX} bytes: refusing to read it",
            path.display()
        );
    }
    Ok(ConfigLayer::from_toml_str(path, &text)?)
}

/// The policy a `--force` flag asks for.
fn on_existing(force: bool) -> OnExisting {
    if force {
        OnExisting::Replace
    } else {
        OnExisting::Refuse
    }
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Makes the fields `--offsets NAME=FILE.npy` names variable-length, their values the rows of the
/// field and their offsets the file's (see `PackArgs::offsets`).
fn with_offsets(mut fields: Vec<FieldSource>, offsets: &[String]) -> Result<Vec<FieldSource>> {
    for arg in offsets {
        let Some((name, file)) = arg.split_once('=') else {
            bail!("--offsets {arg:?}: expected NAME=FILE.npy");
        };
        let Some(at) = fields.iter().position(|f| f.name == name) else {
            bail!("--offsets {arg:?}: no field '{name}' to make variable-length (give it with --field)");
        };
        let table = input::open_npy_field("offsets", &[PathBuf::from(file)])?;
        if !table.sample_shape.is_empty() || !matches!(table.dtype, DType::I64 | DType::U64) {
            bail!(
                "--offsets {arg:?}: offsets are a 1-D int64 or uint64 array, not {}{:?}",
                table.dtype.name(),
                table.sample_shape
            );
        }
        let mut bytes = Vec::new();
        table.copy_samples(0, table.sample_count(), &mut bytes)?;
        let offsets: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect();
        match offsets.first() {
            Some(0) => {}
            Some(first) => bail!("--offsets {arg:?}: the first offset is {first}, not 0"),
            None => bail!("--offsets {arg:?}: no offsets (one more than the samples, from 0)"),
        }
        if table.dtype == DType::I64 && offsets.iter().any(|&o| (o as i64) < 0) {
            bail!("--offsets {arg:?}: a negative offset");
        }
        let values = fields.remove(at);
        let field = FieldSource::variable(values, offsets[1..].to_vec())
            .map_err(|error| anyhow::anyhow!("--offsets {arg:?}: {error}"))?;
        fields.insert(at, field);
    }
    Ok(fields)
}

/// Turns `--field` arguments and positional paths into field sources, in the order given.
fn open_fields(
    field_args: &[String],
    paths: &[PathBuf],
    out: &Path,
    threads: usize,
) -> Result<Vec<FieldSource>> {
    // Parquet and Arrow IPC inputs are decoded into scratch files, in memory when they fit an
    // eighth of the available memory, otherwise beside the output (the disk that receives the
    // dataset), unlinked from the start.
    let scratch = match out.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let tables = paths
        .iter()
        .filter(|p| input::arrow::is_table_path(p))
        .count();
    let table_fields = field_args.iter().any(|arg| {
        arg.split_once('=').is_some_and(|(_, spec)| {
            spec.rsplit_once(':')
                .is_some_and(|(file, _)| input::arrow::is_table_path(Path::new(file)))
                || input::arrow::is_table_path(Path::new(spec))
        })
    });
    if tables > 0 || table_fields {
        if tables != paths.len() || (tables > 0 && !field_args.is_empty()) {
            bail!(
                "Parquet/Arrow inputs are packed either whole (every column, files given as paths) \
                 or by --field NAME=FILE:COLUMN, and not mixed with .npy or safetensors inputs"
            );
        }
        if tables > 0 {
            return Ok(input::arrow::open_table_dataset(paths, scratch, threads)?);
        }
        let mut requests = Vec::new();
        for arg in field_args {
            let parsed = arg.split_once('=').and_then(|(name, spec)| {
                let (file, column) = spec.rsplit_once(':')?;
                input::arrow::is_table_path(Path::new(file)).then(|| input::arrow::ColumnRequest {
                    field: name.to_string(),
                    path: PathBuf::from(file),
                    column: column.to_string(),
                })
            });
            match parsed {
                Some(request) => requests.push(request),
                None => bail!(
                    "--field {arg:?}: with Parquet/Arrow inputs every --field is NAME=FILE:COLUMN \
                     (`gpufeed list-inputs FILE` lists the columns)"
                ),
            }
        }
        return Ok(input::arrow::open_table_fields(
            &requests, scratch, threads,
        )?);
    }
    let mut npy_fields: Vec<(String, Vec<PathBuf>)> = Vec::new();
    let mut order: Vec<(String, Option<(PathBuf, String)>)> = Vec::new();
    if !paths.is_empty() {
        npy_fields.push(("data".into(), paths.to_vec()));
        order.push(("data".into(), None));
    }
    for arg in field_args {
        let Some((name, spec)) = arg.split_once('=') else {
            bail!("--field {arg:?}: expected NAME=FILE.npy or NAME=FILE.safetensors:TENSOR");
        };
        if spec.ends_with(".safetensors") {
            bail!(missing_tensor(arg, name, Path::new(spec)));
        }
        if let Some((file, tensor)) = spec
            .rsplit_once(':')
            .filter(|(f, _)| f.ends_with(".safetensors"))
        {
            if order.iter().any(|(n, _)| n == name) {
                bail!("--field {arg:?}: field '{name}' is given twice");
            }
            order.push((name.into(), Some((PathBuf::from(file), tensor.into()))));
        } else if let Some((_, files)) = npy_fields.iter_mut().find(|(n, _)| n == name) {
            files.push(PathBuf::from(spec));
        } else {
            if order.iter().any(|(n, _)| n == name) {
                bail!("--field {arg:?}: field '{name}' is given twice");
            }
            npy_fields.push((name.into(), vec![PathBuf::from(spec)]));
            order.push((name.into(), None));
        }
    }
    if order.is_empty() {
        bail!("nothing to pack: give .npy paths or --field NAME=PATH");
    }
    order
        .into_iter()
        .map(|(name, safetensors)| match safetensors {
            Some((file, tensor)) => Ok(input::open_safetensors_field(&name, &file, &tensor)?),
            None => {
                let files = &npy_fields
                    .iter()
                    .find(|(n, _)| *n == name)
                    .expect("recorded")
                    .1;
                input::open_npy_field(&name, files).map_err(|error| match &error {
                    // A safetensors file given without `.safetensors` in its name: say so rather
                    // than only that it is no .npy file.
                    input::InputError::NotNpy { path }
                        if tools::list_input(path).is_ok_and(|listing| {
                            listing.format == tools::InputFormat::Safetensors
                        }) =>
                    {
                        anyhow::anyhow!(missing_tensor(
                            &format!("{name}={}", path.display()),
                            &name,
                            path
                        ))
                    }
                    _ => error.into(),
                })
            }
        })
        .collect()
}

/// Tensors named in the error for a safetensors `--field` without `:TENSOR`; `list-inputs` lists all.
const LISTED_TENSORS_MAX: usize = 20;

/// The error for `--field NAME=FILE` where FILE is a safetensors file and no tensor was named: what
/// is missing, and the tensors FILE holds.
fn missing_tensor(arg: &str, name: &str, file: &Path) -> String {
    let mut text = format!(
        "--field {arg:?}: a safetensors file holds many tensors; name the one to pack as \
         --field {name}={}:TENSOR",
        file.display()
    );
    match tools::list_input(file) {
        Ok(listing) => {
            let tensors: Vec<String> = listing
                .arrays
                .iter()
                .take(LISTED_TENSORS_MAX)
                .map(tools::InputArray::describe)
                .collect();
            text.push_str(&format!("; its tensors: {}", tensors.join(", ")));
            let omitted = listing.arrays.len().saturating_sub(LISTED_TENSORS_MAX);
            if omitted > 0 {
                text.push_str(&format!(
                    " and {omitted} more (gpufeed list-inputs {} lists them all)",
                    file.display()
                ));
            }
        }
        Err(error) => text.push_str(&format!("; its tensors could not be listed: {error}")),
    }
    text
}

/// A byte-count progress bar on stderr (hidden when stderr is not a terminal or with --quiet).
struct Bar(ProgressBar);

impl Bar {
    fn new(quiet: bool, label: &'static str) -> Bar {
        let bar = if quiet {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(0)
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        bar.set_prefix(label);
        Bar(bar)
    }

    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

impl PackObserver for Bar {
    fn started(&self, raw_bytes_total: u64) {
        self.0.set_length(raw_bytes_total);
    }
    fn progress(&self, raw_bytes_done: u64) {
        self.0.set_position(raw_bytes_done);
    }
}

impl ToolProgress for Bar {
    fn started(&self, total: u64) {
        self.0.set_length(total);
    }
    fn progress(&self, done: u64) {
        self.0.set_position(done);
    }
}
