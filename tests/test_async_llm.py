"""The asyncio front: concurrent streams equal generate's, one event-loop wake per step, shared
sinks and token batches, cancellation and timeouts abort and free blocks, a bounded waiting queue,
bad input, loop failures reach every consumer, no busy loop while idle, clean shutdown; the same
front over an engine process of its own."""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time

import pytest

from radixinfer import LLM, AsyncLLM, EngineProcess, SamplingParams
from radixinfer.async_llm import EngineLoopError, QueueFullError
from radixinfer.async_stream import RequestTimeoutError
from radixinfer.core_messages import StreamFailure
from radixinfer.engine_core import STEP_TRACE_ENV, StepTrace
from radixinfer.engine_process import start_engine_process
from radixinfer.outputs import TokenBatch

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
LONG = SamplingParams(max_tokens=1000, ignore_eos=True)
PROMPTS = ["alpha", "beta beta", "gamma gamma gamma", "alpha and more", "delta"]


@pytest.fixture
def llm():
    return LLM("tiny", block_size=4, num_blocks=256)


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def collect(front: AsyncLLM, prompt, params=PARAMS, **kwargs) -> list:
    return [delta async for delta in front.generate(prompt, params, **kwargs)]


async def wait_idle(front: AsyncLLM) -> dict:
    """The front's stats once no request runs (within 30 s)."""
    deadline = time.monotonic() + 30
    while (stats := await front.stats())["running"] or stats["waiting"]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    return stats


async def all_blocks_free(front: AsyncLLM) -> bool:
    await front.reset_prefix_cache()
    stats = await front.stats()
    return stats["free_blocks"] == stats["total_blocks"] and stats["running"] == 0


def test_concurrent_streams_equal_generate_and_wake_the_event_loop_once_a_step(llm):
    expected = {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, PARAMS))}
    llm.reset_prefix_cache()
    wakes = 0

    async def main() -> dict[str, list[int]]:
        nonlocal wakes
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal wakes
            wakes += 1
            return call_soon_threadsafe(*args)

        loop.call_soon_threadsafe = counting
        with AsyncLLM(llm) as front:
            streams = await asyncio.gather(*(collect(front, p) for p in PROMPTS))
        for deltas in streams:
            assert deltas[-1].finished and deltas[-1].finish_reason == "length"
            assert [d.timestamp for d in deltas] == sorted(d.timestamp for d in deltas)
        return {p: tokens(d) for p, d in zip(PROMPTS, streams)}

    assert asyncio.run(main()) == expected
    # 5 streams x 6 tokens = 30 deltas; they share steps, and a step wakes the event loop once
    assert wakes <= 6 + len(PROMPTS)


def test_a_step_trace_records_every_step_of_the_thread_and_of_an_engine_process(
    llm, tmp_path, monkeypatch
):
    """With `STEP_TRACE_ENV` set, each engine core writes a line per step to a file of its own (two
    fronts of one process, one after the other, too): the requests it took add up, the first step
    follows a wait for work, the prompt tokens computed add up to the engine's count, the times
    run in order, and the core's thread ran for no longer than each step lasted."""
    monkeypatch.setenv(STEP_TRACE_ENV, str(tmp_path))

    async def run(front: AsyncLLM) -> None:
        await asyncio.gather(*(collect(front, p) for p in PROMPTS))

    for _ in range(2):  # the second finds every prompt cached
        with AsyncLLM(llm) as front:
            asyncio.run(run(front))
    with AsyncLLM(EngineProcess(model="tiny", block_size=4, num_blocks=256)) as front:
        asyncio.run(run(front))
        pid = front.engine_pid
    threads = sorted(tmp_path.glob(f"engine-thread-{os.getpid()}-*.steps"))
    (process,) = tmp_path.glob(f"engine-process-{pid}-*.steps")
    assert len(threads) == 2
    computed = []
    for path in [*threads, process]:
        assert tuple(path.read_text().split("\n", 1)[0].split()) == StepTrace.FIELDS
        steps = StepTrace.read(path)
        assert sum(s["added"] for s in steps) == len(PROMPTS) and steps[0]["idle"] == 1
        assert all(s["take"] <= s["start"] <= s["end"] for s in steps)
        # the thread's CPU time in a step is no more than the step's wall time (a clock's tick of
        # slack: the two clocks are read one after the other)
        assert all(0 <= s["cpu"] <= s["end"] - s["start"] + 0.01 for s in steps)
        assert sum(s["cpu"] for s in steps) > 0
        assert all(s["gc"] >= 0 and s["preempted"] >= 0 for s in steps)
        assert steps[-1]["active"] == steps[-1]["waiting"] == 0
        computed.append(sum(s["computed"] for s in steps))
    assert computed[0] + computed[1] == llm.engine.counters.computed_prompt_tokens
    assert 0 < computed[2] <= sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)


