#!/usr/bin/env bash
# The side-by-side runs of benchmarks/RESULTS.md in one go, on one GPU (H100 or H200; under 8 minutes).
#
#   OUT=/path/to/results bash benchmarks/gpu_suite.sh            # GPU; needs checkpoints/gpt2-small
#   SMOKE=1 OUT=/tmp/suite bash benchmarks/gpu_suite.sh          # CPU smoke test: tiny model, tiny sizes
#   ONLY="shared_prefix_cache random" OUT=... bash benchmarks/gpu_suite.sh  # the runs whose names start so
#
# checkpoints/gpt2-small, the GPT-2-small comparison checkpoint (random weights, fp16, byte-level BPE):
#   python benchmarks/make_gpt2_checkpoint.py checkpoints/gpt2-small --dtype float16
#
# Every line below is a `radixinfer bench` command line (replay one with `radixinfer bench FLAGS`); all
# run in one Python process (radixinfer.bench.suite), writing $OUT/NAME.json (every metric) and
# $OUT/NAME.txt (the table), then a summary table ($OUT/summary.txt). A run that fails or passes
# RUN_TIMEOUT seconds is reported and skipped; the exit status is the number of failed runs.
#
#   fixed_hello65        fixed prompt "Hello" x 65, 512 requests, 2 new tokens, warm cache (exact repeats)
#   shared_prompt        a shared 20-sentence prompt + unique suffix x 256 requests, cold cache, cache on vs off
#   head_of_line         one long prompt per three short ones, fifo vs pack vs lpm, no cache
#   shared_prefix_cache  generated shared prefix, 16 groups x 32 prompts (1,024 + 128 tokens, 128 out),
#                        qwen2.5-0.5b shapes: prefix cache on vs off
#   shared_prefix_vs_hf  the same with 8 prompts per group: radixinfer vs transformers' continuous batching
#                        (transformers takes minutes on the full 512)
#   random_cache_cost    random prompts (nothing shared): what the prefix cache costs when it never hits
#
# Compared variants run side by side in one process, measured in alternating (ABBA) rounds;
# shared_prefix_cache and random_cache_cost take an even number of rounds so each variant goes first
# equally often, and report the paired rounds' spread.
#
# --no-stop-on-eos everywhere: random weights emit EOS only by accident, which would make token counts differ.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the results directory}"

if [[ "${SMOKE:-0}" == 1 ]]; then
    GPT2="--model tiny --device cpu"
    QWEN="--model tiny --device cpu"
    FIXED="--prompt-repeats 65 --num-requests 8"
    SHARED="--prompt-repeats 2 --num-requests 8 --max-new-tokens 4"
    HOL="--prompt-repeats 64,1,1,1 --num-requests 8 --prefill-max-tokens 64 --max-new-tokens 4"
    PREFIX="--num-groups 2 --prompts-per-group 4 --system-prompt-len 64 --question-len 8 --output-len 4"
    PREFIX_HF="$PREFIX"
    RANDOM_PROMPTS="--num-requests 8 --input-len 32 --output-len 4"
    PREFIX_ROUNDS=2 RANDOM_ROUNDS=2
    RUN_TIMEOUT=${RUN_TIMEOUT:-120}
else
    GPT2="--model checkpoints/gpt2-small --dtype float16"
    QWEN="--model qwen2.5-0.5b --dtype bfloat16"
    FIXED="--prompt-repeats 65 --num-requests 512"
    SHARED="--prompt-repeats 20 --num-requests 256 --max-new-tokens 64"
    HOL="--prompt-repeats 512,1,1,1 --num-requests 128 --prefill-max-tokens 256 --max-new-tokens 32"
    PREFIX="--num-groups 16 --prompts-per-group 32 --system-prompt-len 1024 --question-len 128 --output-len 128"
    PREFIX_HF="--num-groups 16 --prompts-per-group 8 --system-prompt-len 1024 --question-len 128 --output-len 128"
    RANDOM_PROMPTS="--num-requests 256 --input-len 512 --output-len 128"
    PREFIX_ROUNDS=8 RANDOM_ROUNDS=10  # the cache-on/off ratios are judged against 3x and 2%: pool enough rounds
    RUN_TIMEOUT=${RUN_TIMEOUT:-300}
fi
SHARED_TEXT="You are a helpful assistant. Answer the question concisely and cite your sources."

RUNS=$(cat <<EOF
fixed_hello65 $GPT2 --prompt Hello $FIXED --max-new-tokens 2 --max-batch-size 16 --prefill-max-batch-size 16 --warmup-runs 1 --no-stop-on-eos
shared_prompt $GPT2 --prompt "$SHARED_TEXT" $SHARED --unique-prompts --max-batch-size 256 --prefill-max-batch-size 64 --cold-cache --compare-no-cache --warmup-runs 1 --no-stop-on-eos
head_of_line $GPT2 --prompt Hello $HOL --unique-prompts --max-batch-size 8 --prefill-max-batch-size 128 --prefill-force-fifo-every 8 --no-prefix-cache --truncate-prompts --compare-policies fifo,pack,lpm --warmup-runs 1 --no-stop-on-eos
shared_prefix_cache $QWEN --dataset shared-prefix $PREFIX --max-batch-size 512 --cold-cache --compare-no-cache --warmup-runs 1 --repeat-runs $PREFIX_ROUNDS --no-stop-on-eos
shared_prefix_vs_hf $QWEN --dataset shared-prefix $PREFIX_HF --max-batch-size 512 --cold-cache --compare-backends --hf-batching continuous --warmup-runs 1 --no-stop-on-eos
random_cache_cost $GPT2 --dataset random $RANDOM_PROMPTS --max-batch-size 128 --cold-cache --compare-no-cache --warmup-runs 1 --repeat-runs $RANDOM_ROUNDS --no-stop-on-eos
EOF
)
if [[ -n "${ONLY:-}" ]]; then  # e.g. ONLY="shared_prefix_cache random": the runs whose names start so
    RUNS=$(grep -E "^(${ONLY// /|})" <<<"$RUNS")
fi
python -m radixinfer.bench.suite "$OUT" --run-timeout "$RUN_TIMEOUT" <<<"$RUNS"
