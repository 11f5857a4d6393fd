"""Runs one gpufeed consumer (examples/consume) against a running daemon and records one measurement.

    python3 scripts/e2e/measure.py --jsonl e2e.jsonl --kind emb --temperature cold --batch-size 1024 \
        --bytes-per-sample-in 2048 --daemon-pid PID --cold-file DATASET_DIR -- \
        .gpu/e2e/bin/consume --socket /tmp/gpufeed.sock --dataset emb --batch-size 1024 --dtype f32

`--temperature cold` syncs and drops the page cache first. The consumer's last stdout line is its JSON
summary ({"batches","samples","bytes","seconds",...}, bytes = delivered output bytes); the record adds:
bytes_in (samples x --bytes-per-sample-in: the raw payload, before any compression) and bytes_stored
(samples x --stored-bytes-per-sample, what was read from disk), bytes_out, the rates, the daemon's CPU
seconds over the consumer's lifetime (/proc/PID/stat utime + stime), the consumer's own (rusage of the
waited-for child), host_cpu_seconds = their sum, cores = host_cpu_seconds / wall_seconds (both over the
consumer process's lifetime: its start, the stream's opening and its end included) and gpu_busy_pct.
`seconds` is the consumer's own: from the stream's opening to the last batch. When the consumer was
given `--daemon-pid`, its summary carries the daemon's and its own CPU seconds over that stream
(daemon_cpu_s_stream, consumer_cpu_s_stream): the record adds them with daemon_cores_stream and
consumer_cores_stream (over `seconds`, start-up excluded). A consumer that fails or times out is
recorded with `error` and the tail of its stderr, and the exit status is 1 (the calling script counts
it as a failed step and goes on).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def last_json_line(text):
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jsonl", required=True)
    parser.add_argument("--loader", default="gpufeed")
    parser.add_argument("--kind", required=True)
    parser.add_argument("--temperature", choices=["cold", "warm", "warmup"], required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--bytes-per-sample-in", type=int, required=True)
    parser.add_argument("--stored-bytes-per-sample", type=float)
    parser.add_argument("--daemon-pid", type=int, required=True)
    parser.add_argument("--cold-file", help="with --temperature cold: the file or dataset directory to evict (all caches as root)")
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--no-gpu-busy", dest="gpu_busy", action="store_false")
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra string field for the record (repeatable)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no consumer command after --")

    record = {"loader": args.loader, "kind": args.kind, "temperature": args.temperature,
              "batch_size": args.batch_size, "command": " ".join(command), "date": common.utc_now()}
    for pair in args.set:
        key, _, value = pair.partition("=")
        record[key] = value
    if args.temperature == "cold":
        if args.cold_file is None:
            parser.error("--temperature cold needs --cold-file")
        record["cold_method"] = common.make_cold(args.cold_file)

    sampler = common.GpuBusySampler(args.gpu) if args.gpu_busy else None
    daemon0 = common.pid_cpu_seconds(args.daemon_pid)
    children0 = common.children_cpu_seconds()
    started = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            stdout, _ = process.communicate(timeout=args.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, _ = process.communicate()
            timed_out = True
        ended = time.monotonic()
        stderr.seek(0)
        stderr_text = stderr.read()
    consumer_cpu = common.children_cpu_seconds() - children0
    try:
        daemon_cpu = common.pid_cpu_seconds(args.daemon_pid) - daemon0
    except OSError:
        daemon_cpu = None
    if sampler is not None:
        sampler.stop()
        busy, count = sampler.mean_between(started, ended)
        record.update({"gpu_busy_pct": busy, "gpu_busy_samples": count})
        if sampler.error:
            record["gpu_busy_error"] = sampler.error

    wall = ended - started
    summary = last_json_line(stdout)
    record.update({"wall_seconds": wall, "consumer_cpu_seconds": consumer_cpu,
                   "daemon_cpu_seconds": daemon_cpu, "rc": process.returncode})
    if timed_out or process.returncode != 0 or summary is None:
        record["error"] = ("timed out after %.0f s" % args.timeout if timed_out
                           else f"exit {process.returncode}" if process.returncode != 0
                           else "no JSON summary on stdout")
        record["stderr_tail"] = stderr_text[-2000:]
        record["stdout_tail"] = stdout[-1000:]
        common.emit(record, args.jsonl)
        return 1
    record["consume"] = summary
    samples = summary["samples"]
    record.update({
        "batches": summary["batches"],
        "samples": samples,
        "bytes_in": samples * args.bytes_per_sample_in,
        "bytes_out": summary["bytes"],
        "seconds": summary["seconds"],
        "host_cpu_seconds": consumer_cpu + (daemon_cpu or 0.0),
        "cpu_window_seconds": wall,
        "daemon_cores": daemon_cpu / wall if daemon_cpu is not None and wall > 0 else None,
        "consumer_cores": consumer_cpu / wall if wall > 0 else None,
    })
    stream_seconds = summary["seconds"]
    for who in ("daemon", "consumer"):
        cpu = summary.get(f"{who}_cpu_s_stream")
        if cpu is not None:
            record[f"{who}_cpu_s_stream"] = cpu
            record[f"{who}_cores_stream"] = cpu / stream_seconds if stream_seconds > 0 else None
    if args.stored_bytes_per_sample is not None:
        record["bytes_stored"] = round(samples * args.stored_bytes_per_sample)
        record["gb_per_s_stored"] = (record["bytes_stored"] / summary["seconds"] / 1e9
                                     if summary["seconds"] > 0 else None)
    if stderr_text.strip():
        record["stderr_tail"] = stderr_text[-500:]
    common.finish_record(record)
    common.emit(record, args.jsonl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
