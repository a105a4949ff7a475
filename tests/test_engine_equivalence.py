"""Greedy `LLM.generate` equals transformers' `generate(do_sample=False)` token for token, for every model
family, with and without the prefix cache, across block sizes and burst shapes that exercise matching
mid-block, exact repeats, prompts that are prefixes of others, a second burst hitting the first, and a
pool so small that eviction and preemption happen."""

from __future__ import annotations

import random

import pytest

from radixinfer import LLM, SamplingParams
from tests.engine_helpers import FAMILIES, hf_greedy, save_tiny_checkpoint

MAX_NEW = 6


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    return save_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def burst(seed: int) -> list[list[int]]:
    """Prompts sharing a system prefix, exact repeats, and one prompt that is a prefix of another."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 300) for _ in range(11)]
    prompts = [
        system + [rng.randrange(1, 300) for _ in range(rng.randrange(1, 9))] for _ in range(4)
    ]
    prompts.append(list(prompts[1]))  # exact repeat in the same burst
    prompts.append(prompts[2][:-1])  # a strict prefix of another prompt
    prompts.append([rng.randrange(1, 300) for _ in range(5)])  # unrelated
    return prompts


def check(llm: LLM, checkpoint, prompts: list[list[int]], stop_token_ids=()) -> None:
    """Greedy answers of ``prompts`` equal transformers'. ``stop_token_ids``: tokens that end an
    answer, none of which transformers' answers hold (they stop nothing, but the engine cannot
    know how long the answers run)."""
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=stop_token_ids)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        want = hf_greedy(checkpoint, prompt, MAX_NEW)
        assert not set(stop_token_ids) & set(want), f"a stop token in the answer to {prompt}"
        assert out.prompt_token_ids == prompt
        assert out.token_ids == want, f"prompt {prompt}"


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("cache", [True, False])
def test_bursts_match_transformers(checkpoint, block_size, cache):
    llm = LLM(str(checkpoint), block_size=block_size, num_blocks=512, enable_prefix_cache=cache)
    first = burst(0)
    check(llm, checkpoint, first)
    # Second burst: repeats and extensions of what the first published, plus fresh prompts.
    second = [first[0], first[3] + [7, 8, 9], first[5][:4]] + burst(1)[:3]
    check(llm, checkpoint, second)
    stats = llm.cache_stats()
    assert (stats["cached_tokens"] > 0) == cache
    llm.reset_prefix_cache()
    assert llm.cache_stats()["free_blocks"] == llm.cache_stats()["total_blocks"]


def test_single_requests_one_at_a_time(checkpoint):
    llm = LLM(str(checkpoint), block_size=3, num_blocks=256)
    for prompt in burst(2):
        check(llm, checkpoint, [prompt])


def test_tiny_pool_evicts_and_preempts(checkpoint):
    """Eight requests that cannot all fit: the engine evicts LRU leaves, then preempts the newest; the
    outputs are still exactly transformers'. (A stop token keeps their length unknown: admission
    leaves room for the outputs of requests that surely run to their length, which preempts
    none.)"""
    llm = LLM(str(checkpoint), block_size=2, num_blocks=40, max_batch_size=8)
    prompts = burst(3) + burst(4)[:2]
    check(llm, checkpoint, prompts, stop_token_ids=[0])
    check(llm, checkpoint, burst(5), stop_token_ids=[0])
    stats = llm.cache_stats()
    assert stats["preemptions"] > 0
    assert stats["evicted_blocks"] > 0
    llm.reset_prefix_cache()
    assert llm.cache_stats()["free_blocks"] == 40
