//! The configuration of `gpufeed serve`: built-in defaults, a TOML file, `GPUFEED_*` environment
//! variables and command-line flags, each overriding the one before.
//!
//! Every source is read into a [`ConfigLayer`] whose keys are all optional; layers are stacked with
//! [`ConfigLayer::over`] and [`ConfigLayer::resolve`] turns the stack into checked [`Settings`]. The
//! TOML keys are the flag names with `_` for `-` (`slot_memory_max = "8G"`), and the environment
//! variables are the same names upper-cased behind `GPUFEED_` (`GPUFEED_SLOT_MEMORY_MAX=8G`); unknown
//! TOML keys are an error, so a misspelt key is never silently ignored.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::storage::{EngineMode, UnknownEngine};

/// Where the control API listens unless told otherwise.
pub const HTTP_ADDR_DEFAULT: &str = "127.0.0.1:7070";
/// Default largest request body of the control API (1 MiB): a pack request listing thousands of input
/// files fits; nothing the API accepts needs more.
pub const BODY_BYTES_MAX_DEFAULT: u64 = 1 << 20;
/// Default bound on the control API's open connections (well below the descriptors the daemon
/// keeps for consumers: see `--http-connections-max`).
pub const HTTP_CONNECTIONS_MAX_DEFAULT: u32 = 256;
/// Most connections `--http-connections-max` may allow.
pub const HTTP_CONNECTIONS_MAX_MAX: u32 = 16384;
/// Default time a control API connection may take to send a request's headers, and may stay idle
/// between requests, in seconds.
pub const HTTP_IDLE_TIMEOUT_S_DEFAULT: u64 = 30;
/// Longest `--http-idle-timeout`: a day; a longer one would be no bound on idle connections at all.
pub const HTTP_IDLE_TIMEOUT_S_MAX: u64 = 86_400;
/// Smallest body limit accepted: below this even an ordinary request would be refused.
pub const BODY_BYTES_MAX_MIN: u64 = 1 << 10;
/// Largest body limit accepted: the API never needs more, and every body is held in memory.
pub const BODY_BYTES_MAX_MAX: u64 = 64 << 20;
/// Default most concurrent consumer sessions.
pub const SESSIONS_MAX_DEFAULT: u32 = 64;
/// Default most bytes of slot memory over all streams (8 GiB), where a quarter of the memory the
/// daemon may use is more (see [`slot_memory_bytes_max_default`]).
pub const SLOT_MEMORY_BYTES_MAX_DEFAULT: u64 = 8 << 30;
/// Share of the memory the daemon may use (the RAM, or its memory cgroup's limit) that the default
/// slot memory may take at most.
pub const SLOT_MEMORY_SHARE_DEFAULT: u64 = 4;
/// Smallest slot memory bound accepted: one slot of the smallest stride, the least memory any
/// stream needs (a stream has at least one slot). Below it no stream could ever open.
pub const SLOT_MEMORY_BYTES_MAX_MIN: u64 = gpufeed_proto::protocol::SLOT_STRIDE_ALIGN_BYTES;
/// Default size of a registered page-cache window: registering one costs about 2 ms on the H100 box
/// (unregistering 0.6 ms): small enough that a stream beyond the budget, which registers each window
/// for its copy, queues copies in small steps (64 MiB windows streamed 20.6 GB/s there, 256 MiB ones
/// 17.5), large enough that a round's region table covers 256 GiB of shards.
pub const REGISTERED_WINDOW_BYTES_DEFAULT: u64 = 64 << 20;
/// Smallest window accepted (tests use small ones to exercise eviction on small datasets).
pub const REGISTERED_WINDOW_BYTES_MIN: u64 = 64 << 10;
/// Largest window accepted.
pub const REGISTERED_WINDOW_BYTES_MAX: u64 = 4 << 30;
/// Granularity of the derived registration budget.
pub const REGISTERED_BYTES_MAX_MIN: u64 = 256 << 20;
/// Share of the host's RAM (or cgroup limit) the default registration budget may lock (the rest
/// stays reclaimable).
pub const REGISTERED_RAM_SHARE_DEFAULT: f64 = 0.5;
/// Default most pack jobs running at once: packing is CPU- and disk-heavy and competes with serving.
pub const JOBS_RUNNING_MAX_DEFAULT: u32 = 2;
/// Default most pack jobs waiting for a running slot.
pub const JOBS_QUEUED_MAX_DEFAULT: u32 = 16;
/// Default most job records kept (finished ones beyond this are dropped, oldest first).
pub const JOB_RECORDS_MAX_DEFAULT: u32 = 64;
/// Largest `jobs_max`.
pub const JOBS_RUNNING_MAX_MAX: u32 = 64;
/// Largest `jobs_queued_max`.
pub const JOBS_QUEUED_MAX_MAX: u32 = 1024;
/// Largest `job_records_max`.
pub const JOB_RECORDS_MAX_MAX: u32 = 65_536;
/// Shortest API token accepted: shorter ones are guessable.
pub const API_TOKEN_BYTES_MIN: usize = 16;
/// Longest API token accepted.
pub const API_TOKEN_BYTES_MAX: usize = 1024;

// The GPU pipeline's settings. The pipeline keeps its own copies of some of these (its node defaults);
// a test in `daemon` checks that the two agree.

/// Default device memory each GPU stream in dataset order or a window shuffle may fill with whole
/// shards copied ahead of need: room for two windows of four shards of 512 MiB (the window being
/// served and the next) with their headers, 6 % of an 80 GiB GPU. With 4 GiB (seven such slots) the
/// next window's last shard could not be copied before its window began.
pub const DEVICE_SHARD_BYTES_DEFAULT: u64 = 5 << 30;
/// Default share of the memory the daemon may use (the host's RAM, or its memory cgroup's limit)
/// that datasets with compressed blocks may take decoded in page-locked host memory, for all served
/// GPUs together, when device memory does not take them: a quarter. Such a copy serves every order
/// at the link's rate where reading and decoding round by round serves a full shuffle at a
/// twentieth of it; the page cache keeps the rest (the registration budget is half).
pub const HOST_DECODED_RAM_SHARE_DEFAULT: u64 = 4;
/// Default threads per GPU stream copying shards through pinned buffers beyond the registration
/// budget: none. Copy threads move more than registering beyond the budget, but on several host
/// cores against one, and the host's cores belong to the training processes first.
pub const LOADER_COPY_THREADS_DEFAULT: u32 = 0;
/// Most `--loader-copy-threads`.
pub const LOADER_COPY_THREADS_MAX: u32 = 16;
/// Default rounds a GPU stream queues on the device at once.
pub const ROUNDS_IN_FLIGHT_DEFAULT: u32 = 3;
/// Fewest `--rounds-in-flight`: one round on the device while the next is queued.
pub const ROUNDS_IN_FLIGHT_MIN: u32 = 2;
/// Most `--rounds-in-flight` (each holds a staging buffer and tables).
pub const ROUNDS_IN_FLIGHT_MAX: u32 = 8;
/// Default `--filler-spin-us`: the filler sleeps at once until the device wakes it (polling costs a
/// host core).
pub const FILLER_SPIN_US_DEFAULT: u32 = 0;
/// Longest `--filler-spin-us` (1 ms).
pub const FILLER_SPIN_US_MAX: u32 = 1000;
/// Default largest output of a gather piece made of consecutive rows, in KiB: small enough that a
/// batch read in dataset order spreads over many thread blocks of the gather kernel.
pub const GATHER_PIECE_KIB_DEFAULT: u32 = 16;
/// Smallest `--gather-piece-kib`.
pub const GATHER_PIECE_KIB_MIN: u32 = 4;
/// Largest `--gather-piece-kib`.
pub const GATHER_PIECE_KIB_MAX: u32 = 1024;
/// Default gather launches a round read in place may take with its piece table in the launch
/// parameters: a dataset-order round of up to 8 MiB out in 16 KiB pieces.
pub const INLINE_GATHER_TABLES_DEFAULT: u32 = 2;
/// Most `--inline-gather-tables`.
pub const INLINE_GATHER_TABLES_MAX: u32 = 8;
/// Default and largest `--batch-group-max`: consecutive small batches one round gathers.
pub const BATCH_GROUP_MAX_DEFAULT: u32 = 16;
/// Largest `--batch-group-max`.
pub const BATCH_GROUP_MAX_MAX: u32 = 16;
/// Default `--plan-threads`: 0, chosen by the pipeline from the host's CPU count.
pub const PLAN_THREADS_AUTOMATIC: u32 = 0;
/// Most `--plan-threads`.
pub const PLAN_THREADS_MAX: u32 = 32;
/// Default seconds device memory kept between a device's streams may stay idle before it is freed.
pub const DEVICE_POOL_IDLE_S_DEFAULT: u32 = 30;
/// Longest `--device-pool-idle-s` (a day).
pub const DEVICE_POOL_IDLE_S_MAX: u32 = 86_400;

