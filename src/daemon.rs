//! The daemon: composes the registry, the socket server and (later) the HTTP control API.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::ipc::{Server, ServerConfig};
use crate::pipeline::StreamLimits;
use crate::registry::Registry;
use crate::storage::EngineMode;

/// Everything `gpufeed serve` is configured with.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// Directory whose subdirectories are datasets.
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
    /// Per-stream bounds.
    pub stream_limits: StreamLimits,
}

/// Starts the daemon and serves until the listener fails.
///
/// Prints `gpufeed: serving N dataset(s) on SOCKET` on stdout once it accepts connections, so that
/// supervisors and tests can wait for readiness without polling.
pub fn run(config: DaemonConfig) -> Result<()> {
    match config.device.as_str() {
        "cpu" => {}
        "auto" => tracing::info!(
            "device auto: the GPU backend is not part of this build yet; serving from host memory (CPU backend)"
        ),
        other => bail!(
            "--device {other}: only the CPU backend can serve in this build (use --device cpu or auto)"
        ),
    }
    if config.engine == EngineMode::CuFile {
        bail!("--engine cufile: the cuFile engine serves only the GPU backend, which is not part of this build yet");
    }
    let registry = Arc::new(Registry::new());
    let skipped = registry
        .scan(&config.data_root)
        .with_context(|| format!("reading the data root {}", config.data_root.display()))?;
    for skip in &skipped {
        tracing::warn!("not serving {}: {}", skip.dir.display(), skip.reason);
    }
    let names = registry.names();
    tracing::info!("datasets: {}", names.join(", "));
    let server_config = ServerConfig {
        socket_path: config.socket_path.clone(),
        allowed_uids: config.allowed_uids.clone(),
        sessions_max: config.sessions_max,
        slot_memory_bytes_max: config.slot_memory_bytes_max,
        stream_limits: config.stream_limits,
    };
    let server = Server::bind(server_config, registry)
        .with_context(|| format!("binding {}", config.socket_path.display()))?;
    println!(
        "gpufeed: serving {} dataset(s) on {}",
        names.len(),
        config.socket_path.display()
    );
    std::io::stdout().flush()?;
    server.run()?;
    Ok(())
}
