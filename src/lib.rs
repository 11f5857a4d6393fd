//! gpufeed: a per-node daemon that feeds GPU training jobs device-resident batches.
//!
//! See `docs/ARCHITECTURE.md` for the module map and the invariants between modules.

pub mod api;
pub mod catalog;
pub mod config;
pub mod daemon;
pub mod decode;
pub mod demo;
pub mod device;
pub mod durable;
pub mod format;
pub mod input;
pub mod ipc;
pub mod kernels;
pub mod metrics;
pub mod notify;
pub mod pack;
pub mod pipeline;
pub mod registry;
pub mod remote;
pub mod storage;
// Test and benchmark support (and the demo's data), not API: public so that the integration tests,
// the benchmarks and `gpufeed demo` reach it, but out of the documentation.
#[doc(hidden)]
pub mod synth;
pub mod tools;

/// An error and its causes joined with ": ", leaving out a cause whose text the message before it
/// already ends with (error types that name their cause in their own message, as ours name their I/O
/// cause). What the command-line tools print for a failure.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = String::new();
    let mut cause = Some(error);
    while let Some(error) = cause {
        let message = error.to_string();
        if !text.ends_with(&message) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&message);
        }
        cause = error.source();
    }
    text
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("{what}")]
    struct Context {
        what: String,
        source: std::io::Error,
    }

    #[test]
    fn error_chain_joins_causes_and_skips_a_cause_already_named() {
        let io = || std::io::Error::other("disk on fire");
        let separate = Context {
            what: "writing x".into(),
            source: io(),
        };
        assert_eq!(super::error_chain(&separate), "writing x: disk on fire");
        let named = Context {
            what: "writing x: disk on fire".into(),
            source: io(),
        };
        assert_eq!(super::error_chain(&named), "writing x: disk on fire");
    }
}
