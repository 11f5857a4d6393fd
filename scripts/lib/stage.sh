# Sourced by the scripts/gpu-stage*.sh scripts, from the repository root, after `set -euo pipefail`:
# what each of them does to build binaries here (no GPU needed) and stage them, stripped, in a folder
# under .gpu/ (git-ignored) that the device tool carries to the GPU machine.

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

# stage_clean DIR: creates DIR/bin and empties it, so that nothing from an earlier stage travels.
stage_clean() {
  mkdir -p "$1/bin"
  rm -f "$1"/bin/*
}

# stage_test DIR TEST: builds the integration test TEST of the gpufeed crate (release) and copies its
# binary to DIR/bin/TEST. Cargo names the binary (its name carries a hash) in its JSON build messages.
stage_test() {
  local dir=$1 test=$2 binary
  binary=$(cargo test --release -p gpufeed --test "$test" --no-run --message-format=json | python3 -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == name and m.get("executable"):
        print(m["executable"])
' "$test")
  if [ -z "$binary" ]; then
    echo "error: cargo named no binary for test $test" >&2
    return 1
  fi
  cp "$binary" "$dir/bin/$test"
}

# stage_build DIR (--bin NAME | --example NAME)...: builds those binaries and examples of the gpufeed
# crate (release) and copies each to DIR/bin/NAME.
stage_build() {
  local dir=$1
  shift
  cargo build --release -p gpufeed "$@"
  while [ "$#" -gt 0 ]; do
    case "$1" in
      --bin) cp "$CARGO_TARGET_DIR/release/$2" "$dir/bin/$2" ;;
      --example) cp "$CARGO_TARGET_DIR/release/examples/$2" "$dir/bin/$2" ;;
      *) echo "stage_build: expected --bin NAME or --example NAME, got $1" >&2; return 2 ;;
    esac
    shift 2
  done
}

# stage_wheels DIR REQUIREMENT...: downloads the wheels (no dependencies) for Python 3.12 on the GPU
# machine (x86_64 manylinux) into DIR.
stage_wheels() {
  local dir=$1
  shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "$@"
}

# stage_kvikio_wheels DIR: the KvikIO wheels (CUDA 13) that the read benchmark and the end-to-end peers
# run, into DIR.
stage_kvikio_wheels() {
  stage_wheels "$1" kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0
}
