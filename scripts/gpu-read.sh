#!/usr/bin/env bash
# Runs on the GPU machine after scripts/gpu-stage-read.sh staged .gpu/read/ here, in one command:
#   1. GPU tests: serving (zero-copy reads in every order with a budget smaller than the dataset,
#      bit-exact against the source and the CPU backend; corrupt blocks; 100 killed consumers), the
#      kernels (the gather kernel's region table among them) and the read paths (gpu_storage);
#   2. compute-sanitizer memcheck over the zero-copy serving test, the daemon child included;
#   3. the read-path benchmark (READ_* settings below): an fp16 .npy of READ_GIB GiB, [N, 1024] rows of
#      2 KiB, packed raw into shards of 512 MiB; a daemon with the default registration budget, then
#      one with a budget of a third of the dataset (cases third-copyN: with N loader copy threads
#      instead of the default), and one with zero-copy off (full shuffle staging whole blocks, for
#      comparison); per order (none, window of 4 shards, full) a consumer process (`consume`, fp32
#      device batches of READ_BATCH rows) per run, serving READ_EPOCHS (3) epochs one after another
#      as a training process does, each next epoch's stream opened when READ_OPEN_AHEAD (0.3) of the
#      current one is left; one warm-up run then READ_REPEAT measured runs, each within 120 s. The full
#      shuffle beyond the budget (third) runs once, one epoch within READ_BEYOND_S (60) seconds: a
#      cliff shows as a low rate, or as TIMED OUT with the rate's upper bound (recorded, not failed).
#      Shapes not run (zero-copy off in order and window; --zero-copy always beyond dataset order) are
#      said so, in the output and the jsonl. KvikIO (4, 8 and 16 threads, each a line, 8 batches in
#      flight, read + astype) and the simplest strong peer (the .npy mapped and registered once, copy
#      + astype) interleaved with gpufeed's in-order runs, and after the full-shuffle runs a PyTorch
#      DataLoader in its strong form (a RandomSampler's batches fetched whole with __getitems__,
#      sorted indices, pinned; best of 4/8/16 workers, 64 batches each timed after a warm-up; values
#      checked by index). Every run is one JSON line in $OUT/read.jsonl, with the consumer's stream
#      seconds, the process's wall seconds (from before it connects), the daemon's and the consumer's
#      CPU seconds over the stream (read by the consumer at its clock's start and end:
#      daemon_cores_stream, consumer_cores_stream; daemon_cores is the older figure over the process's
#      wall) and the bytes the daemon read (from /metrics) per byte of the epoch. Any consumer or peer
#      run that fails (or a daemon that does not start) fails step 3, after the remaining runs.
#      READ_DAEMON_FLAGS: extra flags for every daemon (e.g. "--registered-window 1G"). READ_PREFETCH:
#      the consumer's --prefetch (4); READ_PREFETCHES="4 8": each run once per value, interleaved.
#      READ_KVIKIO_THREADS: KvikIO's thread counts (4,8,16). READ_BENCH_ONLY=1: step 3 only;
#      READ_TESTS_ONLY=1: steps 1 and 2 only. READ_COLD_ROUNDS=N: after step 3, N interleaved cold
#      rounds (see read_cold); READ_BENCH_ONLY=1 READ_CASES=none READ_COLD_ROUNDS=N: cold rounds only.
#      READ_TORCH_PEER=0: no PyTorch DataLoader peer (said so).
#      READ_BENCH_S: the seconds step 3 may take (300: the full shuffle beyond the budget and the
#      peers' sweeps take up to about a minute more than the 240 it had before).
# Any failed step makes the script exit non-zero; logs go to $OUT; a summary is printed last, with
# the count of tests that said `SKIPPED:` (could not test what they are for on this machine).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

