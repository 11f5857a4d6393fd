#!/usr/bin/env bash
# End-to-end benchmark (issue 7), run on the GPU machine after scripts/gpu-stage-e2e.sh staged .gpu/e2e/
# here: dataset -> gpufeed daemon -> a separate consumer process, against dd iflag=direct and the peers
# (PyTorch DataLoader, KvikIO + CuPy, DALI where it can be installed) on the same data and batch sizes,
# cold and warm.
#   1. data: emb_fp16.npy [N, 1024] float16 (incompressible) and tokens_i32.npy [M, 2048] int32 (zipf,
#      compressible), written by scripts/e2e/make_data.py under $E2E_WORK/npy;
#   2. gpufeed: both packed (`gpufeed pack`, codec auto), a daemon (`gpufeed serve`, restarted before
#      each cold run: it keeps page-cache windows pinned, which drop_caches cannot drop), then per kind,
#      batch size and temperature one examples/consume process, measured by scripts/e2e/measure.py
#      (daemon and consumer CPU time, nvidia-smi GPU busy); the daemon's /v1/status and /metrics;
#   3. dd iflag=direct on the fp16 file, cold, before and after the gpufeed runs;
#   4. peers: scripts/e2e/peers.py torch, kvikio, kvikio --read-only and dali.
# Every measurement is one JSON line in $OUT/e2e.jsonl; full logs in $OUT/e2e.log and
# $OUT/daemon.log; a short table is printed last. Plot and tabulate here afterwards with
# scripts/e2e/report.py.
#
# Settings (environment; defaults in brackets). The defaults finish in about 5 minutes on the H100 box;
# past E2E_BUDGET_S the remaining parts are skipped and said to be.
#   E2E_PARTS [gpufeed dd peers]     E2E_EMB_GIB [4]   E2E_TOKENS_GIB [2]   E2E_WORK [/var/tmp/gpufeed-e2e]
#   E2E_EMB_BATCHES [256 1024 4096]  E2E_TOKENS_BATCHES [128 512 2048]      E2E_WARM_REPEAT [3]
#   E2E_DEVICE [cuda:0]  E2E_ENGINE [auto]  E2E_PEERS [torch kvikio kvikio-read dali]
#   E2E_TORCH_WORKERS [4,8,12]  E2E_KVIKIO_DEPTHS [2 8]  E2E_KVIKIO_COMPAT [ON]  E2E_BUDGET_S [510]
#   E2E_SOCKET [/tmp/gpufeed.sock]  E2E_HTTP [127.0.0.1:7070]  E2E_PYTHON [python3]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
. scripts/lib/exits.sh
OUT="${OUT:-/tmp/gpufeed-e2e-out}"
mkdir -p "$OUT"
. scripts/lib/gpu-env.sh
export PYTHONUNBUFFERED=1
py=${E2E_PYTHON:-python3}
stage=.gpu/e2e
bin=$stage/bin
work=${E2E_WORK:-/var/tmp/gpufeed-e2e}
npy=$work/npy
data=$work/data
parts=" ${E2E_PARTS:-gpufeed dd peers} "
emb_batches=${E2E_EMB_BATCHES:-256 1024 4096}
tokens_batches=${E2E_TOKENS_BATCHES:-128 512 2048}
warm_repeat=${E2E_WARM_REPEAT:-3}
device=${E2E_DEVICE:-cuda:0}
engine=${E2E_ENGINE:-auto}
peers=${E2E_PEERS:-torch kvikio kvikio-read dali}
socket=${E2E_SOCKET:-/tmp/gpufeed.sock}
http=${E2E_HTTP:-127.0.0.1:7070}
consume_timeout=120
deadline=$((SECONDS + ${E2E_BUDGET_S:-510}))
log=$OUT/e2e.log
jsonl=$OUT/e2e.jsonl
: >"$jsonl"

say() { echo "=== $*" | tee -a "$log"; }
# True while the time budget lasts; otherwise says which part is skipped.
in_budget() {
  if [ "$SECONDS" -ge "$deadline" ]; then
    say "SKIPPED (time budget spent): $*"
    return 1
  fi
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nproc
  free -g
  df -hT /var/tmp
  echo "gpufeed build: $(cat "$bin/COMMIT" 2>/dev/null || echo none)"
  echo "uncommitted changes in it:"
  cat "$bin/DIRTY" 2>/dev/null
  cat "$stage/dali.txt" 2>/dev/null
  env | grep '^E2E_' || true
} >"$log" 2>&1

