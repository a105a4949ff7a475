"""What a user must be able to rely on: admission never livelocks, eviction gives up only what it must,
accounting is honest, and streams lose nothing (interleaved, interrupted, abandoned)."""

from __future__ import annotations

import gc

import pytest

from radixinfer import LLM, SamplingParams
from radixinfer.cache.kv_manager import KVCacheManager

ONE = SamplingParams(max_tokens=1, ignore_eos=True)
TWELVE = SamplingParams(max_tokens=12, ignore_eos=True)


def all_free(llm: LLM) -> bool:
    """No request holds a KV block: every block is free or held by the prefix cache alone."""
    engine, stats = llm.engine, llm.cache_stats()
    engine.cache.check_integrity([])
    return (
        not (engine.active or engine.waiting)
        and stats["free_blocks"] + held_by_tree(llm) == stats["total_blocks"]
    )


def held_by_tree(llm: LLM) -> int:
    return len(llm.engine.cache.tree.block_holders())


def run_steps(llm: LLM, bound: int = 500) -> None:
    for _ in range(bound):
        if not llm.engine.has_unfinished():
            return
        llm.engine.step()
    raise AssertionError(f"still running after {bound} steps")


# ------------------------------------------------------------------------------------------ admission
def test_a_short_hit_on_a_long_cached_edge_is_admitted():
    """A 5-token hit on a cached 40-token edge used to pin all 10 of its blocks, leaving the request unable
    to reserve and retried forever."""
    llm = LLM("tiny", block_size=4, num_blocks=12)
    prompt = list(range(40))
    llm.generate([prompt], ONE)
    out = llm.generate([prompt[:5] + list(range(100, 130))], ONE)[0]
    assert out.finish_reason == "length" and out.num_cached_tokens == 5
    llm.engine.cache.check_integrity([])


def test_a_hit_whose_path_holds_extra_boundary_blocks_falls_back_to_a_miss():
    """A path split mid-block holds two versions of the boundary block; a request reading it whole pins
    both. In a pool it would fit alone as a miss, it is admitted (as a miss) instead of waiting forever."""
    llm = LLM("tiny", block_size=4, num_blocks=9)
    base = list(range(30))
    llm.generate([base[:6]], ONE)  # node [0, 6): blocks 0, 1
    llm.generate([base[:26]], ONE)  # node [6, 26) holds its own version of block 1
    out = llm.generate([base[:26] + [200] * 4], ONE)[0]  # needs 8 blocks + a copy; the path pins 8
    assert out.finish_reason == "length"
    assert all_free(llm)


