#!/usr/bin/env bash
# The H200 recipe behind every figure of docs/benchmarks.md: synthetic weights of the real Qwen3.5-27B shapes, the
# engine with no flags (its defaults are the fast path), forced acceptance at the published DFlash2 rates.
# PARTS picks what runs, in order (default: bf16 warm int4 vocab, ~12 minutes on an H200 with empty caches):
#   tests      CUDA tests (TESTS_K selects, as pytest -k; ~6 minutes with empty compile caches)
#   bf16       the bf16 target in every mode (MODES, default none,mtp,dflash2): the headline table; first starts
#              (empty compile caches: load_times)
#   warm       a second DFlash2 start on the warm disk caches (load_times: the drafter's graphs)
#   int4       the INT4 table (INT4 target + int8 head; DFlash2 with the bf16 drafter, then the int8 one)
#   vocab      the bf16 speculative modes (VOCAB_MODES, default mtp,dflash2) over a 32768-id draft vocabulary
#   sampling   the cost of sampling (SAMPLING_MODES, default none,dflash2; bf16): each mode greedy, then at
#              temperature 1, top-k 20, top-p 0.95 (the published DFlash2 acceptance's settings), both at the forced
#              rates; column "x greedy" / JSON cost_vs_greedy: a sampled DFlash2 cycle's (plain: step's) cost over
#              the greedy one's (~4 minutes)
#   trees      DFlash2 with draft trees (TREE_BUDGETS, default 0,8,16,24,32,48; bf16, then INT4 + int8 head unless
#              TREES_INT4 is empty), forced chain acceptance at the published rates: cycle ms and x plain step per
#              budget (rows dflash2:N); TREE_MODES (default none,dflash2), TREES_ARGS add to both runs (e.g. the
#              sampling part's settings and --compare-greedy: a sampled tree cycle's cost over the greedy one's)
#   fp8        the FP8 target (block-wise e4m3, quantized at load) in every mode: the FP8 table
#   reuse      prefix reuse over a scripted 10-turn chat of 1000-token turns and 128-token replies (bench/multi_turn.py;
#              REUSE_MODES, default none,dflash2, one run each): time to first token of each turn without and with
#              reuse, decode tokens/s of both
#   memory     peak GPU memory of the INT4 target + int8 head + int8 DFlash2 drafter at 32k, 8k and 128k context
#              (MEMORY_CONTEXTS; results' "memory": loading and decoding peaks, their parts, the estimate; the log:
#              each process's highest GPU memory by nvidia-smi, which other processes on the GPU do not inflate)
#   kernels    the W4A16 / W8A16 kernel's checks and table (bench/quant_kernels.py; KERNELS_ARGS, e.g.
#              "--rows 8,17,33,64": a draft tree's passes)
#   fp8_kernels  the FP8 kernel against cuBLAS bf16 at 1, 8 and 16 rows (bench/fp8_kernels.py; FP8_ARGS=--sweep)
#   schedules  W4A16 / W8A16 launch schedules, balanced or not: FP8, INT4 at 1 and 8 rows (bench/kernel_schedules.py)
#   persistent_mlp  the 27B's INT4 MLP in one persistent launch (a work queue, gate_up then down) against the
#              engine's two launches, and without the wait between them (bench/persistent_mlp.py)
#   tma_stream  the W4A16 kernel with its codes (and scales) through TMA bulk copies against the engine's launches, the
#              27B's INT4 projections at 1, 8 and 16 rows (bench/tma_stream.py)
#   warp_specialized  the warp-specialized W4A16 kernel (2 or 3 consumer warpgroups) against the engine's launches
#              at 1, 8, 16 and 32 rows, the 27B's INT4 projections (bench/warp_specialized.py; WS_ARGS, e.g.
#              "--shapes gate_up,down --pdl-level 3": both launched under PDL, as the INT4 engine does)
#   variants   the graphed step under variants of the kernels' constants, alternated with the default
#              (bench/step_variants.py; VARIANTS_ARGS, default --quant fp8)
#   timeline   per-program time stamps of every projection launch of the graphed step (bench/launch_timeline.py;
#              TIMELINE_ARGS, default --quant fp8 --pdl-levels 3: the engine's level for FP8)
#   sweep      the W4A16 config sweep (bench/quant_kernels.py --sweep; SWEEP_S seconds at most)
#   attention  split-KV attention against SDPA (bench/attention_kernels.py)
#   gdn        the DeltaNet kernels' configs (bench/gdn_kernel.py)
#   gdn_tree   the draft-tree DeltaNet mixer (tree_pass) on drafted trees and combs of 9..64 nodes
#              (bench/gdn_kernel.py --parts tree)
#   norm       the RMSNorm kernel's warps (bench/norm_kernel.py)
#   linear     the few-row bf16 matmul against cuBLAS (bench/linear_kernels.py; LINEAR_ARGS=--quick: the chosen
#              configs only; --rows 8,17,33,64: those row counts)
#   profile    where a step / cycle goes, kernel tables (bench/profile_cycle.py $PROFILE_ARGS, e.g.
#              "--modes none --quant int4 --vocab-quant int8 --pdl-level 0")
#   pair_target    the demo pair's target (train-target on the machine's installed packages' .py files, 78M tokens,
#                  ~7.5 minutes) into .pair/target, kept for the next parts while the machine is held
#   pair_regenerate  the target's own continuations as training data (.pair/target, else the shipped demo target
#                  without its MTP head): REGEN_PROMPTS (default 8000) 256-token cuts of the installed packages' .py
#                  files, REGEN_NEW (default 512) new tokens each, for each of REGEN_MODES (default "greedy sampled":
#                  --greedy, --temperature REGEN_TEMPERATURE, default 1) into .pair/regen_MODE.jsonl, gzipped
#                  into $OUT too (the machine's .pair does not outlive it)
#   pair_drafters  its DFlash2 drafter and MTP head (train-drafter on the same files, or PAIR_DATA, e.g.
#                  .pair/regen_greedy.jsonl; both at once on the one GPU) into .pair/drafterTAG and .pair/mtpTAG (the
#                  target with its head; PAIR_TAG, default empty); archives in $OUT
#   pair_bench     the pair (PAIR_TAG's) on standard-library code: tokens/s of the three modes, acceptance over whole
#                  generations and from 500 real contexts (bench --fixtures stdlib --one-cycle 500; ~5 minutes)
#   demo_one_cycle  the shipped demo pair's one-cycle acceptance, MTP and DFlash2's chain (bench --fixtures stdlib
#                  --one-cycle 500 --context-length 1024, bf16; the two modes in two processes at once, ~3 minutes)
#   pair_recipes   what each training-recipe change buys on the demo pair's target: RECIPES (default
#                  drafter-3-layers,drafter-block-16; names of bench/drafter_recipes.py's RECIPES; the shipped pair's
#                  proposers are drafter-3-layers-4x and mtp-4x) trained RECIPES_PARALLEL (default 2) at once for
#                  RECIPES_STEPS (default 2000) on the installed packages' .py files, each evaluated every 500 steps by
#                  one cycle from 500 standard-library contexts; RECIPES_ARGS add to the bench (e.g. --regenerated
#                  /abs/path.jsonl for the *-regenerated and *-mixed recipes; or RECIPES_REGENERATED, a
#                  pair_regenerate .jsonl.gz carried in an ignored folder, e.g. out/regen/regen_sampled.jsonl.gz:
#                  unpacked and given as --regenerated); each run's log in $OUT; then each
#                  *-block-16 drafter run with blocks of 8 (--dflash2-block-size 8), one cycle from 500 contexts. Every
#                  run's trained weights (not its optimizer state) come back in $OUT/weights_NAME.tar. Runs at once
#                  share the GPU: one 8000-step run (drafter-4x) alone takes ~5 minutes with its start-up
#   demo_trees     the shipped demo pair (blockspec demo --save) with draft trees (DEMO_TREE_BUDGETS, default 0,16,32):
#                  tokens/s of plain decoding and each budget on standard-library code (bf16, graphs), then one-cycle
#                  acceptance sampled at DEMO_TREE_TEMPERATURES (default 0.7 1, empty: none; bench/tree_acceptance.py,
#                  fp32); DEMO_BENCH_ARGS adds to the tokens/s run (e.g. "--temperature 1 --seed 0": sampled)
#   cycle_trace    where the shipped demo pair's chain and tree cycles go (bench/cycle_trace.py, CYCLE_BUDGETS,
#                  default 0,15): tokens/s with the budgets taking turns, then per profiled cycle the pieces' host
#                  time, runtime calls, kernel busy time and the kernels' time against the chain's
#   drafter_train  train-drafter's step on the synthetic 27B with the published drafter (bench/drafter_training.py;
#                  ~3 minutes, most of it building the synthetic target) under torchrun in DRAFTER_TRAIN_NPROC
#                  processes (default 1, one GPU each); DRAFTER_TRAIN_ARGS add to it (e.g. "--preset tiny --seq-len
#                  1024 --batch-tokens 8192 --window 1024 --attention block-sparse --profile 25", or
#                  "--target-sharding replicate,fsdp" on several GPUs)
#   drafter_scaling  train-drafter on the demo pair's target under torchrun at SCALING_NPROC processes (default 1,2;
#                  one GPU each), the same global batch: block tokens/s, scaling efficiency, loss curves against one
#                  process's (bench/drafter_scaling.py; SCALING_STEPS, default 200; SCALING_ARGS add to the bench,
#                  e.g. --kill-and-resume)
#   train_step  train-drafter's step on the demo pair's target with drafter_scaling's flags, on torch.nn's .py files:
#              s a step, block tokens/s and its profile, under each TRAIN_STEP_ATTENTION (default "train-drafter
#              dense": train-drafter's own attention, block-sparse on CUDA, then the dense mask; bench/train_step.py);
#              TRAIN_STEP_ARGS add to train-drafter's flags (e.g. "--no-compile": the drafter's step eagerly),
#              TRAIN_STEP_BENCH to the bench's (e.g. --syncs: where a step's host waits for the device)
#   ckpt       users' downloads: the 27B's shapes written as a checkpoint in each published format (CKPT_FORMATS,
#              default gptq,awq,fp8; also ct-fp8, bf16, bf16-int4), ~4 GB shards, then loaded cold by the engine:
#              write and load s, GB/s, loading peak vs the estimate, decode tokens/s (bench/checkpoint_loading.py;
#              ~1.5-2 minutes a format; needs the checkpoint's size free on the disk: bf16 55 GB, fp8 30, int4 18)
# Usage (device machine, repo root, wheels in .whl): PARTS="tests bf16 int4" bash bench/h200.sh  (writes to $OUT)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; export OUT=$(cd "$OUT" && pwd); LOG="$OUT/bench_log.txt"  # the benches' JSON too
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/blockspec-inductor-cache  # starts empty: a cold first start
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  } > "$OUT/machine.txt" 2>&1
BENCH="python3 -m blockspec.cli bench --synthetic qwen3.5-27b"
FORCED="--forced-acceptance 0.553,0.297,0.516 --max-tokens ${MAX_TOKENS:-200} --repeats ${REPEATS:-2}"
CHAIN="--tree-budget 0"  # forced acceptance forces a chain's rates: DFlash2 verifies chains there (trees: part trees)
Q="--target-quantization int4 --vocabulary-quantization int8"
run() { local limit=$1; shift; echo "## $*" >> "$LOG"
        timeout "$limit" "$@" 2>&1 | grep -v "^ \|[Ww]arn\|softmax\|important use" >> "$LOG"; echo "## exit ${PIPESTATUS[0]}" >> "$LOG"; }
