"""The `gpufeed` command that the wheel installs beside the Python package: the daemon binary the
wheel build compiled from this source tree (build.rs), run by the console script and by
`python -m gpufeed` through exec (python/gpufeed/_cli.py). Here it packs an .npy file, serves it on
the CPU backend, and the Python package reads a batch from it.

ci.sh runs this file twice: with the suite, and in a fresh virtual environment that holds only the
wheel, NumPy and pytest, with no cargo on PATH (GPUFEED_TEST_FRESH_VENV=1), as a cluster image
would install it."""

import os
import select
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import gpufeed
from gpufeed import _cli

TIMEOUT_S = 60
FRESH_VENV = os.environ.get("GPUFEED_TEST_FRESH_VENV") == "1"


def console_script() -> str:
    """The `gpufeed` script pip installed with the package: beside the interpreter in an
    environment, or in the `bin` beside the package's folder for `pip install --target DIR`. Where
    there is none (the package run from its sources), the tests of the script skip, except in CI."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(gpufeed.__file__)))
    candidates = [os.path.join(os.path.dirname(sys.executable), "gpufeed"),
                  os.path.join(package_parent, "bin", "gpufeed")]
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return candidate
    message = f"no `gpufeed` script installed with the package (looked at {candidates})"
    if FRESH_VENV or os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def run(*args):
    return subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.skipif(not FRESH_VENV, reason="checks ci.sh's fresh environment (GPUFEED_TEST_FRESH_VENV=1)")
def test_the_fresh_environment_has_no_rust_toolchain():
    assert shutil.which("cargo") is None, "cargo is on PATH: the test would not show an install without Rust"
    assert shutil.which("gpufeed") == console_script()


def test_the_command_is_the_daemon_of_this_source_tree():
    assert os.access(_cli.binary(), os.X_OK), f"no executable daemon in the package at {_cli.binary()}"
    for command in ([console_script()], [sys.executable, "-m", "gpufeed"]):
        out = run(*command, "--version")
        assert out.returncode == 0, f"{command} --version: {out.stderr}"
        # The daemon's version and the extension's come from the same workspace version.
        assert out.stdout.strip() == f"gpufeed {gpufeed.__version__}"


def test_the_exit_status_and_usage_are_the_binarys():
    direct = run(_cli.binary(), "no-such-subcommand")
    assert direct.returncode == 2, direct.stderr
    for command in ([console_script()], [sys.executable, "-m", "gpufeed"]):
        out = run(*command, "no-such-subcommand")
        assert (out.returncode, out.stderr) == (direct.returncode, direct.stderr), command


def test_pack_serve_and_read_a_batch(tmp_path):
    command = console_script()
    tokens = np.arange(300 * 4, dtype=np.int32).reshape(300, 4)
    np.save(tmp_path / "tokens.npy", tokens)
    data = tmp_path / "data"
    data.mkdir()
    packed = run(command, "pack", "--out", str(data / "small"), "--field", f"tokens={tmp_path / 'tokens.npy'}")
    assert packed.returncode == 0, packed.stderr

    socket = str(tmp_path / "gpufeed.sock")
    log = open(tmp_path / "daemon.log", "wb")
    daemon = subprocess.Popen(
        [command, "serve", "--data-root", str(data), "--socket", socket, "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )
    try:
        ready, _, _ = select.select([daemon.stdout], [], [], TIMEOUT_S)
        first = daemon.stdout.readline() if ready else ""
        assert first.startswith("gpufeed: serving 1 dataset"), (
            f"daemon said {first!r}: {(tmp_path / 'daemon.log').read_text(errors='replace')}"
        )
        # Exec, not a child process: the PID a supervisor holds is the daemon's, and its signals
        # reach the daemon.
        assert os.path.realpath(f"/proc/{daemon.pid}/exe") == os.path.realpath(_cli.binary())

        with gpufeed.Client(socket) as client:
            stream = client.open_stream("small", batch_size=100)
            with next(iter(stream)) as batch:
                np.testing.assert_array_equal(np.from_dlpack(batch["tokens"]), tokens[:100])
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            status = daemon.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
            raise
        finally:
            log.close()
    assert status == 0, (tmp_path / "daemon.log").read_text(errors="replace")