# cuFile needs this udev entry on this VM (shared/GPU_MACHINE.md); gpufeed's auto engine does not use
# cuFile without the nvidia-fs driver, but a registration attempt should not fail for want of it.
cufile_udev_entry

say "data: make_data.py (emb ${E2E_EMB_GIB:-4} GiB, tokens ${E2E_TOKENS_GIB:-2} GiB)"
timeout 240 "$py" scripts/e2e/make_data.py --out-dir "$npy" --emb-gib "${E2E_EMB_GIB:-4}" \
  --tokens-gib "${E2E_TOKENS_GIB:-2}" >>"$log" 2>&1
note_exit $? "$log"
sync

kinds=()
[ -f "$npy/emb_fp16.npy" ] && kinds+=(emb)
[ -f "$npy/tokens_i32.npy" ] && kinds+=(tokens)
npy_file() { [ "$1" = emb ] && echo "$npy/emb_fp16.npy" || echo "$npy/tokens_i32.npy"; }
batch_sizes() { [ "$1" = emb ] && echo "$emb_batches" || echo "$tokens_batches"; }

dd_direct() {
  local file
  file=$(npy_file emb)
  [ -f "$file" ] || return 0
  in_budget "dd iflag=direct ($1)" || return 0
  say "dd iflag=direct cold ($1)"
  sync
  echo 3 >/proc/sys/vm/drop_caches
  timeout 120 dd if="$file" of=/dev/null bs=16M iflag=direct 2>&1 | tail -1 | tee -a "$log" |
    "$py" -c 'import sys, json, re
line = sys.stdin.read()
m = re.search(r"(\d+) bytes.*?([\d.]+) s", line)
if m:
    b, s = int(m[1]), float(m[2])
    print(json.dumps({"loader": "dd-direct", "kind": "emb", "temperature": "cold", "when": sys.argv[1],
                      "bytes_in": b, "bytes_out": b, "seconds": s, "gb_per_s_in": b / s / 1e9}))' "$1" >>"$jsonl"
}

# --- gpufeed ---------------------------------------------------------------------------------------
daemon_pid=
stop_daemon() {
  [ -n "$daemon_pid" ] || return 0
  kill -TERM "$daemon_pid" 2>/dev/null
  for _ in $(seq 1 50); do
    kill -0 "$daemon_pid" 2>/dev/null || break
    sleep 0.2
  done
  kill -KILL "$daemon_pid" 2>/dev/null
  wait "$daemon_pid" 2>/dev/null
  echo "daemon stopped" >>"$log"
  daemon_pid=
}
trap stop_daemon EXIT

# A field of `gpufeed inspect`'s JSON, divided by the sample count: "raw_bytes" or "stored_bytes".
per_sample() {
  "$py" -c 'import json, sys
d = json.load(open(sys.argv[1]))
print(d[sys.argv[2]] / d["samples"])' "$work/inspect-$1.json" "$2"
}

# Starts `gpufeed serve` and waits for its socket; returns 1 (daemon log in the main log) if it does
# not come up.
start_daemon() {
  say "serve --device $device --engine $engine"
  rm -f "$socket"
  # Each start gets a fresh log (the readiness line is looked for in it); earlier ones are kept.
  [ -s "$OUT/daemon.log" ] && cat "$OUT/daemon.log" >>"$OUT/daemon-earlier.log"
  "$bin/gpufeed" serve --data-root "$data" --socket "$socket" --http "$http" --device "$device" \
    --engine "$engine" >"$OUT/daemon.log" 2>&1 &
  daemon_pid=$!
  local up=0
  for _ in $(seq 1 300); do
    if grep -q '^gpufeed: serving' "$OUT/daemon.log" && [ -S "$socket" ]; then up=1; break; fi
    kill -0 "$daemon_pid" 2>/dev/null || break
    sleep 0.2
  done
  if [ "$up" != 1 ]; then
    say "FAILED: the daemon did not come up (daemon.log follows); gpufeed runs skipped"
    cat "$OUT/daemon.log" >>"$log"
    stop_daemon
    return 1
  fi
}

