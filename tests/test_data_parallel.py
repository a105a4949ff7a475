"""Data parallelism on a CPU: `DataParallelLLM` over two engine replicas. The router's policies on
plain data; the proof that cache-aware routing keeps one replica's hit rate on a shared-prefix
workload whose groups arrive interleaved (round-robin's is clearly lower) with every block free on
every replica at the end; routing by each replica's own tree under the request's salt; the server
over replicas (health, models, per-replica metrics, cache reset, the bench's openai backend);
a replica that fails to start, and one that dies."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from radixinfer import LLM, EngineProcess, SamplingParams
from radixinfer.async_llm import EngineLoopError
from radixinfer.bench.args import parse_bench_args
from radixinfer.bench.backends import DataParallelBackend
from radixinfer.bench.metrics import cache_delta
from radixinfer.bench.run_loop import run_workload
from radixinfer.bench.workloads import build_workload
from radixinfer.cli import main, parse_args
from radixinfer.data_parallel import DataParallelLLM, replica_processes
from radixinfer.router import Router
from tests.http_server import running_server

ENGINE = {"model": "tiny", "block_size": 4, "num_blocks": 512, "max_batch_size": 32}
SHARED_PREFIX = [
    "--dataset", "shared-prefix", "--num-groups", "8", "--prompts-per-group", "4",
    "--system-prompt-len", "64", "--question-len", "8", "--max-new-tokens", "4", "--ignore-eos",
]  # fmt: skip


# ---------------------------------------------------------------------- the router, on plain data
def tokens(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def test_round_robin_takes_turns_and_least_loaded_takes_the_idlest():
    router = Router(3, "round_robin", load_margin=0, chunk_tokens=2)
    assert [router.place(tokens(1, 2), None)[0] for _ in range(4)] == [0, 1, 2, 0]
    router = Router(3, "least_loaded", load_margin=0, chunk_tokens=2)
    placed = [router.place(tokens(1, 2), None) for _ in range(3)]
    assert [r for r, _ in placed] == [0, 1, 2]
    router.release(*placed[1])
    assert router.place(tokens(1, 2), None)[0] == 1
    assert router.loads == [1, 1, 1] and router.routed == [1, 2, 1]


def test_cache_aware_follows_the_tree_then_requests_in_flight_then_the_load():
    router = Router(2, "cache_aware", load_margin=2, chunk_tokens=2)
    prompt = tokens(1, 2, 3, 4, 5)
    assert router.place(prompt, None, cached=[0, 3])[0] == 1  # the longer cached prefix
    # nothing cached: the first goes to the least loaded, the second follows it in flight
    other = tokens(9, 9, 9, 9)
    first, keys = router.place(other, None, cached=[0, 0])
    assert first == 0
    assert router.place(tokens(9, 9, 9, 9, 7), None, cached=[0, 0])[0] == first
    # another salt shares nothing in flight: the least loaded (replica 1)
    assert router.place(other, "tenant", cached=[0, 0])[0] == 1
    router.release(first, keys)
    assert router.in_flight_prefix(first, keys) == 4  # the second is still in flight


def test_cache_aware_skips_a_replica_busier_than_the_margin():
    router = Router(2, "cache_aware", load_margin=1, chunk_tokens=2)
    for _ in range(3):
        router.place(tokens(5, 6), None, cached=[8, 0])
    assert router.loads == [2, 1]  # the third went to replica 1: replica 0 was 2 busier
    assert router.place(tokens(5, 6), None, cached=[8, 0], down=[0])[0] == 1
    with pytest.raises(RuntimeError, match="every data-parallel replica"):
        router.place(tokens(5, 6), None, cached=[8, 0], down=[0, 1])
    with pytest.raises(ValueError, match="policy"):
        Router(2, "random", load_margin=0)
    with pytest.raises(ValueError, match="load_margin"):
        Router(2, "cache_aware", load_margin=-1)


def test_each_replica_sees_its_own_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,8")
    kwargs = {"model": "tiny", "device": "cuda:1", "tensor_parallel_size": 2}
    specs = replica_processes(kwargs, 2)
    assert [s.environment["CUDA_VISIBLE_DEVICES"] for s in specs] == ["5,6", "7,8"]
    assert {s.llm_kwargs["device"] for s in specs} == {"cuda"}
    with pytest.raises(ValueError, match="need 7 GPUs; 5 are visible"):
        replica_processes(kwargs, 3)
    assert all(s.environment == {} for s in replica_processes({"device": "cpu"}, 2))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
        (["--router-load-margin", "-1"], "--router-load-margin must be >= 0"),
        (["--router-policy", "random"], "invalid choice"),
    ],
)
def test_serve_refuses_bad_data_parallel_flags(capsys, flags, message):
    with pytest.raises(SystemExit):
        parse_args(["serve", *flags])
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------- two engine processes
@pytest.fixture(scope="module")
def dp2():
    with DataParallelLLM([EngineProcess(**ENGINE) for _ in range(2)]) as front:
        yield front


def replica_stats(front: DataParallelLLM) -> list[dict]:
    return asyncio.run(front.stats())["replicas"]


def shared_prefix_hit_rate(front: DataParallelLLM) -> float:
    """The shared-prefix workload, every request at once, through the bench's run loop; the hit
    rate of its prompt tokens. Afterwards nothing runs or waits anywhere, and emptying the
    caches frees every block of every replica."""
    args = parse_bench_args(SHARED_PREFIX)
    backend = DataParallelBackend(front)
    sessions = build_workload(args, backend.tokenizer, backend.vocab_size)
    before = backend.cache_stats()
    records, _ = run_workload(backend, sessions, [0.0] * len(sessions), args, front.policy)
    delta = cache_delta(before, backend.cache_stats())
    assert len(records) == 32 and all(len(r.token_ids) == 4 for r in records)
    assert all(s["running"] == 0 and s["waiting"] == 0 for s in replica_stats(front))
    backend.reset_cache()
    assert all(s["free_blocks"] == s["total_blocks"] for s in replica_stats(front))
    return delta["cached_tokens"] / delta["prompt_tokens"]


def test_cache_aware_routing_keeps_one_replicas_hit_rate_and_round_robin_does_not(dp2):
    with DataParallelLLM([LLM(**ENGINE)]) as one:
        single = shared_prefix_hit_rate(one)
    dp2.policy = "cache_aware"
    cache_aware = shared_prefix_hit_rate(dp2)
    dp2.policy = "round_robin"
    try:
        round_robin = shared_prefix_hit_rate(dp2)
    finally:
        dp2.policy = "cache_aware"
    assert single > 0.6  # each system prompt computed once: 3 of 4 hit its 64 tokens
    assert abs(cache_aware - single) <= 0.02
    assert round_robin < single - 0.1  # groups split over both replicas compute it twice


def test_four_replicas_keep_one_replicas_hit_rate_and_all_serve():
    """Four engine processes behind one front: cache-aware routing still computes each system
    prompt once, and the groups spread over every replica (the load balance)."""
    with DataParallelLLM([LLM(**ENGINE)]) as one:
        single = shared_prefix_hit_rate(one)
    with DataParallelLLM([EngineProcess(**ENGINE) for _ in range(4)]) as dp4:
        cache_aware = shared_prefix_hit_rate(dp4)
        served = [s["prompt_tokens"] for s in replica_stats(dp4)]
    assert abs(cache_aware - single) <= 0.02
    assert all(tokens > 0 for tokens in served), served


def test_replicas_of_two_tensor_parallel_ranks_each():
    """Tensor parallelism inside data parallelism: each engine process starts its own worker rank
    (an engine process is a daemon, and daemons may not start processes unless it allows it).
    Greedy tokens are one device's, and routing keeps one replica's hit rate."""
    prompt = [(5 * i) % 250 + 1 for i in range(40)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = LLM(**ENGINE).generate([prompt], params)[0].token_ids
    with DataParallelLLM([LLM(**ENGINE)]) as one:
        single = shared_prefix_hit_rate(one)

    async def tokens_of(front: DataParallelLLM) -> list[int]:
        return [t async for delta in front.generate(prompt, params) for t in delta.token_ids]

    replicas = [EngineProcess(**ENGINE, tensor_parallel_size=2) for _ in range(2)]
    with DataParallelLLM(replicas) as front:
        assert asyncio.run(tokens_of(front)) == expected
        assert abs(shared_prefix_hit_rate(front) - single) <= 0.02


async def generate_on(front: DataParallelLLM, prompt: list[int], salt: str | None) -> int:
    """Run ``prompt`` to its end; the replica it ran on."""
    routed = list(front._router.routed)
    async for _ in front.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True), salt):
        pass
    return next(r for r, (a, b) in enumerate(zip(routed, front._router.routed)) if a != b)


def test_a_finished_prefix_draws_its_requests_to_its_replica_under_its_salt_only(dp2):
    asyncio.run(dp2.reset_prefix_cache())
    prefix = list(range(3, 43))
    first = asyncio.run(generate_on(dp2, prefix + [50], None))
    # Nothing is in flight now: only the replica's tree knows the prefix. Without it, the tie
    # between two idle replicas would go to the other one (turns).
    assert asyncio.run(generate_on(dp2, prefix + [60, 61], None)) == first
    assert asyncio.run(generate_on(dp2, prefix + [60, 61], "tenant-b")) != first


def test_the_server_over_replicas(dp2):
    asyncio.run(dp2.reset_prefix_cache())
    with running_server(dp2) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "tiny"
        body = {"prompt": "a shared system prompt, long enough to span blocks", "max_tokens": 3}
        url = f"{server.url}/v1/completions"
        usages = [httpx.post(url, json=body, timeout=60).json()["usage"] for _ in range(2)]
        assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
        assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0  # same replica
        metrics = httpx.get(f"{server.url}/metrics").text
        for replica in ("0", "1"):
            assert f'radixinfer_replica_prefix_cache_hit_rate{{replica="{replica}"}}' in metrics
            assert f'radixinfer_replica_routed_requests_total{{replica="{replica}"}}' in metrics
        assert "radixinfer_prefix_cache_hit_tokens_total" in metrics
        result = main(
            ["bench", "--backend", "openai", "--base-url", server.url, "--cold-cache",
             *SHARED_PREFIX]
        )  # fmt: skip
        assert result == 0
        assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
    assert all(s["free_blocks"] == s["total_blocks"] for s in replica_stats(dp2))


# ---------------------------------------------------------------------- failures
def test_a_replica_that_fails_to_start_is_named_and_the_others_are_closed():
    # (an engine process that fails to build its LLM raises the same way from AsyncLLM's
    # constructor; a bad spec fails there at once)
    started = LLM(**ENGINE)
    with pytest.raises(RuntimeError, match="replica 1 of 2 failed to start") as caught:
        DataParallelLLM([started, {"model": "tiny"}])  # type: ignore[list-item]
    assert isinstance(caught.value.__cause__, ValueError)
    # replica 0's engine thread has stopped: the LLM is free again
    assert not any(t.name == "radixinfer-engine" for t in threading.enumerate())
    assert started.generate([1, 2, 3], SamplingParams(max_tokens=2))[0].finished


def test_a_router_that_fails_fails_its_requests_and_later_submissions():
    with DataParallelLLM([LLM(**ENGINE), LLM(**ENGINE)]) as front:

        def broken(*args: object, **kwargs: object) -> None:
            raise KeyError("a bug")

        front._router.place = broken  # type: ignore[method-assign]
        with pytest.raises(EngineLoopError, match="router failed"):
            asyncio.run(generate_on(front, [1, 2, 3], None))
        with pytest.raises(EngineLoopError):
            front.submit([1, 2, 3], None, None, queue.SimpleQueue())


def test_a_replica_that_dies_fails_its_requests_and_the_others_serve_on():
    with DataParallelLLM([EngineProcess(**ENGINE), LLM(**ENGINE)], policy="round_robin") as front:
        os.kill(front.engine_pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while front.replicas[0].error is None:
            assert time.monotonic() < deadline, "the dead replica was not noticed"
            time.sleep(0.02)
        for _ in range(2):  # round-robin's turn would be replica 0's: it is skipped
            assert asyncio.run(generate_on(front, [1, 2, 3], None)) == 1
        with pytest.raises(EngineLoopError):
            asyncio.run(front.stats())


# ---------------------------------------------------------------------- the benchmark script
def test_the_data_parallel_benchmark_runs_on_a_cpu(monkeypatch, tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_data_parallel.py"
    spec = importlib.util.spec_from_file_location("bench_data_parallel", script)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_data_parallel", bench)  # its dataclass looks there
    spec.loader.exec_module(bench)
    # replicas on threads of this process (engine processes are tested above, and take seconds
    # each to start on a CPU); the script's flags, variants, report and JSON are what runs here
    monkeypatch.setattr(
        bench,
        "replica_processes",
        lambda kwargs, n: [LLM(**{**kwargs, "freeze_gc": False}) for _ in range(n)],
    )
    out = tmp_path / "dp.json"
    flags = ["--num-groups", "2", "--prompts-per-group", "2", "--block-size", "4"]
    result = bench.main([*SHARED_PREFIX, *flags, "--json", str(out)])
    labels = ["dp=2 cache_aware", "dp=2 round_robin", "dp=1"]
    assert [run["label"] for run in result["runs"]] == labels
    assert all(run["metrics"]["requests"] == 4 for run in result["runs"])
    assert json.loads(out.read_text())["comparisons"][0]["other"] == labels[1]