def test_a_consumer_that_falls_behind_takes_every_waiting_token_once_with_their_text(llm):
    """Tokens that wait for a busy consumer come in one `next_deltas`, in order, each once; the
    steady steps' tokens in one delta (not one delta a step), each step's time kept in
    ``step_times``; the stream decodes their text at once (the engine streams ids only), equal to
    generate's."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = llm.generate(["fall behind"], params)[0]
    llm.reset_prefix_cache()

    async def main(front: AsyncLLM) -> tuple[list[list], list[float]]:
        stream = front.add_request("fall behind", params)
        batches = [await stream.next_deltas()]
        time.sleep(0.3)  # the event loop stands still while the engine goes on
        while batch := await stream.next_deltas():
            batches.append(batch)
        return batches, stream.step_times

    with AsyncLLM(llm) as front:
        batches, step_times = asyncio.run(main(front))
    deltas = [delta for batch in batches for delta in batch]
    assert tokens(deltas) == expected.token_ids
    assert "".join(delta.text for delta in deltas) == expected.text
    waited = max(batches, key=lambda batch: len(tokens(batch)))
    assert len(tokens(waited)) > len(waited)  # the waiting steps came at once, merged
    assert len(step_times) == len(expected.token_ids) == len(set(step_times))  # one token a step
    assert step_times == sorted(step_times)
    assert [d.timestamp for d in deltas] == sorted(d.timestamp for d in deltas)
    assert {d.timestamp for d in deltas} <= set(step_times)  # a merged delta: its last step's


def test_one_sink_for_many_requests(llm):
    sink: queue.SimpleQueue = queue.SimpleQueue()
    with AsyncLLM(llm) as front:
        ids = {front.submit(p, PARAMS, None, sink) for p in PROMPTS}
        finished: set[str] = set()
        widest = 0
        while finished != ids:
            batch = sink.get(timeout=30)  # one step's events of every request on this sink
            assert {delta.request_id for delta in batch} <= ids - finished
            widest = max(widest, len({delta.request_id for delta in batch}))
            finished |= {delta.request_id for delta in batch if delta.finished}
        assert widest > 1  # requests decoded in one step arrive in one list


def test_token_batches_go_whole_to_a_shared_sink_and_as_deltas_to_streams(llm):
    """Ids-only requests decode in one batch, so their steady tokens come as `TokenBatch`es: a
    shared sink gets its own requests' rows only, a coroutine's stream gets deltas, and every stream
    equals generate's."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, detokenize=False)
    expected = {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, params))}
    llm.reset_prefix_cache()
    sink: queue.SimpleQueue = queue.SimpleQueue()

    async def main(front: AsyncLLM) -> tuple[dict, dict, int]:
        shared = {front.submit(p, params, None, sink): p for p in PROMPTS[:3]}
        private = await asyncio.gather(*(collect(front, p, params) for p in PROMPTS[3:]))
        streamed: dict[str, list[int]] = {}
        batches = 0
        while sum(len(streamed.get(r, ())) for r in shared) < 12 * len(shared):
            for event in await asyncio.to_thread(sink.get, timeout=30):
                if isinstance(event, TokenBatch):
                    batches += 1
                    assert set(event.request_ids) <= set(shared)
                    for request_id, token in zip(event.request_ids, event.token_ids):
                        streamed.setdefault(request_id, []).append(token)
                else:
                    streamed.setdefault(event.request_id, []).extend(event.token_ids)
        by_prompt = {shared[r]: t for r, t in streamed.items()}
        return by_prompt, {p: tokens(d) for p, d in zip(PROMPTS[3:], private)}, batches

    with AsyncLLM(llm) as front:
        shared, private, batches = asyncio.run(main(front))
    assert batches > 0
    assert shared == {p: expected[p] for p in PROMPTS[:3]}
    assert private == {p: expected[p] for p in PROMPTS[3:]}


