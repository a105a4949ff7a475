"""The memory plan on a real GPU: engines stay inside their share of it, a configuration that cannot
fit is refused before anything is allocated, the largest decode batch at the longest context
survives, and the planned activation figure matches the peak a real burst allocates (within 10%).

The model is qwen2.5-0.5b's shape with random weights: its 152k vocabulary makes the LM head's rows,
the sampler's work on them (a processed copy, the logprobs' log-softmax) and the penalties' token-count
rows the largest activations, the figure under test. (The tests that need the GPU to
themselves run before the module's shared engine is built.)"""

from __future__ import annotations

import gc
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from radixinfer import LLM, SamplingParams
from radixinfer.engine.memory import DeviceMemory
from radixinfer.engine.worst_case import PENALIZED

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MODEL = "qwen2.5-0.5b"
BATCH = 128  # max_batch_size
CONTEXT = 4096  # max_model_len
UTILIZATION = 0.5


def sampled(max_tokens: int) -> SamplingParams:
    """The sampler's most expensive mode, as the profile's worst-case step samples
    (`radixinfer.engine.worst_case`): every filter, a bias, ``min_tokens``, every penalty and the
    most logprobs a request may ask for."""
    return replace(PENALIZED, max_tokens=max_tokens, ignore_eos=True)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """Random prompts that share no prefix, not even a first token: the engine defers a request
    extending a prefix another request of the same pass computes to a second pass, which would
    split the burst's LM-head rows over two forwards."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, 250, size=(count, length))
    prompts[:, 0] = rng.permutation(np.arange(1, 250))[:count]
    return prompts.tolist()


def test_engines_side_by_side_share_the_gpu_and_a_third_that_does_not_fit_is_refused():
    release()
    engines = [
        LLM("tiny", device="cuda", gpu_memory_utilization=0.4, max_batch_size=8) for _ in range(2)
    ]
    for llm in engines:
        assert llm.memory_plan.budget_bytes == int(0.4 * llm.memory_plan.total_bytes)
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert len(out.token_ids) == 4
    with pytest.raises(ValueError, match="lower gpu_memory_utilization to at most"):
        LLM("tiny", device="cuda", gpu_memory_utilization=0.4)
    del engines, llm
    release()


def test_a_model_that_cannot_fit_is_refused_and_gives_its_memory_back():
    release()
    before = DeviceMemory.read(device())
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        LLM(
            MODEL, device="cuda", gpu_memory_utilization=0.005
        )  # under 0.7 GiB: not even the weights
    release()
    assert DeviceMemory.read(device()).used - before.used < 64 * 2**20


@pytest.fixture(scope="module")
def engine():
    release()
    before = DeviceMemory.read(device())
    start = time.perf_counter()
    llm = LLM(
        MODEL,
        device="cuda",
        max_batch_size=BATCH,
        max_model_len=CONTEXT,
        gpu_memory_utilization=UTILIZATION,
    )
    print(f"\nstart-up {time.perf_counter() - start:.1f} s; " + llm.memory_plan.summary())
    yield llm, before
    del llm
    release()


def test_the_engine_holds_no_more_than_its_budget_after_start_up(engine):
    llm, before = engine
    plan = llm.memory_plan
    held = DeviceMemory.read(device()).used - before.used
    room = plan.budget_bytes - plan.activation_bytes  # what may stay held between steps
    print(
        f"\nheld after start-up {held / 2**30:.2f} GiB of a {plan.budget_bytes / 2**30:.2f} GiB "
        f"budget (planned without activations {room / 2**30:.2f} GiB)"
    )
    # the graphs are captured again against the real pool: allow their allocator rounding (1%)
    assert held <= room + 0.01 * plan.budget_bytes
    assert plan.kv_tokens >= BATCH * CONTEXT  # the next test's whole batch fits at once


def test_planned_activations_match_the_peak_of_a_burst_through_the_lm_head_and_sampler(engine):
    """A burst of ``BATCH`` short prompts: one prefill round whose every sequence reaches the LM
    head, then decode steps of the whole batch, every request sampling in the sampler's most
    expensive mode (`sampled`): the step the profile planned for. The sampler's token-count rows
    are released first (nothing runs), so the burst allocates them, as the profile did: planned
    and measured cover the same memory."""
    llm, _ = engine
    planned = llm.memory_plan.activation_bytes
    llm.reset_prefix_cache()
    llm.engine.sampler.release()  # nothing runs: the burst takes the count rows anew
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outs = llm.generate(random_prompts(BATCH, 16, seed=1), sampled(4))
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    print(
        f"\nactivations: planned {planned / 2**20:.1f} MiB, measured peak "
        f"{measured / 2**20:.1f} MiB ({measured / planned:.3f} of planned)"
    )
    assert all(len(out.token_ids) == 4 and len(out.outputs[0].logprobs) == 4 for out in outs)
    assert abs(measured - planned) <= 0.1 * planned


def test_the_largest_batch_at_the_longest_context_survives_a_worst_case_step(engine):
    """``BATCH`` distinct prompts that fill ``max_model_len``: full-budget prefill passes, then
    decode steps of the whole batch at the longest context, sampling in the sampler's most
    expensive mode (penalties and logprobs too). Every request finishes and the peak stays within
    the plan."""
    llm, _ = engine
    planned = llm.memory_plan.activation_bytes
    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outs = llm.generate(random_prompts(BATCH, CONTEXT - 8, seed=2), sampled(8))
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    print(
        f"\nlongest context: planned activations {planned / 2**20:.1f} MiB, measured peak "
        f"{measured / 2**20:.1f} MiB; preemptions {llm.cache_stats()['preemptions']}"
    )
    assert [len(out.token_ids) for out in outs] == [8] * BATCH
    assert measured <= 1.1 * planned