/// A configuration source could not be read or holds an invalid value.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The configuration file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The configuration file is not valid TOML of the expected shape.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the key.
        reason: String,
    },
    /// A value (from whichever source) is invalid.
    #[error("{key}: {reason}")]
    Invalid {
        /// The key, as a flag name (`--http`) or environment variable.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// A byte count written as an integer (`65536`) or with a binary suffix (`"64K"`, `"1M"`, `"8G"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteCount(pub u64);

impl<'de> Deserialize<'de> for ByteCount {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            // TOML integers are signed: a negative one is read, to be refused by name.
            Number(i64),
            Text(String),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Number(value) => u64::try_from(value)
                .map(ByteCount)
                .map_err(|_| serde::de::Error::custom(format!("{value} is negative"))),
            Raw::Text(text) => parse_byte_count(&text)
                .map(ByteCount)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// Parses a byte count such as `65536`, `64K`, `1M` or `8G` (binary multiples; `B` and `iB` allowed).
pub fn parse_byte_count(text: &str) -> Result<u64, String> {
    let trimmed = text.trim().trim_end_matches("iB").trim_end_matches('B');
    let (digits, multiplier) = match trimmed.chars().last() {
        Some('K' | 'k') => (&trimmed[..trimmed.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&trimmed[..trimmed.len() - 1], 1u64 << 20),
        Some('G' | 'g') => (&trimmed[..trimmed.len() - 1], 1u64 << 30),
        _ => (trimmed, 1),
    };
    let value = parse_whole::<u64>(digits).map_err(|fault| match fault {
        NumberFault::TooLarge => format!("{text:?} is too large"),
        NumberFault::Negative | NumberFault::NotANumber => {
            format!("{text:?} is not a byte count like 65536, 64K or 1M")
        }
    })?;
    value
        .checked_mul(multiplier)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// Why a text is not a whole number of the type asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NumberFault {
    /// Digits, but more than the type holds.
    TooLarge,
    /// A minus sign before digits.
    Negative,
    /// Not digits at all.
    NotANumber,
}

/// Parses a whole number, telling a number too large for `T` (or negative) from one that is no
/// number at all: `99999999999` for a 32-bit setting is too large, not "not a whole number".
fn parse_whole<T: std::str::FromStr<Err = std::num::ParseIntError>>(
    text: &str,
) -> Result<T, NumberFault> {
    let text = text.trim();
    text.parse::<T>().map_err(|error| match error.kind() {
        std::num::IntErrorKind::PosOverflow => NumberFault::TooLarge,
        _ if text.strip_prefix('-').is_some_and(|digits| {
            !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
        }) =>
        {
            NumberFault::Negative
        }
        _ => NumberFault::NotANumber,
    })
}

/// What is wrong with `text`, which is not a whole number for the reason `fault`.
fn number_message(text: &str, fault: NumberFault) -> String {
    match fault {
        NumberFault::TooLarge => format!("{text:?} is too large"),
        NumberFault::Negative => format!("{text:?} is negative"),
        NumberFault::NotANumber => format!("{text:?} is not a whole number"),
    }
}

/// Reads an optional TOML integer into a `u32`, saying whether a value that does not fit is too
/// large or negative (serde's own message names the Rust type).
fn toml_whole_number<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u32>, D::Error> {
    let value = i64::deserialize(deserializer)?;
    u32::try_from(value).map(Some).map_err(|_| {
        serde::de::Error::custom(if value < 0 {
            format!("{value} is negative")
        } else {
            format!("{value} is too large (at most {})", u32::MAX)
        })
    })
}

/// `on` or `off`, written as `on`/`off`, `1`/`0`, `true`/`false` or `yes`/`no` (a TOML boolean too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Switch(pub bool);

impl std::str::FromStr for Switch {
    type Err = String;

    fn from_str(text: &str) -> Result<Switch, String> {
        match text.trim() {
            "on" | "1" | "true" | "yes" => Ok(Switch(true)),
            "off" | "0" | "false" | "no" => Ok(Switch(false)),
            other => Err(format!("{other:?} is not on or off")),
        }
    }
}

impl<'de> Deserialize<'de> for Switch {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bool(bool),
            Text(String),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Bool(on) => Ok(Switch(on)),
            Raw::Text(text) => text.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// The settings one source gives; every key is optional. Field names are the TOML keys.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ConfigLayer {
    /// Directory whose subdirectories are datasets; also holds the catalog.
    pub data_root: Option<PathBuf>,
    /// The consumers' Unix socket.
    pub socket: Option<PathBuf>,
    /// `auto`, `cpu` or `cuda:N`.
    pub device: Option<String>,
    /// `auto`, `cufile` or `uring`.
    pub engine: Option<String>,
    /// Uids allowed on the socket.
    pub allow_uids: Option<Vec<u32>>,
    /// Most concurrent consumer sessions.
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub sessions_max: Option<u32>,
    /// Most bytes of slot memory over all streams.
    pub slot_memory_max: Option<ByteCount>,
    /// The control API's address (`IP:PORT`, port 0 for any free port) or `off`.
    pub http: Option<String>,
    /// Bearer token for the control API.
    pub api_token: Option<String>,
    /// Largest request body of the control API.
    pub body_limit: Option<ByteCount>,
    /// Most pack jobs running at once.
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub jobs_max: Option<u32>,
    /// Most pack jobs waiting to run.
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub jobs_queued_max: Option<u32>,
    /// Most job records kept.
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub job_records_max: Option<u32>,
    /// Threads compressing blocks in each pack job.
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub pack_threads: Option<u32>,
    /// Most raw bytes per second each pack job packs (unlimited when absent).
    pub pack_rate_max: Option<ByteCount>,
    /// Most bytes of page cache registered (locked) for device access at once, per node; `0` turns
    /// the page-cache path off. Default: see [`registered_bytes_max_default`].
    pub registered_memory_max: Option<ByteCount>,
    /// Most open control API connections.
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub http_connections_max: Option<u32>,
    /// Seconds a control API connection may take to send a request's headers or stay idle.
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub http_idle_timeout_s: Option<u32>,
    /// Size of one registered page-cache window (a multiple of 4096).
    pub registered_window: Option<ByteCount>,
    /// `auto`, `always` or `off`: when GPUs read rows of raw blocks straight from registered page
    /// cache instead of staging whole blocks.
    pub zero_copy: Option<String>,
    /// Device memory each GPU stream in dataset order or a window shuffle may fill with whole
    /// shards copied ahead of need; `0` turns the copies off. Default: [`DEVICE_SHARD_BYTES_DEFAULT`].
    pub device_shard_memory: Option<ByteCount>,
    /// Device memory each served GPU keeps for whole datasets read by every stream and epoch (the
    /// device-memory tier); `0` turns it off. Default: 0 (the training processes need that memory).
    pub device_cache: Option<ByteCount>,
    /// Host memory, for all served GPUs together (split evenly), that datasets with compressed
    /// blocks may take decoded when device memory does not take them; `0`: none. Default: a
    /// quarter of the memory the daemon may use ([`HOST_DECODED_RAM_SHARE_DEFAULT`]), within the
    /// locked-memory limit.
    pub host_decoded_memory: Option<ByteCount>,
    /// Threads per GPU stream copying shards through pinned buffers beyond the registration
    /// budget (0: windows registered for their copy). Default: [`LOADER_COPY_THREADS_DEFAULT`].
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub loader_copy_threads: Option<u32>,
    /// Rounds a GPU stream queues on the device at once.
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub rounds_in_flight: Option<u32>,
    /// Microseconds a GPU stream's filler polls a round for completion before it sleeps.
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub filler_spin_us: Option<u32>,
    /// Largest output of a gather piece made of consecutive rows, in KiB.
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub gather_piece_kib: Option<u32>,
    /// Gather launches a round read in place may take with its piece table in the launch
    /// parameters (0: never).
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub inline_gather_tables: Option<u32>,
    /// Most consecutive small batches of a resident stream one round gathers.
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub batch_group_max: Option<u32>,
    /// Threads per GPU stream planning rows ahead of the filler (0: chosen from the CPU count).
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub plan_threads: Option<u32>,
    /// Seconds device memory kept between a device's streams may stay idle before it is freed.
    #[serde(default, deserialize_with = "toml_whole_number")]
    pub device_pool_idle_s: Option<u32>,
    /// Whether GPU streams' threads keep off the CPUs that service their device's interrupts.
    pub avoid_irq_cpus: Option<Switch>,
    /// Directory of the compiled-kernel cache.
    pub cache_dir: Option<PathBuf>,
    /// Directory of the cache of shards fetched from object storage.
    pub object_cache_dir: Option<PathBuf>,
    /// Most bytes of shard files that cache keeps.
    pub object_cache_max: Option<ByteCount>,
    /// Datasets in object storage registered at start, each `NAME=URL`.
    pub datasets: Option<Vec<String>>,
}

/// The environment variable of each key.
pub const ENV_VARS: [&str; 36] = [
    "GPUFEED_DATA_ROOT",
    "GPUFEED_SOCKET",
    "GPUFEED_DEVICE",
    "GPUFEED_ENGINE",
    "GPUFEED_ALLOW_UIDS",
    "GPUFEED_SESSIONS_MAX",
    "GPUFEED_SLOT_MEMORY_MAX",
    "GPUFEED_HTTP",
    "GPUFEED_API_TOKEN",
    "GPUFEED_BODY_LIMIT",
    "GPUFEED_JOBS_MAX",
    "GPUFEED_JOBS_QUEUED_MAX",
    "GPUFEED_JOB_RECORDS_MAX",
    "GPUFEED_PACK_THREADS",
    "GPUFEED_PACK_RATE_MAX",
    "GPUFEED_REGISTERED_MEMORY_MAX",
    "GPUFEED_REGISTERED_WINDOW",
    "GPUFEED_ZERO_COPY",
    "GPUFEED_DEVICE_SHARD_MEMORY",
    "GPUFEED_DEVICE_CACHE",
    "GPUFEED_HOST_DECODED_MEMORY",
    "GPUFEED_HTTP_CONNECTIONS_MAX",
    "GPUFEED_HTTP_IDLE_TIMEOUT_S",
    "GPUFEED_LOADER_COPY_THREADS",
    "GPUFEED_ROUNDS_IN_FLIGHT",
    "GPUFEED_FILLER_SPIN_US",
    "GPUFEED_GATHER_PIECE_KIB",
    "GPUFEED_INLINE_GATHER_TABLES",
    "GPUFEED_BATCH_GROUP_MAX",
    "GPUFEED_PLAN_THREADS",
    "GPUFEED_DEVICE_POOL_IDLE_S",
    "GPUFEED_AVOID_IRQ_CPUS",
    "GPUFEED_CACHE_DIR",
    "GPUFEED_OBJECT_CACHE_DIR",
    "GPUFEED_OBJECT_CACHE_MAX",
    "GPUFEED_DATASETS",
];

/// The environment variable naming the configuration file.
pub const CONFIG_FILE_ENV_VAR: &str = "GPUFEED_CONFIG";

impl ConfigLayer {
    /// Reads a TOML configuration file.
    pub fn from_toml_file(path: &Path) -> Result<ConfigLayer, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        ConfigLayer::from_toml_str(path, &text)
    }

    /// Parses TOML text; `path` names it in errors.
    pub fn from_toml_str(path: &Path, text: &str) -> Result<ConfigLayer, ConfigError> {
        toml::from_str(text).map_err(|error| ConfigError::File {
            path: path.to_path_buf(),
            reason: error.to_string().trim_end().to_string(),
        })
    }

    /// Reads the `GPUFEED_*` variables through `lookup` (the process environment in the daemon, a map
    /// in tests). An empty variable counts as unset.
    pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> Result<ConfigLayer, ConfigError> {
        let get = |key: &str| lookup(key).filter(|value| !value.is_empty());
        let number = |key: &str| -> Result<Option<u32>, ConfigError> {
            get(key)
                .map(|text| {
                    parse_whole::<u32>(&text)
                        .map_err(|fault| invalid(key, number_message(&text, fault)))
                })
                .transpose()
        };
        let bytes = |key: &str| -> Result<Option<ByteCount>, ConfigError> {
            get(key)
                .map(|text| {
                    parse_byte_count(&text)
                        .map(ByteCount)
                        .map_err(|r| invalid(key, r))
                })
                .transpose()
        };
        let allow_uids = get("GPUFEED_ALLOW_UIDS")
            .map(|text| {
                text.split(',')
                    .map(|uid| {
                        parse_whole::<u32>(uid).map_err(|fault| {
                            invalid(
                                "GPUFEED_ALLOW_UIDS",
                                match fault {
                                    NumberFault::TooLarge => {
                                        format!("{uid:?} is too large for a uid")
                                    }
                                    _ => format!(
                                        "{uid:?} is not a uid (expected a comma-separated list)"
                                    ),
                                },
                            )
                        })
                    })
                    .collect::<Result<Vec<u32>, ConfigError>>()
            })
            .transpose()?;
        Ok(ConfigLayer {
            data_root: get("GPUFEED_DATA_ROOT").map(PathBuf::from),
            socket: get("GPUFEED_SOCKET").map(PathBuf::from),
            device: get("GPUFEED_DEVICE"),
            engine: get("GPUFEED_ENGINE"),
            allow_uids,
            sessions_max: number("GPUFEED_SESSIONS_MAX")?,
            slot_memory_max: bytes("GPUFEED_SLOT_MEMORY_MAX")?,
            http: get("GPUFEED_HTTP"),
            api_token: get("GPUFEED_API_TOKEN"),
            body_limit: bytes("GPUFEED_BODY_LIMIT")?,
            jobs_max: number("GPUFEED_JOBS_MAX")?,
            jobs_queued_max: number("GPUFEED_JOBS_QUEUED_MAX")?,
            job_records_max: number("GPUFEED_JOB_RECORDS_MAX")?,
            pack_threads: number("GPUFEED_PACK_THREADS")?,
            pack_rate_max: bytes("GPUFEED_PACK_RATE_MAX")?,
            registered_memory_max: bytes("GPUFEED_REGISTERED_MEMORY_MAX")?,
            registered_window: bytes("GPUFEED_REGISTERED_WINDOW")?,
            zero_copy: get("GPUFEED_ZERO_COPY"),
            device_shard_memory: bytes("GPUFEED_DEVICE_SHARD_MEMORY")?,
            device_cache: bytes("GPUFEED_DEVICE_CACHE")?,
            host_decoded_memory: bytes("GPUFEED_HOST_DECODED_MEMORY")?,
            http_connections_max: number("GPUFEED_HTTP_CONNECTIONS_MAX")?,
            http_idle_timeout_s: number("GPUFEED_HTTP_IDLE_TIMEOUT_S")?,
            loader_copy_threads: number("GPUFEED_LOADER_COPY_THREADS")?,
            rounds_in_flight: number("GPUFEED_ROUNDS_IN_FLIGHT")?,
            filler_spin_us: number("GPUFEED_FILLER_SPIN_US")?,
            gather_piece_kib: number("GPUFEED_GATHER_PIECE_KIB")?,
            inline_gather_tables: number("GPUFEED_INLINE_GATHER_TABLES")?,
            batch_group_max: number("GPUFEED_BATCH_GROUP_MAX")?,
            plan_threads: number("GPUFEED_PLAN_THREADS")?,
            device_pool_idle_s: number("GPUFEED_DEVICE_POOL_IDLE_S")?,
            avoid_irq_cpus: get("GPUFEED_AVOID_IRQ_CPUS")
                .map(|text| {
                    text.parse::<Switch>()
                        .map_err(|reason| invalid("GPUFEED_AVOID_IRQ_CPUS", reason))
                })
                .transpose()?,
            cache_dir: get("GPUFEED_CACHE_DIR").map(PathBuf::from),
            object_cache_dir: get("GPUFEED_OBJECT_CACHE_DIR").map(PathBuf::from),
            object_cache_max: bytes("GPUFEED_OBJECT_CACHE_MAX")?,
            datasets: get("GPUFEED_DATASETS").map(|text| {
                text.split(',')
                    .map(|entry| entry.trim().to_string())
                    .collect()
            }),
        })
    }

    /// This layer with every key it leaves unset taken from `lower`.
    pub fn over(self, lower: ConfigLayer) -> ConfigLayer {
        ConfigLayer {
            data_root: self.data_root.or(lower.data_root),
            socket: self.socket.or(lower.socket),
            device: self.device.or(lower.device),
            engine: self.engine.or(lower.engine),
            allow_uids: self.allow_uids.or(lower.allow_uids),
            sessions_max: self.sessions_max.or(lower.sessions_max),
            slot_memory_max: self.slot_memory_max.or(lower.slot_memory_max),
            http: self.http.or(lower.http),
            api_token: self.api_token.or(lower.api_token),
            body_limit: self.body_limit.or(lower.body_limit),
            jobs_max: self.jobs_max.or(lower.jobs_max),
            jobs_queued_max: self.jobs_queued_max.or(lower.jobs_queued_max),
            job_records_max: self.job_records_max.or(lower.job_records_max),
            pack_threads: self.pack_threads.or(lower.pack_threads),
            pack_rate_max: self.pack_rate_max.or(lower.pack_rate_max),
            registered_memory_max: self.registered_memory_max.or(lower.registered_memory_max),
            registered_window: self.registered_window.or(lower.registered_window),
            zero_copy: self.zero_copy.or(lower.zero_copy),
            device_shard_memory: self.device_shard_memory.or(lower.device_shard_memory),
            device_cache: self.device_cache.or(lower.device_cache),
            host_decoded_memory: self.host_decoded_memory.or(lower.host_decoded_memory),
            http_connections_max: self.http_connections_max.or(lower.http_connections_max),
            http_idle_timeout_s: self.http_idle_timeout_s.or(lower.http_idle_timeout_s),
            loader_copy_threads: self.loader_copy_threads.or(lower.loader_copy_threads),
            rounds_in_flight: self.rounds_in_flight.or(lower.rounds_in_flight),
            filler_spin_us: self.filler_spin_us.or(lower.filler_spin_us),
            gather_piece_kib: self.gather_piece_kib.or(lower.gather_piece_kib),
            inline_gather_tables: self.inline_gather_tables.or(lower.inline_gather_tables),
            batch_group_max: self.batch_group_max.or(lower.batch_group_max),
            plan_threads: self.plan_threads.or(lower.plan_threads),
            device_pool_idle_s: self.device_pool_idle_s.or(lower.device_pool_idle_s),
            avoid_irq_cpus: self.avoid_irq_cpus.or(lower.avoid_irq_cpus),
            cache_dir: self.cache_dir.or(lower.cache_dir),
            object_cache_dir: self.object_cache_dir.or(lower.object_cache_dir),
            object_cache_max: self.object_cache_max.or(lower.object_cache_max),
            datasets: self.datasets.or(lower.datasets),
        }
    }

    /// The control API's connection limit and header/idle timeout.
    fn resolve_http_connections(&self) -> Result<HttpConnections, ConfigError> {
        let connections_max = self
            .http_connections_max
            .unwrap_or(HTTP_CONNECTIONS_MAX_DEFAULT);
        if !(1..=HTTP_CONNECTIONS_MAX_MAX).contains(&connections_max) {
            return Err(invalid(
                "--http-connections-max",
                format!("must be in 1..={HTTP_CONNECTIONS_MAX_MAX}"),
            ));
        }
        let idle_timeout_s = self
            .http_idle_timeout_s
            .map_or(HTTP_IDLE_TIMEOUT_S_DEFAULT, u64::from);
        if !(1..=HTTP_IDLE_TIMEOUT_S_MAX).contains(&idle_timeout_s) {
            return Err(invalid(
                "--http-idle-timeout",
                format!("{idle_timeout_s} s is outside 1..={HTTP_IDLE_TIMEOUT_S_MAX} seconds"),
            ));
        }
        Ok(HttpConnections {
            connections_max: connections_max as usize,
            idle_timeout: std::time::Duration::from_secs(idle_timeout_s),
        })
    }

    /// The control API's address and request body limit.
    fn resolve_http(&self) -> Result<(HttpListen, u64), ConfigError> {
        let http = match self.http.as_deref() {
            None => HttpListen::Default(HTTP_ADDR_DEFAULT.parse().expect("a valid address")),
            Some("off") => HttpListen::Off,
            Some(text) => HttpListen::Chosen(text.parse().map_err(|_| {
                invalid(
                    "--http",
                    format!("{text:?} is not IP:PORT (such as 127.0.0.1:7070) or off"),
                )
            })?),
        };
        if let Some(token) = &self.api_token {
            check_token(token)?;
        }
        if let Some(addr) = http.addr() {
            if !addr.ip().is_loopback() && self.api_token.is_none() {
                return Err(invalid(
                    "--http",
                    format!(
                        "{addr} is not a loopback address: set an API token (--api-token or \
                         GPUFEED_API_TOKEN) so that every request must authenticate"
                    ),
                ));
            }
        }
        let body_bytes_max = self
            .body_limit
            .map_or(BODY_BYTES_MAX_DEFAULT, |ByteCount(n)| n);
        if !(BODY_BYTES_MAX_MIN..=BODY_BYTES_MAX_MAX).contains(&body_bytes_max) {
            return Err(invalid(
                "--body-limit",
                format!(
                    "{body_bytes_max} bytes is outside {BODY_BYTES_MAX_MIN}..={BODY_BYTES_MAX_MAX}"
                ),
            ));
        }
        Ok((http, body_bytes_max))
    }

    /// The pack jobs' bounds.
    fn resolve_jobs(&self) -> Result<JobLimits, ConfigError> {
        let jobs = JobLimits {
            running_max: self.jobs_max.unwrap_or(JOBS_RUNNING_MAX_DEFAULT),
            queued_max: self.jobs_queued_max.unwrap_or(JOBS_QUEUED_MAX_DEFAULT),
            records_max: self.job_records_max.unwrap_or(JOB_RECORDS_MAX_DEFAULT),
        };
        if !(1..=JOBS_RUNNING_MAX_MAX).contains(&jobs.running_max) {
            return Err(invalid(
                "--jobs-max",
                format!("must be in 1..={JOBS_RUNNING_MAX_MAX}"),
            ));
        }
        if jobs.queued_max > JOBS_QUEUED_MAX_MAX {
            return Err(invalid(
                "--jobs-queued-max",
                format!("must be at most {JOBS_QUEUED_MAX_MAX}"),
            ));
        }
        if jobs.records_max > JOB_RECORDS_MAX_MAX
            || jobs.records_max < jobs.running_max + jobs.queued_max
        {
            return Err(invalid(
                "--job-records-max",
                format!(
                    "must be in {}..={JOB_RECORDS_MAX_MAX} (at least --jobs-max plus \
                     --jobs-queued-max, so that every active job keeps its record)",
                    jobs.running_max + jobs.queued_max
                ),
            ));
        }
        Ok(jobs)
    }

    /// The page-cache registration budget and when GPUs read rows in place.
    fn resolve_registration(&self) -> Result<(RegistrationBudget, ZeroCopyMode), ConfigError> {
        let window_bytes = self
            .registered_window
            .map_or(REGISTERED_WINDOW_BYTES_DEFAULT, |ByteCount(n)| n);
        if !(REGISTERED_WINDOW_BYTES_MIN..=REGISTERED_WINDOW_BYTES_MAX).contains(&window_bytes)
            || window_bytes % 4096 != 0
        {
            return Err(invalid(
                "--registered-window",
                format!(
                    "{window_bytes} bytes is not a multiple of 4096 in \
                     {REGISTERED_WINDOW_BYTES_MIN}..={REGISTERED_WINDOW_BYTES_MAX}"
                ),
            ));
        }
        let zero_copy: ZeroCopyMode = self
            .zero_copy
            .as_deref()
            .unwrap_or("auto")
            .parse()
            .map_err(|reason: String| invalid("--zero-copy", reason))?;
        let registered = match self.registered_memory_max {
            Some(ByteCount(0)) => RegistrationBudget {
                bytes_max: 0,
                window_bytes,
                source: BudgetSource::Configured,
            },
            Some(ByteCount(n)) if n < window_bytes => {
                return Err(invalid(
                    "--registered-memory-max",
                    format!(
                        "{n} bytes is below one registration window ({window_bytes} bytes); use 0 \
                         to turn the page-cache path off"
                    ),
                ))
            }
            Some(ByteCount(n)) => RegistrationBudget {
                bytes_max: n / window_bytes * window_bytes,
                window_bytes,
                source: BudgetSource::Configured,
            },
            None => RegistrationBudget {
                window_bytes,
                ..registered_bytes_max_default()
            },
        };
        Ok((registered, zero_copy))
    }

    /// What every GPU backend is built with: the registration budget and the pipeline's tuning.
    fn resolve_gpu(&self) -> Result<GpuSettings, ConfigError> {
        let (registered, zero_copy) = self.resolve_registration()?;
        let loader_copy_threads = within(
            "--loader-copy-threads",
            self.loader_copy_threads,
            LOADER_COPY_THREADS_DEFAULT,
            0..=LOADER_COPY_THREADS_MAX,
        )?;
        let rounds_in_flight = within(
            "--rounds-in-flight",
            self.rounds_in_flight,
            ROUNDS_IN_FLIGHT_DEFAULT,
            ROUNDS_IN_FLIGHT_MIN..=ROUNDS_IN_FLIGHT_MAX,
        )?;
        let filler_spin_us = within(
            "--filler-spin-us",
            self.filler_spin_us,
            FILLER_SPIN_US_DEFAULT,
            0..=FILLER_SPIN_US_MAX,
        )?;
        let gather_piece_kib = within(
            "--gather-piece-kib",
            self.gather_piece_kib,
            GATHER_PIECE_KIB_DEFAULT,
            GATHER_PIECE_KIB_MIN..=GATHER_PIECE_KIB_MAX,
        )?;
        let inline_gather_tables = within(
            "--inline-gather-tables",
            self.inline_gather_tables,
            INLINE_GATHER_TABLES_DEFAULT,
            0..=INLINE_GATHER_TABLES_MAX,
        )?;
        let batch_group_max = within(
            "--batch-group-max",
            self.batch_group_max,
            BATCH_GROUP_MAX_DEFAULT,
            1..=BATCH_GROUP_MAX_MAX,
        )?;
        let plan_threads = within(
            "--plan-threads",
            self.plan_threads,
            PLAN_THREADS_AUTOMATIC,
            0..=PLAN_THREADS_MAX,
        )?;
        let device_pool_idle_s = within(
            "--device-pool-idle-s",
            self.device_pool_idle_s,
            DEVICE_POOL_IDLE_S_DEFAULT,
            1..=DEVICE_POOL_IDLE_S_MAX,
        )?;
        Ok(GpuSettings {
            registered,
            zero_copy,
            device_shard_bytes: self
                .device_shard_memory
                .map_or(DEVICE_SHARD_BYTES_DEFAULT, |ByteCount(n)| n),
            device_cache_bytes: self.device_cache.map_or(0, |ByteCount(n)| n),
            host_decoded_bytes: self
                .host_decoded_memory
                .map_or_else(host_decoded_bytes_default, |ByteCount(n)| n),
            loader_copy_threads: loader_copy_threads as usize,
            rounds_in_flight: rounds_in_flight as usize,
            filler_spin: Duration::from_micros(u64::from(filler_spin_us)),
            gather_piece_bytes: u64::from(gather_piece_kib) << 10,
            inline_gather_tables: inline_gather_tables as usize,
            batch_group_max: batch_group_max as usize,
            plan_threads: plan_threads as usize,
            device_pool_idle_release: Duration::from_secs(u64::from(device_pool_idle_s)),
            interrupt_cpus: match self.avoid_irq_cpus {
                Some(Switch(false)) => InterruptCpus::Share,
                Some(Switch(true)) | None => InterruptCpus::Avoid,
            },
            kernel_cache_dir: self
                .cache_dir
                .clone()
                .or_else(|| kernel_cache_dir_default(|name| std::env::var_os(name))),
        })
    }

    /// Fills in the defaults and checks every value. `own_uid` is the default socket allowlist.
    pub fn resolve(self, own_uid: u32) -> Result<Settings, ConfigError> {
        let (http, body_bytes_max) = self.resolve_http()?;
        let http_connections = self.resolve_http_connections()?;
        let jobs = self.resolve_jobs()?;
        let gpu = self.resolve_gpu()?;
        let data_root = self.data_root.clone().ok_or_else(|| {
            invalid(
                "--data-root",
                "required (or GPUFEED_DATA_ROOT, or data_root in the configuration file)",
            )
        })?;
        let object = self.resolve_object(&data_root)?;
        let socket_path = self
            .socket
            .unwrap_or_else(|| data_root.join("gpufeed.sock"));
        let engine: EngineMode = self
            .engine
            .as_deref()
            .unwrap_or("auto")
            .parse()
            .map_err(|error: UnknownEngine| invalid("--engine", error.to_string()))?;
        let allowed_uids = match self.allow_uids {
            Some(uids) if !uids.is_empty() => uids,
            _ => vec![own_uid],
        };
        let sessions_max = self.sessions_max.unwrap_or(SESSIONS_MAX_DEFAULT);
        if sessions_max == 0 {
            return Err(invalid("--sessions-max", "must be at least 1"));
        }
        let pack_threads = match self.pack_threads {
            Some(0) => return Err(invalid("--pack-threads", "must be at least 1")),
            Some(n) => n as usize,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        let slot_memory_bytes_max = self
            .slot_memory_max
            .map_or_else(slot_memory_bytes_max_default, |ByteCount(n)| n);
        if slot_memory_bytes_max < SLOT_MEMORY_BYTES_MAX_MIN {
            return Err(invalid(
                "--slot-memory-max",
                format!(
                    "{slot_memory_bytes_max} bytes is less than one batch slot \
                     ({SLOT_MEMORY_BYTES_MAX_MIN} bytes): no stream could open"
                ),
            ));
        }
        let pack_bytes_per_s_max = match self.pack_rate_max {
            Some(ByteCount(0)) => {
                return Err(invalid(
                    "--pack-rate-max",
                    "must be at least 1 byte per second",
                ))
            }
            Some(ByteCount(n)) => Some(n),
            None => None,
        };
        Ok(Settings {
            data_root,
            socket_path,
            device: self.device.unwrap_or_else(|| "auto".to_string()),
            engine,
            allowed_uids,
            sessions_max,
            slot_memory_bytes_max,
            http,
            api_token: self.api_token,
            body_bytes_max,
            jobs,
            pack_threads,
            pack_bytes_per_s_max,
            gpu,
            http_connections,
            object,
        })
    }

    /// Where datasets in object storage are cached, and those registered at start.
    fn resolve_object(&self, data_root: &Path) -> Result<ObjectSettings, ConfigError> {
        let cache_bytes_max = self
            .object_cache_max
            .map_or(OBJECT_CACHE_BYTES_MAX_DEFAULT, |ByteCount(n)| n);
        if cache_bytes_max < OBJECT_CACHE_BYTES_MAX_MIN {
            return Err(invalid(
                "--object-cache-max",
                format!("{cache_bytes_max} bytes is less than {OBJECT_CACHE_BYTES_MAX_MIN}"),
            ));
        }
        let datasets = self
            .datasets
            .iter()
            .flatten()
            .filter(|entry| !entry.is_empty())
            .map(|entry| {
                let (name, url) = entry.split_once('=').ok_or_else(|| {
                    invalid(
                        "--dataset",
                        format!("{entry:?} is not NAME=URL (s3://, gs://, az:// or file://)"),
                    )
                })?;
                crate::format::validate_dataset_name(name)
                    .map_err(|reason| invalid("--dataset", format!("{entry:?}: {reason}")))?;
                if !crate::remote::is_object_url(url) {
                    return Err(invalid(
                        "--dataset",
                        format!("{entry:?}: {url:?} is not an s3://, gs://, az:// or file:// URL"),
                    ));
                }
                Ok((name.to_string(), url.to_string()))
            })
            .collect::<Result<Vec<_>, ConfigError>>()?;
        Ok(ObjectSettings {
            cache_dir: self
                .object_cache_dir
                .clone()
                .unwrap_or_else(|| data_root.join(OBJECT_CACHE_DIR_DEFAULT)),
            cache_bytes_max,
            datasets,
        })
    }
}

/// The object cache's directory under the data root unless configured (hidden: the start-up scan
/// of the data root does not take it for a dataset).
pub const OBJECT_CACHE_DIR_DEFAULT: &str = ".object-cache";

/// The object cache's budget unless configured: 64 GiB.
pub const OBJECT_CACHE_BYTES_MAX_DEFAULT: u64 = 64 << 30;

/// The smallest object cache budget accepted.
pub const OBJECT_CACHE_BYTES_MAX_MIN: u64 = 1 << 20;

/// Datasets in object storage and their node-local cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectSettings {
    /// The cache directory.
    pub cache_dir: PathBuf,
    /// Most bytes of shard files it keeps.
    pub cache_bytes_max: u64,
    /// Registered at start: (name, URL).
    pub datasets: Vec<(String, String)>,
}

/// `value` (or `default` when unset) if it lies in `bounds`; otherwise an error naming `key`.
fn within(
    key: &str,
    value: Option<u32>,
    default: u32,
    bounds: std::ops::RangeInclusive<u32>,
) -> Result<u32, ConfigError> {
    let value = value.unwrap_or(default);
    if bounds.contains(&value) {
        return Ok(value);
    }
    let side = if value > *bounds.end() {
        "too large"
    } else {
        "too small"
    };
    Err(invalid(
        key,
        format!(
            "{value} is {side}: must be in {}..={}",
            bounds.start(),
            bounds.end()
        ),
    ))
}

/// The compiled-kernel cache directory when none is configured: `$XDG_CACHE_HOME/gpufeed/kernels`,
/// else `~/.cache/gpufeed/kernels`; none when neither variable is set (`lookup` reads the
/// environment). `--cache-dir` (`GPUFEED_CACHE_DIR`) overrides it.
pub fn kernel_cache_dir_default(
    lookup: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Option<PathBuf> {
    let var = |name: &str| lookup(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("XDG_CACHE_HOME")
        .map(|dir| dir.join("gpufeed").join("kernels"))
        .or_else(|| var("HOME").map(|dir| dir.join(".cache").join("gpufeed").join("kernels")))
}

/// When GPUs read rows of raw blocks straight from registered page cache instead of staging whole
/// blocks (`--zero-copy`). The daemon turns it into the pipeline's own policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroCopyMode {
    /// Always stage whole blocks.
    Off,
    /// Read a block's rows in place when a batch uses less than half of it.
    Auto,
    /// Read every raw block in place when its window can be mapped.
    Always,
}

impl ZeroCopyMode {
    /// The name used in configuration and status.
    pub fn name(self) -> &'static str {
        match self {
            ZeroCopyMode::Off => "off",
            ZeroCopyMode::Auto => "auto",
            ZeroCopyMode::Always => "always",
        }
    }
}

impl std::str::FromStr for ZeroCopyMode {
    type Err = String;

    fn from_str(text: &str) -> Result<ZeroCopyMode, String> {
        match text {
            "off" => Ok(ZeroCopyMode::Off),
            "auto" => Ok(ZeroCopyMode::Auto),
            "always" => Ok(ZeroCopyMode::Always),
            other => Err(format!("{other:?} is not auto, always or off")),
        }
    }
}

/// Whether a GPU stream's threads (its filler, planning, loader and copy threads) keep off the CPUs
/// that service their device's interrupts (`--avoid-irq-cpus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InterruptCpus {
    /// Keep off them when other CPUs are allowed (the default: on the H100 test machine a filler on
    /// the interrupt CPU ran an epoch three times slower).
    Avoid,
    /// Run anywhere the process may.
    Share,
}

/// What every GPU backend of the daemon is built with. Some of these are fields of the pipeline's
/// own limits, which the daemon sets from here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuSettings {
    /// Most page-cache bytes registered for the devices at once (the one copy of this budget).
    pub registered: RegistrationBudget,
    /// When GPUs read rows of raw blocks in place from registered page cache.
    pub zero_copy: ZeroCopyMode,
    /// Device memory per GPU stream for shards copied ahead of need (0: none).
    pub device_shard_bytes: u64,
    /// Device memory per served GPU for the device-memory tier (0: off).
    pub device_cache_bytes: u64,
    /// Host memory, for all served GPUs together, for datasets with compressed blocks decoded
    /// whole when device memory does not take them (0: none).
    pub host_decoded_bytes: u64,
    /// Threads per GPU stream copying shards through pinned buffers beyond the registration budget.
    pub loader_copy_threads: usize,
    /// Rounds a GPU stream queues on the device at once.
    pub rounds_in_flight: usize,
    /// How long a GPU stream's filler polls a round for completion before it sleeps.
    pub filler_spin: Duration,
    /// Largest output of a gather piece made of consecutive rows, in bytes.
    pub gather_piece_bytes: u64,
    /// Gather launches a round read in place may take with its piece table in the launch
    /// parameters (0: never).
    pub inline_gather_tables: usize,
    /// Most consecutive small batches of a resident stream one round gathers.
    pub batch_group_max: usize,
    /// Threads per GPU stream planning rows ahead of the filler; 0: the pipeline's choice from the
    /// host's CPU count.
    pub plan_threads: usize,
    /// How long device memory kept between a device's streams may stay idle before it is freed.
    pub device_pool_idle_release: Duration,
    /// Whether GPU streams' threads keep off their device's interrupt CPUs.
    pub interrupt_cpus: InterruptCpus,
    /// Directory of the compiled-kernel cache; none: kernels are compiled at every start.
    pub kernel_cache_dir: Option<PathBuf>,
}

