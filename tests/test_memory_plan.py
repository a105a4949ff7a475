"""The memory plan's arithmetic on made-up devices (`plan_gpu_memory`): the budget is a share of the
whole GPU, the KV pool gets what the measured figures leave, and a configuration that cannot fit
raises a ValueError saying what to lower. Then ``max_model_len`` and ``gpu_memory_utilization``
through `LLM` on a CPU, and the runner's worst-case step on the tiny model."""

from __future__ import annotations

import pytest

from radixinfer import LLM, SamplingParams
from radixinfer.engine.memory import (
    GiB,
    ProfiledMemory,
    blocks_for_sequence,
    plan_cpu_memory,
    plan_gpu_memory,
)
from tests.engine_helpers import logprob_table

MiB = 2**20
BLOCK = 2 * MiB  # bytes per block of 16 tokens


def plan(**overrides):
    """An 80 GiB GPU, all free; 16 GiB of weights, 1 GiB other, 2 GiB activations, 1.5 GiB
    graphs."""
    profiled = ProfiledMemory(
        activation_bytes=2 * GiB, activation_reserved_bytes=2 * GiB, cuda_graph_bytes=3 * GiB // 2
    )
    args = {
        "device": "cuda:0",
        "total_bytes": 80 * GiB,
        "free_bytes_at_start": 80 * GiB,
        "gpu_memory_utilization": 0.9,
        "weights_bytes": 16 * GiB,
        "other_bytes": 1 * GiB,
        "profiled": profiled,
        "bytes_per_block": BLOCK,
        "block_size": 16,
        "max_model_len": 8192,
        "num_blocks": None,
    }
    return plan_gpu_memory(**{**args, **overrides})


