#!/usr/bin/env bash
# Issue 18's GPU checks in one go, on a machine with CUDA: the CUDA tests (and the GPU path's CPU
# tests), then bench_gpu.py. Logs and JSON go to $OUT (default /tmp/tsl-gpu-check).
# On a machine that lacks some dependencies, put their wheels in ../.whl (beside the checkout):
# they are installed to /tmp/site first. Each part has its own time limit.
#   bash benchmarks/gpu_check.sh [bench_gpu.py options...]
set -o pipefail
OUT=${OUT:-/tmp/tsl-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
if compgen -G "../.whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl \
        && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    nvidia-smi -L 2>&1; df -h /dev/shm /tmp; echo "ulimit -l: $(ulimit -l)"; nproc
    python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/machine.txt"
T0=$SECONDS
timeout -k 5 ${TEST_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider -o addopts=-ra \
    tests/test_cuda.py tests/test_pinning.py 2>&1 | tee "$OUT/tests.log"
echo "tests: exit ${PIPESTATUS[0]} after $((SECONDS - T0)) s" | tee -a "$OUT/tests.log"
T0=$SECONDS
timeout -k 5 ${BENCH_TIMEOUT:-220} python3 benchmarks/bench_gpu.py --json-out "$OUT/bench.jsonl" "$@" 2>&1 \
    | grep -v -E "Warning|warnings.warn|^ *$" | tee "$OUT/bench.log"
echo "bench: exit ${PIPESTATUS[0]} after $((SECONDS - T0)) s" | tee -a "$OUT/bench.log"