impl GpuSettings {
    /// Every default, with the registration budget derived from this host (for tools and
    /// benchmarks that build a GPU backend without a configuration).
    pub fn node_defaults() -> GpuSettings {
        ConfigLayer::default()
            .resolve_gpu()
            .expect("the defaults are valid")
    }

    /// The defaults under the process's `GPUFEED_*` variables, as the daemon would read them (for
    /// benchmarks that build a GPU backend in process and are tuned like the daemon).
    pub fn from_environment() -> Result<GpuSettings, ConfigError> {
        ConfigLayer::from_env(|key| std::env::var(key).ok())?.resolve_gpu()
    }
}

/// Where the registration budget came from, shown in `/v1/status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetSource {
    /// `--registered-memory-max`, its variable or its TOML key.
    Configured,
    /// Half the host's RAM, below `RLIMIT_MEMLOCK`.
    Derived,
}

impl BudgetSource {
    /// The name shown in status.
    pub fn name(self) -> &'static str {
        match self {
            BudgetSource::Configured => "configured",
            BudgetSource::Derived => "derived",
        }
    }
}

/// The most page-cache bytes the daemon keeps registered (locked) for its devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegistrationBudget {
    /// The bound, a whole number of windows; 0 turns the page-cache path off.
    pub bytes_max: u64,
    /// Size of one registered window.
    pub window_bytes: u64,
    /// Where it came from.
    pub source: BudgetSource,
}

