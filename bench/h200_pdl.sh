#!/usr/bin/env bash
# Programmatic dependent launch on the H200 (blockspec/kernels/pdl.py): the benchmark recipe with the engine's
# default level and without PDL (BLOCKSPEC_PDL=0), both in one run so the ratio is read on one machine. PARTS picks what runs:
# tests (CUDA tests; TESTS_K selects), bf16 (plain greedy off/default, then DFlash2 beside plain), int4 (the same
# with the INT4 target + int8 head, MTP too, and DFlash2 with the int8 drafter).
# Usage (device machine, repo root, wheels in .whl): PARTS="tests bf16" bash bench/h200_pdl.sh  (writes to $OUT)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; LOG="$OUT/bench.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  } > "$OUT/machine.txt" 2>&1
BENCH="python3 -m blockspec.cli bench --synthetic qwen3.5-27b --compile-mode 0 --context-length 4096 --fuse-kvq --fuse-gate"
FORCED="--forced-acceptance 0.553,0.297,0.516 --max-tokens ${MAX_TOKENS:-200} --repeats ${REPEATS:-1}"
Q="--target-quantization int4 --vocabulary-quantization int8"
run() { local limit=$1; shift; echo "## $*" >> "$LOG"; timeout "$limit" "$@" 2>&1 | grep -v "^ \|[Ww]arn\|softmax\|important use" >> "$LOG"; echo "## exit $?" >> "$LOG"; }
for part in ${PARTS:-tests bf16 int4}; do
  case $part in
    tests) timeout ${TEST_S:-200} python3 -m pytest -q tests/test_cuda.py -s ${TESTS_K:+-k "$TESTS_K"} > "$OUT/cuda_tests.txt" 2>&1
           tail -3 "$OUT/cuda_tests.txt" >> "$LOG" ;;
    bf16) BLOCKSPEC_PDL=0 run 150 $BENCH --mode none $FORCED --json-out "$OUT/bf16_nopdl.json"
          run 240 $BENCH --mode none,dflash2 $FORCED --json-out "$OUT/bf16_pdl.json" ;;
    int4) BLOCKSPEC_PDL=0 run 150 $BENCH $Q --mode none $FORCED --json-out "$OUT/int4_nopdl.json"
          run 240 $BENCH $Q --mode none,mtp,dflash2 $FORCED --json-out "$OUT/int4_pdl.json"
          run 150 $BENCH $Q --dflash2-quantization int8 --mode dflash2 $FORCED --json-out "$OUT/int4_d8_pdl.json" ;;
  esac
done
cat "$LOG"
