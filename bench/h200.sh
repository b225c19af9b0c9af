#!/usr/bin/env bash
# Second H200 run behind docs/benchmarks.md: the benchmark recipe on synthetic 27B weights, packed projections:
# bf16 target in every mode (first start: empty compile cache), a second start on the warm disk cache, and the
# INT4 table of issue 6 (INT4 target + int8 head; DFlash2 with the bf16 drafter and with the int8 drafter).
# Usage (device machine, repo root, wheels in .whl): bash bench/h200.sh  (writes to $OUT or ./out)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT/run"; R="$OUT/run"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/blockspec-inductor-cache  # starts empty: a cold first start
BENCH="python3 -m blockspec.cli bench --synthetic qwen3.5-27b --compile-mode 0 --context-length 4096 --fuse-kvq --fuse-gate"
FORCED="--forced-acceptance 0.553,0.297,0.516 --max-tokens ${MAX_TOKENS:-200} --repeats ${REPEATS:-2}"
timeout 260 $BENCH --mode none,mtp,dflash2 $FORCED --json-out "$R/bench.json" --png-out "$R/bench.png" 2>&1 | tee "$R/bench.txt" | grep -v "^ "
timeout 90 $BENCH --mode dflash2 --max-tokens 16 --repeats 1 --prompt "warm start" --json-out "$R/warm_start.json" > /dev/null 2>&1
python3 -c "import json; print('load times, second start:', json.load(open('$R/warm_start.json'))['load_times'])"
Q="--target-quantization int4 --vocabulary-quantization int8"
timeout 200 $BENCH $Q --mode none,mtp,dflash2 $FORCED --json-out "$R/bench_int4.json" --png-out "$R/bench_int4.png" 2>&1 | tee "$R/bench_int4.txt" | grep -v "^ "
timeout 110 $BENCH $Q --dflash2-quantization int8 --mode dflash2 $FORCED --json-out "$R/bench_int4_drafter_int8.json" 2>&1 | tee "$R/bench_int4_drafter_int8.txt" | grep -v "^ "
tar czf "$OUT/h200_run.tgz" -C "$OUT" run