/// The default registration budget: [`REGISTERED_RAM_SHARE_DEFAULT`] of the host's RAM (or of the
/// daemon's memory cgroup limit, where lower: registered pages are charged to it and cannot be
/// reclaimed), and no more than `RLIMIT_MEMLOCK` allows (registration locks pages: past the limit it would fail), rounded
/// down to whole windows.
pub fn registered_bytes_max_default() -> RegistrationBudget {
    let ram = host_ram_bytes().unwrap_or(16 << 30);
    let mut bytes = (ram as f64 * REGISTERED_RAM_SHARE_DEFAULT) as u64;
    if let Some(memlock) = memlock_limit_bytes() {
        bytes = bytes.min(memlock);
    }
    let bytes = bytes / REGISTERED_BYTES_MAX_MIN * REGISTERED_BYTES_MAX_MIN;
    RegistrationBudget {
        bytes_max: bytes,
        window_bytes: REGISTERED_WINDOW_BYTES_DEFAULT,
        source: BudgetSource::Derived,
    }
}

/// The default host memory for decoded datasets ([`HOST_DECODED_RAM_SHARE_DEFAULT`] of the memory
/// the daemon may use, within the locked-memory limit; 0 where neither is known).
pub fn host_decoded_bytes_default() -> u64 {
    let share = host_ram_bytes().map_or(0, |ram| ram / HOST_DECODED_RAM_SHARE_DEFAULT);
    memlock_limit_bytes().map_or(share, |memlock| share.min(memlock))
}

