#!/usr/bin/env python3
"""Datasets in object storage: a cold epoch against a parallel download of the same bytes, and a
warm epoch against the same dataset on local disk, in one run on this machine.

An S3-compatible server (moto in server mode, `pip install 'moto[server]'`) is started on a loopback
port; a dataset of incompressible f16 rows is packed to it with `gpufeed pack --out s3://...` and to
the data root. Each run, in turn:

- `boto3`: every shard object downloaded by 16 threads with 8 MiB ranged GETs (what `aws s3 cp` and
  s5cmd do), written into files;
- `cold`: a daemon started with an empty object cache, then `gpufeed consume` of the dataset, timed
  from before connecting to the last batch (the shards' fetch, verification and the epoch);
- `warm`: a second epoch on the same daemon, served from the cache;
- `local`: an epoch of the same dataset packed on local disk, same daemon (its second epoch: the
  first verifies its blocks, as the cold epoch did for the cached copy).

Every run is one JSON line in --out; the medians and ratios are printed at the end.

Usage: python3 scripts/bench_object_store.py --binary target/release/gpufeed \
    --out docs/benchmarks/object-store-DATE.jsonl [--mib 256] [--runs 3]
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import boto3
import numpy as np

BUCKET = "bench"
ROW_BYTES = 2048  # 1024 f16 per sample
SHARD_BYTES = 64 << 20
RANGE_BYTES = 8 << 20
THREADS = 16


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_moto(port, log_path):
    """moto on `port`; returns once it serves, its log drained to `log_path`."""
    child = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = open(log_path, "a")
    for line in child.stderr:
        log.write(line)
        if "Running on" in line:
            break
    else:
        raise SystemExit(f"moto exited before serving; see {log_path}")
    threading.Thread(target=lambda: shutil.copyfileobj(child.stderr, log), daemon=True).start()
    return child


def s3_env(port):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ENDPOINT=f"http://127.0.0.1:{port}",
        AWS_ALLOW_HTTP="true",
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    return env


def boto3_download(client, prefix, dest):
    """Every object under `prefix` into `dest` by THREADS threads of ranged GETs; returns bytes."""
    objects = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]
    jobs = []
    for obj in objects:
        path = os.path.join(dest, os.path.basename(obj["Key"]))
        with open(path, "wb") as f:
            f.truncate(obj["Size"])
        for start in range(0, obj["Size"], RANGE_BYTES):
            end = min(start + RANGE_BYTES, obj["Size"]) - 1
            jobs.append((obj["Key"], path, start, end))

    def fetch(job):
        key, path, start, end = job
        body = client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={start}-{end}")["Body"].read()
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, body, start)
        finally:
            os.close(fd)
        return len(body)

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        return sum(pool.map(fetch, jobs))


def start_daemon(binary, root, cache, env):
    socket_path = os.path.join(root, "bench.sock")
    child = subprocess.Popen(
        [binary, "serve", "--data-root", root, "--socket", socket_path, "--device", "cpu",
         "--http", "off", "--dataset", f"data=s3://{BUCKET}/data", "--object-cache-dir", cache],
        stdout=subprocess.PIPE,
        stderr=open(os.path.join(root, "daemon.log"), "a"),
        text=True,
        env=env,
    )
    line = child.stdout.readline()
    if not line.startswith("gpufeed: serving"):
        raise SystemExit(f"daemon said {line!r}; see {root}/daemon.log")
    return child, socket_path


def consume(binary, socket_path, dataset):
    command = [binary, "consume", "--socket", socket_path, "--dataset", dataset, "--batch-size", "256"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    return summary["seconds"], summary["bytes"], " ".join(command)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--binary", default="target/release/gpufeed")
    parser.add_argument("--out", required=True)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    binary = os.path.abspath(args.binary)
    work = tempfile.mkdtemp(prefix="gpufeed-objbench-")
    port = free_port()
    moto = start_moto(port, os.path.join(work, "moto.log"))
    env = s3_env(port)
    client = boto3.client(
        "s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="testing",
        aws_secret_access_key="testing", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    rows = (args.mib << 20) // ROW_BYTES
    data = np.random.default_rng(1).standard_normal((rows, ROW_BYTES // 2)).astype(np.float16)
    np.save(os.path.join(work, "emb.npy"), data)
    root = os.path.join(work, "root")
    os.mkdir(root)
    pack = [binary, "pack", "--quiet", "--codec", "raw", "--field",
            f"emb={os.path.join(work, 'emb.npy')}", "--samples-per-shard", str(SHARD_BYTES // ROW_BYTES)]
    subprocess.run(pack + ["--out", f"s3://{BUCKET}/data", "--name", "data"], check=True, env=env)
    subprocess.run(pack + ["--out", os.path.join(root, "local"), "--name", "local"], check=True, env=env)
    machine = f"{platform.node()}: {os.cpu_count()} CPUs, {platform.machine()}, Linux {platform.release()}"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    results = {}
    with open(args.out, "a") as out:
        def record(kind, run, seconds, nbytes, command):
            line = dict(date=date, machine=machine, kind=kind, run=run, seconds=round(seconds, 4),
                        bytes=nbytes, gb_per_s=round(nbytes / seconds / 1e9, 4), command=command)
            out.write(json.dumps(line) + "\n")
            out.flush()
            results.setdefault(kind, []).append(seconds)
            print(json.dumps(line), flush=True)

        for run in range(args.runs):
            dest = tempfile.mkdtemp(dir=work)
            started = time.perf_counter()
            nbytes = boto3_download(client, "data/shard-", dest)
            record("boto3", run, time.perf_counter() - started, nbytes,
                   f"boto3 get_object, {THREADS} threads, {RANGE_BYTES >> 20} MiB ranges")
            shutil.rmtree(dest)
            cache = tempfile.mkdtemp(dir=work)
            daemon, socket_path = start_daemon(binary, root, cache, env)
            try:
                for kind, dataset in (("cold", "data"), ("warm", "data")):
                    seconds, nbytes, command = consume(binary, socket_path, dataset)
                    record(kind, run, seconds, nbytes, command)
                # The local dataset's first epoch verifies its blocks (once per dataset, as the
                # cold epoch did for the cached one): measured on its second, as `warm` is.
                consume(binary, socket_path, "local")
                seconds, nbytes, command = consume(binary, socket_path, "local")
                record("local", run, seconds, nbytes, command)
            finally:
                daemon.terminate()
                daemon.wait()
            shutil.rmtree(cache)
    moto.kill()
    medians = {kind: statistics.median(values) for kind, values in results.items()}
    print(json.dumps({"medians_s": medians,
                      "cold_vs_boto3": medians["boto3"] / medians["cold"],
                      "warm_vs_local": medians["local"] / medians["warm"]}))
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
