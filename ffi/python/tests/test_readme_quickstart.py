"""The README's CPU-only quickstart, run as written: its blocks are taken from README.md between the
`<!-- quickstart:NAME -->` markers and run in a fresh directory with the `gpufeed` binary and this
interpreter first on PATH, so that a change to a command, a flag or the Python API that the
quickstart does not follow fails here. The install block is not run (CI installs the same way);
its commands are checked instead."""

import json
import os
import pathlib
import re
import select
import signal
import subprocess
import sys

import pytest

from conftest import REPO, gpufeed_bin

# Each step is bounded: the whole quickstart takes a few seconds on the CPU backend.
STEP_TIMEOUT_S = 120
MARKER = re.compile(r"<!-- quickstart:(\w+) -->\n```(\w+)\n(.*?)\n```", re.DOTALL)


def quickstart_blocks():
    readme = (REPO / "README.md").read_text()
    blocks = {name: (language, body) for name, language, body in MARKER.findall(readme)}
    assert set(blocks) == {"install", "pack", "serve", "consume", "python"}, (
        f"README.md's quickstart markers: {sorted(blocks)}")
    return blocks


def shell_commands(body):
    """The commands of a shell block, without comments and blank lines."""
    lines = (line.split("#", 1)[0].strip() for line in body.splitlines())
    return [line for line in lines if line]


@pytest.fixture
def quickstart_env(tmp_path):
    binary = pathlib.Path(gpufeed_bin()).resolve()
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join(
        [str(binary.parent), str(pathlib.Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_step(name, args, cwd, env):
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=STEP_TIMEOUT_S)
    assert done.returncode == 0, (
        f"quickstart step {name!r} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def start_daemon(command, cwd, env):
    """Starts the serve command in its own process group (the shell replaced by the daemon, so that
    its exit status is the daemon's) and waits, within the step bound, for the line saying it
    serves; returns the process and that line."""
    process = subprocess.Popen(["bash", "-c", "exec " + command], cwd=cwd, env=env,
                               stdout=subprocess.PIPE,
                               stderr=open(cwd / "daemon.log", "wb"), text=True,
                               start_new_session=True)
    ready, _, _ = select.select([process.stdout], [], [], STEP_TIMEOUT_S)
    line = process.stdout.readline() if ready else ""
    return process, line


def stop_daemon(process):
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def test_the_install_block_is_what_ci_installs():
    language, body = quickstart_blocks()["install"]
    assert language == "sh"
    assert shell_commands(body) == ["python3 -m pip install ./ffi/python"]


def test_the_quickstart_runs_as_written(tmp_path, quickstart_env):
    blocks = quickstart_blocks()
    env = quickstart_env

    language, body = blocks["pack"]
    assert language == "sh"
    run_step("pack", ["bash", "-euo", "pipefail", "-c", body], tmp_path, env)
    assert (tmp_path / "data" / "my-set" / "manifest.json").exists()

    language, body = blocks["serve"]
    assert language == "sh" and len(shell_commands(body)) == 1
    daemon, line = start_daemon(shell_commands(body)[0], tmp_path, env)

    def log():
        return (tmp_path / "daemon.log").read_text(errors="replace")

    try:
        assert line.startswith("gpufeed: serving 1 dataset(s) on gpufeed.sock"), (
            f"daemon said {line!r}: {log()}")

        language, body = blocks["consume"]
        assert language == "sh"
        summary = json.loads(run_step("consume", ["bash", "-euo", "pipefail", "-c", body],
                                      tmp_path, env))
        # 20 000 samples in batches of 256, the last partial step dropped.
        assert summary["batches"] == 20000 // 256, summary

        language, body = blocks["python"]
        assert language == "python"
        out = run_step("python", [sys.executable, "-c", body], tmp_path, env)
        assert out.strip().splitlines()[-1] == "resumed at step 10", out
        state = json.loads((tmp_path / "data-state.json").read_text())
        assert state["cursor"] == 10 * 256 and state["shuffle"] == "full", state
    finally:
        stop_daemon(daemon)
    assert daemon.returncode == 0, f"the daemon exited {daemon.returncode} on SIGTERM: {log()}"
