#!/usr/bin/env bash
# Second H200 run behind docs/benchmarks.md: the benchmark recipe on synthetic 27B weights, packed projections:
# bf16 target in every mode (first start: empty compile cache), a second start on the warm disk cache, and the
# INT4 table of issue 6 (INT4 target + int8 head; DFlash2 with the bf16 drafter and with the int8 drafter), then
# the bf16 speculative modes over a 32768-id draft vocabulary.
# Usage (device machine, repo root, wheels in .whl): bash bench/h200.sh  (writes to $OUT or ./out)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; LOG="$OUT/bench_log.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/blockspec-inductor-cache  # starts empty: a cold first start
BENCH="python3 -m blockspec.cli bench --synthetic qwen3.5-27b --compile-mode 0 --context-length 4096 --fuse-kvq --fuse-gate"
FORCED="--forced-acceptance 0.553,0.297,0.516 --max-tokens ${MAX_TOKENS:-200} --repeats ${REPEATS:-2}"
Q="--target-quantization int4 --vocabulary-quantization int8"
run() { local limit=$1; shift; echo "## $*" >> "$LOG"; timeout "$limit" "$@" >> "$LOG" 2>&1; echo "## exit $?" >> "$LOG"; }
run 240 $BENCH --mode none,mtp,dflash2 $FORCED --json-out "$OUT/bench.json" --png-out "$OUT/bench.png"
run 70 $BENCH --mode dflash2 --max-tokens 16 --repeats 1 --prompt "warm start" --json-out "$OUT/warm_start.json"
run 180 $BENCH $Q --mode none,mtp,dflash2 $FORCED --json-out "$OUT/bench_int4.json" --png-out "$OUT/bench_int4.png"
run 100 $BENCH $Q --dflash2-quantization int8 --mode dflash2 $FORCED --json-out "$OUT/bench_int4_drafter_int8.json"
run 200 $BENCH --draft-vocabulary 32768 --mode mtp,dflash2 $FORCED --json-out "$OUT/bench_draft_vocabulary.json"
grep -v "^ \|Warning\|warn" "$LOG" | tail -60
