"""Admission (docs/request-lifecycle.md, Admission): each policy's selection on plain data through
`plan_admission`, then the engine's chunked prefill end to end on the tiny preset (same greedy
outputs as unchunked, decodes keep running while a long prompt is chunked, streamed tokens equal
generate's, timestamps monotone)."""

from __future__ import annotations

import functools
import random

import pytest

from radixinfer import LLM, SamplingParams
from radixinfer.engine.admission import AdmissionConfig, plan_admission
from radixinfer.outputs import deltas_of


def plan(
    costs: dict[str, int], *, round_index: int = 1, cached: dict[str, int] | None = None, **config
):
    """Grants as ``(name, num_tokens, chunked)`` for candidates named by ``costs`` (in arrival order)."""
    cached = cached or {}
    grants = plan_admission(
        list(costs),
        AdmissionConfig(**config),
        round_index,
        costs.__getitem__,
        lambda name: cached.get(name, 0),
    )
    return [(g.item, g.num_tokens, g.chunked) for g in grants]


# ---------------------------------------------------------------------------------------------- fifo
def test_fifo_admits_in_arrival_order_within_both_budgets():
    costs = {"a": 10, "b": 20, "c": 30, "d": 5}
    assert plan(costs, policy="fifo", max_tokens=100) == [
        ("a", 10, False),
        ("b", 20, False),
        ("c", 30, False),
        ("d", 5, False),
    ]
    assert plan(costs, policy="fifo", max_tokens=100, max_requests=2) == [
        ("a", 10, False),
        ("b", 20, False),
    ]


def test_fifo_chunks_an_oversize_head_into_the_budget():
    assert plan({"long": 500, "short": 5}, policy="fifo", max_tokens=64) == [("long", 64, True)]


def test_fifo_oversize_request_behind_others_takes_the_rest_and_ends_the_round():
    costs = {"a": 40, "long": 500, "b": 5}
    assert plan(costs, policy="fifo", max_tokens=64) == [("a", 40, False), ("long", 24, True)]
    # without chunking it waits for a round where it is first (nobody overtakes it)
    assert plan(costs, policy="fifo", max_tokens=64, chunked_prefill=False) == [("a", 40, False)]


def test_fifo_without_chunking_runs_an_oversize_head_alone():
    assert plan({"long": 500, "b": 5}, policy="fifo", max_tokens=64, chunked_prefill=False) == [
        ("long", 500, False)
    ]


# ---------------------------------------------------------------------------------------------- pack
def test_pack_skips_what_does_not_fit_and_keeps_arrival_order():
    costs = {"long": 500, "a": 30, "b": 40, "c": 20}
    assert plan(costs, policy="pack", max_tokens=64) == [("a", 30, False), ("c", 20, False)]


def test_pack_only_looks_inside_its_window():
    costs = {"long": 500, "a": 30, "b": 20}
    assert plan(costs, policy="pack", max_tokens=64, lookahead=2) == [("a", 30, False)]


@pytest.mark.parametrize("policy", ["pack", "lpm"])
def test_all_oversize_admits_the_head_chunked(policy):
    costs = {"x": 300, "y": 200, "z": 100}
    assert plan(costs, policy=policy, max_tokens=64) == [("x", 64, True)]
    assert plan(costs, policy=policy, max_tokens=64, chunked_prefill=False) == [("x", 300, False)]


def _rounds_until_admitted(force_fifo_every: int, max_rounds: int = 40) -> int | None:
    """Rounds (from 1) until a long head is admitted while short requests keep arriving, or None."""
    waiting = ["long"] + [f"s{i}" for i in range(4)]
    costs = {"long": 500}
    arrivals = 4
    for round_index in range(1, max_rounds + 1):
        costs.update({name: 16 for name in waiting if name != "long"})
        config = AdmissionConfig(policy="pack", max_tokens=64, force_fifo_every=force_fifo_every)
        granted = [g.item for g in plan_admission(waiting, config, round_index, costs.__getitem__)]
        if "long" in granted:
            return round_index
        waiting = [w for w in waiting if w not in granted] + [f"s{arrivals + i}" for i in range(4)]
        arrivals += 4
    return None


def test_pack_starves_a_long_prompt_without_forced_fifo_rounds():
    assert _rounds_until_admitted(force_fifo_every=0) is None