/// The default slot memory (host memory for batches, host streams' working sets and the
/// decoded-block cache): [`SLOT_MEMORY_BYTES_MAX_DEFAULT`], or a quarter of the memory the daemon
/// may use where that is less (a daemon in a container of 4 GiB would otherwise grow its cache until
/// the kernel killed it), in whole slot strides, at least [`SLOT_MEMORY_BYTES_MAX_MIN`].
pub fn slot_memory_bytes_max_default() -> u64 {
    slot_memory_default_within(host_ram_bytes())
}

/// [`slot_memory_bytes_max_default`] for a daemon that may use `memory` bytes (unknown: `None`).
fn slot_memory_default_within(memory: Option<u64>) -> u64 {
    let share = memory.map_or(u64::MAX, |bytes| bytes / SLOT_MEMORY_SHARE_DEFAULT);
    let bytes = SLOT_MEMORY_BYTES_MAX_DEFAULT.min(share);
    (bytes / SLOT_MEMORY_BYTES_MAX_MIN * SLOT_MEMORY_BYTES_MAX_MIN).max(SLOT_MEMORY_BYTES_MAX_MIN)
}

/// The memory the daemon may use: the host's RAM, or its memory cgroup's limit where lower.
fn host_ram_bytes() -> Option<u64> {
    crate::storage::memory::memory_limit_bytes()
}