OUT="${OUT:-/tmp/gpufeed-read}"
budget_s="${GPUFEED_CHECK_BUDGET_S:-560}"
step_name_width=14
. scripts/lib/check.sh
. scripts/lib/staged.sh
if [ "${1:-}" != --bench-only ] && [ -z "${READ_BENCH_ONLY:-}" ]; then
  {
    date -u
    cat "$bin/COMMIT"
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
    free -g | head -2
    ulimit -l
  } >"$OUT/tests.log" 2>&1
  # The two-device test runs on the 2-GPU kind (scripts/gpu-multi.sh).
  step gpu_serve tests 200 60 "$bin/gpu_serve" --include-ignored --nocapture --test-threads=1 \
    --skip two_devices
  step gpu_kernels tests 60 20 "$bin/gpu_kernels" --include-ignored --test-threads=4
  # The read paths (page cache, bounce, cuFile in compatibility mode) on multi-GiB files, cold and
  # warm. The udev entry cuFile needs is written already (scripts/lib/staged.sh), so the test of the
  # fallback without it runs in scripts/gpu-storage.sh only.
  step gpu_storage tests 200 60 env GPUFEED_TEST_DIR=/var/tmp "$bin/gpu_storage" --include-ignored \
    --test-threads=1 --skip cufile_falls_back
fi

# ----- the read-path benchmark -----
gib=${READ_GIB:-8}
# READ_KIND=tokens: LZ4-compressed int32 tokens (make_data.py's zipf rows of 2048, 8 KiB, packed with
# codec auto: LZ4 and a byte shuffle) instead of the fp16 embeddings; int32 batches (no conversion).
kind=${READ_KIND:-emb}
if [ "$kind" = tokens ]; then
  source_npy_name=tokens_i32.npy row_bytes=8192 dtype_flags=
  export READ_OUT_PER_IN=1
else
  source_npy_name=emb_fp16.npy row_bytes=2048 dtype_flags="--dtype f32"
fi
batch=${READ_BATCH:-4096}
repeat=${READ_REPEAT:-3}
work=/var/tmp/gpufeed-read
source_npy="$work/npy/$source_npy_name"
jsonl="$OUT/read.jsonl"
socket=/tmp/gpufeed-read.sock
http=127.0.0.1:7171

# metric NAME: the sum of the daemon's /metrics samples of NAME.
metric() {
  python3 - "$1" <<'PY'
import sys, urllib.request
name = sys.argv[1]
text = urllib.request.urlopen("http://127.0.0.1:7171/metrics", timeout=5).read().decode()
print(sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(name)))
PY
}

cpu_seconds() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }

start_daemon() {
  rm -f "$socket"
  # shellcheck disable=SC2086  # daemon_env: NAME=VALUE words of an env: case
  env ${daemon_env:-} "${daemon_bin:-$bin}/gpufeed" serve --data-root "$work/data" --socket "$socket" --device cuda:0 --http "$http" \
    "$@" ${READ_DAEMON_FLAGS:-} >"$work/daemon.out" 2>>"$OUT/daemon.log" &
  daemon=$!
  for _ in $(seq 1 300); do
    grep -q "serving" "$work/daemon.out" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "daemon did not start" >&2
  return 1
}

stop_daemon() {
  kill -TERM "$daemon" 2>/dev/null
  wait "$daemon" 2>/dev/null
}

# field_flags: `--field NAME` for each field of the dataset, from the control API. A training loop
# names the fields it wants; without names, `consume --dtype` would open a short probe stream first
# to learn them (1 to 1.5 ms of the timed epoch in runs up to 45).
field_flags() {
  python3 -c 'import json,urllib.request; d=json.load(urllib.request.urlopen("http://127.0.0.1:7171/v1/datasets/emb", timeout=5)); print(" ".join("--field " + f for f in d["dataset"]["fields"]))'
}

