"""The streaming front: submits from many threads, deltas equal generate's, abort, bad input, loop failures
reach every consumer, no busy loop while idle, clean shutdown."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from radixinfer import LLM, SamplingParams
from radixinfer.outputs import TokenBatch
from radixinfer.serving import EngineLoopError, EngineServer, StreamFailure

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = ["alpha", "beta beta", "gamma gamma gamma", "alpha and more", "delta"]


@pytest.fixture
def llm():
    return LLM("tiny", block_size=4, num_blocks=256)


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_concurrent_submits_stream_what_generate_returns(llm):
    expected = {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, PARAMS))}
    llm.reset_prefix_cache()
    results: dict[str, list[int]] = {}
    with EngineServer(llm.engine) as server:

        def client(prompt: str) -> None:
            deltas = list(server.submit(prompt, PARAMS))
            assert deltas[-1].finished and deltas[-1].finish_reason == "length"
            assert [d.timestamp for d in deltas] == sorted(d.timestamp for d in deltas)
            results[prompt] = tokens(deltas)

        threads = [threading.Thread(target=client, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == expected


def test_one_sink_for_many_requests(llm):
    sink: queue.SimpleQueue = queue.SimpleQueue()
    with EngineServer(llm.engine) as server:
        ids = {server.submit(p, PARAMS, sink=sink).request_id for p in PROMPTS}
        finished: set[str] = set()
        widest = 0
        while finished != ids:
            batch = sink.get(timeout=30)  # one step's events of every request on this sink
            assert {delta.request_id for delta in batch} <= ids - finished
            widest = max(widest, len({delta.request_id for delta in batch}))
            finished |= {delta.request_id for delta in batch if delta.finished}
        assert widest > 1  # requests decoded in one step arrive in one list


def test_token_batches_are_split_by_queue_and_handles_yield_deltas(llm):
    """Ids-only requests decode in one batch, so their steady tokens come as `TokenBatch`es: a shared queue
    gets its own requests' rows only, a private handle gets deltas, and every stream equals generate's."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, detokenize=False)
    expected = {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, params))}
    llm.reset_prefix_cache()
    sink: queue.SimpleQueue = queue.SimpleQueue()
    with EngineServer(llm.engine) as server:
        shared = {server.submit(p, params, sink=sink).request_id: p for p in PROMPTS[:3]}
        handles = {p: server.submit(p, params) for p in PROMPTS[3:]}
        streamed: dict[str, list[int]] = {}
        batches = 0
        while len([r for r in streamed if r in shared and len(streamed[r]) == 12]) < len(shared):
            for event in sink.get(timeout=30):
                if isinstance(event, TokenBatch):
                    batches += 1
                    assert set(event.request_ids) <= set(shared)
                    for request_id, token in zip(event.request_ids, event.token_ids):
                        streamed.setdefault(request_id, []).append(token)
                else:
                    streamed.setdefault(event.request_id, []).extend(event.token_ids)
        private = {p: tokens(handle) for p, handle in handles.items()}
    assert batches > 0
    assert {shared[r]: t for r, t in streamed.items()} == {p: expected[p] for p in PROMPTS[:3]}
    assert private == {p: expected[p] for p in PROMPTS[3:]}


def test_abort_ends_the_stream_and_frees_the_blocks(llm):
    with EngineServer(llm.engine) as server:
        handle = server.submit("a long one", SamplingParams(max_tokens=1000, ignore_eos=True))
        stream = iter(handle)
        first = next(stream)
        assert not first.finished
        handle.abort()
        rest = list(stream)
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        server.call(lambda engine: engine.reset_prefix_cache()).result()
        stats = server.call(lambda engine: engine.cache_stats()).result()
        assert stats["free_blocks"] == stats["total_blocks"]


def test_bad_prompt_fails_its_handle_and_the_server_keeps_serving(llm):
    with EngineServer(llm.engine) as server:
        with pytest.raises(ValueError, match="empty"):
            list(server.submit("", PARAMS))
        with pytest.raises(ValueError, match="prompt: token id 100000"):  # checked on the submitting thread
            list(server.submit([1, 100000], PARAMS))
        assert tokens(server.submit("fine", PARAMS)) == llm.generate(["fine"], PARAMS)[0].token_ids


def test_a_loop_failure_reaches_waiting_consumers_and_later_submits(llm, monkeypatch):
    server = EngineServer(llm.engine)
    started = threading.Event()

    def broken_step():
        started.set()
        raise RuntimeError("boom")

    monkeypatch.setattr(llm.engine, "step", broken_step)
    handle = server.submit("x", PARAMS)
    with pytest.raises(EngineLoopError) as info:
        list(handle)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(EngineLoopError):
        server.submit("y", PARAMS)
    server.close()


def test_the_loop_sleeps_while_idle(llm, monkeypatch):
    checks = 0
    has_unfinished = llm.engine.has_unfinished

    def counting() -> bool:
        nonlocal checks
        checks += 1
        return has_unfinished()

    monkeypatch.setattr(llm.engine, "has_unfinished", counting)
    with EngineServer(llm.engine) as server:
        list(server.submit("wake up", PARAMS))
        before = checks
        time.sleep(0.3)
        assert checks - before <= 2  # a spinning loop would check thousands of times


def test_close_aborts_open_requests_and_stops_the_thread(llm):
    server = EngineServer(llm.engine)
    sink: queue.SimpleQueue = queue.SimpleQueue()
    server.submit("never finishes", SamplingParams(max_tokens=900, ignore_eos=True), sink=sink)
    assert not sink.get(timeout=30)[0].finished  # running
    server.close()
    events = []
    while not sink.empty():
        events.extend(sink.get())
    assert events[-1].finish_reason == "abort" and not isinstance(events[-1], StreamFailure)
    assert "radixinfer-engine" not in {t.name for t in threading.enumerate()}  # joined
    with pytest.raises(RuntimeError, match="closed"):
        server.submit("late", PARAMS)
    server.close()  # idempotent
