"""Engine behaviour through the public API on the tiny preset: forward counts and computed tokens (one
ragged prefill per burst, in-burst dedup, exact repeats compute nothing), salts, bad input, no leaks."""

from __future__ import annotations

import gc
import math
import random

import numpy as np
import pytest

from radixinfer import LLM, SamplingParams
from radixinfer.outputs import TokenBatch, deltas_of

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture
def llm():
    return LLM("tiny", block_size=4, num_blocks=512)


def unique_prefix_count(prompts: list[list[int]]) -> int:
    """Distinct (prefix) positions over a set of prompts: what a perfect prefix cache computes."""
    return len({tuple(p[: i + 1]) for p in prompts for i in range(len(p))})


def shared_burst() -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(256) for _ in range(30)]
    prompts = [system + [rng.randrange(256) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    return prompts + [list(prompts[0]), list(prompts[3]), [rng.randrange(256) for _ in range(9)]]


def test_burst_runs_one_prefill_and_computes_unique_prefixes_once(llm):
    prompts = shared_burst()
    llm.generate(prompts, GREEDY)
    stats = llm.cache_stats()
    # One ragged forward, plus at most one more pass for suffixes that copy a block the first pass writes.
    assert 1 <= stats["prefill_forwards"] <= 2
    distinct = len({tuple(p) for p in prompts})
    assert (
        unique_prefix_count(prompts)
        <= stats["computed_prompt_tokens"]
        <= unique_prefix_count(prompts) + distinct
    )
    assert stats["prompt_tokens"] == sum(map(len, prompts))


def test_exact_repeats_compute_no_prompt_tokens(llm):
    prompts = shared_burst()
    first = llm.generate(prompts, GREEDY)
    before = llm.cache_stats()
    again = llm.generate(prompts, GREEDY)
    after = llm.cache_stats()
    assert after["computed_prompt_tokens"] == before["computed_prompt_tokens"]
    assert [o.num_cached_tokens for o in again] == [len(p) for p in prompts]
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


def test_hit_computes_its_suffix_in_one_extend(llm):
    prompt = list(range(40))
    llm.generate([prompt], GREEDY)
    before = llm.cache_stats()
    out = llm.generate([prompt + list(range(100, 125))], GREEDY)[0]
    after = llm.cache_stats()
    assert out.num_cached_tokens == 40
    assert after["computed_prompt_tokens"] - before["computed_prompt_tokens"] == 25
    assert after["prefill_forwards"] - before["prefill_forwards"] == 1


def test_prefix_of_a_cached_prompt_recomputes_one_token(llm):
    llm.generate([list(range(50))], GREEDY)
    before = llm.cache_stats()
    out = llm.generate([list(range(37))], GREEDY)[0]
    assert (
        out.num_cached_tokens == 36
    )  # the last position is computed again for its logits, so not cached
    assert llm.cache_stats()["computed_prompt_tokens"] - before["computed_prompt_tokens"] == 1


def test_generated_tokens_are_published_for_the_next_turn(llm):
    prompt = list(range(20))
    out = llm.generate([prompt], SamplingParams(max_tokens=9, ignore_eos=True))[0]
    follow_up = prompt + out.token_ids + [5, 6, 7]
    second = llm.generate([follow_up], GREEDY)[0]
    # everything but the last generated token (whose KV is never computed) comes from the cache
    assert second.num_cached_tokens == len(prompt) + len(out.token_ids) - 1


def test_salts_never_share(llm):
    prompt = list(range(60))
    llm.generate([prompt], GREEDY, cache_salt="tenant-a")
    other = llm.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    same = llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 60
    assert other.token_ids == same.token_ids


def test_cache_off_computes_everything():
    llm = LLM("tiny", block_size=4, num_blocks=512, enable_prefix_cache=False)
    prompts = shared_burst()
    llm.generate(prompts, GREEDY)
    llm.generate(prompts, GREEDY)
    stats = llm.cache_stats()
    assert stats["cached_tokens"] == 0 and stats["hit_rate"] == 0.0
    assert stats["computed_prompt_tokens"] == 2 * sum(map(len, prompts))


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", GREEDY, "prompt"),
        ([], GREEDY, "prompt"),
        ([1, 2, 100000], GREEDY, "prompt"),
        ([1, -1], GREEDY, "prompt"),
        ([1, 2.0], GREEDY, "prompt"),
        ([True, 1], GREEDY, "prompt"),
        ([1, "2"], GREEDY, "prompt"),
        ([1, 2**70], GREEDY, "prompt"),
        ([1] * 5000, GREEDY, "prompt"),
        (np.array([[1, 2]]), GREEDY, "prompt"),
        (np.array([1.0, 2.0]), GREEDY, "prompt"),
        (np.array([True, False]), GREEDY, "prompt"),
        (np.array([], dtype=np.int32), GREEDY, "prompt"),
        (np.array([1, 300]), GREEDY, "prompt"),
        (np.array([1, 2**63], dtype=np.uint64), GREEDY, "prompt"),
        ("hi", None, "max_tokens"),
    ],
)
def test_bad_input_raises_naming_the_field_and_leaks_nothing(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(["fine prompt", prompt], params or SamplingParams(max_tokens=10**6))
    out = llm.generate(["still serving"], GREEDY)[0]
    assert len(out.token_ids) == 4
    llm.reset_prefix_cache()
    assert llm.cache_stats()["free_blocks"] == llm.cache_stats()["total_blocks"]


def test_token_id_arrays_are_prompts_like_lists_and_are_copied(llm):
    ids = [5, 17, 99, 3, 250, 8]
    expected = llm.generate([ids], GREEDY)[0].token_ids
    for dtype in (np.int64, np.int32, np.uint16):
        array = np.array(ids, dtype=dtype)
        request_id = llm.engine.add_request(array, GREEDY)
        array[:] = 0  # the request keeps its own copy
        while llm.engine.requests[request_id].finish_reason is None:
            llm.engine.step()
        assert llm.engine.pop_finished(request_id).output_ids == expected


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_random_workload_with_aborts_and_preemption_leaks_nothing():
    # EOS may stop these requests any time, so admission leaves no room for their outputs (it
    # does for requests that surely run to their length): their decoding preempts
    llm = LLM("tiny", block_size=2, num_blocks=36, max_batch_size=6)
    engine = llm.engine
    rng = random.Random(1)
    base = [rng.randrange(256) for _ in range(10)]
    ids = []
    for _i in range(24):
        prompt = base[: rng.randrange(1, 10)] + [
            rng.randrange(256) for _ in range(rng.randrange(1, 12))
        ]
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 24))))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps % 3 == 0:
            engine.abort(rng.choice(ids))
        engine.cache.check_integrity([r.seq for r in engine.active])
    assert engine.cache_stats()["preemptions"] > 0
    llm.reset_prefix_cache()
    assert llm.cache_stats()["free_blocks"] == 36


