#!/usr/bin/env bash
# The H200 run behind docs/benchmarks.md: CUDA tests, then the benchmark recipe on synthetic 27B weights.
# Usage (device machine, repo root, wheels in .whl): bash bench/h200.sh  (writes to $OUT or ./out)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" | tee -a "$OUT/machine.txt"
timeout 240 python3 -m pytest -q -x tests/test_cuda.py -s 2>&1 | tail -15 | tee "$OUT/cuda_tests.txt"
time python3 -m blockspec.cli bench --synthetic qwen3.5-27b --mode none,mtp,dflash2 --compile-mode 0 \
  --max-tokens ${MAX_TOKENS:-200} --repeats ${REPEATS:-2} --context-length 4096 \
  --forced-acceptance 0.553,0.297,0.516 --json-out "$OUT/bench.json" --png-out "$OUT/bench.png" 2>&1 | tee "$OUT/bench.txt"
