"""Helpers shared by the end-to-end benchmark scripts (peers.py, measure.py): page-cache control, CPU
time, GPU busy sampling and the measurement record. Standard library only."""
import json
import os
import resource
import subprocess
import threading
import time

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds():
    """User + system CPU seconds of this process and of its children that have been waited for
    (DataLoader workers count once they are joined)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def children_cpu_seconds():
    """User + system CPU seconds of the children of this process that have been waited for."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


def pid_cpu_seconds(pid):
    """User + system CPU seconds of process `pid`, all its threads (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as stat:
        text = stat.read()
    # Fields after the command name, which is in parentheses and may hold spaces.
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is field 3 (state), so field 14 (utime) is fields[11] and field 15 (stime) fields[12].
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


def make_cold(path):
    """Evicts `path` (a file, or every file under a directory) from the page cache: all caches when
    root (after a sync, so that no dirty page stays), else through posix_fadvise. Returns the method."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    if os.path.isdir(path):
        files = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    else:
        files = [path]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed"


def make_warm(path):
    """Reads `path` once through the page cache. Returns the seconds it took."""
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, 64 << 20):
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - started


class GpuBusySampler:
    """Samples `nvidia-smi --query-gpu=utilization.gpu` every `interval_ms` in the background.

    utilization.gpu is the share of the sample period in which at least one kernel ran; copies by the
    DMA engines alone do not count. Periods shorter than the interval get few or no samples, so the
    count goes with the mean. Start it before reading CPU times and stop it after, so that nvidia-smi's
    own CPU time (counted for children once reaped) is never in a measurement.
    """

    def __init__(self, gpu_index=0, interval_ms=100):
        self.interval_s = interval_ms / 1000
        self.samples = []
        self.error = None
        self._first = threading.Event()
        try:
            self._process = subprocess.Popen(
                ["nvidia-smi", "--id", str(gpu_index), "--query-gpu=utilization.gpu",
                 "--format=csv,noheader,nounits", "-lms", str(interval_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as error:
            self._process = None
            self.error = f"nvidia-smi: {error}"
            return
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        # nvidia-smi takes a while to start; a measurement begun earlier would go unsampled.
        if not self._first.wait(5):
            self.error = "nvidia-smi printed no sample within 5 s"

    def _read(self):
        for line in self._process.stdout:
            try:
                self.samples.append((time.monotonic(), float(line.strip())))
            except ValueError:
                continue
            self._first.set()

    def stop(self):
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(5)

    def mean_between(self, start, end):
        """(mean utilization %, sample count) of the samples taken from `start` to one interval after
        `end` (a sample reports the period before it), in time.monotonic() seconds."""
        values = [value for when, value in self.samples
                  if start < when <= end + self.interval_s]
        if not values:
            return None, 0
        return sum(values) / len(values), len(values)


def finish_record(record):
    """Adds the derived rates to a record holding samples, bytes_in, bytes_out, seconds and
    host_cpu_seconds, and returns it."""
    seconds = record["seconds"]
    record["samples_per_s"] = record["samples"] / seconds if seconds > 0 else None
    record["gb_per_s_in"] = record["bytes_in"] / seconds / 1e9 if seconds > 0 else None
    record["gb_per_s_out"] = record["bytes_out"] / seconds / 1e9 if seconds > 0 else None
    cpu_window = record.get("cpu_window_seconds", seconds)
    record["cores"] = record["host_cpu_seconds"] / cpu_window if cpu_window > 0 else None
    return record


# Records emitted with `verified` false: a peer whose batches did not match the source measured
# something else, so its script exits non-zero (peers.py's main).
unverified_records = []


def emit(record, jsonl_path=None):
    """Prints the record as one JSON line and appends it to `jsonl_path` when given."""
    if record.get("verified") is False:
        unverified_records.append(record)
    line = json.dumps(record, sort_keys=True)
    print(line, flush=True)
    if jsonl_path:
        with open(jsonl_path, "a") as out:
            out.write(line + "\n")


def utc_now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