def test_seeded_sampling_is_independent_of_batch_composition(llm):
    params = SamplingParams(
        max_tokens=8, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True
    )
    alone = llm.generate(["the same prompt"], params)[0].token_ids
    crowd = llm.generate(["other", "the same prompt", "more text here"], [GREEDY, params, GREEDY])[
        1
    ].token_ids
    assert alone == crowd


def test_stop_token_ends_the_request(llm):
    greedy = llm.generate(["stop here"], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    stop = greedy[3]
    out = llm.generate(
        ["stop here"], SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[stop])
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy[: greedy.index(stop) + 1]


def test_stream_yields_the_same_tokens_as_generate(llm):
    expected = llm.generate(["stream me"], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    deltas = list(llm.stream("stream me", SamplingParams(max_tokens=6, ignore_eos=True)))
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert "".join(d.text for d in deltas) == expected.text
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])


def test_detokenize_off_streams_the_same_ids_without_text(llm):
    expected = llm.generate(["ids only"], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert expected.text  # the tiny model's byte tokenizer gives text for these ids
    params = SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False)
    deltas = list(llm.stream("ids only", params))
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert all(d.text == "" for d in deltas)
    out = llm.generate(["ids only"], params)[0]
    assert out.token_ids == expected.token_ids and out.text == ""
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize="no")