# run_gpufeed CASE ORDER RUN [BOUND_S]: one consumer process over READ_EPOCHS epochs, killed after
# BOUND_S seconds (120); one JSON line. The consumer reads the daemon's CPU time itself when its clock
# starts and after its last batch (--daemon-pid), so that daemon_cores_stream and consumer_cores_stream
# are counted over the stream (stream_seconds); daemon_cores is the older figure, the daemon's CPU over
# the consumer process's whole wall time, start-up included. A consumer that fails, times out or prints
# no summary gets a line with `error` (and `timed_out` with the bound, and the most bytes it could
# have consumed in it: gb_per_s_in_upper_bound) and makes this function fail.
run_gpufeed() {
  local case=$1 order=$2 run=$3 bound=${4:-120} read0 read1 cpu0 cpu1 t0 t1 line fields status
  fields=$(field_flags)
  read0=$(metric gpufeed_read_bytes_total)
  cpu0=$(cpu_seconds "$daemon")
  t0=$(date +%s.%N)
  # shellcheck disable=SC2086  # dtype_flags, fields and READ_CONSUME_FLAGS are lists of words
  line=$(timeout "$bound" "$bin/consume" --socket "$socket" --dataset emb --device cuda:0 \
    --batch-size "$batch" $dtype_flags $fields --shuffle "$order" --window-shards 4 --seed "$run" \
    --prefetch "${READ_PREFETCH:-4}" --epochs "${READ_EPOCHS:-3}" --open-ahead "${READ_OPEN_AHEAD:-0.3}" \
    --daemon-pid "$daemon" ${READ_CONSUME_FLAGS:-} | tail -1)
  status=$?
  t1=$(date +%s.%N)
  cpu1=$(cpu_seconds "$daemon")
  read1=$(metric gpufeed_read_bytes_total)
  python3 - "$case" "$order" "$run" "$t0" "$t1" "$cpu0" "$cpu1" "$read0" "$read1" "$batch" "$line" \
    "$status" "$bound" "$(stat -c %s "$source_npy")" >>"$jsonl" <<'PY'
import json, os, sys
case, order, run, t0, t1, cpu0, cpu1, read0, read1, batch, line, status, bound, npy_bytes = sys.argv[1:]
status, bound = int(status), float(bound)
try:
    summary = json.loads(line)
except ValueError:
    summary = {"error": line[-300:] or "no summary on stdout"}
wall = float(t1) - float(t0)
bytes_in = summary.get("bytes", 0) // int(os.environ.get("READ_OUT_PER_IN", "2"))
stream_seconds = summary.get("seconds")
per_stream = lambda cpu: cpu / stream_seconds if cpu is not None and stream_seconds else None
epochs = int(os.environ.get("READ_EPOCHS", "3"))
record = {
    "loader": "gpufeed", "case": case, "order": order, "run": int(run), "batch_size": int(batch),
    "prefetch": int(os.environ.get("READ_PREFETCH", "4")),
    "epochs": summary.get("epochs"), "open_ahead": float(os.environ.get("READ_OPEN_AHEAD", "0.3")),
    "epoch_times": summary.get("epoch_times"),
    "stream_seconds": stream_seconds, "wall_seconds": wall,
    "first_batch_seconds": summary.get("first_batch_seconds"),
    "bytes_in": bytes_in, "bytes_out": summary.get("bytes", 0),
    "gb_per_s_in_stream": bytes_in / stream_seconds / 1e9 if stream_seconds else None,
    "gb_per_s_in_wall": bytes_in / wall / 1e9,
    # Over the consumer process's whole wall time (start-up included): kept for older reports.
    "daemon_cores": (float(cpu1) - float(cpu0)) / wall,
    # Over the stream (stream_seconds), read by the consumer at its clock's start and end.
    "daemon_cpu_s_stream": summary.get("daemon_cpu_s_stream"),
    "consumer_cpu_s_stream": summary.get("consumer_cpu_s_stream"),
    "daemon_cores_stream": per_stream(summary.get("daemon_cpu_s_stream")),
    "consumer_cores_stream": per_stream(summary.get("consumer_cpu_s_stream")),
    "read_bytes": float(read1) - float(read0),
    "read_per_byte_in": (float(read1) - float(read0)) / bytes_in if bytes_in else None,
    "handoff_us_p50": summary.get("handoff_us_p50"), "handoff_us_p99": summary.get("handoff_us_p99"),
    "exit_status": status, "bound_seconds": bound,
}
if status == 124:
    record["timed_out"] = True
    record["error"] = f"timed out after {bound:.0f} s"
    # The whole run's payload (every epoch, or --steps' share is not known here) in the bound: the
    # rate was below this.
    record["gb_per_s_in_upper_bound"] = int(npy_bytes) * epochs / bound / 1e9
elif status != 0:
    record["error"] = f"consume exited {status}: " + summary.get("error", "")
elif "error" in summary:
    record["error"] = summary["error"]
print(json.dumps(record))
PY
  tail -1 "$jsonl"
  [ "$status" -ne 0 ] && return "$status"
  [ -n "$line" ] || return 1
}