def test_cancelling_a_consumer_aborts_its_request_and_frees_its_blocks(llm):
    async def main() -> None:
        with AsyncLLM(llm) as front:
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in front.generate("a long one", LONG):
                    started.set()

            tasks = [asyncio.create_task(consume()) for _ in range(3)]
            await asyncio.wait_for(started.wait(), 30)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert (await wait_idle(front))[
                "decode_forwards"
            ] < 500  # stopped long before 1,000 tokens
            assert await all_blocks_free(front)
            assert tokens(await collect(front, "fine")) == expected  # and the front keeps serving

    expected = llm.generate(["fine"], PARAMS)[0].token_ids
    asyncio.run(main())


def test_a_request_past_its_timeout_fails_and_frees_its_blocks(llm):
    async def main() -> None:
        with AsyncLLM(llm, request_timeout=0.2) as front:
            with pytest.raises(RequestTimeoutError, match="timeout"):
                await collect(front, "a long one", LONG)
            assert (await wait_idle(front))["decode_forwards"] < 500  # aborted, not run to the end
            assert await all_blocks_free(front)
            assert (await collect(front, "quick", timeout=30))[-1].finish_reason == "length"

    asyncio.run(main())


def test_a_full_waiting_queue_refuses_at_once_and_drains():
    llm = LLM("tiny", block_size=4, num_blocks=256, max_num_seqs=1)
    sink: queue.SimpleQueue = queue.SimpleQueue()
    with AsyncLLM(llm, max_waiting=2) as front:
        running = front.submit("runs", LONG, None, sink)
        assert not sink.get(timeout=30)[0].finished  # admitted: it holds the only seat
        queued = [front.submit("waits", PARAMS, None, sink) for _ in range(2)]
        with pytest.raises(QueueFullError):
            front.submit("one too many", PARAMS, None, sink)
        front.abort(running)
        finished: set[str] = set()
        while finished != {running, *queued}:
            finished |= {e.request_id for e in sink.get(timeout=30) if e.finished}
        front.submit("room again", PARAMS, None, sink)


def test_bad_input_raises_and_the_front_keeps_serving(llm):
    async def main() -> None:
        with AsyncLLM(llm) as front:
            with pytest.raises(ValueError, match="empty"):
                front.add_request("", PARAMS)
            with pytest.raises(ValueError, match="prompt: token id 100000"):
                front.add_request([1, 100000], PARAMS)
            with pytest.raises(
                ValueError, match="max_tokens"
            ):  # found by the engine: raised by the stream
                await collect(front, "too big for the pool", SamplingParams(max_tokens=5000))
            assert tokens(await collect(front, "fine")) == expected

    expected = llm.generate(["fine"], PARAMS)[0].token_ids
    asyncio.run(main())


def test_a_loop_failure_reaches_waiting_consumers_and_later_submits(llm, monkeypatch):
    front = AsyncLLM(llm)

    def broken_step():
        raise RuntimeError("boom")

    monkeypatch.setattr(llm.engine, "step", broken_step)

    async def main() -> None:
        with pytest.raises(EngineLoopError) as info:
            await collect(front, "x")
        assert isinstance(info.value.__cause__, RuntimeError)
        with pytest.raises(EngineLoopError):
            front.add_request("y", PARAMS)

    asyncio.run(main())
    front.close()


def test_the_loop_sleeps_while_idle(llm, monkeypatch):
    checks = 0
    has_unfinished = llm.engine.has_unfinished

    def counting() -> bool:
        nonlocal checks
        checks += 1
        return has_unfinished()

    monkeypatch.setattr(llm.engine, "has_unfinished", counting)
    with AsyncLLM(llm) as front:
        asyncio.run(collect(front, "wake up"))
        before = checks
        time.sleep(0.3)
        assert checks - before <= 2  # a spinning loop would check thousands of times


