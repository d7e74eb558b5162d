#!/usr/bin/env bash
# The GPU checks in one go, on a machine with CUDA: the CUDA tests (and the GPU path's CPU tests),
# then bench_gpu.py. Logs and JSON go to $OUT (default /tmp/tsl-gpu-check). Exits non-zero if a
# test failed, a part ran past its time limit, or the benchmark wrote an error row.
# On a machine that lacks some dependencies (pytest, pytest-timeout, di-treetensor, lightning,
# torchdata), put their wheels in .whl/ in the checkout (ignored by git: name it in the device
# tool's carry) or in $WHEELS: they are installed to /tmp/site first.
#   bash benchmarks/gpu_check.sh [bench_gpu.py options...]   (default: --workers 2 8)
set -o pipefail
OUT=${OUT:-/tmp/tsl-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
        && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ $# -eq 0 ] && set -- --workers 2 8
{
    nvidia-smi -L 2>&1; df -h /dev/shm /tmp; echo "ulimit -l: $(ulimit -l)"; nproc
    python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, 'cuda', torch.cuda.is_available())"
    for m in pytest pytest_timeout treetensor lightning torchdata numpy; do
        python3 -c "import $m" 2>/dev/null && echo "import $m: ok" || echo "import $m: MISSING"
    done
} 2>&1 | tee "$OUT/machine.txt"
T0=$SECONDS
# Per-test limits below the part's, so that a hung test is named (faulthandler prints every stack).
timeout -k 5 ${TEST_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider -o addopts=-ra \
    -o timeout=60 -o faulthandler_timeout=50 -W ignore::pytest.PytestConfigWarning \
    tests/test_cuda.py tests/test_pinning.py 2>&1 | tee "$OUT/tests.log"
t_rc=${PIPESTATUS[0]}
echo "tests: exit $t_rc after $((SECONDS - T0)) s" | tee -a "$OUT/tests.log"
T0=$SECONDS
timeout -k 5 ${BENCH_TIMEOUT:-220} python3 benchmarks/bench_gpu.py --json-out "$OUT/bench.jsonl" "$@" 2>&1 \
    | grep --line-buffered -v -E "^ *warnings\.warn\(|^ *$" | tee "$OUT/bench.log"
b_rc=${PIPESTATUS[0]}
echo "bench: exit $b_rc after $((SECONDS - T0)) s" | tee -a "$OUT/bench.log"
if grep -q '"section": "error"' "$OUT/bench.jsonl" 2>/dev/null; then
    echo "bench: error rows in $OUT/bench.jsonl" | tee -a "$OUT/bench.log"
    b_rc=${b_rc/#0/1}
fi
exit $(( t_rc || b_rc ))