def test_chunked_prompts_that_hold_each_others_memory_both_finish():
    llm = LLM("tiny", block_size=4, num_blocks=12, prefill_max_tokens=8)
    outs = llm.generate([[1] * 40, [2] * 40], SamplingParams(max_tokens=2, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert all_free(llm)


# ------------------------------------------------------------------------------------------ eviction
def test_eviction_trims_a_leaf_from_its_tail():
    """A one-block shortage takes one block off the least recently used leaf; its head stays cached."""
    mgr = KVCacheManager(num_blocks=12, block_size=4)
    seq = mgr.admit(list(range(40)))
    mgr.reserve([seq], [40])
    mgr.release(seq, publish=list(range(40)))
    assert mgr.tree.evict(1) == 1
    assert mgr.num_free_blocks == 3
    assert mgr.cached_prefix_len(list(range(40))) == 36
    assert mgr.tree.evict(2) == 2
    assert mgr.cached_prefix_len(list(range(40))) == 28
    mgr.check_integrity([])


def test_a_one_block_shortage_keeps_the_rest_of_a_long_conversation():
    llm = LLM("tiny", block_size=4, num_blocks=16)
    conversation = [9] * 40
    answer = llm.generate([conversation], SamplingParams(max_tokens=8, ignore_eos=True))[
        0
    ].token_ids
    history = conversation + answer  # 48 tokens: 12 blocks cached, 4 free
    llm.generate(
        [[3] * 16], SamplingParams(max_tokens=2, ignore_eos=True)
    )  # needs 5 blocks: one short
    assert llm.cache_stats()["evicted_blocks"] == 1
    follow_up = llm.generate([history + [5] * 4], ONE)[0]
    assert (
        follow_up.num_cached_tokens == 44
    )  # one block of the conversation's tail went, not all of it


# ------------------------------------------------------------------------------------------ accounting
def test_cached_tokens_are_counted_at_the_admission_that_succeeds():
    """A request that found 8 cached tokens but could not get memory, waited while that prefix was evicted,
    then computed everything must report 0 cached tokens, not 8."""
    llm = LLM("tiny", block_size=4, num_blocks=12)
    llm.generate([[7] * 8], ONE)
    engine = llm.engine
    first = engine.add_request([3] * 32, TWELVE)
    engine.step()
    second = engine.add_request([7] * 8 + [5] * 16, TWELVE)
    run_steps(llm)
    for request_id in (first, second):
        req = engine.pop_finished(request_id)
        assert req.num_cached_tokens + req.num_computed_prompt_tokens == len(req.prompt_ids)
    stats = llm.cache_stats()
    assert (
        stats["cached_tokens"] + stats["computed_prompt_tokens"]
        == stats["prompt_tokens"]
        == 8 + 32 + 24
    )


# ------------------------------------------------------------------------------------------ streams
def test_interleaved_streams_each_receive_every_token():
    llm = LLM("tiny")
    expected = [o.token_ids for o in llm.generate(["hello there", "general kenobi"], TWELVE)]
    streams = [llm.stream("hello there", TWELVE), llm.stream("general kenobi", TWELVE)]
    received: list[list[int]] = [[], []]
    done = [False, False]
    while not all(done):
        for i, stream in enumerate(streams):
            if not done[i]:
                delta = next(stream)
                received[i] += delta.token_ids
                done[i] = delta.finished
    assert received == expected
    assert all_free(llm)


def test_a_stream_keeps_its_tokens_while_generate_runs_between_two_reads():
    llm = LLM("tiny")
    expected = llm.generate(["abc"], TWELVE)[0].token_ids
    stream = llm.stream("abc", TWELVE)
    tokens = list(next(stream).token_ids)
    llm.generate(["xyz", "uvw"], TWELVE)
    tokens += [t for delta in stream for t in delta.token_ids]
    assert tokens == expected
    assert all_free(llm)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_generate_aborts_its_requests_and_frees_their_blocks(monkeypatch, error):
    llm = LLM("tiny")
    engine = llm.engine
    real_step, calls = engine.step, []

    def step_then_interrupt():
        calls.append(1)
        if len(calls) == 3:
            raise error("interrupted")
        return real_step()

    monkeypatch.setattr(engine, "step", step_then_interrupt)
    with pytest.raises(error):
        llm.generate(
            ["one prompt", "another prompt"], SamplingParams(max_tokens=50, ignore_eos=True)
        )
    monkeypatch.undo()
    assert engine.requests == {} and all_free(llm)
    assert llm.generate(["one prompt"], ONE)[0].finish_reason == "length"  # still usable


def test_a_closed_stream_aborts_its_request():
    llm = LLM("tiny")
    stream = llm.stream("a long answer", SamplingParams(max_tokens=100, ignore_eos=True))
    next(stream)
    stream.close()
    assert llm.engine.requests == {} and all_free(llm)


def test_a_dropped_stream_aborts_its_request():
    llm = LLM("tiny")
    stream = llm.stream("a long answer", SamplingParams(max_tokens=100, ignore_eos=True))
    next(stream)
    del stream
    gc.collect()
    assert llm.engine.requests == {} and all_free(llm)


def test_a_stream_dropped_before_its_first_read_aborts_its_request():
    llm = LLM("tiny")
    stream = llm.stream("never read", SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(llm.engine.requests) == 1
    del stream
    gc.collect()
    assert llm.engine.requests == {} and all_free(llm)


def test_a_stream_with_bad_input_raises_at_the_call():
    llm = LLM("tiny")
    with pytest.raises(ValueError, match="prompt"):
        llm.stream("", SamplingParams())
    assert llm.engine.requests == {}
