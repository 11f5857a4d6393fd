# Sourced by the GPU scripts that run something under CUDA MPS (docs/MPS.md): `mps_start` starts an
# MPS control daemon of the script's own (pipe and log directories under /tmp/gpufeed-mps-*, not the
# system's /tmp/nvidia-mps) and exports CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY, so that
# every CUDA process started afterwards from that shell is its client; `mps_stop` stops it (safe to
# call when none runs). A caller stops it by trap, so that no control daemon outlives the script.

mps_pipe=/tmp/gpufeed-mps-pipe
mps_log=/tmp/gpufeed-mps-log

mps_start() {
  mps_stop
  rm -rf "$mps_pipe" "$mps_log"
  mkdir -p "$mps_pipe" "$mps_log"
  export CUDA_MPS_PIPE_DIRECTORY=$mps_pipe CUDA_MPS_LOG_DIRECTORY=$mps_log
  nvidia-cuda-mps-control -d
}

# mps_stop: `quit` to this script's control daemon, then up to 5 s for it to remove its pid file.
mps_stop() {
  [ -e "$mps_pipe/nvidia-cuda-mps-control.pid" ] || return 0
  echo quit | CUDA_MPS_PIPE_DIRECTORY=$mps_pipe nvidia-cuda-mps-control >/dev/null 2>&1 || true
  for _ in $(seq 1 50); do
    [ -e "$mps_pipe/nvidia-cuda-mps-control.pid" ] || return 0
    sleep 0.1
  done
  echo "MPS: the control daemon for $mps_pipe did not stop" >&2
}