# skip_shape CASE ORDER REASON: a shape this benchmark does not run, said on stdout and recorded in
# the jsonl (the summary lists them), so that a missing row is never silent.
skip_shape() {
  echo "skipped: $1 $2: $3"
  printf '{"loader": "gpufeed", "case": "%s", "order": "%s", "skipped": "%s"}\n' "$1" "$2" "$3" >>"$jsonl"
}

# failed_run WHAT: counts a failed consumer or peer run (read_bench fails at its end when any did).
failed_runs=()
failed_run() {
  echo "FAILED: $1" >&2
  failed_runs+=("$1")
}

# run_torch_random: the PyTorch DataLoader peer of a full shuffle in its strong form: a RandomSampler
# whose batches of indices are fetched whole (__getitems__, indices sorted, one fancy index of the
# memory-mapped .npy per batch), pinned, fp32 on the GPU; best of 4, 8 and 16 workers, each timed over
# 64 batches after a warm-up (worker start-up and the first prefetched batches not timed); a sampled
# batch checked against the source rows by index (`verified`).
run_torch_random() {
  timeout 300 python3 scripts/e2e/peers.py torch --random --file "$source_npy" \
    --batch-sizes "$batch" --temperatures warm --workers 4,8,16 --batches-max 64 --jsonl "$jsonl" \
    --no-gpu-busy | tail -3
}

# run_kvikio: KvikIO's reads (8 in flight) and a conversion per batch, with 4, 8 and 16 threads (each
# line says its count; the summary gives each count and the best).
run_kvikio() {
  env PYTHONPATH=/tmp/kvikio-site timeout 120 python3 scripts/e2e/peers.py kvikio --file "$source_npy" \
    --batch-sizes "$batch" --temperatures warm --repeat 1 --threads "${READ_KVIKIO_THREADS:-4,8,16}" \
    --depth 8 --jsonl "$jsonl" --no-gpu-busy | tail -3
}

# The simplest strong peer: the .npy mapped and registered once, each batch copied from it and
# converted with CuPy (scripts/e2e/peers.py register-copy), interleaved like KvikIO.
run_register_copy() {
  timeout 120 python3 scripts/e2e/peers.py register-copy --file "$source_npy" --batch-sizes "$batch" \
    --temperatures warm --repeat 1 --depth 4 --jsonl "$jsonl" --no-gpu-busy | tail -1
}

