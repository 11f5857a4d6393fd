//! The consumer-facing side of the daemon: a Unix socket speaking the protocol of
//! `gpufeed_proto::protocol` (`docs/PROTOCOL.md`), one thread per session, and the slot leases.
//!
//! *Invariant*: only this module and the client crate know the wire format. A malformed frame ends
//! that session with an error frame; it never affects the daemon or other sessions. A consumer's
//! request reaches the pipeline converted into its own types ([`convert`]).

pub mod convert;
pub mod ring;
pub mod server;
pub mod slots;

pub use server::{Server, ServerConfig, ServerStopper, HANDSHAKE_TIMEOUT_DEFAULT};