def test_steady_decode_steps_derive_inputs_from_the_last_step_exactly():
    """A decode step of the same batch as the last one takes its inputs from that step (no pass over the
    requests) and rewrites only the block-table rows `reserve` changed; inputs and packed rows must equal what
    the full pass builds, through joins, finishes and block crossings."""

    def run(fast: bool) -> tuple[list, list, int]:
        llm = LLM("tiny", block_size=4, num_blocks=512, max_batch_size=8)
        engine, calls, full_passes = llm.engine, [], []
        real_decode, real_inputs = engine.runner.decode, engine.pipeline.decode_inputs
        engine.pipeline.decode_inputs = lambda batch: full_passes.append(1) or real_inputs(batch)

        def decode(
            input_ids,
            positions,
            slots,
            tables,
            context_lens,
            carried=None,
            carried_rows=None,
            changed_tables=None,
        ):
            calls.append(
                (list(map(int, positions)), list(map(int, context_lens)), [list(t) for t in tables])
            )
            logits = real_decode(
                input_ids,
                positions,
                slots,
                tables,
                context_lens,
                carried,
                carried_rows,
                changed_tables,
            )
            buffers = engine.runner._decode_buffers
            rows = buffers.tables
            assert all(
                rows[i, : len(t)].tolist() == t and not rows[i, len(t) :].any()
                for i, t in enumerate(tables)
            )
            # the device copy holds the same rows: only the rewritten ones were sent
            np.testing.assert_array_equal(
                buffers.device_tables[: len(tables)].cpu().numpy(), rows[: len(tables)]
            )
            return logits

        engine.runner.decode = decode
        rng = random.Random(3)
        for _i in range(12):
            engine.add_request(
                [rng.randrange(256) for _ in range(rng.randrange(3, 20))],
                SamplingParams(max_tokens=rng.randrange(2, 30), ignore_eos=True),
            )
        outputs = {}
        while engine.has_unfinished():
            if not fast:
                engine.scheduler.last_decode = None
            for delta in deltas_of(engine.step()):
                outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
        return calls, sorted(outputs.items()), len(full_passes)

    fast_calls, fast_out, fast_passes = run(fast=True)
    slow_calls, slow_out, slow_passes = run(fast=False)
    assert fast_calls == slow_calls and fast_out == slow_out
    assert (
        slow_passes == len(slow_calls) and fast_passes <= len(fast_calls) // 2
    )  # the fast path ran


def test_token_batches_end_requests_exactly_where_per_request_deltas_do():
    """A batch of ids-only requests streams its steady tokens as `TokenBatch`es; rows that stop (a stop token)
    or reach max_tokens at different steps, and an abort mid-batch, must end exactly as with detokenizing
    requests, which take the per-request path."""
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 12))] for _ in range(10)]
    free_run = LLM("tiny", block_size=4, num_blocks=512).generate(
        prompts, SamplingParams(max_tokens=24, ignore_eos=True)
    )
    settings = []
    for i, out in enumerate(free_run):
        stop = (
            [out.token_ids[5 + i]] if i % 3 == 0 else None
        )  # stop on a token the request will sample
        settings.append(dict(max_tokens=8 + 2 * i, ignore_eos=True, stop_token_ids=stop))

    def run(detokenize: bool) -> tuple[dict, int]:
        engine = LLM("tiny", block_size=4, num_blocks=512).engine
        ids = [
            engine.add_request(p, SamplingParams(detokenize=detokenize, **kw))
            for p, kw in zip(prompts, settings)
        ]
        streamed, finish, batches, step = {}, {}, 0, 0
        while engine.has_unfinished():
            events = engine.step()
            batches += sum(type(e) is TokenBatch for e in events)
            for delta in deltas_of(events):
                streamed.setdefault(delta.request_id, []).extend(delta.token_ids)
                if delta.finished:
                    finish[delta.request_id] = delta.finish_reason
            step += 1
            if step == 6:
                final = engine.abort(ids[4])
                finish[final.request_id] = final.finish_reason
        return [(streamed.get(i), finish[i]) for i in ids], batches

    with_text, no_batches = run(detokenize=True)
    ids_only, batches = run(detokenize=False)
    assert ids_only == with_text and no_batches == 0 and batches > 0
    assert {reason for _, reason in ids_only} == {"stop", "length", "abort"}


