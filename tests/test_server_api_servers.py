"""``radixinfer serve --api-server-count 2``, the command itself: concurrent streams equal
`LLM.generate` and land on both API server processes, spread by the kernel even while one is busy;
``/metrics`` adds both processes up; the API
key and the cache-salt header hold in both; clients that leave abort their requests and free every
block; a process that dies stops the whole server; the flag refuses what it cannot serve."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from radixinfer import LLM, SamplingParams
from radixinfer.cli import parse_args
from tests.http_server import (
    MODEL,
    REPO,
    ServeProcess,
    leave_mid_stream,
    serve_process,
    stream_texts,
)

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE = ["--block-size", "4", "--num-blocks", "1024", "--max-batch-size", "64"]
FLAGS = ["--api-server-count", "2", "--api-key", KEY, "--cache-salt-header", "X-Tenant", *ENGINE]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server():
    with serve_process(*FLAGS) as running:
        yield running


def scrape(url: str) -> dict[str, float]:
    """The server's metrics, by name with labels."""
    text = httpx.get(f"{url}/metrics").text
    samples = re.findall(r"^([a-z0-9_]+(?:\{[^}]*\})?) (\S+)$", text, re.MULTILINE)
    return {name: float(value) for name, value in samples}


def served_by(metrics: dict[str, float], api_server: int) -> float:
    return metrics[f'radixinfer_api_server_requests_total{{api_server="{api_server}"}}']


def wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(url)
        if (
            not metrics["radixinfer_num_requests_running"]
            + metrics["radixinfer_num_requests_waiting"]
        ):
            return metrics
        assert time.monotonic() < deadline, metrics
        time.sleep(0.05)


def test_concurrent_streams_equal_generate_land_on_both_api_servers_and_add_up(server):
    """Waves of 32 concurrent streams until both API server processes have served some (the
    kernel hashes each connection to one of them); every text is greedy generate's, and
    the whole server's counters move by what all the waves did."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    before = scrape(server.url)
    llm = LLM("tiny", block_size=4, num_blocks=1024, max_batch_size=64)  # the server's engine
    waves = 0
    while True:
        prompts = [f"wave {waves} stream {i}" for i in range(32)]
        expected = [out.text for out in llm.generate(prompts, params)]
        assert stream_texts(server.url, prompts, MAX_TOKENS, AUTH) == expected
        waves += 1
        after = wait_idle(server.url)
        if all(served_by(after, i) > served_by(before, i) for i in (0, 1)) or waves == 8:
            break
    assert all(served_by(after, i) > served_by(before, i) for i in (0, 1))

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    requests = 32 * waves
    assert moved('radixinfer_requests_total{finish_reason="length"}') == requests
    assert (
        served_by(after, 0) + served_by(after, 1) - served_by(before, 0) - served_by(before, 1)
        == requests
    )
    assert moved("radixinfer_generation_tokens_total") == requests * MAX_TOKENS
    assert moved("radixinfer_time_to_first_token_seconds_count") == requests
    assert moved("radixinfer_inter_token_latency_seconds_count") == requests * (MAX_TOKENS - 1)
    assert moved("radixinfer_prefix_cache_queried_tokens_total") == moved(
        "radixinfer_prompt_tokens_total"
    )


def api_server_pids(running: ServeProcess, count: int = 2) -> list[int]:
    """The API server processes' ids, in order, once each has started and named itself."""
    names = [f"radixinfer-api{i}" for i in range(count)]
    deadline = time.monotonic() + 120
    while not set(names) <= set(children := running.children()):
        assert time.monotonic() < deadline, children
        time.sleep(0.2)
    return [children[name] for name in names]


def test_connections_wait_for_a_busy_api_server_instead_of_piling_onto_the_free_one(server):
    """32 streams connect while API server 0 is stopped (SIGSTOP: as busy as a process gets). Each
    process listens on its own socket, which the kernel hashes connections over, so about half of
    them wait for process 0 and it serves them once it goes on; on one socket shared by both,
    process 1 would have accepted every one."""
    first = api_server_pids(server)[0]
    prompts = [f"while one is busy, stream {i}" for i in range(32)]
    before = wait_idle(server.url)
    with ThreadPoolExecutor(1) as pool:
        os.kill(first, signal.SIGSTOP)
        try:
            texts = pool.submit(stream_texts, server.url, prompts, 2, AUTH)
            time.sleep(2)  # every connection is made (and hashed) meanwhile
        finally:
            os.kill(first, signal.SIGCONT)
        assert len(texts.result()) == 32
    after = wait_idle(server.url)
    # hashed evenly, fewer than 4 of 32 is about a one-in-a-million chance
    assert served_by(after, 0) - served_by(before, 0) >= 4


def test_the_api_key_and_the_tenant_header_hold_on_every_api_server(server):
    body = {"model": MODEL, "prompt": "a tenant's prompt, long enough to cache", "max_tokens": 2}
    url = f"{server.url}/v1/completions"
    for _ in range(4):  # connections go to either process
        assert httpx.post(url, json=body).status_code == 401
        assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 401

    def cached(tenant: str) -> int:
        headers = {**AUTH, "X-Tenant": tenant}
        answer = httpx.post(url, json={**body, "cache_salt": "ignored"}, headers=headers).json()
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    first = cached("a")
    again = [cached("a") for _ in range(4)]  # the engine's cache, whichever process answers
    assert len(set(again)) == 1 and again[0] > first
    assert cached("b") == 0


def test_clients_leaving_mid_stream_abort_and_free_every_block(server):
    before = wait_idle(server.url)

    leave_mid_stream(server.url, 30, AUTH)
    wait_idle(server.url)
    assert httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH).status_code == 200
    after = scrape(server.url)
    assert after["radixinfer_kv_blocks_used"] == 0
    aborted = 'radixinfer_requests_total{finish_reason="abort"}'
    assert after[aborted] - before[aborted] == 30
    assert (
        after["radixinfer_generation_tokens_total"] - before["radixinfer_generation_tokens_total"]
        < 30 * 1500
    )  # aborted, not run to the end


@pytest.mark.parametrize("victim", ["radixinfer-api1", "radixinfer-core"])
def test_a_process_that_dies_stops_the_whole_server(victim):
    with serve_process("--api-server-count", "2", *ENGINE) as running:
        api_server_pids(running)  # both started
        names = {"radixinfer-core", "radixinfer-api0", "radixinfer-api1"}
        children = {name: running.children()[name] for name in names}
        os.kill(children[victim], signal.SIGKILL)
        assert running.process.wait(timeout=60) == 1
        output = running.process.stdout.read().decode()
        assert "exited with code" in output
        for pid in children.values():  # every process of the server has ended
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def test_an_engine_that_cannot_start_ends_the_server_with_its_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a checkpoint the engine cannot read
    command = [sys.executable, "-m", "radixinfer.cli", "serve", "--api-server-count", "2"]
    command += ["--port", "0", "--model", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "config.json cannot be read" in done.stderr
    assert "radixinfer-engine exited with code 1" in done.stderr


def test_the_flag_refuses_what_it_cannot_serve(capsys):
    for flags in (
        ["--api-server-count", "0"],
        ["--api-server-count", "2", "--data-parallel-size", "2"],
    ):
        with pytest.raises(SystemExit) as info:
            parse_args(["serve", *flags])
        assert info.value.code == 2
        assert "--api-server-count" in capsys.readouterr().err
    assert parse_args(["serve"]).api_server_count == 1
