"""``radixinfer bench --backend openai`` against a real ``radixinfer serve`` on a loopback port: the same
greedy tokens as in process, multi-turn answers fed back, a shared-prefix run end to end through the
CLI with its metrics, and the flags that go together."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from radixinfer import LLM
from radixinfer.bench.client_processes import ClientProcesses
from radixinfer.bench.run_loop import run_workload
from radixinfer.bench.runner import Variant, open_backend
from radixinfer.bench.workloads import build_workload
from radixinfer.cli import main, parse_args
from tests.http_server import running_server


@pytest.fixture(scope="module")
def server():
    with running_server(LLM("tiny", block_size=16, num_blocks=1024)) as running:
        yield running


@pytest.mark.parametrize(
    "workload",
    [
        ["--num-requests", "4", "--unique-prompts"],
        [
            "--dataset",
            "multi-turn",
            "--num-conversations",
            "2",
            "--turns",
            "2",
            "--input-len",
            "24",
        ],
    ],
)
def test_the_server_streams_the_tokens_radixinfer_generates_in_process(server, workload):
    flags = ["bench", *workload, "--ignore-eos", "--max-new-tokens", "6"]
    outputs = []
    for variant, extra in (
        (Variant("radixinfer", True, "fifo"), []),
        (Variant("openai", True, None), ["--backend", "openai", "--base-url", server.url]),
    ):
        args = parse_args(flags + extra)
        backend = open_backend(variant, "tiny", args, args.gpu_memory_utilization)
        try:
            sessions = build_workload(args, backend.tokenizer, backend.vocab_size)
            records, _ = run_workload(backend, sessions, [0.0] * len(sessions), args, variant.label)
        finally:
            backend.close()
        outputs.append(sorted((r.prompt_len, r.token_ids, r.finish_reason) for r in records))
    assert outputs[0] == outputs[1]
    assert all(len(ids) == 6 for _, ids, _ in outputs[1])


def test_client_processes_stream_what_one_process_does(server):
    """Three conversations of two turns split over two client processes: the same answers as one
    process gets, each turn timed on the one clock every process reads."""
    flags = ["bench", "--dataset", "multi-turn", "--num-conversations", "3", "--turns", "2"]
    flags += ["--input-len", "24", "--ignore-eos", "--max-new-tokens", "6"]
    args = parse_args([*flags, "--backend", "openai", "--base-url", server.url])
    backend = open_backend(Variant("openai", True, None), "tiny", args, 0.0)
    clients = ClientProcesses(server.url, "tiny", 2)
    try:
        sessions = build_workload(args, backend.tokenizer, backend.vocab_size)
        offsets = [0.0] * len(sessions)
        alone, _ = run_workload(backend, sessions, offsets, args, "one process")
        split, wall = clients.run(sessions, offsets, args, "two processes")
    finally:
        clients.close()
        backend.close()

    def answers(records):
        return sorted((r.prompt_len, r.token_ids, r.finish_reason) for r in records)

    assert len(split) == 3 * 2 and answers(split) == answers(alone)
    assert all(r.submit_time < r.token_times[0] <= r.token_times[-1] for r in split)
    assert 0 < wall == max(r.token_times[-1] for r in split) - min(r.submit_time for r in split)


def _hit_tokens(server) -> float:
    """The server's prefix-cache hit tokens so far (``/metrics``)."""
    text = httpx.get(f"{server.url}/metrics").text
    return float(re.search(r"^radixinfer_prefix_cache_hit_tokens_total (\S+)$", text, re.M)[1])


@pytest.mark.parametrize("client_processes", [1, 3])
def test_a_shared_prefix_run_through_the_cli(server, tmp_path, client_processes):
    """Its metrics, the hit rate among them: each request's cached prompt tokens as its usage
    reported them, adding up to what the server counted."""
    out = tmp_path / "result.json"
    hits_before = _hit_tokens(server)
    flags = [
        "bench",
        "--backend",
        "openai",
        "--base-url",
        server.url,
        "--dataset",
        "shared-prefix",
        "--num-groups",
        "2",
        "--prompts-per-group",
        "4",
        "--system-prompt-len",
        "64",
        "--question-len",
        "8",
        "--max-new-tokens",
        "4",
        "--ignore-eos",
        "--cold-cache",
        "--warmup-runs",  # one run reaches the server: its hit counter moves by that run's hits
        "0",
        "--json",
        str(out),
        "--client-processes",
        str(client_processes),
    ]
    assert main(flags) == 0
    (run,) = json.loads(out.read_text())["runs"]
    metrics = run["metrics"]
    assert run["info"].get("client_processes", 1) == client_processes
    assert run["backend"] == "openai" and run["info"]["served_model"] == "tiny"
    assert metrics["requests"] == 8 and metrics["completion_tokens"] == 8 * 4
    assert metrics["ttft_ms"]["p50"] > 0 and metrics["tpot_ms"]["p50"] > 0
    assert metrics["cached_tokens"] == _hit_tokens(server) - hits_before > 0
    assert metrics["hit_rate"] == metrics["cached_tokens"] / metrics["prompt_tokens"]
    assert metrics["computed_prompt_tokens"] == metrics["prompt_tokens"] - metrics["cached_tokens"]
    assert metrics["preemptions"] is None  # the server's own


@pytest.mark.parametrize(
    "flags",
    [
        ["--backend", "openai"],
        ["--base-url", "http://127.0.0.1:1"],
        ["--backend", "openai", "--base-url", "http://x", "--compare-no-cache"],
        ["--client-processes", "2"],
    ],
)
def test_openai_flags_go_together(flags, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["bench", *flags])
    assert info.value.code == 2 and "--backend openai" in capsys.readouterr().err