def test_close_aborts_open_requests_and_stops_the_thread(llm):
    front = AsyncLLM(llm)
    sink: queue.SimpleQueue = queue.SimpleQueue()
    front.submit("never finishes", SamplingParams(max_tokens=900, ignore_eos=True), None, sink)
    assert not sink.get(timeout=30)[0].finished  # running
    front.close()
    events = []
    while not sink.empty():
        events.extend(sink.get())
    assert events[-1].finish_reason == "abort" and not isinstance(events[-1], StreamFailure)
    assert "radixinfer-engine" not in {t.name for t in threading.enumerate()}  # joined
    with pytest.raises(RuntimeError, match="closed"):
        front.submit("late", PARAMS, None, sink)
    front.close()  # idempotent


def test_an_engine_process_serves_like_the_thread_and_stops_with_the_front(llm):
    expected = {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, PARAMS))}

    async def main(front: AsyncLLM) -> dict[str, list[int]]:
        streams = await asyncio.gather(*(collect(front, p) for p in PROMPTS))
        with pytest.raises(ValueError, match="max_tokens"):  # refused by the engine process
            await collect(front, "too big for the pool", SamplingParams(max_tokens=5000))
        assert await all_blocks_free(front)
        return {p: tokens(d) for p, d in zip(PROMPTS, streams)}

    with AsyncLLM(EngineProcess(model="tiny", block_size=4, num_blocks=256)) as front:
        assert asyncio.run(main(front)) == expected
        with pytest.raises(Exception, match="pickle"):  # what crosses to the process must pickle
            front.call(lambda llm: llm.cache_stats())
        pid = front.engine_pid
        os.kill(pid, 0)  # alive
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped by close


def test_fronts_sharing_one_engine_process_each_get_their_own_streams(llm):
    """Two fronts over one engine (what two API server processes hold): the same request ids on
    both, each front's streams equal generate's, calls answered to their caller; a front that
    closes aborts only its own requests, and the engine ends when the last front has gone."""
    expected = {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, PARAMS))}
    spec = EngineProcess(model="tiny", block_size=4, num_blocks=256)  # the fixture's engine
    process, connections = start_engine_process(spec, 2)
    fronts = [AsyncLLM(connection) for connection in connections]
    assert {front.engine_pid for front in fronts} == {process.pid}

    async def main() -> list[list[list[int]]]:
        streams = [[collect(front, p) for p in PROMPTS] for front in fronts]
        results = await asyncio.gather(*(asyncio.gather(*s) for s in streams))
        return [[tokens(d) for d in result] for result in results]

    assert asyncio.run(main()) == [list(expected.values())] * 2
    left: queue.SimpleQueue = queue.SimpleQueue()
    long_id = fronts[1].submit("runs long", LONG, None, left)
    assert not left.get(timeout=30)[0].finished  # running on the front that stays
    closing: queue.SimpleQueue = queue.SimpleQueue()
    fronts[0].submit("runs long too", LONG, None, closing)
    fronts[0].close()  # aborts its own request, not the other front's
    assert closing.get(timeout=30)[-1].finish_reason == "abort"
    assert not left.get(timeout=30)[-1].finished
    assert process.is_alive()
    fronts[1].abort(long_id)
    while not left.get(timeout=30)[-1].finished:
        pass
    assert asyncio.run(all_blocks_free(fronts[1]))
    fronts[1].close()
    process.join(timeout=30)
    assert process.exitcode == 0


def test_an_engine_process_that_cannot_start_raises_what_its_llm_raised():
    with pytest.raises(ValueError, match="block_size"):
        AsyncLLM(EngineProcess(model="tiny", block_size=0))


class BrokenSink:
    def put(self, events) -> None:
        raise RuntimeError("this sink is broken")


@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_sink_that_raises_fails_every_request_instead_of_leaving_it_waiting(where):
    kwargs = {"model": "tiny", "block_size": 4, "num_blocks": 256}
    engine = LLM(**kwargs) if where == "thread" else EngineProcess(**kwargs)
    good: queue.SimpleQueue = queue.SimpleQueue()
    with AsyncLLM(engine) as front:
        front.submit("runs long", LONG, None, good)
        assert not good.get(timeout=30)[0].finished  # running
        front.submit("breaks", PARAMS, None, BrokenSink())
        events = []
        while not events or not events[-1].finished:
            events += good.get(timeout=30)
        assert isinstance(events[-1], StreamFailure)
        assert isinstance(events[-1].error, EngineLoopError)
        with pytest.raises(EngineLoopError):
            front.submit("later", PARAMS, None, good)
