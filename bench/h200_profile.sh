#!/usr/bin/env bash
# Second H200 run behind docs/benchmarks.md: where a cycle's time goes, then the quantized-matmul kernels.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
timeout 170 python3 bench/profile_cycle.py 2>&1 | tail -25 | tee "$OUT/profile_cycle.txt"
BENCH_BUDGET_S=60 timeout 150 python3 bench/quant_kernels.py 2>&1 | tail -60 | tee "$OUT/quant_kernels.txt"