/// The soft `RLIMIT_MEMLOCK`, unless unlimited.
fn memlock_limit_bytes() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given and nothing else.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } == 0;
    (ok && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}

fn check_token(token: &str) -> Result<(), ConfigError> {
    if token.len() < API_TOKEN_BYTES_MIN || token.len() > API_TOKEN_BYTES_MAX {
        return Err(invalid(
            "--api-token",
            format!("must be {API_TOKEN_BYTES_MIN} to {API_TOKEN_BYTES_MAX} bytes long"),
        ));
    }
    // The token travels in an HTTP header: printable ASCII without spaces keeps it intact.
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(
            "--api-token",
            "must be printable ASCII without spaces",
        ));
    }
    Ok(())
}

/// Where the control API listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HttpListen {
    /// No control API.
    Off,
    /// The built-in default address, which nobody chose: if it is taken (another daemon on the node
    /// holds it), the daemon serves its socket without a control API and says so, rather than
    /// refusing to serve consumers.
    Default(SocketAddr),
    /// An address from a flag, the environment or the file: failing to bind it is fatal.
    Chosen(SocketAddr),
}

impl HttpListen {
    /// The address, unless the API is off.
    pub fn addr(&self) -> Option<SocketAddr> {
        match self {
            HttpListen::Off => None,
            HttpListen::Default(addr) | HttpListen::Chosen(addr) => Some(*addr),
        }
    }
}

/// Bounds on pack jobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobLimits {
    /// Most jobs running at once.
    pub running_max: u32,
    /// Most jobs waiting to run.
    pub queued_max: u32,
    /// Most job records kept; finished ones beyond it are dropped, oldest first.
    pub records_max: u32,
}

/// Everything `gpufeed serve` runs with, checked.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Directory whose subdirectories are datasets; holds the catalog.
    pub data_root: PathBuf,
    /// The consumers' Unix socket.
    pub socket_path: PathBuf,
    /// `auto`, `cpu` or `cuda:N`.
    pub device: String,
    /// Storage engine choice.
    pub engine: EngineMode,
    /// Uids allowed on the socket.
    pub allowed_uids: Vec<u32>,
    /// Most concurrent sessions.
    pub sessions_max: u32,
    /// Most bytes of slot memory over all streams.
    pub slot_memory_bytes_max: u64,
    /// The control API's address.
    pub http: HttpListen,
    /// Bearer token of the control API: required for mutating requests, and for every request when
    /// the API listens on a non-loopback address.
    pub api_token: Option<String>,
    /// Largest request body of the control API.
    pub body_bytes_max: u64,
    /// Bounds on pack jobs.
    pub jobs: JobLimits,
    /// Threads compressing blocks in each pack job.
    pub pack_threads: usize,
    /// Most raw bytes per second each pack job packs.
    pub pack_bytes_per_s_max: Option<u64>,
    /// What every GPU backend is built with.
    pub gpu: GpuSettings,
    /// Bounds on the control API's connections.
    pub http_connections: HttpConnections,
    /// Datasets in object storage and their node-local cache.
    pub object: ObjectSettings,
}