run_gpufeed() {
  if [ ! -x "$bin/gpufeed" ] || [ ! -x "$bin/consume" ]; then
    say "SKIPPED gpufeed: no binaries in $bin (run scripts/gpu-stage-e2e.sh without --wheels-only)"
    return 0
  fi
  mkdir -p "$data"
  local kind
  for kind in "${kinds[@]}"; do
    in_budget "pack $kind" || return 0
    say "pack $kind"
    local started=$SECONDS
    timeout 240 "$bin/gpufeed" pack --out "$data/$kind" --field "data=$(npy_file "$kind")" --quiet --force >>"$log" 2>&1
    rc=$?
    echo "after $((SECONDS - started)) s" >>"$log"
    note_exit "$rc" "$log"
    timeout 60 "$bin/gpufeed" inspect "$data/$kind" >"$work/inspect-$kind.json" 2>>"$log"
    cat "$work/inspect-$kind.json" >>"$log"
  done
  sync

  start_daemon || return 0
  cat "$OUT/daemon.log" >>"$log"
  # Which backend serves (the GPU one, or the CPU one when the GPU is not usable): every record says.
  local backend
  backend=$("$py" -c 'import json, sys, urllib.request
try:
    with urllib.request.urlopen("http://" + sys.argv[1] + "/v1/status", timeout=5) as r:
        status = json.load(r)
    print(json.dumps(status), file=sys.stderr)
    print(status.get("serving", {}).get("backend", "unknown"))
except Exception as error:
    print(f"status: {error}", file=sys.stderr)
    print("unknown")' "$http" 2>>"$log")
  say "serving backend: $backend"

  local consume_device=()
  if "$bin/consume" --help | grep -q -- '--device'; then
    consume_device=(--device "$device")
  else
    say "consume has no --device flag in this build: it maps batches on the host"
  fi
  # The consumer reads the daemon's CPU over its stream itself (daemon_cores_stream), when it can.
  local consume_takes_pid=
  if "$bin/consume" --help | grep -q -- '--daemon-pid'; then
    consume_takes_pid=1
  fi

  local batch temperature dtype_args bytes_in stored repeat
  for kind in "${kinds[@]}"; do
    bytes_in=$(per_sample "$kind" raw_bytes)
    stored=$(per_sample "$kind" stored_bytes)
    dtype_args=()
    [ "$kind" = emb ] && dtype_args=(--dtype f32)
    for batch in $(batch_sizes "$kind"); do
      for temperature in cold warmup warm; do
        local repeats=1
        [ "$temperature" = warm ] && repeats=$warm_repeat
        # gpufeed's cold reads use O_DIRECT, which leaves the page cache as it was: a gpufeed run does
        # not warm it. The warm case (data in the page cache, as after any buffered reader) is set up
        # by reading the shards once through the page cache.
        [ "$temperature" = warmup ] && cat "$data/$kind"/*.gfs >/dev/null
        # The daemon keeps page-cache windows it read from registered (pinned) for later epochs and
        # consumers, and pinned pages survive drop_caches: a cold run gets a fresh daemon.
        if [ "$temperature" = cold ] && [ -n "$daemon_pid" ]; then
          stop_daemon
          start_daemon || return 0
        fi
        for repeat in $(seq 1 "$repeats"); do
          in_budget "gpufeed $kind $batch $temperature" || return 0
          echo "--- gpufeed $kind batch $batch $temperature $repeat" >>"$log"
          # The daemon's pid now (a cold run restarted it).
          local consume_cpu=()
          if [ -n "$consume_takes_pid" ]; then
            consume_cpu=(--daemon-pid "$daemon_pid")
          fi
          timeout $((consume_timeout + 30)) "$py" scripts/e2e/measure.py --jsonl "$jsonl" \
            --kind "$kind" --temperature "$temperature" --batch-size "$batch" \
            --bytes-per-sample-in "${bytes_in%.*}" --stored-bytes-per-sample "$stored" \
            --daemon-pid "$daemon_pid" --cold-file "$data/$kind" --timeout "$consume_timeout" \
            --set "device=$device" --set "engine=$engine" --set "backend=$backend" \
            --set "repeat=$repeat" -- \
            "$bin/consume" --socket "$socket" --dataset "$kind" --batch-size "$batch" --shuffle none \
            "${dtype_args[@]}" "${consume_device[@]}" "${consume_cpu[@]}" >>"$log" 2>&1
          # A failed or timed-out consumer is recorded with `error` and fails the script at its end.
          note_exit $? "$log"
        done
      done
    done
  done

  say "daemon status and metrics"
  if command -v curl >/dev/null; then
    curl -s --max-time 5 "http://$http/v1/status" >"$OUT/status.json" 2>>"$log"
    curl -s --max-time 5 "http://$http/metrics" >"$OUT/metrics.txt" 2>>"$log"
  else
    "$py" -c 'import sys, urllib.request
for path, name in (("/v1/status", "status.json"), ("/metrics", "metrics.txt")):
    with urllib.request.urlopen("http://" + sys.argv[1] + path, timeout=5) as r:
        open(sys.argv[2] + "/" + name, "wb").write(r.read())' "$http" "$OUT" 2>>"$log"
  fi
  stop_daemon
  tail -20 "$OUT/daemon.log" >>"$log"
}

# --- peers -----------------------------------------------------------------------------------------
run_peers() {
  timeout 120 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/kvikio-site "$stage"/whl/*.whl >>"$log" 2>&1 || say "KvikIO wheels did not install"
  local kind peer file batches depth
  for kind in "${kinds[@]}"; do
    file=$(npy_file "$kind")
    batches=$(batch_sizes "$kind" | tr ' ' ',')
    for peer in $peers; do
      case "$peer" in
        torch)
          # Each warm configuration tries every worker count; the cold run uses the fastest.
          in_budget "torch $kind" || return 0
          say "peer torch $kind"
          timeout 300 "$py" scripts/e2e/peers.py torch --file "$file" --batch-sizes "$batches" \
            --workers "${E2E_TORCH_WORKERS:-4,8,12}" --jsonl "$jsonl" >>"$log" 2>&1
          note_exit $? "$log"
          ;;
        kvikio | kvikio-read)
          # KvikIO's POSIX path (KVIKIO_COMPAT_MODE=ON) with 8 threads is its fastest configuration on
          # this machine: left to itself it reads through cuFile's compatibility mode and O_DIRECT,
          # 1.4 - 1.6 GB/s warm (docs/benchmarks/gpu-read-2026-11-22.md). Depth 2 is double buffering;
          # deeper read-ahead keeps more of its threads busy on small batches; the report takes the best.
          local read_only=()
          [ "$peer" = kvikio-read ] && read_only=(--read-only)
          for depth in ${E2E_KVIKIO_DEPTHS:-2 8}; do
            in_budget "$peer $kind depth $depth" || return 0
            say "peer $peer $kind depth $depth"
            KVIKIO_COMPAT_MODE=${E2E_KVIKIO_COMPAT:-ON} PYTHONPATH=/tmp/kvikio-site timeout 180 \
              "$py" scripts/e2e/peers.py kvikio --file "$file" --batch-sizes "$batches" --threads 8 \
              --depth "$depth" --repeat "$warm_repeat" "${read_only[@]}" --jsonl "$jsonl" >>"$log" 2>&1
            note_exit $? "$log"
          done
          ;;
        dali)
          in_budget "dali $kind" || return 0
          say "peer dali $kind"
          timeout 180 "$py" scripts/e2e/peers.py dali --file "$file" --batch-sizes "$batches" \
            --jsonl "$jsonl" >>"$log" 2>&1
          note_exit $? "$log"
          ;;
        *) say "unknown peer $peer" ;;
      esac
    done
  done
}

case "$parts" in *" dd "*) dd_direct before-gpufeed ;; esac
case "$parts" in *" gpufeed "*) run_gpufeed ;; esac
case "$parts" in *" dd "*) dd_direct after-gpufeed ;; esac
case "$parts" in *" peers "*) run_peers ;; esac

say "done in $SECONDS s"
grep -E '^exit [1-9]|Traceback|"error"|"skipped"|SKIPPED|FAILED' "$log" | cut -c1-240
echo
"$py" scripts/e2e/report.py --table-only "$jsonl" | tee "$OUT/table.md"
finish
