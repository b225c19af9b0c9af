#!/usr/bin/env bash
# The H200 run behind docs/benchmarks.md: the benchmark recipe on synthetic 27B weights, packed projections.
# PARTS picks what runs, in order (default: all but tests):
#   tests  CUDA tests (TESTS_K selects, as pytest -k)
#   bf16   the bf16 target in every mode (MODES, default none,mtp,dflash2), first start: empty compile caches
#   warm   a second DFlash2 start on the warm disk caches (load_times: the drafter's graphs)
#   int4   the INT4 table of issue 6 (INT4 target + int8 head; DFlash2 with the bf16 drafter, then the int8 one)
#   vocab  the bf16 speculative modes (VOCAB_MODES, default mtp,dflash2) over a 32768-id draft vocabulary
#   startprof  where a second start's time goes: cProfile of a warm plain start (top functions, cumulative / own)
#   sweep  the W4A16 schedule sweep (bench/quant_kernels.py --sweep; SWEEP_S seconds at most)
#   kernels  the W4A16 kernel's checks and table (bench/quant_kernels.py)
#   profile  where a step / cycle goes, kernel tables (bench/profile_cycle.py --variants packed $PROFILE_ARGS)
#   compiles  two DFlash2 starts (first, then warm): load times and what torch.compile traced (bench/start_compiles.py)
# Usage (device machine, repo root, wheels in .whl): PARTS="tests bf16 warm" bash bench/h200.sh  (writes to $OUT)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; LOG="$OUT/bench_log.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/blockspec-inductor-cache  # starts empty: a cold first start
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  } > "$OUT/machine.txt" 2>&1
BENCH="python3 -m blockspec.cli bench --synthetic qwen3.5-27b --context-length 4096"
FORCED="--forced-acceptance 0.553,0.297,0.516 --max-tokens ${MAX_TOKENS:-200} --repeats ${REPEATS:-2}"
Q="--target-quantization int4 --vocabulary-quantization int8"
run() { local limit=$1; shift; echo "## $*" >> "$LOG"
        timeout "$limit" "$@" 2>&1 | grep -v "^ \|[Ww]arn\|softmax\|important use" >> "$LOG"; echo "## exit ${PIPESTATUS[0]}" >> "$LOG"; }
for part in ${PARTS:-bf16 warm int4 vocab}; do
  case $part in
    tests) timeout ${TEST_S:-240} python3 -m pytest -q tests/test_cuda.py -s ${TESTS_K:+-k "$TESTS_K"} > "$OUT/cuda_tests.txt" 2>&1
           tail -3 "$OUT/cuda_tests.txt" >> "$LOG" ;;
    bf16) run 240 $BENCH --mode ${MODES:-none,mtp,dflash2} $FORCED --json-out "$OUT/bench.json" --png-out "$OUT/bench.png" ;;
    warm) run 70 $BENCH --mode dflash2 --max-tokens 16 --repeats 1 --prompt "warm start" --json-out "$OUT/warm_start.json" ;;
    int4) run 180 $BENCH $Q --mode none,mtp,dflash2 $FORCED --json-out "$OUT/bench_int4.json" --png-out "$OUT/bench_int4.png"
          run 150 $BENCH $Q --dflash2-quantization int8 --mode dflash2 $FORCED --json-out "$OUT/bench_int4_drafter_int8.json" ;;
    startprof) run 90 python3 -m cProfile -o "$OUT/start.prof" -m blockspec.cli bench --synthetic qwen3.5-27b \
                 --context-length 4096 --mode none --max-tokens 16 --repeats 1 \
                 --prompt "warm start" --json-out "$OUT/start_profile.json"
               python3 -c "import pstats, sys; s = pstats.Stats('$OUT/start.prof', stream=sys.stdout); \
                 s.sort_stats('cumulative').print_stats(60); s.sort_stats('tottime').print_stats(30)" \
                 > "$OUT/start_profile.txt" 2>&1; rm -f "$OUT/start.prof" ;;
    compiles) for start in first warm; do
                run 120 python3 bench/start_compiles.py bench --synthetic qwen3.5-27b \
                  --context-length 4096 --mode dflash2 --max-tokens 16 --repeats 1 \
                  --prompt "$start start" --json-out "$OUT/start_$start.json"
              done ;;
    sweep) timeout ${SWEEP_S:-240} python3 bench/quant_kernels.py --sweep > "$OUT/quant_sweep.txt" 2>&1
           echo "## sweep exit $?" >> "$LOG"; sed -n '/^best per shape/,$p' "$OUT/quant_sweep.txt" >> "$LOG" ;;
    kernels) timeout ${KERNELS_S:-240} python3 bench/quant_kernels.py > "$OUT/quant_kernels.txt" 2>&1
             echo "## kernels exit $?" >> "$LOG"; sed -n '/^summary/,$p' "$OUT/quant_kernels.txt" >> "$LOG" ;;
    profile) timeout ${PROFILE_S:-200} python3 bench/profile_cycle.py --variants packed ${PROFILE_ARGS:-} \
               > "$OUT/profile_cycle.txt" 2>&1; echo "## profile exit $?" >> "$LOG"
             grep -v "^  \|Assertion\|[Ww]arn" "$OUT/profile_cycle.txt" | tail -60 >> "$LOG" ;;
    vocab) run 200 $BENCH --draft-vocabulary 32768 --mode ${VOCAB_MODES:-mtp,dflash2} $FORCED --json-out "$OUT/bench_draft_vocabulary.json" ;;
  esac
done
cat "$LOG"
