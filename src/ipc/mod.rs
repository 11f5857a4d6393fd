//! The consumer-facing side of the daemon: a Unix socket speaking the protocol of
//! `gpufeed_proto::protocol` (`docs/PROTOCOL.md`), one thread per session, and the slot leases.
//!
//! *Invariant*: only this module and the client crate know the wire format. A malformed frame ends
//! that session with an error frame; it never affects the daemon or other sessions. A consumer's
//! request reaches the pipeline converted into its own types ([`convert`]).

pub mod convert;
pub mod devices;
pub mod ring;
pub mod server;
pub mod slots;

pub use server::{Server, ServerConfig, ServerStopper, HANDSHAKE_TIMEOUT_DEFAULT};

/// A new memfd named `name` of `bytes` bytes, sealed against shrinking, growing and further seals:
/// shared memory a consumer gets the descriptor of but cannot truncate under the daemon's mapping
/// (which would crash the daemon with SIGBUS).
fn sealed_memfd(name: &std::ffi::CStr, bytes: u64) -> std::io::Result<std::fs::File> {
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    use nix::sys::memfd::{memfd_create, MFdFlags};
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
        .map_err(std::io::Error::from)?;
    let file = std::fs::File::from(fd);
    file.set_len(bytes)?;
    fcntl(
        &file,
        FcntlArg::F_ADD_SEALS(
            SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
        ),
    )
    .map_err(std::io::Error::from)?;
    Ok(file)
}
