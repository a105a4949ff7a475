#!/usr/bin/env bash
# The benchmark issue's side-by-side runs, in one go, for one GPU (an H100; budget: under 8 minutes).
#
#   OUT=/path/to/results bash benchmarks/gpu_suite.sh            # GPU; needs checkpoints/gpt2-peer
#   SMOKE=1 OUT=/tmp/suite bash benchmarks/gpu_suite.sh          # CPU smoke test: tiny model, tiny sizes
#   ONLY="d1 e" OUT=/path/to/results bash benchmarks/gpu_suite.sh  # only the runs whose names start so
#
# Every line below is a `radixinfer bench` command line (replay one with `radixinfer bench FLAGS`); all
# run in one Python process (radixinfer.bench.suite), writing $OUT/NAME.json (every metric) and
# $OUT/NAME.txt (the table), then a summary table ($OUT/summary.txt). A run that fails or passes
# RUN_TIMEOUT seconds is reported and skipped; the exit status is the number of failed runs.
#
#   a  fixed prompt, 130 tokens x 512 requests, 2 new tokens, warm cache (exact repeats)
#   b  shared 541-token prompt + unique suffix x 256 requests, cold cache, prefix cache on vs off
#   c  head-of-line mix (one 1,024-token prompt per three 5-token ones), fifo vs pack vs lpm, no cache
#   d  generated shared prefix 16 groups x 32 prompts (1,024 + 128 tokens, 128 out), qwen2.5-0.5b shapes:
#      prefix cache on vs off (d1); radixinfer vs transformers' continuous batching (d2, 8 prompts per group:
#      transformers takes minutes on the full 512)
#   e  random prompts (nothing shared): what the prefix cache costs when it never hits
#
# Compared variants run side by side in one process, measured in alternating (ABBA) rounds; d1 and e take an
# even number of rounds so each variant goes first equally often, and report the paired rounds' spread.
#
# --no-stop-on-eos everywhere: random weights emit EOS only by accident, which would make token counts differ.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the results directory}"

if [[ "${SMOKE:-0}" == 1 ]]; then
    PEER="--model tiny --device cpu"
    QWEN="--model tiny --device cpu"
    A="--prompt-repeats 65 --num-requests 8"
    B="--prompt-repeats 2 --num-requests 8 --max-new-tokens 4"
    C="--prompt-repeats 64,1,1,1 --num-requests 8 --prefill-max-tokens 64 --max-new-tokens 4"
    D="--num-groups 2 --prompts-per-group 4 --system-prompt-len 64 --question-len 8 --output-len 4"
    D2="$D"
    E="--num-requests 8 --input-len 32 --output-len 4"
    D1_ROUNDS=2 E_ROUNDS=2
    RUN_TIMEOUT=${RUN_TIMEOUT:-120}
else
    PEER="--model checkpoints/gpt2-peer --dtype float16"
    QWEN="--model qwen2.5-0.5b --dtype bfloat16"
    A="--prompt-repeats 65 --num-requests 512"
    B="--prompt-repeats 20 --num-requests 256 --max-new-tokens 64"
    C="--prompt-repeats 512,1,1,1 --num-requests 128 --prefill-max-tokens 256 --max-new-tokens 32"
    D="--num-groups 16 --prompts-per-group 32 --system-prompt-len 1024 --question-len 128 --output-len 128"
    D2="--num-groups 16 --prompts-per-group 8 --system-prompt-len 1024 --question-len 128 --output-len 128"
    E="--num-requests 256 --input-len 512 --output-len 128"
    D1_ROUNDS=8 E_ROUNDS=10  # the cache-on/off ratios are judged against 3x and 2%: pool enough rounds
    RUN_TIMEOUT=${RUN_TIMEOUT:-300}
fi
SHARED="You are a helpful assistant. Answer the question concisely and cite your sources."

RUNS=$(cat <<EOF
a_fixed_hello65 $PEER --prompt Hello $A --max-new-tokens 2 --max-batch-size 16 --prefill-max-batch-size 16 --warmup-runs 1 --no-stop-on-eos
b_shared_prompt $PEER --prompt "$SHARED" $B --unique-prompts --max-batch-size 256 --prefill-max-batch-size 64 --cold-cache --compare-no-cache --warmup-runs 1 --no-stop-on-eos
c_head_of_line $PEER --prompt Hello $C --unique-prompts --max-batch-size 8 --prefill-max-batch-size 128 --prefill-force-fifo-every 8 --no-prefix-cache --truncate-prompts --compare-policies fifo,pack,lpm --warmup-runs 1 --no-stop-on-eos
d1_shared_prefix_cache $QWEN --dataset shared-prefix $D --max-batch-size 512 --cold-cache --compare-no-cache --warmup-runs 1 --repeat-runs $D1_ROUNDS --no-stop-on-eos
d2_shared_prefix_vs_hf $QWEN --dataset shared-prefix $D2 --max-batch-size 512 --cold-cache --compare-backends --hf-batching continuous --warmup-runs 1 --no-stop-on-eos
e_random_cache_cost $PEER --dataset random $E --max-batch-size 128 --cold-cache --compare-no-cache --warmup-runs 1 --repeat-runs $E_ROUNDS --no-stop-on-eos
EOF
)
if [[ -n "${ONLY:-}" ]]; then  # e.g. ONLY="d1 e": the runs whose names start so
    RUNS=$(grep -E "^(${ONLY// /|})" <<<"$RUNS")
fi
python -m radixinfer.bench.suite "$OUT" --run-timeout "$RUN_TIMEOUT" <<<"$RUNS"
