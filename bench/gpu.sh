#!/usr/bin/env bash
#
# Usage: bench/gpu.sh OUTDIR
#
# On a machine with a CUDA GPU, unattended, with the python3 on PATH: a run
# of train.py under torchrun on nccl (a few steps, to tell a machine where
# torchrun cannot start from a failing test), then tests/test_gpu.py, then
# what fills bench/README.md's GPU rows, data_path.py and step_throughput.py.
# Each runs under a time limit of its own, so that one that hangs leaves time
# for the rest. Its output goes to OUTDIR/NAME.txt, and its exit status and
# seconds to OUTDIR/status.txt; OUTDIR/machine.txt names the GPU, Python and
# torch, and whether this machine's name resolves (torchrun --standalone
# waits for ever where it does not). 10 minutes at most (the limits' sum).
# Exits with the last non-zero status of a step, else 0.

set -euo pipefail

usage() {
  sed -n '3,/^$/s/^# \{0,1\}//p' "$0"
}

# Runs the command after $1 (a name) and $2 (a limit in seconds) into
# $out/NAME.txt, and notes how it ended.
run_step() {
  local name=$1 limit=$2 started=$SECONDS status=0
  shift 2
  # SIGTERM at the limit: the benchmarks then stop what they started.
  timeout -k 5 "$limit" "$@" >"$out/$name.txt" 2>&1 || status=$?
  echo "$name: exit status $status after $((SECONDS - started)) s" | tee -a "$out/status.txt"
  if ((status != 0)); then failed_status=$status; fi
}

main() {
  if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    usage
    exit 0
  fi
  if (($# != 1)); then
    usage >&2
    exit 2
  fi
  out=$(realpath -m -- "$1")
  mkdir -p -- "$out"
  : >"$out/status.txt"
  cd -- "$(dirname -- "$0")/.."
  export PYTHONUNBUFFERED=1 REQUIRE_GPU_TESTS=1
  failed_status=0
  {
    timeout 10 nvidia-smi --query-gpu=name,driver_version,compute_mode,persistence_mode --format=csv || true
    timeout 20 python3 -c 'import sys, torch; print(sys.version, torch.__version__, torch.cuda.get_device_name())'
    # The name torchrun goes by (--standalone, without --local-addr).
    timeout 10 python3 -c 'import socket; n = socket.getfqdn(); print(n, socket.getaddrinfo(n, None)[0][4])'
  } >"$out/machine.txt" 2>&1 || true
  run_step nccl_smoke 45 python3 -m torch.distributed.run --standalone --nproc-per-node=1 \
    train.py --dataset synthetic --arch cnn --max-steps 3
  run_step test_gpu 230 python3 -m pytest -n 0 -p no:cacheprovider tests/test_gpu.py
  run_step data_path 75 python3 bench/data_path.py
  run_step step_throughput 170 python3 bench/step_throughput.py
  exit "$failed_status"
}

main "$@"