read_bench() {
  set -e
  : >"$jsonl"
  mkdir -p "$work/npy" "$work/data"
  if [ "$kind" = tokens ]; then
    python3 scripts/e2e/make_data.py --out-dir "$work/npy" --emb-gib 0 --tokens-gib "$gib"
  else
    python3 scripts/e2e/make_data.py --out-dir "$work/npy" --emb-gib "$gib" --tokens-gib 0
  fi
  # The dataset is called "emb" whatever its kind; shards of 512 MiB raw. A later invocation on the
  # same machine reuses it when it was packed, whole, by this build from the same .npy (same size
  # and time).
  local packed_from want
  packed_from="$work/emb.packed-from"
  want="$(cat "$bin/COMMIT" 2>/dev/null) $(stat -c '%s %Y' "$source_npy") $(( (512 << 20) / row_bytes ))"
  if [ -d "$work/data/emb" ] && [ "$(cat "$packed_from" 2>/dev/null)" = "$want" ]; then
    echo "reusing $work/data/emb, packed from $source_npy by this build"
  else
    rm -rf "$work/data/emb" "$packed_from"
    "$bin/gpufeed" pack --out "$work/data/emb" --samples-per-shard $(( (512 << 20) / row_bytes )) "$source_npy"
    echo "$want" >"$packed_from"
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kvikio-site .gpu/read/whl/*.whl || echo "kvikio: not installed"
  cat "$source_npy" >/dev/null
  local third=$(( (gib << 30) / 3 ))
  # Every consumer and peer run is checked (failed_run), not stopped at: the remaining runs still
  # measure, and the step fails at the end when any failed.
  set +e
  failed_runs=()
  for case in ${READ_CASES:-default always third zero-copy-off}; do
    local started=0
    case $case in
      default) start_daemon && started=1 ;;
      always) start_daemon --zero-copy always && started=1 ;;
      third) start_daemon --registered-memory-max "$third" && started=1 ;;
      third-copy*) start_daemon --registered-memory-max "$third" --loader-copy-threads "${case#third-copy}" && started=1 ;;
      zero-copy-off) start_daemon --zero-copy off && started=1 ;;
      # env:NAME=VALUE,NAME=VALUE: the default daemon with those tuning variables set.
      env:*) daemon_env=$(echo "${case#env:}" | tr , ' ') start_daemon && started=1 ;;
      # flags:FLAG,VALUE,...: the default daemon with those flags (commas for spaces), e.g.
      # flags:--device-shard-memory,1G.
      # shellcheck disable=SC2046  # the flags are words
      flags:*) start_daemon $(echo "${case#flags:}" | tr , ' ') && started=1 ;;
      # bin:DIR: the daemon binary staged in DIR (another build, for an A/B); bin:DIR@NAME=VALUE,...
      # with those variables set too.
      bin:*@*) daemon_bin=$(echo "${case#bin:}" | cut -d@ -f1) daemon_env=$(echo "${case#*@}" | tr , ' ') start_daemon && started=1 ;;
      bin:*) daemon_bin=${case#bin:} start_daemon && started=1 ;;
      none) continue ;;  # only the data (for the cold rounds)
      *) failed_run "case $case: unknown (READ_CASES)"; continue ;;
    esac
    if [ "$started" != 1 ]; then
      failed_run "case $case: the daemon did not start (daemon.log)"
      stop_daemon
      continue
    fi
    # The status is informational: a daemon that cannot answer it fails its consumers' runs below.
    python3 -c 'import json,urllib.request; print(json.load(urllib.request.urlopen("http://127.0.0.1:7171/v1/status"))["serving"])' \
      || echo "case $case: /v1/status did not answer"
    for order in ${READ_ORDERS:-none window full}; do
      if [ "$case" = zero-copy-off ] && [ "$order" != full ]; then
        skip_shape "$case" "$order" "zero-copy off changes only the full shuffle's path"
        continue
      fi
      if [ "$case" = always ] && [ "$order" != none ]; then
        skip_shape "$case" "$order" "--zero-copy always is measured in dataset order only"
        continue
      fi
      local runs=$repeat bound=120 epochs=${READ_EPOCHS:-3} beyond=0
      if [ "$case" = zero-copy-off ]; then
        # Whole blocks staged per row: about 20 s an epoch; one run shows the difference.
        runs=1
      elif [ "${case%%-copy*}" = third ] && [ "$order" = full ]; then
        # A full shuffle beyond the registration budget: one epoch, one run, within READ_BEYOND_S
        # (60) seconds; a cliff shows as a low rate, or as a timeout with the rate's upper bound.
        runs=1 bound=${READ_BEYOND_S:-60} epochs=1 beyond=1
      else
        READ_EPOCHS=$epochs run_gpufeed "$case-warmup" "$order" 0 \
          || failed_run "gpufeed $case-warmup $order"
      fi
      for run in $(seq 1 "$runs"); do
        # READ_PREFETCHES="4 8": each run once per slot count, interleaved.
        for prefetch in ${READ_PREFETCHES:-${READ_PREFETCH:-4}}; do
          READ_EPOCHS=$epochs READ_PREFETCH=$prefetch run_gpufeed "$case" "$order" "$run" "$bound"
          local rc=$?
          if [ "$rc" -eq 124 ] && [ "$beyond" = 1 ]; then
            # Beyond the budget the bound is the measurement (the summary says TIMED OUT).
            echo "TIMED OUT: gpufeed $case $order run $run after ${bound} s (recorded, with the rate's upper bound)"
          elif [ "$rc" -ne 0 ]; then
            failed_run "gpufeed $case $order run $run prefetch $prefetch (exit $rc)"
          fi
        done
        if [ "$case" = default ] && [ "$order" = none ]; then
          run_kvikio || failed_run "kvikio run $run"
          run_register_copy || failed_run "register-copy run $run"
        fi
      done
      if [ "$case" = default ] && [ "$order" = full ]; then
        if [ "${READ_TORCH_PEER:-1}" = 0 ]; then
          echo "skipped: the PyTorch DataLoader peer of the full shuffle (READ_TORCH_PEER=0)"
        else
          run_torch_random || failed_run "torch-random"
        fi
      fi
    done
    python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:7171/metrics").read().decode())' \
      | grep -E "read_bytes" >>"$OUT/daemon.log" || echo "case $case: /metrics did not answer"
    stop_daemon
  done
  if [ "${#failed_runs[@]}" -ne 0 ]; then
    printf 'FAILED run: %s\n' "${failed_runs[@]}"
    return 1
  fi
}
# read_cold: READ_COLD_ROUNDS interleaved cold rounds (page cache dropped before each measurement;
# gpufeed with a fresh daemon each time, as pinned windows survive drop_caches): dd iflag=direct of
# the .npy (the disk's sequential pace), gpufeed in dataset order and in a window shuffle (a whole
# epoch), KvikIO cold, a random 4 KiB O_DIRECT read probe at queue depth 64 (the disk's random pace),
# and gpufeed in a full shuffle over its first READ_COLD_FULL_STEPS batches. Lines in $OUT/read.jsonl
# (case "cold"). Expects read_bench's data (run after it, or with READ_COLD_ONLY=1 after a bench).
read_cold() {
  set -e
  local npy="$source_npy" round order cold_failed=0
  drop() { sync; echo 3 >/proc/sys/vm/drop_caches; }
  for round in $(seq 1 "${READ_COLD_ROUNDS:-3}"); do
    drop
    dd if="$npy" of=/dev/null bs=16M iflag=direct 2>&1 | python3 -c 'import sys,json,re; l=sys.stdin.read(); m=re.search(r"(\d+) bytes.*?([\d.]+) s",l); b,s=int(m[1]),float(m[2]); print(json.dumps({"loader":"dd-direct","case":"cold","run":int(sys.argv[1]),"bytes":b,"seconds":s,"gb_per_s_in":b/s/1e9}))' "$round" >>"$jsonl"
    tail -1 "$jsonl"
    for order in none window; do
      start_daemon
      drop
      READ_EPOCHS=1 run_gpufeed cold "$order" "$round" || cold_failed=$((cold_failed + 1))
      stop_daemon
    done
    env PYTHONPATH=/tmp/kvikio-site python3 scripts/e2e/peers.py kvikio --file "$npy" \
      --batch-sizes "$batch" --temperatures cold --repeat 1 --threads 8 --depth 8 --jsonl "$jsonl" \
      --no-gpu-busy | tail -1
    drop
    python3 scripts/random_read_probe.py --file "$npy" --depth 64 --seconds 5 \
      | python3 -c 'import json,sys; d=json.load(sys.stdin); d.update(case="cold", run=int(sys.argv[1])); print(json.dumps(d))' "$round" >>"$jsonl"
    tail -1 "$jsonl"
    start_daemon
    drop
    READ_EPOCHS=1 READ_CONSUME_FLAGS="--steps ${READ_COLD_FULL_STEPS:-16}" run_gpufeed cold full "$round" \
      || cold_failed=$((cold_failed + 1))
    stop_daemon
  done
  # A failed consumer is counted, not stopped at (its daemon is stopped first), and fails the step.
  [ "$cold_failed" -eq 0 ] || { echo "FAILED: $cold_failed cold consumer run(s)"; return 1; }
}
if [ "${1:-}" = --cold-only ]; then
  read_cold
  exit $?
fi
if [ "${1:-}" = --bench-only ]; then
  read_bench
  exit $?
fi
[ -z "${READ_TESTS_ONLY:-}" ] && step read_bench bench "${READ_BENCH_S:-300}" 60 bash "$0" --bench-only
[ -n "${READ_COLD_ROUNDS:-}" ] && step read_cold bench 400 60 bash "$0" --cold-only
# API errors are not reported: libcufile's own cuFileDriverOpen frees an invalid pointer once per
# process (an error inside NVIDIA's library, seen in the first run); kernel memory errors still are.
[ -z "${READ_BENCH_ONLY:-}" ] && step memcheck sanitizer 200 60 compute-sanitizer --error-exitcode 99 --print-limit 20 \
  --report-api-errors no --target-processes all --tool memcheck \
  "$bin/gpu_serve" --include-ignored --test-threads=1 zero_copy

grep -E '^test result|FAILED|panicked' "$OUT/tests.log" | head -20
grep -E '^=== |ERROR SUMMARY' "$OUT/sanitizer.log" | cut -c1-160
[ -s "$jsonl" ] && python3 - "$jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
prefetches = {r.get("prefetch") for r in rows if r.get("loader") == "gpufeed" and "skipped" not in r}
groups, timed_out, failed, skipped = {}, [], [], []
for r in rows:
    if "skipped" in r:
        skipped.append(r)
    elif r.get("loader") == "gpufeed" and r.get("timed_out"):
        timed_out.append(r)
    elif "error" in r:
        failed.append(r)
    elif r.get("loader") == "gpufeed" and "warmup" not in r["case"]:
        case = r["case"] if len(prefetches) < 2 else f'{r["case"]}, prefetch {r.get("prefetch")}'
        groups.setdefault((case, r["order"]), []).append(r)
    elif r.get("loader", "").startswith("kvikio"):
        groups.setdefault((f'kvikio-{r.get("temperature", "warm")}, {r.get("threads")} threads', "none"), []).append(r)
    elif r.get("loader") == "register-copy":
        groups.setdefault(("register-copy", "none"), []).append(r)
    elif r.get("loader") == "torch-random":
        groups.setdefault((f'torch-random, {r.get("workers")} workers', "full"), []).append(r)
    elif r.get("loader") in ("dd-direct", "random-read-probe"):
        groups.setdefault((r["loader"], "cold"), []).append(r)
print("| case | order | runs | GB/s in (stream) | GB/s in (wall) | daemon cores (stream) | consumer cores (stream) | daemon cores (process wall) | read / byte in |")
print("|---|---|---|---|---|---|---|---|---|")
fmt = lambda v: "" if v != v else f"{v:.2f}"
best_of = {}
for (case, order), rs in groups.items():
    med = lambda k: statistics.median([r[k] for r in rs if r.get(k) is not None] or [float("nan")])
    if not rs[0].get("loader") == "gpufeed":
        for r in rs:
            r.setdefault("gb_per_s_in", r.get("gb_per_s"))
        best = max(r["gb_per_s_in"] for r in rs)
        unverified = sum(1 for r in rs if r.get("verified") is False)
        note = f" ({unverified} NOT VERIFIED)" if unverified else ""
        print(f"| {case}{note} | {order} | {len(rs)} | {med('gb_per_s_in'):.2f} (best {best:.2f}) | | | {fmt(med('cores'))} | | |")
        peer = case.split(",")[0]
        if med("gb_per_s_in") > best_of.get(peer, ("", -1.0))[1]:
            best_of[peer] = (case, med("gb_per_s_in"))
    else:
        print(f"| {case} | {order} | {len(rs)} | {med('gb_per_s_in_stream'):.2f} | {med('gb_per_s_in_wall'):.2f} "
              f"| {fmt(med('daemon_cores_stream'))} | {fmt(med('consumer_cores_stream'))} | {med('daemon_cores'):.2f} "
              f"| {fmt(med('read_per_byte_in'))} |")
for peer, (case, rate) in best_of.items():
    if peer in ("kvikio-warm", "kvikio-cold", "torch-random"):
        print(f"best {peer}: {case}, {rate:.2f} GB/s in (median)")
for r in timed_out:
    print(f"TIMED OUT: gpufeed {r['case']} {r['order']} run {r['run']} after {r['bound_seconds']:.0f} s: "
          f"below {r['gb_per_s_in_upper_bound']:.2f} GB/s in")
for r in failed:
    print(f"FAILED: {r.get('loader')} {r.get('case', '')} {r.get('order', '')} run {r.get('run', '')}: {str(r['error'])[:160]}")
for r in skipped:
    print(f"skipped: {r.get('loader')} {r.get('case')} {r.get('order')}: {r['skipped']}")
PY
step_summary
# Any failed step fails the script.
! printf '%s\n' "${summary[@]}" | grep -q FAIL
