"""The host KV tier through the public API (CPU: the KV pool and the host pool are both in RAM, the
engine's logic is the one a GPU runs): multi-turn chat whose history is many times the KV pool gives
the same greedy tokens as the engine without a prefix cache, and its hits come from the host
tier."""

from __future__ import annotations

import functools
import random

import pytest

from radixinfer import LLM, SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 20  # 80 tokens of KV
HOST_BLOCKS = 256


@functools.cache
def _llm(prefix_cache: bool, host_blocks: int) -> LLM:
    bytes_per_block = LLM("tiny", block_size=BLOCK_SIZE, num_blocks=1).memory_plan.bytes_per_block
    return LLM(
        "tiny",
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        enable_prefix_cache=prefix_cache,
        max_batch_size=8,
        host_cache_gb=host_blocks * bytes_per_block / (1 << 30),
    )


def _chat(llm: LLM, conversations: int, turns: int, seed: int) -> list[list[int]]:
    """Every conversation's turns, round robin: each turn's prompt is the conversation so far plus a
    new user message; one `generate` call per round. Returns every turn's greedy answer."""
    rng = random.Random(seed)
    histories: list[list[int]] = [[] for _ in range(conversations)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    answers = []
    for _ in range(turns):
        prompts = [h + [rng.randrange(3, 250) for _ in range(10)] for h in histories]
        outs = llm.generate(prompts, params)
        for h, prompt, out in zip(histories, prompts, outs):
            h[:] = prompt + out.token_ids
            answers.append(out.token_ids)
    return answers


def test_multi_turn_history_many_times_the_pool_matches_no_cache_with_host_hits():
    conversations, turns = 6, 4
    # 6 conversations of up to 4 x 16 = 64 tokens: 384 tokens of history for an 80-token pool
    want = _chat(_llm(False, 0), conversations, turns, seed=1)
    gpu_only = _llm(True, 0)
    gpu_only.reset_prefix_cache()
    before_gpu = gpu_only.cache_stats()
    assert _chat(gpu_only, conversations, turns, seed=1) == want
    tiered = _llm(True, HOST_BLOCKS)
    tiered.reset_prefix_cache()
    before = tiered.cache_stats()
    assert _chat(tiered, conversations, turns, seed=1) == want
    stats, gpu_stats = tiered.cache_stats(), gpu_only.cache_stats()
    keys = ("cached_tokens", "host_hit_tokens", "gpu_hit_tokens")
    delta = {k: stats[k] - before[k] for k in keys}
    moved = {k: stats[k] - before[k] for k in ("loaded_tokens", "offloaded_tokens")}
    assert delta["host_hit_tokens"] > 0 and moved["loaded_tokens"] >= delta["host_hit_tokens"]
    assert moved["offloaded_tokens"] >= moved["loaded_tokens"]
    assert delta["cached_tokens"] == delta["host_hit_tokens"] + delta["gpu_hit_tokens"]
    # the evicted histories come back from the host instead of being computed again
    gpu_cached = gpu_stats["cached_tokens"] - before_gpu["cached_tokens"]
    assert delta["cached_tokens"] > gpu_cached
    assert stats["host_total_blocks"] == HOST_BLOCKS
    tiered.reset_prefix_cache()
    after_reset = tiered.cache_stats()
    assert after_reset["free_blocks"] == NUM_BLOCKS
    assert after_reset["host_free_blocks"] == HOST_BLOCKS


def test_a_host_tier_smaller_than_the_history_evicts_and_stays_exact():
    """A host tier of 16 blocks keeps only the most recent evicted tails: it evicts on its own,
    drops tails it cannot take, and every answer is still the no-cache engine's."""
    want = _chat(_llm(False, 0), 6, 3, seed=2)
    small = _llm(True, 16)
    small.reset_prefix_cache()
    before = small.cache_stats()
    assert _chat(small, 6, 3, seed=2) == want
    stats = small.cache_stats()
    assert stats["offloaded_tokens"] > before["offloaded_tokens"]
    assert stats["host_free_blocks"] <= 16


def test_without_the_option_there_is_no_host_tier():
    stats = _llm(True, 0).cache_stats()
    assert stats["host_total_blocks"] == 0 and stats["host_hit_tokens"] == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(host_cache_gb=-1.0), "host_cache_gb"),
        (dict(host_cache_gb="1"), "host_cache_gb"),
        (dict(host_cache_gb=float("nan")), "host_cache_gb"),
        (dict(host_cache_gb=1e-9), "host_cache_gb"),  # holds no block
        (dict(host_cache_gb=0.001, enable_prefix_cache=False), "host_cache_gb"),
        (dict(host_cache_gb=0.001, tensor_parallel_size=2), "host_cache_gb"),  # not yet
    ],
)
def test_bad_host_cache_gb_is_a_value_error_naming_it(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM("tiny", block_size=BLOCK_SIZE, num_blocks=8, **kwargs)
