"""The host KV tier through the public API (CPU: the KV pool and the host pool are both in RAM, the
engine's logic is the one a GPU runs): multi-turn chat whose history is many times the KV pool gives
the same greedy tokens as the engine without a prefix cache, with write-through or without, and its
hits come from the host tier; the tier's counters move by exactly what moved; a request whose
prefix is loading waits for it while the others go on."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from radixinfer import LLM, SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 20  # 80 tokens of KV
HOST_BLOCKS = 256


@functools.cache
def _bytes_per_block() -> int:
    return LLM("tiny", block_size=BLOCK_SIZE, num_blocks=1).memory_plan.bytes_per_block


@functools.cache
def _llm(
    prefix_cache: bool,
    host_blocks: int,
    write_through_hits: int | None = None,
    device="cpu",
    num_blocks: int = NUM_BLOCKS,
) -> LLM:
    return LLM(
        "tiny",
        device=device,
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        enable_prefix_cache=prefix_cache,
        max_batch_size=8,
        host_cache_gb=host_blocks * _bytes_per_block() / (1 << 30),
        host_write_through_hits=write_through_hits,
    )


def _chat(llm: LLM, conversations: int, turns: int, seed: int) -> list[list[int]]:
    """Every conversation's turns, round robin: each turn's prompt is the conversation so far plus a
    new user message; one batch of requests per round, stepped until done (an engine that stops
    making progress fails the test instead of hanging it). Returns every turn's greedy answer."""
    rng = random.Random(seed)
    histories: list[list[int]] = [[] for _ in range(conversations)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    answers = []
    for _ in range(turns):
        prompts = [h + [rng.randrange(3, 250) for _ in range(10)] for h in histories]
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        for _ in range(100 * conversations):
            if not engine.has_unfinished():
                break
            engine.step()
        assert not engine.has_unfinished(), "the engine stopped making progress"
        for h, prompt, request_id in zip(histories, prompts, ids):
            out = engine.pop_finished(request_id).output_ids
            h[:] = prompt + out
            answers.append(out)
    return answers


def _chat_under_way(llm: LLM, conversations: int, turns: int, seed: int) -> tuple[list, int]:
    """Every conversation under way at once: a conversation's next turn (the conversation so far
    plus a new user message) is added as soon as its answer is out, while the others decode.
    Returns every turn's greedy answer by conversation and turn, and the preemptions."""
    rng = random.Random(seed)
    histories = [[rng.randrange(3, 250) for _ in range(16)] for _ in range(conversations)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    preempted = llm.cache_stats()["preemptions"]
    live = {engine.add_request(h, params): c for c, h in enumerate(histories)}
    answers: list[list[list[int]]] = [[] for _ in range(conversations)]
    for _ in range(200 * conversations * turns):
        if not live:
            break
        engine.step()
        for request_id in [r for r in live if engine.is_finished(r)]:
            c = live.pop(request_id)
            answers[c].append(engine.pop_finished(request_id).output_ids)
            if len(answers[c]) < turns:
                histories[c] += answers[c][-1] + [rng.randrange(3, 250) for _ in range(12)]
                live[engine.add_request(histories[c], params)] = c
    assert not live, "the engine stopped making progress"
    return answers, llm.cache_stats()["preemptions"] - preempted


def test_conversations_under_way_at_once_preempt_no_more_with_the_tier():
    """10 conversations of 4 turns, all under way at once, over a 48-block pool: the turns that
    hit the host tier are admitted cheaply (only their new message is computed), many in one
    round. Admission leaves free the blocks the requests holding KV will surely still take (these
    run to their length), so the tier preempts no more than the engine without it, and answers
    as the engine without a prefix cache. (When admission left no room for decoding, the tier
    preempted 9 times here, and the engine without it 4.)"""
    want, _ = _chat_under_way(_llm(False, 0, num_blocks=48), 10, 4, seed=0)
    runs = {}
    for host_blocks in (0, HOST_BLOCKS):
        llm = _llm(True, host_blocks, num_blocks=48)
        llm.reset_prefix_cache()
        before = llm.cache_stats()["host_hit_tokens"]
        answers, preempted = _chat_under_way(llm, 10, 4, seed=0)
        runs[host_blocks] = (preempted, llm.cache_stats()["host_hit_tokens"] - before)
        assert answers == want
        llm.engine.cache.check_integrity([])
    (off_preempted, _), (on_preempted, host_hits) = runs[0], runs[HOST_BLOCKS]
    assert host_hits > 0
    assert on_preempted <= off_preempted


@pytest.mark.parametrize("write_through_hits", [None, 1])
def test_multi_turn_history_many_times_the_pool_matches_no_cache_with_host_hits(
    write_through_hits,
):
    conversations, turns = 6, 4
    # 6 conversations of up to 4 x 16 = 64 tokens: 384 tokens of history for an 80-token pool
    want = _chat(_llm(False, 0), conversations, turns, seed=1)
    gpu_only = _llm(True, 0)
    gpu_only.reset_prefix_cache()
    before_gpu = gpu_only.cache_stats()
    assert _chat(gpu_only, conversations, turns, seed=1) == want
    tiered = _llm(True, HOST_BLOCKS, write_through_hits)
    tiered.reset_prefix_cache()
    before = tiered.cache_stats()
    assert _chat(tiered, conversations, turns, seed=1) == want
    stats, gpu_stats = tiered.cache_stats(), gpu_only.cache_stats()
    keys = ("cached_tokens", "host_hit_tokens", "gpu_hit_tokens")
    delta = {k: stats[k] - before[k] for k in keys}
    moved = {k: stats[k] - before[k] for k in ("loaded_tokens", "offloaded_tokens")}
    assert delta["host_hit_tokens"] > 0 and moved["loaded_tokens"] >= delta["host_hit_tokens"]
    # every loaded position went to the host first: written back, or evicted onto its copy
    onto_copies = stats["evicted_to_copy_tokens"] - before["evicted_to_copy_tokens"]
    assert moved["offloaded_tokens"] + onto_copies >= moved["loaded_tokens"]
    assert delta["cached_tokens"] == delta["host_hit_tokens"] + delta["gpu_hit_tokens"]
    # the evicted histories come back from the host instead of being computed again
    gpu_cached = gpu_stats["cached_tokens"] - before_gpu["cached_tokens"]
    assert delta["cached_tokens"] > gpu_cached
    assert stats["host_total_blocks"] == HOST_BLOCKS
    written_through = stats["written_through_tokens"] - before["written_through_tokens"]
    if write_through_hits is None:
        assert written_through == 0
    # histories loaded back kept their host blocks, and their next evictions took those copies
    assert onto_copies > 0
    tiered.engine.cache.check_integrity([])  # both pools: every block held by the tree, once
    tiered.reset_prefix_cache()
    after_reset = tiered.cache_stats()
    assert after_reset["free_blocks"] == NUM_BLOCKS
    assert after_reset["host_free_blocks"] == HOST_BLOCKS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("write_through_hits", [None, 1])
def test_on_a_gpu_the_host_tier_gives_the_no_cache_answers(write_through_hits):
    """The copies on CUDA (pinned host pool, gathers on the current stream, bus copies and loads
    on the side stream, requests waiting for their loads by event) move the right bytes in the
    right order: multi-turn chat many times the pool answers as the engine without a cache."""
    want = _chat(_llm(False, 0, device="cuda"), 6, 4, seed=3)
    tiered = _llm(True, HOST_BLOCKS, write_through_hits, device="cuda")
    tiered.reset_prefix_cache()
    assert _chat(tiered, 6, 4, seed=3) == want
    assert tiered.cache_stats()["host_hit_tokens"] > 0
    tiered.engine.cache.check_integrity([])


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


def test_requests_admitted_while_their_prefix_loads_reserve_their_chunk_and_preempt_no_more():
    """8 conversations of 5 turns at once over a 48-block pool: many turns are admitted while
    their history loads from the host tier. Each reserves its prompt chunk at admission, as any
    admission does, so the requests admitted while it waits cannot take the memory it needs: the
    run preempts no more than without the tier (none) and gives the same answers. (Without the
    reservation, loading requests held their loaded blocks with nothing reserved, the pool ran
    dry, and preempting the newest, which was admitted again at once, went on forever.)"""
    runs = {}
    for host_blocks in (0, HOST_BLOCKS):
        llm = _llm(True, host_blocks, num_blocks=48)
        llm.reset_prefix_cache()
        before = llm.cache_stats()
        answers = _chat(llm, 8, 5, seed=0)
        moved = _moved(before, llm.cache_stats())
        runs[host_blocks] = (answers, moved["preemptions"], moved["host_hit_tokens"])
        llm.engine.cache.check_integrity([])
    (off, off_preempted, _), (on, on_preempted, host_hits) = runs[0], runs[HOST_BLOCKS]
    assert on == off and host_hits > 0
    assert on_preempted == off_preempted == 0


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
        (dict(host_cache_gb=0.001, host_write_through_hits=-1), "host_write_through_hits"),
        (dict(host_cache_gb=0.001, host_write_through_hits=1.5), "host_write_through_hits"),
        (dict(host_write_through_hits=1), "host_write_through_hits"),  # no host tier
    ],
)
def test_bad_host_cache_gb_is_a_value_error_naming_it(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM("tiny", block_size=BLOCK_SIZE, num_blocks=8, **kwargs)


P = list(range(10, 50))  # 40 tokens: 10 blocks, half the pool
Q = list(range(100, 172))  # 72 tokens: 18 blocks (the most a request may hold with its answer)
ONE = SamplingParams(max_tokens=1, temperature=0.0)


def _moved(before: dict, after: dict) -> dict:
    return {k: v - before[k] for k, v in after.items() if isinstance(v, (int, float))}


def test_the_counters_move_by_what_moved_and_the_load_bandwidth_is_bytes_over_time():
    """P is computed, Q's admission writes 8 blocks of P's tail (32 tokens) back to the host, and P
    again reads its first 8 tokens where they are and loads the 32 back, after writing 8 blocks of
    Q back: every counter by exactly that much."""
    llm = _llm(True, HOST_BLOCKS)
    llm.reset_prefix_cache()
    before = llm.cache_stats()
    for prompt in (P, Q, P):
        llm.generate([prompt], ONE)
    moved = _moved(before, llm.cache_stats())
    assert moved["offloaded_tokens"] == 32 + 32 and moved["loaded_tokens"] == 32
    assert moved["host_hit_tokens"] == 32 and moved["gpu_hit_tokens"] == 8
    assert moved["cached_tokens"] == 40 and moved["written_through_tokens"] == 0
    assert moved["loaded_bytes"] == 8 * _bytes_per_block() and moved["load_seconds"] > 0
    stats = llm.cache_stats()
    assert stats["load_gb_per_s"] == pytest.approx(
        stats["loaded_bytes"] / stats["load_seconds"] / 1e9
    )


def test_with_write_through_the_hit_prefix_is_copied_once_and_its_eviction_moves_nothing():
    llm = _llm(True, HOST_BLOCKS, 0)
    llm.reset_prefix_cache()
    before = llm.cache_stats()
    for prompt in (P, P, Q, P):  # the second P hits it: it is copied to the host
        llm.generate([prompt], ONE)
    moved = _moved(before, llm.cache_stats())
    assert moved["written_through_tokens"] == 40
    assert moved["evicted_to_copy_tokens"] == 32  # Q's admission evicts P's tail onto its copy
    assert moved["offloaded_tokens"] == 32  # only Q's tail, for P's load: P moved nothing
    assert moved["loaded_tokens"] == moved["host_hit_tokens"] == 32
    assert moved["gpu_hit_tokens"] == 40 + 8  # the second P, and the third's head
    # the loaded tail kept its host blocks as its copy: nothing more was written through
    llm.engine.cache.check_integrity([])


def test_a_request_hit_on_the_host_starts_in_the_round_of_its_load_and_aborting_it_leaks_nothing():
    """A request whose prefix loads from the host tier is admitted beside a fresh prompt; the
    round's first pass computes the fresh prompt without waiting for the load, and the second pass
    computes the loaded request's suffix once the load completed: both prompts are done in the
    step that admitted them (the loaded request used to wait for the next step)."""
    want = _llm(False, 0).generate([P + [7, 8], list(range(200, 230))], ONE)
    llm = _llm(True, HOST_BLOCKS)
    llm.reset_prefix_cache()
    llm.generate([P], ONE)
    llm.generate([Q], ONE)  # P is host-resident now
    engine = llm.engine
    forwards = engine.counters.prefill_forwards
    loading = engine.add_request(P + [7, 8], ONE)
    fresh = engine.add_request(list(range(200, 230)), ONE)
    engine.step()  # both admitted: the fresh prompt is computed, P's load queued and run
    assert engine.requests[fresh].prompt_done == 30
    assert engine.requests[loading].prompt_done == 42  # in the second pass, after its load
    assert engine.counters.prefill_forwards == forwards + 2
    while engine.has_unfinished():
        engine.step()
    got = [engine.pop_finished(r).output_ids for r in (loading, fresh)]
    assert got == [w.token_ids for w in want]
    assert llm.cache_stats()["host_hit_tokens"] > 0
    # a request aborted in the step that loaded its prefix releases everything
    llm.generate([Q], ONE)
    held = engine.add_request(P + [9], ONE)
    engine.step()
    engine.abort(held)
    engine.pop_finished(held)
    assert llm.generate([P + [7, 8]], ONE)[0].token_ids == want[0].token_ids
    engine.cache.check_integrity([])
    llm.reset_prefix_cache()
    stats = llm.cache_stats()
    assert (stats["free_blocks"], stats["host_free_blocks"]) == (NUM_BLOCKS, HOST_BLOCKS)


class _LoadsInFlight:
    """Makes the engine's host pool report each load complete one query late, as a GPU's loads
    are still crossing the bus when the step that queued them asks (on a CPU they complete at
    once), and counts the device waits for them (`HostKVPool.join`)."""

    def __init__(self, host_kv) -> None:
        self.joins = 0
        self._reported = host_kv.finished_ticket()
        finished, join = host_kv.finished_ticket, host_kv.join

        def finished_late(wait: bool = False) -> int:
            done = finished(wait)
            shown, self._reported = (done if wait else self._reported), done
            return shown

        def counted_join() -> None:
            self.joins += 1
            join()

        host_kv.finished_ticket, host_kv.join = finished_late, counted_join


def test_a_step_with_other_work_does_not_wait_for_loads_still_in_flight():
    """The device waits for loads only when it has nothing else to run: beside a fresh prompt, a
    request whose load is still in flight is computed in a later step; alone, in the step of its
    load."""
    want = _llm(False, 0).generate([P + [7, 8], list(range(200, 230)), P + [9]], ONE)
    llm = _llm(True, HOST_BLOCKS)
    llm.reset_prefix_cache()
    llm.generate([P], ONE)
    llm.generate([Q], ONE)  # P is host-resident now
    engine = llm.engine
    loads = _LoadsInFlight(engine.host_kv)
    loading = engine.add_request(P + [7, 8], ONE)
    fresh = engine.add_request(list(range(200, 230)), ONE)
    engine.step()
    assert engine.requests[fresh].prompt_done == 30
    assert engine.requests[loading].prompt_done == 0 and loads.joins == 0  # still loading
    engine.step()  # its load reported complete: it joins while the fresh prompt decodes
    assert engine.requests[loading].prompt_done == 42 and loads.joins == 0
    while engine.has_unfinished():
        engine.step()
    got = [engine.pop_finished(r).output_ids for r in (loading, fresh)]
    llm.generate([Q], ONE)  # P back on the host
    alone = engine.add_request(P + [9], ONE)
    joins = loads.joins
    engine.step()
    assert engine.requests[alone].prompt_done == 41 and loads.joins == joins + 1
    while engine.has_unfinished():
        engine.step()
    got.append(engine.pop_finished(alone).output_ids)
    assert got == [w.token_ids for w in want]
    assert llm.cache_stats()["host_hit_tokens"] > 0
    engine.cache.check_integrity([])


def test_the_server_metrics_carry_the_tier_counters():
    from radixinfer.server.metrics import ServerMetrics

    llm = _llm(True, HOST_BLOCKS)
    llm.reset_prefix_cache()
    for prompt in (P, Q, P):
        llm.generate([prompt], ONE)
    stats = llm.cache_stats()
    text = ServerMetrics().render({**stats, "running": 0, "waiting": 0}).decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    expected = {
        "radixinfer_prefix_cache_gpu_hit_tokens_total": stats["gpu_hit_tokens"],
        "radixinfer_prefix_cache_host_hit_tokens_total": stats["host_hit_tokens"],
        "radixinfer_host_cache_loaded_tokens_total": stats["loaded_tokens"],
        "radixinfer_host_cache_offloaded_tokens_total": stats["offloaded_tokens"],
        "radixinfer_host_cache_written_through_tokens_total": stats["written_through_tokens"],
        "radixinfer_host_cache_loaded_bytes_total": stats["loaded_bytes"],
        "radixinfer_host_cache_load_seconds_total": stats["load_seconds"],
        "radixinfer_host_cache_load_bandwidth_bytes_per_second": stats["load_gb_per_s"] * 1e9,
    }
    assert {k: float(values[k]) for k in expected} == pytest.approx(expected)
    assert stats["gpu_hit_tokens"] > 0 and stats["loaded_bytes"] > 0


def test_a_prefix_is_loaded_only_for_a_request_admitted_in_that_step():
    """12 conversations of 5 turns at once over a 48-block pool: many admissions find their history
    host-resident and memory short. A load is made only when the admission's reservation (its
    chunk, and what it leaves free) fits beside it, so every loaded position is a host hit: none is
    loaded for a request that then finds no room, gives the blocks back and loads them again at its
    next attempt (2163 positions were loaded for 1230 host hits that way). The answers are the
    engine's without a prefix cache."""
    want, _ = _chat_under_way(_llm(False, 0, num_blocks=48), 12, 5, seed=1)
    llm = _llm(True, HOST_BLOCKS, num_blocks=48)
    llm.reset_prefix_cache()
    before = llm.cache_stats()
    answers, preempted = _chat_under_way(llm, 12, 5, seed=1)
    moved = _moved(before, llm.cache_stats())
    assert answers == want and preempted == 0
    assert moved["host_hit_tokens"] > 0
    assert moved["loaded_tokens"] == moved["host_hit_tokens"]
    llm.engine.cache.check_integrity([])
