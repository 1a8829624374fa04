#!/usr/bin/env bash
# Issue 2's GPU figures and the CUDA tests, on a machine with CUDA, PyTorch and
# transformers but without this project installed and without Ray (the lent
# GPU machines: no internet, and Ray's wheel is more than a call can carry).
#
#     bash bench/device.sh [OUT_DIR]          # from the repository root
#     BENCH_ARGS="--model llama-3-8b" bash bench/device.sh /tmp/out   # other bench flags
#
# The copy a GPU machine gets has no .git, or a stale one: pass the commit it is, as
# SPLITSERVE_COMMIT=$(git rev-parse --short HEAD), so that the figures name it.
#
# The repository's src/ goes on the path, so `splitserve` imports from the checkout
# (nothing is installed), the CUDA tests run, then `splitserve bench engine
# --device cuda` on SmolLM2 (its shape with random weights when the 98 MB GGUF
# is not installed: a step's time does not depend on the values), Llama-3.2-1B
# and Llama-3-8B shapes, with the 4K-token prefill figure, and `splitserve bench
# transfer` over CUDA IPC against TCP. Outputs go to OUT_DIR (default
# bench/results): engine-cuda.txt and transfer-cuda.txt, each the benchmark's
# output with the command on its first line as bench/report.py wants it, and
# cuda-tests.txt (the tests marked gpu: CUDA graphs, CUDA vs CPU, CUDA IPC).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/bench/results}
mkdir -p "$out"
export PYTHONPATH="$root/src:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$root"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# a failing test must not cost the figures (a GPU call is scarce): the script exits with its status at the end
tests_rc=0
tests=(python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda.py tests/test_kv_transfer.py)
{
  echo "\$ bash bench/device.sh   # ${tests[*]}, at ${SPLITSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}"
  "${tests[@]}" 2>&1
} | tee "$out/cuda-tests.txt" || tests_rc=$?

# shellcheck disable=SC2206  # BENCH_ARGS is split on purpose
cmd=(python3 -m splitserve.cli bench engine --device cuda ${BENCH_ARGS:-})
{
  echo "\$ bash bench/device.sh   # ${cmd[*]}, at ${SPLITSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}"
  "${cmd[@]}" 2>&1
} | tee "$out/engine-cuda.txt"

transfer=(python3 -m splitserve.cli bench transfer --transports tcp,cuda_ipc --size 1G --repeats 5)
{
  echo "\$ bash bench/device.sh   # ${transfer[*]}, at ${SPLITSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}"
  "${transfer[@]}" 2>&1
} | tee "$out/transfer-cuda.txt"
exit "$tests_rc"
