#!/usr/bin/env bash
# The IPC hand-off benchmarks of issue 25 with and without CUDA MPS, in one command on the GPU machine:
#
#   bash scripts/ipc-mps-bench.sh [IPC_HANDOFF] [-- PYTHON_BENCH_ARGS...]
#
# IPC_HANDOFF is the ipc_handoff binary (default: .gpu/bin/ipc_handoff after `scripts/gpu-tests.sh pack`,
# else target/release/ipc_handoff). The Python benchmark (python -m mempool.benchmarks.ipc_handoff) runs too
# when `python3 -c "import mempool, torch"` works (PYTHON=... picks the interpreter, for example
# .gpu/venv/bin/python). Each benchmark runs twice: first without MPS, then with an MPS control daemon
# started for that run only (`nvidia-cuda-mps-control -d`, with CUDA_MPS_PIPE_DIRECTORY and
# CUDA_MPS_LOG_DIRECTORY in a fresh temporary directory) and stopped right after it (`echo quit |
# nvidia-cuda-mps-control`), also when the run fails or the script is interrupted. It changes no GPU
# setting (no compute mode, no nvidia-smi -c). Outputs go to $OUT (default /tmp/ipc-mps-bench): one file per
# run, plus machine.txt (GPU, driver, CPU, commit), and everything is printed as it comes.
#
# To fit a 10-minute command: each run is cut at RUN_TIMEOUT seconds (default 140; four runs), the Python
# benchmark's arguments default to `--iterations 300 --sustained-buffers 1000` (pass others after --), and
# MODES=no-mps or MODES=mps (default "no-mps mps") and ONLY=rust or ONLY=python split the work over several
# commands (the daemon is started and stopped within whichever command runs the mps mode). RUST_ARGS are
# ipc_handoff's arguments (default "4 --no-trace"; "4" adds the traced diagnosis of the rings, the socket
# and the host-waiting consumers).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/ipc-mps-bench}
mkdir -p "$out"
bin=${1:-}
[ "$bin" = "--" ] && bin=""
[ -n "$bin" ] && shift
[ "${1:-}" = "--" ] && shift
if [ -z "$bin" ]; then
  if [ -x .gpu/bin/ipc_handoff ]; then bin=.gpu/bin/ipc_handoff; else bin=target/release/ipc_handoff; fi
fi
python=${PYTHON:-python3}
run_timeout=${RUN_TIMEOUT:-140}
modes=${MODES:-no-mps mps}
only=${ONLY:-}
if [ "$#" -eq 0 ]; then set -- --iterations 300 --sustained-buffers 1000; fi
{
  nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader
  lscpu | grep -E '^(Model name|CPU\(s\)):'
  git log -1 --format='commit: %h %s' 2>/dev/null || true
  echo "ipc_handoff: $bin"
  echo "python: $python"
} | tee "$out/machine.txt"

have_python=0
if "$python" -c "import mempool, torch" 2>/dev/null; then have_python=1; fi

mps_dir=""
stop_mps() {
  if [ -n "$mps_dir" ]; then
    echo quit | CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log" nvidia-cuda-mps-control
    sleep 2
    echo "== MPS control daemon stopped; its log:"
    cat "$mps_dir/log/control.log" 2>/dev/null | tail -20
    rm -rf "$mps_dir"
    mps_dir=""
  fi
}
trap stop_mps EXIT INT TERM

start_mps() {
  mps_dir=$(mktemp -d /tmp/mempool-mps.XXXXXX)
  mkdir -p "$mps_dir/pipe" "$mps_dir/log"
  export CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log"
  if ! nvidia-cuda-mps-control -d; then
    echo "== could not start the MPS control daemon: the MPS runs are skipped"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    rm -rf "$mps_dir"
    mps_dir=""
    return 1
  fi
  sleep 1
  echo "== MPS control daemon started (CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY)"
}

run() { # label command...
  local label=$1; shift
  echo "== $label: $*"
  timeout "$run_timeout" "$@" > "$out/$label.txt" 2>&1
  echo "rc=$?" | tee -a "$out/$label.txt"
  cat "$out/$label.txt"
}

benches() { # suffix [python benchmark args...]
  local suffix=$1; shift
  if [ "$only" = python ]; then :
  elif [ -x "$bin" ]; then
    # shellcheck disable=SC2086 # RUST_ARGS is a list of words
    run "ipc-handoff-$suffix" "$bin" ${RUST_ARGS:-4 --no-trace}
  else
    echo "== $bin missing: build it (cargo build --release -p mempool-bench --bin ipc_handoff) or pack .gpu"
  fi
  if [ "$only" = rust ]; then :
  elif [ "$have_python" = 1 ]; then
    run "python-ipc-handoff-$suffix" "$python" -m mempool.benchmarks.ipc_handoff --json "$out/python-$suffix.json" "$@"
  else
    echo "== $python cannot import mempool and torch: the Python benchmark is skipped"
  fi
}

for mode in $modes; do
  case $mode in
    no-mps) benches no-mps "$@" ;;
    mps)
      if start_mps; then
        benches mps "$@"
        stop_mps
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
      fi ;;
    *) echo "== unknown mode $mode (no-mps, mps)" ;;
  esac
done
echo "== outputs in $out"