def test_rows_that_go_on_stream_as_one_batch_while_others_finish():
    """Ids-only requests that end one after another (different max_tokens, an abort):
    once the prefill's first tokens are out, every token of a request that goes on arrives in a
    `TokenBatch`, also in the steps right after one stopped (its row is still in the launch the
    engine made before it stopped), and only a request's last token comes as its own delta."""
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 12))] for _ in range(8)]
    expected = LLM("tiny", block_size=4, num_blocks=512).generate(
        prompts, [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(8)]
    )
    engine = LLM("tiny", block_size=4, num_blocks=512).engine
    ids = [
        engine.add_request(
            p, SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, detokenize=False)
        )
        for i, p in enumerate(prompts)
    ]
    streamed: dict[str, list[int]] = {i: [] for i in ids}
    own_deltas, batched, step = [], 0, 0
    while engine.has_unfinished():
        events = engine.step()
        step += 1
        for event in events:
            if type(event) is TokenBatch:
                batched += len(event.request_ids)
                for request_id, token in zip(event.request_ids, event.token_ids):
                    streamed[request_id].append(token)
                continue
            streamed[event.request_id].extend(event.token_ids)
            if step > 2 and not event.finished:  # past the read-back of the prefill's tokens
                own_deltas.append(event.request_id)
        if step == 5:
            engine.abort(ids[7])
    assert own_deltas == []
    assert [streamed[i] for i in ids[:7]] == [out.token_ids for out in expected[:7]]
    assert streamed[ids[7]] == expected[7].token_ids[: len(streamed[ids[7]])]
    assert batched > sum(len(t) for t in streamed.values()) // 2


def test_steps_overlap_tokens_are_read_back_one_step_late(llm):
    engine = llm.engine
    request_id = engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    # Step 1 launches the prefill and, from its first token still on the device, the first decode.
    assert engine.step() == []
    assert (engine.counters.prefill_forwards, engine.counters.decode_forwards) == (1, 1)
    # Step 2 launches the last decode the length allows, then reads back step 1's two tokens.
    second = list(deltas_of(engine.step()))
    assert [(len(d.token_ids), d.finished) for d in second] == [(1, False), (1, False)]
    assert engine.counters.decode_forwards == 2
    third = list(deltas_of(engine.step()))  # nothing left to launch: reads back the third token
    assert [(len(d.token_ids), d.finished, d.finish_reason) for d in third] == [(1, True, "length")]
    assert engine.counters.decode_forwards == 2 and not engine.has_unfinished()
    expected = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[
        0
    ].token_ids
    assert [d.token_ids[0] for d in second + third] == expected
    engine.pop_finished(request_id)


def test_one_token_requests_never_decode(llm):
    outs = llm.generate([[7, 8, 9], [7, 8, 9, 10]], SamplingParams(max_tokens=1, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [1, 1]
    assert llm.cache_stats()["decode_forwards"] == 0


def test_gc_freeze_is_an_explicit_option_of_long_running_front_ends():
    """`LLM()` leaves the collector alone; ``freeze_gc=True`` moves what is alive out of its reach, and
    the engine still serves (a benchmark's or a server's set-up)."""
    before = gc.get_freeze_count()
    LLM("tiny", num_blocks=64)
    # nothing newly frozen (objects an earlier test froze may die meanwhile: the count can drop)
    assert gc.get_freeze_count() <= before
    try:
        llm = LLM("tiny", num_blocks=64, freeze_gc=True)
        assert gc.get_freeze_count() > before
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3
    finally:
        gc.unfreeze()
