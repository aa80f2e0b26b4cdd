#!/usr/bin/env bash
#
# Usage: bench/gpu.sh OUTDIR
#
# On a machine with a CUDA GPU: runs what fills bench/README.md's GPU rows,
# data_path.py and step_throughput.py, then tests/test_gpu.py, unattended,
# with the python3 on PATH. Each runs under a time limit of its own, so that
# one that hangs leaves time for the rest. Its output goes to OUTDIR/NAME.txt,
# and its exit status and seconds to OUTDIR/status.txt; OUTDIR/machine.txt
# names the GPU, Python and torch. 10 minutes at most (the limits' sum).

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
  timeout -k 10 "$limit" "$@" >"$out/$name.txt" 2>&1 || status=$?
  echo "$name: exit status $status after $((SECONDS - started)) s" | tee -a "$out/status.txt"
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
  {
    nvidia-smi -L || true
    python3 -c 'import sys, torch; print(sys.version, torch.__version__, torch.cuda.get_device_name())'
  } >"$out/machine.txt" 2>&1 || true
  run_step data_path 100 python3 bench/data_path.py
  run_step step_throughput 200 python3 bench/step_throughput.py
  run_step test_gpu 270 python3 -m pytest -n 0 -p no:cacheprovider tests/test_gpu.py
}

main "$@"
