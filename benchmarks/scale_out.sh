#!/usr/bin/env bash
# The scale-out runs of benchmarks/RESULTS.md section 10 in one go, on one host with 4 GPUs (H100 or
# H200): a 70B model with tensor parallelism, data-parallel routing over 4 replicas, and the two
# composed. Under 20 minutes on 4 H200s; each run's limit is RUN_TIMEOUT seconds.
#
#   OUT=/path/to/results bash benchmarks/scale_out.sh             # 4 GPUs
#   ONLY="decode_70b dp4" OUT=... bash benchmarks/scale_out.sh    # the runs whose names start so
#   SMOKE=1 OUT=/tmp/scale bash benchmarks/scale_out.sh           # CPU: tiny model, 2 ranks / replicas
#
#   allreduce_tp4        the all-reduce alone, NCCL in a CUDA graph ([batch, 8192] bf16; GPU only)
#   decode_70b_tp4       llama-3.1-70b decode step at batch 1, 32, 128 against the per-GPU floor
#   shared_prefix_70b_*  llama-3.1-70b TP=4, 8 groups x 32 (2,048 + 128 tokens, 128 out): cache on,
#                        then off (one engine at a time: two 70B engines do not fit an H100 each)
#   dp4_routing          llama-3.1-8b, DP=4 (one GPU a replica) under each router policy, then DP=1:
#                        64 groups x 16 (1,024 + 64 tokens, 128 out), arriving interleaved
#   dp4_served_*         the same workload through `radixinfer serve --data-parallel-size 4` and the
#                        bench's OpenAI client, one server per policy
#   tp2_dp2              the same workload on 2 replicas of TP=2 each, and one TP=2 replica
#
# Every run writes $OUT/NAME.json and $OUT/NAME.log; a run that fails or passes RUN_TIMEOUT is
# reported and the next one starts; the exit status is the number of failed runs.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the results directory}"
mkdir -p "$OUT"

if [[ "${SMOKE:-0}" == 1 ]]; then
    BIG="--model tiny --device cpu"
    MID="--model tiny --device cpu"
    TP=2 DP=2
    STEP="--batches 1,2 --model-steps 3 --warmup 1"
    SP_BIG="--num-groups 2 --prompts-per-group 2 --system-prompt-len 32 --question-len 8 --max-new-tokens 4"
    SP_DP="--num-groups 4 --prompts-per-group 2 --system-prompt-len 32 --question-len 8 --max-new-tokens 4"
    SP_DP="$SP_DP --max-batch-size 8 --warmup-runs 0 --repeat-runs 1"
    RUN_TIMEOUT=${RUN_TIMEOUT:-240}
else
    BIG="--model llama-3.1-70b --dtype bfloat16"
    MID="--model llama-3.1-8b --dtype bfloat16"
    TP=4 DP=4
    STEP="--device cuda --batches 1,32,128 --model-steps 30 --warmup 5"
    SP_BIG="--num-groups 8 --prompts-per-group 32 --system-prompt-len 2048 --question-len 128 --max-new-tokens 128"
    SP_DP="--num-groups 64 --prompts-per-group 16 --system-prompt-len 1024 --question-len 64 --max-new-tokens 128"
    SP_DP="$SP_DP --max-batch-size 256 --warmup-runs 1 --repeat-runs 2"
    RUN_TIMEOUT=${RUN_TIMEOUT:-600}
fi
POLICIES=cache_aware,round_robin,least_loaded
BENCH="python -m radixinfer.cli bench"
failed=0

run() {  # run NAME COMMAND...: unless ONLY leaves it out
    local name=$1
    shift
    if [[ -n "${ONLY:-}" ]] && ! grep -qE "^(${ONLY// /|})" <<<"$name"; then
        return
    fi
    echo "=== $name: $*"
    local start=$SECONDS
    if timeout -k 10 "$RUN_TIMEOUT" "$@" >"$OUT/$name.log" 2>&1; then
        echo "=== $name done in $((SECONDS - start)) s"
    else
        echo "=== $name FAILED (exit $?) after $((SECONDS - start)) s; the end of its log:"
        tail -n 20 "$OUT/$name.log"
        failed=$((failed + 1))
    fi
}

if [[ "${SMOKE:-0}" != 1 ]]; then
    run allreduce_tp4 torchrun --nproc-per-node "$TP" benchmarks/bench_allreduce.py \
        --hidden 8192 --layers 80 --batches 1,32,128 --json "$OUT/allreduce_tp4.json"
fi
run decode_70b_tp4 python benchmarks/bench_engine_step.py --skip-stub $BIG $STEP \
    --tensor-parallel-size "$TP" --json "$OUT/decode_70b_tp4.json"
for cache in on off; do
    flag=$([[ $cache == off ]] && echo --no-prefix-cache)
    run "shared_prefix_70b_tp4_cache_$cache" $BENCH $BIG --tensor-parallel-size "$TP" \
        --dataset shared-prefix $SP_BIG --ignore-eos --max-batch-size 256 --cold-cache \
        --warmup-runs 1 --repeat-runs 1 $flag --json "$OUT/shared_prefix_70b_tp4_cache_$cache.json"
done
run dp4_routing python benchmarks/bench_data_parallel.py $MID --data-parallel-size "$DP" \
    --policies "$POLICIES" --dataset shared-prefix $SP_DP --ignore-eos --json "$OUT/dp4_routing.json"
for policy in ${POLICIES//,/ }; do
    run "dp4_served_$policy" python benchmarks/bench_serve.py $MID --dataset shared-prefix $SP_DP \
        --ignore-eos --cold-cache --skip-in-process --serve-flag=--data-parallel-size=$DP \
        --serve-flag=--router-policy=$policy --json "$OUT/dp4_served_$policy.json"
done
run tp2_dp2 python benchmarks/bench_data_parallel.py $MID --tensor-parallel-size 2 \
    --data-parallel-size 2 --policies cache_aware --dataset shared-prefix $SP_DP \
    --ignore-eos --json "$OUT/tp2_dp2.json"
echo "=== $failed failed"
exit "$failed"
