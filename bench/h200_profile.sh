#!/usr/bin/env bash
# First H200 run behind docs/benchmarks.md: CUDA tests, the production W4A16 kernel against bf16 cuBLAS on the 27B
# shapes (SKIP_QUANT=1 skips it), the attention kernel against SDPA (SKIP_ATTN=1), the DeltaNet kernels' and the norm
# kernel's configs, the few-row bf16 matmul against cuBLAS (SKIP_LINEAR=1), then (unless SKIP_PROFILE=1)
# where a cycle's time goes
# (bench/profile_cycle.py, packed target, kernel tables).
# Usage (device machine, repo root, wheels in .whl): bash bench/h200_profile.sh  (writes to $OUT or ./out)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
} > "$OUT/machine.txt" 2>&1
timeout ${TEST_S:-180} python3 -m pytest -q tests/test_cuda.py -s > "$OUT/cuda_tests.txt" 2>&1; tail -4 "$OUT/cuda_tests.txt"
if [ -z "${SKIP_QUANT:-}" ]; then
  timeout ${QUANT_S:-150} python3 bench/quant_kernels.py > "$OUT/quant_kernels.txt" 2>&1; tail -40 "$OUT/quant_kernels.txt"
fi
if [ -z "${SKIP_ATTN:-}" ]; then
  (cd bench && timeout ${ATTN_S:-60} python3 attention_kernels.py > "$OUT/attention_kernels.txt" 2>&1); tail -24 "$OUT/attention_kernels.txt"
fi
(cd bench && timeout ${GDN_S:-60} python3 gdn_kernel.py > "$OUT/gdn_kernel.txt" 2>&1); tail -40 "$OUT/gdn_kernel.txt"
(cd bench && timeout ${NORM_S:-40} python3 norm_kernel.py > "$OUT/norm_kernel.txt" 2>&1); tail -10 "$OUT/norm_kernel.txt"
if [ -z "${SKIP_LINEAR:-}" ]; then
  (cd bench && timeout ${LINEAR_S:-150} python3 linear_kernels.py ${LINEAR_ARGS:-} > "$OUT/linear_kernels.txt" 2>&1); grep -v "^  " "$OUT/linear_kernels.txt"
fi
[ -n "${SKIP_PROFILE:-}" ] && exit 0
timeout ${PROFILE_S:-200} python3 bench/profile_cycle.py --variants ${VARIANTS:-packed} > "$OUT/profile_cycle.txt" 2>&1
grep -v "^  \|Assertion" "$OUT/profile_cycle.txt" | tail -90
