"""The `gpufeed` command of this install: the daemon and its tools (`gpufeed serve`, `gpufeed pack`,
...), a binary in this package that the wheel build compiled from the same source tree as the
extension. The console script and `python -m gpufeed` exec it in place of the Python process, so
that its arguments, exit status and signals (SIGTERM from a service manager, Ctrl-C) are the
binary's own, and a supervisor's PID is the daemon's."""

import os
import sys


def binary() -> str:
    """The path of the bundled `gpufeed` binary."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin", "gpufeed")


def main() -> None:
    path = binary()
    if not os.access(path, os.X_OK):
        sys.exit(
            f"gpufeed: this install of the Python package has no daemon binary at {path}: install "
            "a wheel built by `pip wheel ./ffi/python` from a gpufeed checkout, or build the "
            "daemon with `cargo install --locked --path .`"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    # argv[0] is the binary's own path: its usage lines then say `gpufeed`, also under
    # `python -m gpufeed`.
    os.execv(path, [path, *sys.argv[1:]])
