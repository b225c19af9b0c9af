#!/usr/bin/env bash
# The H200 run behind docs/benchmarks.md: CUDA tests, then the benchmark recipe on synthetic 27B weights:
# bf16 target (packed projections), a second start on the warm disk cache, and the INT4 table of issue 6.
# Usage (device machine, repo root, wheels in .whl): bash bench/h200.sh  (writes to $OUT or ./out)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT/run"; R="$OUT/run"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/machine.txt"
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" | tee -a "$R/machine.txt"
timeout 300 python3 -m pytest -q -x tests/test_cuda.py -s 2>&1 | tail -20 | tee "$R/cuda_tests.txt"
BENCH="python3 -m blockspec.cli bench --synthetic qwen3.5-27b --compile-mode 0 --context-length 4096 --fuse-kvq --fuse-gate"
FORCED="--forced-acceptance 0.553,0.297,0.516 --max-tokens ${MAX_TOKENS:-200} --repeats ${REPEATS:-3}"
# 1. bf16 target, every mode (first start: cold compile cache)
timeout 420 $BENCH --mode none,mtp,dflash2 $FORCED --json-out "$R/bench.json" --png-out "$R/bench.png" 2>&1 | tee "$R/bench.txt"
# 2. second start of the same engine: compiled kernels come from the disk cache
timeout 200 $BENCH --mode dflash2 --max-tokens 16 --repeats 1 --prompt "warm start" --json-out "$R/warm_start.json" 2>&1 | tail -3
# 3. issue 6: INT4 target + int8 head; DFlash2 with the bf16 drafter and with the int8 drafter (packed)
Q="--target-quantization int4 --vocabulary-quantization int8"
timeout 420 $BENCH $Q --mode none,mtp,dflash2 $FORCED --json-out "$R/bench_int4.json" --png-out "$R/bench_int4.png" 2>&1 | tee "$R/bench_int4.txt"
timeout 300 $BENCH $Q --dflash2-quantization int8 --mode dflash2 $FORCED --json-out "$R/bench_int4_drafter_int8.json" 2>&1 | tee "$R/bench_int4_drafter_int8.txt"
tar czf "$OUT/h200_run.tgz" -C "$OUT" run
