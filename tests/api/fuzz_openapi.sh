#!/usr/bin/env bash
# Schema-driven fuzzing of the control API: starts `gpufeed serve` on a scratch data root, points
# schemathesis at its /openapi.json, and fails on any server error (5xx), any response that breaks the
# document (status code, content type, headers, body schema), a request the token should have
# guarded, a panic in the daemon's log, or a daemon that does not exit 0 on SIGTERM afterwards.
#
# Usage: tests/api/fuzz_openapi.sh [PATH/TO/gpufeed]   (default: target/debug/gpufeed)
# Bounded: 20 examples per operation in the coverage phase, then fuzzing until 90 s have passed.
#
# Without schemathesis (python3 -m pip install -r tests/requirements.txt) it skips, loudly, unless
# CI=true, where it fails.
set -euo pipefail
# `schemathesis ... | tee` must fail when schemathesis does: pipefail above sees to that.

here="$(cd "$(dirname "$0")" && pwd)"
binary="${1:-$here/../../target/debug/gpufeed}"
binary="$(cd "$(dirname "$binary")" && pwd)/$(basename "$binary")"

if ! command -v schemathesis >/dev/null 2>&1; then
    if [ "${CI:-}" = "true" ]; then
        echo "fuzz_openapi: schemathesis is not installed (python3 -m pip install -r tests/requirements.txt)" >&2
        exit 1
    fi
    echo "fuzz_openapi: SKIPPED: schemathesis is not installed (python3 -m pip install -r tests/requirements.txt)" >&2
    exit 0
fi

work="$(mktemp -d)"
daemon=""
cleanup() {
    if [ -n "$daemon" ] && kill -0 "$daemon" 2>/dev/null; then
        kill -KILL "$daemon" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

root="$work/root"
outside="$work/outside"
mkdir -p "$root/nested" "$outside"
python3 - "$root" <<'PY'
import sys
import numpy as np
root = sys.argv[1]
np.save(f"{root}/x.npy", np.arange(4096 * 4, dtype=np.int32).reshape(-1, 4))
np.save(f"{root}/y.npy", np.linspace(0, 1, 4096 * 8, dtype=np.float32).reshape(-1, 8))
PY
"$binary" pack --quiet --out "$root/demo" "$root/x.npy"
"$binary" pack --quiet --out "$root/nested/nested-ds" --field "a=$root/y.npy"
cp -r "$root/demo" "$outside/demo-copy"
ln -s "$outside/demo-copy" "$root/link-out"

token="fuzz-token-0123456789abcdef"
"$binary" serve --data-root "$root" --device cpu --http 127.0.0.1:0 --api-token "$token" \
    --pack-threads 1 >"$work/stdout" 2>"$work/stderr" &
daemon=$!
for _ in $(seq 1 100); do
    grep -q "^gpufeed: http on " "$work/stdout" 2>/dev/null && break
    kill -0 "$daemon" 2>/dev/null || { cat "$work/stderr" >&2; exit 1; }
    sleep 0.1
done
address="$(sed -n 's/^gpufeed: http on //p' "$work/stdout")"
[ -n "$address" ] || { echo "fuzz_openapi: the daemon did not report its address" >&2; exit 1; }
echo "fuzz_openapi: daemon $daemon on $address, schemathesis $(schemathesis --version | awk '{print $NF}')"

status=0
# From the scratch directory: schemathesis keeps a cache (.schemathesis/) in its working directory.
(cd "$work" && schemathesis --config-file "$here/schemathesis.toml" run "http://$address/openapi.json" \
    --checks not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance,ignored_auth \
    --header "Authorization: Bearer $token" \
    --max-examples 20 --max-time 90 --seed 20240601 --workers 2 \
    --request-timeout 30) 2>&1 | tee "$work/schemathesis.log" || status=$?

# What the run reached: datasets registered and pack jobs run through the API.
python3 - "$address" "$token" <<'PY' || true
import json, sys, urllib.request
address, token = sys.argv[1], sys.argv[2]
def get(path):
    request = urllib.request.Request(f"http://{address}{path}", headers={"Authorization": f"Bearer {token}"})
    return json.load(urllib.request.urlopen(request, timeout=10))
datasets = get("/v1/datasets")["datasets"]
jobs = get("/v1/jobs")["jobs"]
states = {}
for job in jobs:
    states[job["state"]] = states.get(job["state"], 0) + 1
print(f"fuzz_openapi: after the run: {len(datasets)} dataset(s) ({', '.join(d['name'] + ':' + d['state'] for d in datasets)}); jobs by state: {states}")
PY

if ! kill -0 "$daemon" 2>/dev/null; then
    echo "fuzz_openapi: the daemon died during the run" >&2
    status=1
elif grep -q "panicked" "$work/stderr"; then
    echo "fuzz_openapi: the daemon panicked:" >&2
    grep -n "panicked" "$work/stderr" >&2
    status=1
else
    kill -TERM "$daemon"
    daemon_status=0
    wait "$daemon" || daemon_status=$?
    daemon=""
    if [ "$daemon_status" -ne 0 ]; then
        echo "fuzz_openapi: the daemon exited $daemon_status on SIGTERM" >&2
        status=1
    fi
fi
if [ "$status" -ne 0 ]; then
    echo "--- daemon log (last 40 lines) ---" >&2
    tail -n 40 "$work/stderr" >&2
fi
# One closing line in the plain form CI reads: test cases passed and failed (a failure of the daemon
# itself counts as one more).
cases="$(grep -E '^ *[0-9]+ generated' "$work/schemathesis.log" | tail -n 1 || true)"
passed="$(echo "$cases" | grep -oE '[0-9]+ passed' | grep -oE '[0-9]+' || echo 0)"
failed="$(echo "$cases" | grep -oE '[0-9]+ failed' | grep -oE '[0-9]+' || echo 0)"
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
    failed=1
fi
echo "fuzz_openapi: ${passed:-0} passed, ${failed} failed"
exit "$status"
