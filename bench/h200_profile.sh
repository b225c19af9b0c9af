#!/usr/bin/env bash
# Second H200 run behind docs/benchmarks.md: where a cycle's time goes (packed vs unpacked target, kernel tables),
# then the W4A16 kernels against bf16 cuBLAS on the 27B shapes.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
timeout 300 python3 bench/profile_cycle.py 2>&1 | tee "$OUT/profile_cycle.txt"
BENCH_BUDGET_S=150 timeout 240 python3 bench/quant_kernels.py 2>&1 | tail -80 | tee "$OUT/quant_kernels.txt"