kernel_bench() { local name=$1 limit=$2 script=$3; shift 3  # bench/SCRIPT.py ARGS, its output in $OUT/NAME.txt
                 (cd bench && timeout "$limit" ${LAUNCH:-python3} "$script.py" "$@" > "$OUT/$name.txt" 2>&1)
                 echo "## $name exit $?" >> "$LOG"; tail -40 "$OUT/$name.txt" >> "$LOG"; }
for part in ${PARTS:-bf16 warm int4 vocab}; do
  case $part in
    tests) timeout ${TEST_S:-420} python3 -m pytest -q tests/test_cuda.py -s ${TESTS_K:+-k "$TESTS_K"} > "$OUT/cuda_tests.txt" 2>&1
           tail -3 "$OUT/cuda_tests.txt" >> "$LOG" ;;
    bf16) run 240 $BENCH --mode ${MODES:-none,mtp,dflash2} $FORCED $CHAIN --json-out "$OUT/bench_bf16.json" --png-out "$OUT/bench_bf16.png" ;;
    warm) run 70 $BENCH --mode dflash2 --max-tokens 16 --repeats 1 --prompt "warm start" --json-out "$OUT/warm_start.json" ;;
    int4) run 180 $BENCH $Q --mode none,mtp,dflash2 $FORCED $CHAIN --json-out "$OUT/bench_int4.json" --png-out "$OUT/bench_int4.png"
          run 150 $BENCH $Q --dflash2-quantization int8 --mode dflash2 $FORCED $CHAIN --json-out "$OUT/bench_int4_drafter_int8.json" ;;
    vocab) run 200 $BENCH --draft-vocabulary 32768 --mode ${VOCAB_MODES:-mtp,dflash2} $FORCED $CHAIN --json-out "$OUT/bench_draft_vocabulary.json" ;;
    sampling) run 420 $BENCH --mode ${SAMPLING_MODES:-none,dflash2} $FORCED $CHAIN --temperature 1 --top-k 20 --top-p 0.95 \
                --seed 0 --compare-greedy --json-out "$OUT/bench_sampling.json" ;;
    trees) run ${TREES_S:-560} $BENCH --mode ${TREE_MODES:-none,dflash2} --tree-budget ${TREE_BUDGETS:-0,8,16,24,32,48} \
             $FORCED ${TREES_ARGS:-} --json-out "$OUT/bench_trees_bf16.json"
           [ -n "${TREES_INT4-1}" ] && run ${TREES_S:-560} $BENCH $Q --mode ${TREE_MODES:-none,dflash2} \
             --tree-budget ${TREE_BUDGETS:-0,8,16,24,32,48} $FORCED ${TREES_ARGS:-} --json-out "$OUT/bench_trees_int4.json" ;;
    fp8) run 240 $BENCH --target-quantization fp8 --mode none,mtp,dflash2 $FORCED $CHAIN --json-out "$OUT/bench_fp8.json" --png-out "$OUT/bench_fp8.png" ;;
    reuse) for mode in $(echo ${REUSE_MODES:-none,dflash2} | tr , ' '); do
             kernel_bench multi_turn_$mode 300 multi_turn --mode $mode --json-out "$OUT/multi_turn_$mode.json"; done ;;
    memory) for ctx in ${MEMORY_CONTEXTS:-32768 131072 8192}; do  # results' "memory": loading and decoding peaks, parts
              nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 200 > "$OUT/.apps" & smi=$!
              run 240 $BENCH $Q --dflash2-quantization int8 --mode dflash2 $FORCED $CHAIN --context-length $ctx \
                --max-tokens 128 --repeats 1 --json-out "$OUT/memory_int4_$ctx.json"; kill $smi
              echo "## $ctx: GPU memory held per process (nvidia-smi, MiB, highest): $(awk -F', ' \
                '$2 > m[$1] {m[$1] = $2} END {for (p in m) printf "pid %s %s; ", p, m[p]}' "$OUT/.apps")" >> "$LOG"
            done; rm -f "$OUT/.apps" ;;
    kernels) kernel_bench quant_kernels ${KERNELS_S:-240} quant_kernels ${KERNELS_ARGS:-} ;;
    fp8_kernels) kernel_bench fp8_kernels ${FP8_KERNELS_S:-300} fp8_kernels ${FP8_ARGS:-} ;;
    schedules) kernel_bench kernel_schedules 150 kernel_schedules ;;
    persistent_mlp) kernel_bench persistent_mlp ${PERSISTENT_S:-200} persistent_mlp ;;
    tma_stream) kernel_bench tma_stream ${TMA_S:-200} tma_stream ;;
    warp_specialized) kernel_bench warp_specialized ${WS_S:-240} warp_specialized ${WS_ARGS:-} ;;
    variants) kernel_bench step_variants ${VARIANTS_S:-540} step_variants ${VARIANTS_ARGS:---quant fp8} ;;
    timeline) kernel_bench launch_timeline 240 launch_timeline ${TIMELINE_ARGS:---quant fp8 --pdl-levels 3} ;;
    sweep) kernel_bench quant_sweep ${SWEEP_S:-300} quant_kernels --sweep ;;
    attention) kernel_bench attention_kernels 60 attention_kernels ;;
    gdn) kernel_bench gdn_kernel 60 gdn_kernel ;;
    gdn_tree) kernel_bench gdn_tree 300 gdn_kernel --parts tree ;;
    norm) kernel_bench norm_kernel 40 norm_kernel ;;
    linear) kernel_bench linear_kernels ${LINEAR_S:-150} linear_kernels ${LINEAR_ARGS:-} ;;
    profile) kernel_bench profile_cycle ${PROFILE_S:-300} profile_cycle ${PROFILE_ARGS:-} ;;
    pair_target) SITE=$(python3 -c "import os, site; print(' '.join(p for p in site.getsitepackages() if os.path.isdir(p)))")
           run 560 python3 -m blockspec.cli train-target --data $SITE --suffixes .py --out .pair/target --hidden 384 \
             --layers 8 --heads 6 --intermediate 1024 --seq-len 1024 --batch-tokens 65536 --tokens 78000000 --seed 0
           cp .pair/target/training.json "$OUT/train_target.json" ;;
    pair_regenerate) [ -d .pair/target ] || { rm -rf .demo && python3 -m blockspec.cli demo --save .demo > /dev/null \
             && mkdir -p .pair && cp -r .demo/target .pair/target && rm .pair/target/mtp.safetensors .pair/target/mtp_training.json; }
           SITE=$(python3 -c "import os, site; print(' '.join(p for p in site.getsitepackages() if os.path.isdir(p)))")
           for how in ${REGEN_MODES:-greedy sampled}; do
             run ${REGEN_S:-280} python3 -m blockspec.cli regenerate --target .pair/target --prompts $SITE --suffixes .py \
               --prompt-tokens 256 --max-new-tokens ${REGEN_NEW:-512} --max-prompts ${REGEN_PROMPTS:-8000} \
               --batch-size ${REGEN_BATCH:-512} $([ $how = greedy ] && echo --greedy || echo --temperature ${REGEN_TEMPERATURE:-1}) \
               --out .pair/regen_$how.jsonl
             gzip -c .pair/regen_$how.jsonl > "$OUT/regen_$how.jsonl.gz"  # for RECIPES_REGENERATED on a later machine
           done ;;
    pair_drafters) SITE=$(python3 -c "import os, site; print(' '.join(p for p in site.getsitepackages() if os.path.isdir(p)))")
           TD="python3 -m blockspec.cli train-drafter --target .pair/target --data ${PAIR_DATA:-$SITE --suffixes .py} --seq-len 1024"
           T=${PAIR_TAG:-}
           run 540 $TD --kind mtp --out .pair/mtp$T --batch-tokens 8192 --steps ${MTP_STEPS:-2000} --eval-cuts 300 &
           run 540 $TD --out .pair/drafter$T --layers 2 --window 1024 --selector-rank 64 --intermediate-size 1024 \
             --lr 1e-3 --batch-tokens 8192 --steps ${DRAFTER_STEPS:-2500} --eval-cuts 300; wait
           tar cf "$OUT/pair_drafter$T.tar" -C .pair --exclude training_state.pt drafter$T
           tar cf "$OUT/pair_mtp$T.tar" -C .pair/mtp$T mtp.safetensors training.json ;;
    pair_bench) T=${PAIR_TAG:-}
           run ${PAIR_BENCH_S:-400} python3 -m blockspec.cli bench --model ${PAIR_MODEL:-.pair/mtp$T} --drafter .pair/drafter$T \
             --mode none,mtp,dflash2 --fixtures stdlib --one-cycle 500 --max-tokens 128 --repeats 1 \
             --json-out "$OUT/pair_bench$T.json" ;;
    demo_one_cycle) rm -rf .demo && python3 -m blockspec.cli demo --save .demo > /dev/null
           for mode in mtp dflash2; do
             run ${DEMO_ONE_CYCLE_S:-300} python3 -m blockspec.cli bench --model .demo/target \
               $([ $mode = dflash2 ] && echo --drafter .demo/drafter) --mode $mode --tree-budget 0 --fixtures stdlib \
               --one-cycle 500 --context-length 1024 --max-tokens 16 --repeats 1 --json-out "$OUT/one_cycle_$mode.json" &
           done; wait ;;
    pair_recipes) rm -rf .demo /tmp/blockspec-recipes && python3 -m blockspec.cli demo --save .demo > /dev/null
           [ -n "${RECIPES_REGENERATED:-}" ] && gunzip -c "$RECIPES_REGENERATED" > /tmp/regenerated.jsonl \
             && RECIPES_ARGS="${RECIPES_ARGS:-} --regenerated /tmp/regenerated.jsonl"
           SITE=$(python3 -c "import os, site; print(' '.join(p for p in site.getsitepackages() if os.path.isdir(p)))")
           LAUNCH="env -u TQDM_DISABLE TQDM_MININTERVAL=20 python3" \
             kernel_bench drafter_recipes ${RECIPES_S:-560} drafter_recipes --recipes \
             ${RECIPES:-drafter-3-layers,drafter-block-16} --work /tmp/blockspec-recipes \
             --parallel ${RECIPES_PARALLEL:-2} ${RECIPES_ARGS:-} --json-out "$OUT/drafter_recipes.json" -- \
             --target "$PWD/.demo/target" --data $SITE --suffixes .py --seq-len 1024 --batch-tokens 8192 \
             --steps ${RECIPES_STEPS:-2000} --checkpoint-every 500
           cp /tmp/blockspec-recipes/*.log "$OUT/" 2>/dev/null  # each run's own log, also of runs the limit cut short
           for run_dir in /tmp/blockspec-recipes/*/; do  # the weights (a drafter, or an MTP head beside its target's)
             files=()  # one tar a run: the device gives back 8 files at most
             for f in config.json model.safetensors mtp.safetensors training.json mtp_training.json; do
               [ -f "$run_dir/$f" ] && { [ $f != model.safetensors ] || [ ! -f "$run_dir/mtp.safetensors" ]; } &&
                 files+=("$f")
             done
             [ ${#files[@]} -gt 0 ] && tar cf "$OUT/weights_$(basename $run_dir).tar" -C "$run_dir" "${files[@]}"
           done
           for run_dir in /tmp/blockspec-recipes/*-block-16; do  # trained at 16, run at 8 (dflash2_block_size)
             [ -f "$run_dir/config.json" ] && run 240 python3 -m blockspec.cli bench --model .demo/target \
               --drafter "$run_dir" --dflash2-block-size 8 --mode dflash2 --tree-budget 0 --fixtures stdlib \
               --one-cycle 500 --max-tokens 16 --repeats 1 --json-out "$OUT/$(basename $run_dir)_at_8.json"
           done ;;
    demo_trees) rm -rf .demo && python3 -m blockspec.cli demo --save .demo > /dev/null
           run ${DEMO_TREES_S:-300} python3 -m blockspec.cli bench --model .demo/target --drafter .demo/drafter \
             --mode none,dflash2 --tree-budget ${DEMO_TREE_BUDGETS:-0,16,32} --fixtures stdlib --max-tokens 128 \
             --repeats 1 ${DEMO_BENCH_ARGS:-} --json-out "$OUT/demo_trees_bench.json"
           for t in ${DEMO_TREE_TEMPERATURES-0.7 1}; do
             kernel_bench demo_trees_t$t ${DEMO_ACCEPTANCE_S:-240} tree_acceptance --model ../.demo/target --drafter ../.demo/drafter \
               --budgets ${DEMO_TREE_BUDGETS:-0,16,32} --temperature $t --device cuda --json-out "$OUT/tree_acceptance_t$t.json"
           done ;;
    cycle_trace) rm -rf .demo && python3 -m blockspec.cli demo --save .demo > /dev/null
           kernel_bench cycle_trace ${CYCLE_S:-300} cycle_trace --model ../.demo/target --drafter ../.demo/drafter \
             --budgets ${CYCLE_BUDGETS:-0,15} --json-out "$OUT/cycle_trace.json" ;;
    drafter_train) N=${DRAFTER_TRAIN_NPROC:-1}
           LAUNCH="python3 -m torch.distributed.run --standalone --nproc-per-node $N" \
             kernel_bench drafter_training_n$N ${DRAFTER_TRAIN_S:-420} drafter_training ${DRAFTER_TRAIN_ARGS:-} \
             --json-out "$OUT/drafter_training_n$N.json" ;;
    drafter_scaling) rm -rf .demo /tmp/blockspec-scaling && python3 -m blockspec.cli demo --save .demo > /dev/null
           SITE=$(python3 -c "import os, site; print(' '.join(p for p in site.getsitepackages() if os.path.isdir(p)))")
           kernel_bench drafter_scaling ${SCALING_S:-560} drafter_scaling --nproc ${SCALING_NPROC:-1,2} \
             --work /tmp/blockspec-scaling --json-out "$OUT/drafter_scaling.json" ${SCALING_ARGS:-} -- \
             --target "$PWD/.demo/target" --data $SITE --suffixes .py --seq-len 1024 --layers 2 --window 1024 \
             --selector-rank 64 --intermediate-size 1024 --lr 1e-3 --batch-tokens 8192 --steps ${SCALING_STEPS:-200} \
             --checkpoint-every 20 --eval-cuts 0 ;;
    train_step) rm -rf .demo && python3 -m blockspec.cli demo --save .demo > /dev/null
           NN=$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")/nn
           for attention in ${TRAIN_STEP_ATTENTION:-train-drafter dense}; do  # train-drafter: its own choice
             kernel_bench train_step_$attention ${TRAIN_STEP_S:-200} train_step \
               $([ $attention = train-drafter ] || echo --attention $attention) ${TRAIN_STEP_BENCH:-} \
               --json-out "$OUT/train_step_$attention.json" -- --target "$PWD/.demo/target" --data $NN --suffixes .py \
               --seq-len 1024 --layers 2 --window 1024 --selector-rank 64 --intermediate-size 1024 --lr 1e-3 \
               --batch-tokens 8192 ${TRAIN_STEP_ARGS:-}
           done ;;
    ckpt) kernel_bench checkpoint_loading ${CKPT_S:-560} checkpoint_loading --format ${CKPT_FORMATS:-gptq,awq,fp8} ;;
    *) echo "## unknown part $part" >> "$LOG" ;;
  esac
done
cat "$LOG"