/// Bounds on the control API's connections, so that idle or slow clients cannot take the daemon's
/// descriptors (which consumers need) or its API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpConnections {
    /// Connections served at once; further ones wait in the listen backlog.
    pub connections_max: usize,
    /// Time a connection may take to send a request's headers, or its body after them, and may
    /// stay idle between requests.
    pub idle_timeout: std::time::Duration,
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> ConfigLayer {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ConfigLayer::from_env(|key| map.get(key).cloned()).unwrap()
    }

    fn file(text: &str) -> ConfigLayer {
        ConfigLayer::from_toml_str(Path::new("test.toml"), text).unwrap()
    }

    #[test]
    fn flags_win_over_env_over_file_over_defaults() {
        let file = file(
            "data_root = \"/file\"\nhttp = \"127.0.0.1:1111\"\nsessions_max = 3\nbody_limit = \"2K\"\n",
        );
        let env = env(&[
            ("GPUFEED_HTTP", "127.0.0.1:2222"),
            ("GPUFEED_SESSIONS_MAX", "5"),
        ]);
        let flags = ConfigLayer {
            http: Some("127.0.0.1:3333".into()),
            ..ConfigLayer::default()
        };
        let settings = flags.over(env.over(file)).resolve(42).unwrap();
        assert_eq!(
            settings.http,
            HttpListen::Chosen("127.0.0.1:3333".parse().unwrap())
        );
        assert_eq!(settings.sessions_max, 5);
        assert_eq!(settings.body_bytes_max, 2048);
        assert_eq!(settings.data_root, PathBuf::from("/file"));
        assert_eq!(settings.socket_path, PathBuf::from("/file/gpufeed.sock"));
        assert_eq!(settings.allowed_uids, vec![42]);
        assert_eq!(
            settings.slot_memory_bytes_max,
            slot_memory_bytes_max_default()
        );
        assert!(slot_memory_bytes_max_default() <= SLOT_MEMORY_BYTES_MAX_DEFAULT);
        assert_eq!(settings.engine, EngineMode::Auto);
    }

    #[test]
    fn every_listed_environment_variable_is_read() {
        let values = [
            "/r",
            "/s",
            "cpu",
            "uring",
            "1,2",
            "2",
            "1M",
            "off",
            "0123456789abcdef",
            "2K",
            "1",
            "0",
            "4",
            "1",
            "1M",
            "1G",
            "1M",
            "always",
            "2G",
            "1G",
            "3G",
            "100",
            "5",
            "3",
            "4",
            "10",
            "64",
            "0",
            "1",
            "6",
            "600",
            "off",
            "/cache",
            "/objects",
            "2G",
            "web=s3://bucket/web",
        ];
        let pairs: Vec<(&str, &str)> = ENV_VARS.iter().copied().zip(values).collect();
        let layer = env(&pairs);
        let shown = format!("{layer:?}");
        assert!(!shown.contains("None"), "a variable is not read: {shown}");
        assert!(layer.resolve(0).is_ok());
    }

    #[test]
    fn default_http_address_is_marked_as_default() {
        let settings = env(&[("GPUFEED_DATA_ROOT", "/r")]).resolve(0).unwrap();
        assert_eq!(
            settings.http,
            HttpListen::Default(HTTP_ADDR_DEFAULT.parse().unwrap())
        );
        let off = env(&[("GPUFEED_DATA_ROOT", "/r"), ("GPUFEED_HTTP", "off")])
            .resolve(0)
            .unwrap();
        assert_eq!(off.http, HttpListen::Off);
    }

    #[test]
    fn unknown_file_keys_are_errors() {
        let error = ConfigLayer::from_toml_str(Path::new("c.toml"), "data_rot = \"/x\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("c.toml") && error.contains("data_rot"),
            "{error}"
        );
    }

    #[test]
    fn non_loopback_address_needs_a_token() {
        let layer = env(&[
            ("GPUFEED_DATA_ROOT", "/r"),
            ("GPUFEED_HTTP", "0.0.0.0:7070"),
        ]);
        let error = layer.clone().resolve(0).unwrap_err().to_string();
        assert!(error.contains("not a loopback address"), "{error}");
        let with_token = ConfigLayer {
            api_token: Some("0123456789abcdef0123".into()),
            ..ConfigLayer::default()
        }
        .over(layer);
        assert!(with_token.resolve(0).is_ok());
    }

    #[test]
    fn bad_values_name_their_key() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("GPUFEED_HTTP", "localhost")], "--http"),
            (&[("GPUFEED_API_TOKEN", "short")], "--api-token"),
            (&[("GPUFEED_BODY_LIMIT", "10")], "--body-limit"),
            (&[("GPUFEED_JOBS_MAX", "0")], "--jobs-max"),
            (&[("GPUFEED_JOB_RECORDS_MAX", "1")], "--job-records-max"),
            (&[("GPUFEED_ENGINE", "spdk")], "--engine"),
            (&[("GPUFEED_PACK_RATE_MAX", "0")], "--pack-rate-max"),
            (
                &[("GPUFEED_REGISTERED_MEMORY_MAX", "1M")],
                "--registered-memory-max",
            ),
            (
                &[("GPUFEED_REGISTERED_WINDOW", "5000")],
                "--registered-window",
            ),
            (&[("GPUFEED_ZERO_COPY", "sometimes")], "--zero-copy"),
        ];
        for (pairs, key) in cases {
            let mut all = vec![("GPUFEED_DATA_ROOT", "/r")];
            all.extend_from_slice(pairs);
            let error = env(&all).resolve(0).unwrap_err().to_string();
            assert!(error.starts_with(key), "{pairs:?}: {error}");
        }
        let map: HashMap<&str, &str> = [("GPUFEED_SESSIONS_MAX", "many")].into();
        let error = ConfigLayer::from_env(|k| map.get(k).map(|v| v.to_string()))
            .unwrap_err()
            .to_string();
        assert!(error.contains("GPUFEED_SESSIONS_MAX"), "{error}");
        assert!(
            ConfigLayer::default().resolve(0).is_err(),
            "data root is required"
        );
    }

    /// Regression: a CPU-backend daemon in a 512 MiB memory cgroup grew its decoded-block cache
    /// toward the 8 GiB default until the kernel killed it, 243 batches into a stream.
    #[test]
    fn the_default_slot_memory_is_a_quarter_of_the_memory_at_most() {
        assert_eq!(
            slot_memory_default_within(None),
            SLOT_MEMORY_BYTES_MAX_DEFAULT
        );
        assert_eq!(
            slot_memory_default_within(Some(128 << 30)),
            SLOT_MEMORY_BYTES_MAX_DEFAULT
        );
        assert_eq!(slot_memory_default_within(Some(512 << 20)), 128 << 20);
        assert_eq!(
            slot_memory_default_within(Some((4 << 30) + 5)),
            1 << 30,
            "whole strides"
        );
        assert_eq!(
            slot_memory_default_within(Some(1)),
            SLOT_MEMORY_BYTES_MAX_MIN
        );
    }

    #[test]
    fn the_default_registration_budget_is_bounded_by_ram_and_memlock() {
        let budget = registered_bytes_max_default();
        assert_eq!(budget.source, BudgetSource::Derived);
        assert_eq!(budget.bytes_max % REGISTERED_BYTES_MAX_MIN, 0);
        let ram = host_ram_bytes().expect("sysconf reports the RAM");
        assert!(budget.bytes_max <= ram / 2, "{budget:?} of {ram}");
        if let Some(memlock) = memlock_limit_bytes() {
            assert!(budget.bytes_max <= memlock, "{budget:?} over {memlock}");
        }
        let off = env(&[
            ("GPUFEED_DATA_ROOT", "/r"),
            ("GPUFEED_REGISTERED_MEMORY_MAX", "0"),
        ])
        .resolve(0)
        .unwrap();
        assert_eq!(off.gpu.registered.bytes_max, 0);
    }

    #[test]
    fn byte_counts_take_suffixes_in_every_source() {
        let layer = file("slot_memory_max = \"1G\"\nbody_limit = 4096\n");
        assert_eq!(layer.slot_memory_max, Some(ByteCount(1 << 30)));
        assert_eq!(layer.body_limit, Some(ByteCount(4096)));
        assert_eq!(parse_byte_count("64K"), Ok(64 << 10));
        assert_eq!(parse_byte_count("2MiB"), Ok(2 << 20));
        assert!(parse_byte_count("lots").is_err());
        assert!(parse_byte_count("99999999999999G").is_err());
        let budget = file("data_root = \"/r\"\nregistered_memory_max = \"2G\"\n")
            .resolve(0)
            .unwrap()
            .gpu
            .registered;
        assert_eq!(budget.bytes_max, 2 << 30);
        assert_eq!(budget.source, BudgetSource::Configured);
        let uids = env(&[("GPUFEED_ALLOW_UIDS", "1000, 1001")]);
        assert_eq!(uids.allow_uids, Some(vec![1000, 1001]));
    }

    /// Regression: a number too large for its setting (`GPUFEED_HTTP_IDLE_TIMEOUT_S=99999999999`)
    /// was reported as "not a whole number", in every numeric variable and byte count alike.
    #[test]
    fn numbers_too_large_say_so_in_every_source() {
        for key in [
            "GPUFEED_HTTP_IDLE_TIMEOUT_S",
            "GPUFEED_SESSIONS_MAX",
            "GPUFEED_PLAN_THREADS",
        ] {
            let map: HashMap<&str, &str> = [(key, "99999999999")].into();
            let error = ConfigLayer::from_env(|k| map.get(k).map(|v| v.to_string()))
                .unwrap_err()
                .to_string();
            assert!(
                error.starts_with(key) && error.contains("too large"),
                "{error}"
            );
        }
        let map: HashMap<&str, &str> = [("GPUFEED_SLOT_MEMORY_MAX", "99999999999999999999")].into();
        let error = ConfigLayer::from_env(|k| map.get(k).map(|v| v.to_string()))
            .unwrap_err()
            .to_string();
        assert!(error.contains("too large"), "{error}");
        let map: HashMap<&str, &str> = [("GPUFEED_ALLOW_UIDS", "1000,99999999999")].into();
        let error = ConfigLayer::from_env(|k| map.get(k).map(|v| v.to_string()))
            .unwrap_err()
            .to_string();
        assert!(error.contains("too large"), "{error}");
        let map: HashMap<&str, &str> = [("GPUFEED_JOBS_MAX", "-3")].into();
        let error = ConfigLayer::from_env(|k| map.get(k).map(|v| v.to_string()))
            .unwrap_err()
            .to_string();
        assert!(error.contains("negative"), "{error}");
        let map: HashMap<&str, &str> = [("GPUFEED_JOBS_MAX", "two")].into();
        let error = ConfigLayer::from_env(|k| map.get(k).map(|v| v.to_string()))
            .unwrap_err()
            .to_string();
        assert!(error.contains("not a whole number"), "{error}");
        let error =
            ConfigLayer::from_toml_str(Path::new("c.toml"), "http_idle_timeout_s = 99999999999\n")
                .unwrap_err()
                .to_string();
        assert!(
            error.contains("c.toml") && error.contains("too large"),
            "{error}"
        );
        let error = ConfigLayer::from_toml_str(Path::new("c.toml"), "slot_memory_max = -1\n")
            .unwrap_err()
            .to_string();
        assert!(error.contains("negative"), "{error}");
        // In range for the type but not for the setting: the setting's bounds are named.
        let error = env(&[
            ("GPUFEED_DATA_ROOT", "/r"),
            ("GPUFEED_HTTP_IDLE_TIMEOUT_S", "4000000000"),
        ])
        .resolve(0)
        .unwrap_err()
        .to_string();
        assert!(
            error.starts_with("--http-idle-timeout") && error.contains("1..=86400"),
            "{error}"
        );
    }

    /// Regression: `slot_memory_max = "0"` was accepted, and the daemon started though no stream
    /// could ever open (every stream was refused for want of slot memory).
    #[test]
    fn slot_memory_too_small_for_any_stream_is_refused() {
        for text in ["slot_memory_max = \"0\"", "slot_memory_max = 4095"] {
            let error = file(&format!("data_root = \"/r\"\n{text}\n"))
                .resolve(0)
                .unwrap_err()
                .to_string();
            assert!(
                error.starts_with("--slot-memory-max") && error.contains("no stream could open"),
                "{error}"
            );
        }
        let smallest = file("data_root = \"/r\"\nslot_memory_max = \"4K\"\n")
            .resolve(0)
            .unwrap();
        assert_eq!(smallest.slot_memory_bytes_max, SLOT_MEMORY_BYTES_MAX_MIN);
    }

    /// The GPU tuning settings, once read by the pipeline from the environment where they were
    /// used, are settings like the others: their defaults, a value from each source, and a value out
    /// of bounds named by its flag.
    #[test]
    fn gpu_tuning_settings_have_defaults_bounds_and_every_source() {
        let defaults = GpuSettings::node_defaults();
        assert_eq!(defaults.rounds_in_flight, 3);
        assert_eq!(defaults.filler_spin, Duration::ZERO);
        assert_eq!(defaults.gather_piece_bytes, 16 << 10);
        assert_eq!(defaults.inline_gather_tables, 2);
        assert_eq!(defaults.batch_group_max, 16);
        assert_eq!(defaults.plan_threads, 0);
        assert_eq!(defaults.device_pool_idle_release, Duration::from_secs(30));
        assert_eq!(defaults.interrupt_cpus, InterruptCpus::Avoid);
        assert_eq!(defaults.zero_copy, ZeroCopyMode::Auto);
        assert_eq!(defaults.device_shard_bytes, DEVICE_SHARD_BYTES_DEFAULT);
        // The device-memory tier is off unless asked for: the trainer needs that memory.
        assert_eq!(defaults.device_cache_bytes, 0);
        assert_eq!(defaults.host_decoded_bytes, host_decoded_bytes_default());

        let from_file = file(
            "data_root = \"/r\"\nrounds_in_flight = 5\nfiller_spin_us = 20\ngather_piece_kib = 64\n\
             inline_gather_tables = 0\nbatch_group_max = 1\nplan_threads = 6\n\
             device_pool_idle_s = 600\navoid_irq_cpus = false\ncache_dir = \"/kernels\"\n",
        );
        let from_env = env(&[
            ("GPUFEED_ROUNDS_IN_FLIGHT", "4"),
            ("GPUFEED_AVOID_IRQ_CPUS", "1"),
        ]);
        let gpu = from_env.over(from_file).resolve(0).unwrap().gpu;
        assert_eq!(gpu.rounds_in_flight, 4);
        assert_eq!(gpu.filler_spin, Duration::from_micros(20));
        assert_eq!(gpu.gather_piece_bytes, 64 << 10);
        assert_eq!(gpu.inline_gather_tables, 0);
        assert_eq!(gpu.batch_group_max, 1);
        assert_eq!(gpu.plan_threads, 6);
        assert_eq!(gpu.device_pool_idle_release, Duration::from_secs(600));
        assert_eq!(gpu.interrupt_cpus, InterruptCpus::Avoid);
        assert_eq!(gpu.kernel_cache_dir, Some(PathBuf::from("/kernels")));

        let cases: &[(&str, &str, &str)] = &[
            ("GPUFEED_ROUNDS_IN_FLIGHT", "1", "--rounds-in-flight"),
            ("GPUFEED_ROUNDS_IN_FLIGHT", "9", "--rounds-in-flight"),
            ("GPUFEED_FILLER_SPIN_US", "1001", "--filler-spin-us"),
            ("GPUFEED_GATHER_PIECE_KIB", "3", "--gather-piece-kib"),
            ("GPUFEED_GATHER_PIECE_KIB", "1025", "--gather-piece-kib"),
            (
                "GPUFEED_INLINE_GATHER_TABLES",
                "9",
                "--inline-gather-tables",
            ),
            ("GPUFEED_BATCH_GROUP_MAX", "0", "--batch-group-max"),
            ("GPUFEED_BATCH_GROUP_MAX", "17", "--batch-group-max"),
            ("GPUFEED_PLAN_THREADS", "33", "--plan-threads"),
            ("GPUFEED_DEVICE_POOL_IDLE_S", "0", "--device-pool-idle-s"),
            (
                "GPUFEED_DEVICE_POOL_IDLE_S",
                "86401",
                "--device-pool-idle-s",
            ),
            ("GPUFEED_LOADER_COPY_THREADS", "17", "--loader-copy-threads"),
        ];
        for (key, value, flag) in cases {
            let error = env(&[("GPUFEED_DATA_ROOT", "/r"), (key, value)])
                .resolve(0)
                .unwrap_err()
                .to_string();
            assert!(error.starts_with(flag), "{key}={value}: {error}");
        }
        let map: HashMap<&str, &str> = [("GPUFEED_AVOID_IRQ_CPUS", "sometimes")].into();
        let error = ConfigLayer::from_env(|k| map.get(k).map(|v| v.to_string()))
            .unwrap_err()
            .to_string();
        assert!(error.starts_with("GPUFEED_AVOID_IRQ_CPUS"), "{error}");
        let off = env(&[("GPUFEED_DATA_ROOT", "/r"), ("GPUFEED_AVOID_IRQ_CPUS", "0")])
            .resolve(0)
            .unwrap();
        assert_eq!(off.gpu.interrupt_cpus, InterruptCpus::Share);
    }

    #[test]
    fn the_kernel_cache_defaults_under_xdg_cache_home_then_home() {
        let lookup = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| std::ffi::OsString::from(v))
            }
        };
        assert_eq!(
            kernel_cache_dir_default(lookup(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")])),
            Some(PathBuf::from("/x/gpufeed/kernels"))
        );
        assert_eq!(
            kernel_cache_dir_default(lookup(&[("XDG_CACHE_HOME", ""), ("HOME", "/h")])),
            Some(PathBuf::from("/h/.cache/gpufeed/kernels"))
        );
        assert_eq!(kernel_cache_dir_default(lookup(&[])), None);
    }

    /// The configuration sits below the pipeline: it defines the defaults, bounds and enums it
    /// needs, and the daemon converts them (it once imported the pipeline's constants and its
    /// zero-copy enum).
    #[test]
    fn the_configuration_imports_nothing_from_the_pipeline() {
        let upward = concat!("crate::", "pipeline");
        let offenders: Vec<&str> = include_str!("config.rs")
            .lines()
            .filter(|line| !line.trim_start().starts_with("//") && line.contains(upward))
            .collect();
        assert!(offenders.is_empty(), "{offenders:?}");
    }
}
