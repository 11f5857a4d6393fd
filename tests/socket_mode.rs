//! Regression test: the daemon made its socket 0600 whatever `--allow-uid` said, so a consumer of
//! another uid that the allowlist names could not even `connect` (the kernel refuses a socket's
//! connect without write permission, before the daemon sees the peer's credentials). The socket is
//! now owner-only only while the allowlist is the daemon's own uid; with other uids in it the socket
//! is 0666 and the allowlist, checked on every connection, decides.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Stdio;

fn socket_mode_with(extra: &[&str]) -> u32 {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let socket = root.path().join("gpufeed.sock");
    let daemon = common::daemon::start_daemon(
        Path::new(env!("CARGO_BIN_EXE_gpufeed")),
        &data,
        socket.clone(),
        "cpu",
        extra,
        Stdio::null(),
    );
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    drop(daemon);
    mode
}

#[test]
fn the_socket_is_owner_only_unless_the_allowlist_names_other_uids() {
    let own = nix::unistd::geteuid().as_raw();
    assert_eq!(socket_mode_with(&[]), 0o600);
    let own_only = own.to_string();
    assert_eq!(socket_mode_with(&["--allow-uid", &own_only]), 0o600);
    let other = own.wrapping_add(1).to_string();
    assert_eq!(
        socket_mode_with(&["--allow-uid", &own_only, "--allow-uid", &other]),
        0o666
    );
}