def test_the_pool_gets_what_the_budget_leaves_in_whole_blocks():
    p = plan()
    assert p.budget_bytes == int(0.9 * 80 * GiB)
    left = p.budget_bytes - (16 + 1 + 2 + 1.5) * GiB
    assert p.num_blocks == int(left // BLOCK)
    assert p.kv_bytes <= left < p.kv_bytes + BLOCK
    assert p.kv_tokens == p.num_blocks * 16
    assert (
        p.weights_bytes + p.other_bytes + p.activation_bytes + p.cuda_graph_bytes + p.kv_bytes
        <= p.budget_bytes
    )
    summary = p.summary()
    for figure in (
        "weights 16.00 GiB",
        "activations 2.00 GiB",
        "CUDA graphs 1.50 GiB",
        "other 1.00 GiB",
        f"{p.num_blocks} blocks",
        f"({p.kv_tokens} tokens)",
        "0.9 of 80.00 GiB",
    ):
        assert figure in summary
    assert p.as_dict()["kv_tokens"] == p.kv_tokens


def test_the_host_tiers_staging_comes_out_of_the_kv_pool_and_shows_in_the_plan():
    without, with_tier = plan(), plan(host_staging_bytes=768 * BLOCK)
    assert with_tier.num_blocks == without.num_blocks - 768
    assert with_tier.host_staging_bytes == 768 * BLOCK
    assert "host staging 1.50 GiB" in with_tier.summary()
    assert "host staging" not in without.summary()
    with pytest.raises(ValueError, match="host tier's staging"):
        plan(num_blocks=without.num_blocks, host_staging_bytes=BLOCK)


def test_the_budget_is_a_share_of_the_whole_gpu_not_of_what_is_free():
    half = plan(
        gpu_memory_utilization=0.45, free_bytes_at_start=50 * GiB
    )  # another engine holds 30 GiB
    assert half.budget_bytes == int(0.45 * 80 * GiB)
    assert half.num_blocks == int((half.budget_bytes - 20.5 * GiB) // BLOCK)
    assert plan(gpu_memory_utilization=0.5).num_blocks < plan().num_blocks


def test_allocator_rounding_above_the_activation_peak_is_charged_to_other():
    rounded = ProfiledMemory(
        activation_bytes=2 * GiB,
        activation_reserved_bytes=2 * GiB + 256 * MiB,
        cuda_graph_bytes=3 * GiB // 2,
    )
    p = plan(profiled=rounded)
    assert p.other_bytes == 1 * GiB + 256 * MiB
    assert p.num_blocks == plan().num_blocks - 128


def test_a_budget_larger_than_what_is_free_names_gpu_memory_utilization():
    with pytest.raises(
        ValueError,
        match=r"gpu_memory_utilization=0.9 .* lower gpu_memory_utilization to at most 0.5",
    ):
        plan(free_bytes_at_start=40 * GiB)


def test_weights_and_activations_over_the_budget_say_what_to_lower():
    with pytest.raises(
        ValueError,
        match="raise gpu_memory_utilization, or lower max_batch_size, prefill_max_tokens",
    ):
        plan(weights_bytes=70 * GiB)
    with pytest.raises(ValueError, match="no room for a KV block"):
        plan(gpu_memory_utilization=0.25)


def test_an_explicit_num_blocks_wins_when_it_fits_and_is_refused_when_it_does_not():
    fits = plan().num_blocks
    assert plan(num_blocks=100).num_blocks == 100
    assert plan(num_blocks=fits).num_blocks == fits
    with pytest.raises(
        ValueError, match=f"num_blocks={fits + 1} .* lower num_blocks to at most {fits}"
    ):
        plan(num_blocks=fits + 1)


def test_a_pool_shorter_than_one_max_model_len_sequence_is_refused_with_the_longest_that_fits():
    # 0.3 of 80 GiB = 24 GiB; 20.5 GiB measured: 3.5 GiB = 1,792 blocks = 28,672 tokens
    p = plan(gpu_memory_utilization=0.3, max_model_len=16 * 1791 - 16)
    assert p.num_blocks == 1792 and blocks_for_sequence(p.max_model_len, 16) <= p.num_blocks
    with pytest.raises(
        ValueError, match=r"max_model_len=32768 .* lower max_model_len to at most 28656"
    ):
        plan(gpu_memory_utilization=0.3, max_model_len=32768)
    # an explicit pool is the user's choice: requests longer than it are refused one by one instead
    assert plan(gpu_memory_utilization=0.3, max_model_len=32768, num_blocks=10).num_blocks == 10


def test_blocks_for_a_sequence_count_the_copy_on_write_block():
    assert blocks_for_sequence(16, 16) == 2
    assert blocks_for_sequence(17, 16) == 3


def test_the_cpu_plan_is_fixed_or_explicit():
    cpu = plan_cpu_memory(
        weights_bytes=10, bytes_per_block=MiB, block_size=16, max_model_len=2048, num_blocks=None
    )
    assert cpu.num_blocks == 256 and cpu.activation_bytes is None and cpu.budget_bytes is None
    assert "activations" not in cpu.summary()
    assert (
        plan_cpu_memory(
            weights_bytes=10, bytes_per_block=MiB, block_size=16, max_model_len=2048, num_blocks=7
        ).num_blocks
        == 7
    )


def test_max_model_len_caps_the_context_the_engine_serves():
    llm = LLM("tiny", block_size=4, num_blocks=64, max_model_len=32)
    assert llm.memory_plan.max_model_len == 32 and llm.memory_plan.num_blocks == 64
    assert llm.engine.runner.table_width == 8  # block tables sized by it, not by the model's 2,048
    out = llm.generate([list(range(1, 31))], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 2  # prompt + output stop at max_model_len
    with pytest.raises(ValueError, match="longer than the model's context of 32"):
        llm.generate([list(range(1, 34))], SamplingParams(max_tokens=1))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_model_len": 4096}, "max_model_len=4096 exceeds the model's context of 2048"),
        ({"max_model_len": 0}, "max_model_len must be a positive integer"),
        ({"max_model_len": 1.5}, "max_model_len must be a positive integer"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be a number in"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be a number in"),
        ({"gpu_memory_utilization": "high"}, "gpu_memory_utilization must be a number"),
        ({"num_blocks": 0}, "num_blocks must be an integer >= 1"),
    ],
)
def test_bad_memory_options_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM("tiny", **kwargs)


def test_without_chunked_prefill_the_worst_case_pass_is_a_whole_context():
    """A prompt over the round's budget then runs alone, up to ``max_model_len`` tokens in one pass:
    the runner is sized (and on CUDA profiled) for that pass, not for the budget."""
    chunked = LLM("tiny", num_blocks=64, prefill_max_tokens=64, max_model_len=512)
    alone = LLM(
        "tiny", num_blocks=64, prefill_max_tokens=64, max_model_len=512, chunked_prefill=False
    )
    assert chunked.engine.runner.prefill_max_tokens < 512 <= alone.engine.runner.prefill_max_tokens
    out = alone.generate(
        [[1 + i % 250 for i in range(500)]], SamplingParams(max_tokens=2, ignore_eos=True)
    )[0]
    assert len(out.token_ids) == 2 and alone.cache_stats()["prefill_forwards"] == 1


def test_the_worst_case_step_runs_the_engines_sampler_and_leaves_the_engine_usable():
    """The step `profile_memory` measures on CUDA, run on a CPU: the largest prefill pass and decode
    batch the runner is sized for, through the LM head and the engine's own sampler in its most
    expensive mode, penalties included. It leaves the sampler's token-count rows allocated for
    ``max_batch_size`` penalised requests (what the plan covers), all free: as many penalised
    requests afterwards sample as on an engine that never ran it."""
    options = dict(block_size=4, num_blocks=64, max_batch_size=8, prefill_max_tokens=256)
    llm, fresh = (LLM("tiny", max_model_len=128, **options) for _ in range(2))
    counts = llm.engine.sampler.logits_processor.counts
    assert counts.output_counts.shape[0] == 0  # no penalised request yet: no rows
    llm.engine.runner.run_worst_case_step()
    assert counts.output_counts.shape == counts.prompt_seen.shape == (8, llm.engine.vocab_size)
    llm.reset_prefix_cache()
    params = [
        SamplingParams(
            max_tokens=3, ignore_eos=True, temperature=1.0, seed=i, presence_penalty=1.0,
            logprobs=2,
        )
        for i in range(8)
    ]  # fmt: skip
    prompts = [[5, 6, 7 + i] for i in range(8)]
    after, expected = (engine.generate(prompts, params) for engine in (llm, fresh))
    assert [o.token_ids for o in after] == [o.token_ids for o in expected]
    assert logprob_table([o.outputs[0] for o in after]) == pytest.approx(
        logprob_table([o.outputs[0] for o in expected]), abs=1e-4
    )
    assert counts.output_counts.shape[0] == 8  # the same rows, reused