@pytest.mark.parametrize("every", [1, 3, 8])
def test_force_fifo_every_admits_the_long_head_within_n_rounds(every):
    assert _rounds_until_admitted(force_fifo_every=every) <= every


# ---------------------------------------------------------------------------------------------- lpm
def test_lpm_orders_by_longest_cached_prefix_ties_in_arrival_order():
    costs = {"a": 10, "b": 10, "c": 10, "d": 10}
    cached = {"a": 0, "b": 50, "c": 7, "d": 50}
    assert [g[0] for g in plan(costs, policy="lpm", max_tokens=100, cached=cached)] == [
        "b",
        "d",
        "c",
        "a",
    ]
    assert [g[0] for g in plan(costs, policy="lpm", max_tokens=25, cached=cached)] == ["b", "d"]


def test_costs_are_asked_lazily_one_candidate_at_a_time():
    asked: list[str] = []

    def cost(name: str) -> int:
        asked.append(name)
        return 10

    grants = plan_admission(
        ["a", "b", "c", "d"], AdmissionConfig(policy="fifo", max_requests=2), 1, cost
    )
    assert next(grants).item == "a" and asked == ["a"]
    assert [g.item for g in grants] == ["b"] and asked == ["a", "b"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("policy", "random"),
        ("max_tokens", 0),
        ("max_requests", 0),
        ("lookahead", 0),
        ("force_fifo_every", -1),
    ],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        AdmissionConfig(**{field: value})


# ---------------------------------------------------------------------------------------------- engine
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def prompts(seed: int = 0) -> list[list[int]]:
    """Mixed lengths, some far over a 16-token budget, two sharing a long prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(40)]
    out = [[rng.randrange(256) for _ in range(n)] for n in (5, 50, 17, 3, 70)]
    return out + [shared + [1, 2], shared + [3]]


def tiny(**kwargs) -> LLM:
    return LLM("tiny", block_size=4, num_blocks=512, **kwargs)


@functools.cache
def unchunked_outputs(cache: bool) -> list[list[int]]:
    return [o.token_ids for o in tiny(enable_prefix_cache=cache).generate(prompts(), GREEDY)]


@pytest.mark.parametrize(
    "cache, policy", [(True, "fifo"), (True, "pack"), (True, "lpm"), (False, "fifo")]
)
def test_chunked_prefill_matches_unchunked_greedy_outputs(cache, policy):
    chunked = tiny(
        enable_prefix_cache=cache,
        prefill_max_tokens=16,
        prefill_admission_policy=policy,
        prefill_force_fifo_every=2,
    )
    assert [o.token_ids for o in chunked.generate(prompts(), GREEDY)] == unchunked_outputs(cache)
    assert (
        chunked.cache_stats()["prefill_forwards"] > 70 // 16
    )  # the long prompts really were chunked


def test_decodes_keep_running_while_a_long_prompt_is_chunked():
    llm = tiny(prefill_max_tokens=16)
    engine = llm.engine
    short = engine.add_request([7] * 5, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()  # the short request is decoding now
    long = engine.add_request(list(range(200)), SamplingParams(max_tokens=2, ignore_eos=True))
    steps_until_long_starts = 0
    while True:
        deltas = {d.request_id: d for d in deltas_of(engine.step())}
        if long in deltas:
            break
        steps_until_long_starts += 1
        assert short in deltas, "the chunked prefill stalled the running decode"
    assert (
        steps_until_long_starts >= 200 // 16 - 1
    )  # it took many rounds, and the short one decoded in each


def test_stream_matches_generate_with_chunking_and_timestamps_are_monotone():
    llm = tiny(prefill_max_tokens=16)
    for prompt, want in zip(prompts(), unchunked_outputs(True)):
        deltas = list(llm.stream(prompt, GREEDY))
        assert [t for d in deltas for t in d.token_ids] == want
        times = [d.timestamp for d in deltas]
        assert times == sorted(times)


def test_a_chunked_prompt_publishes_its_partial_kv():
    engine = tiny(prefill_max_tokens=16).engine
    long = list(range(200))
    request_id = engine.add_request(long, SamplingParams(max_tokens=1, ignore_eos=True))
    for _ in range(5):
        engine.step()  # 5 chunks of 16: 80 positions computed, the prompt is not done
    assert engine.requests[request_id].finish_reason is None
    # a request sharing the prefix would reuse what the chunks computed so far
    assert engine.cache.cached_prefix_len(long[:100] + [1, 2, 3], None) >= 80
