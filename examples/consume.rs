//! The `consume` example: `gpufeed consume` built on its own, for scripts and tests that run it as a
//! separate binary (`cargo run --release --example consume -- --help`). The program is
//! `src/consume.rs`.

#[path = "../src/consume.rs"]
mod consume;

use clap::Parser;

fn main() -> std::process::ExitCode {
    consume::main_with(consume::Args::parse())
}
