"""``radixinfer serve`` over HTTP, with the official ``openai`` client and raw httpx: streamed and
whole answers equal `LLM.generate`'s greedy output, chat through the template, cached tokens per
tenant, metrics, the API key, unsupported fields, the admin reset (``n``, ``stop`` and logprobs:
tests/test_server_sampling.py)."""

from __future__ import annotations

import json
import re
import signal

import httpx
import openai
import pytest

from radixinfer import LLM, SamplingParams
from radixinfer.chat import chat_prompt_ids
from radixinfer.cli import parse_args
from tests.http_server import MODEL, running_server, serve_process

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["Hello there", "A longer prompt about the radix tree", "x"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def server():
    llm = LLM("tiny", block_size=4, num_blocks=1024)
    with running_server(llm, api_key=KEY, cache_salt_header="X-Tenant") as running:
        yield running


@pytest.fixture(scope="module")
def expected(server):
    """Greedy outputs of the server's own LLM, taken before any request reaches it (its front is
    idle)."""
    prompts = PROMPTS + [chat_prompt_ids(server.llm.tokenizer, MESSAGES)]
    outputs = server.engine.call(lambda llm: llm.generate(prompts, GREEDY)).result()
    server.engine.call(lambda llm: llm.reset_prefix_cache()).result()
    return {i: out.text for i, out in enumerate(outputs)}


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def scrape(server) -> dict[str, float]:
    """The server's metrics, by name with labels: ``{'radixinfer_requests_total{...}': 2.0,
    ...}``."""
    text = httpx.get(f"{server.url}/metrics").text
    samples = re.findall(r"^([a-z0-9_]+(?:\{[^}]*\})?) (\S+)$", text, re.MULTILINE)
    return {name: float(value) for name, value in samples}


def test_streamed_and_whole_completions_equal_generate(client, expected):
    for i, prompt in enumerate(PROMPTS):
        stream = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[i]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1].usage
        assert usage.completion_tokens == 8 and usage.prompt_tokens == len(prompt.encode())
        assert usage.prompt_tokens_details.cached_tokens is not None
        whole = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert whole.choices[0].text == expected[i] and whole.usage.completion_tokens == 8


def test_token_id_prompts_and_token_ids_in_the_answer(server, expected):
    ids = list(PROMPTS[0].encode())
    body = {
        "model": MODEL,
        "prompt": ids,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH).json()
    choice = answer["choices"][0]
    assert choice["text"] == expected[0] and len(choice["token_ids"]) == 8


def test_chat_completions_use_the_template(client, expected):
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].message.content == expected[len(PROMPTS)]
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected[len(PROMPTS)]


def test_cached_tokens_repeat_within_a_tenant_and_never_across_tenants(server):
    def cached(tenant: str, body_salt: str | None = None) -> int:
        body = {
            "model": MODEL,
            "prompt": "a tenant's private system prompt, long enough to cache",
            "max_tokens": 2,
            "cache_salt": body_salt,
        }
        answer = httpx.post(
            f"{server.url}/v1/completions", json=body, headers={**AUTH, "X-Tenant": tenant}
        )
        return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    # the header decides; the body's salt is ignored
    assert cached("tenant-a", body_salt="tenant-c") > 0


def test_the_body_salt_separates_tenants_without_a_header():
    llm = LLM("tiny", block_size=4, num_blocks=256)
    with running_server(llm) as running:

        def cached(salt: str) -> int:
            body = {
                "prompt": "shared words, long enough to fill blocks",
                "max_tokens": 2,
                "cache_salt": salt,
            }
            answer = httpx.post(f"{running.url}/v1/completions", json=body).json()
            return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert (cached("a"), cached("a"), cached("b")) == (0, cached("a"), 0)
        assert cached("a") > 0


def test_metrics_move_by_what_the_requests_did(server, client):
    before = scrape(server)
    prompts = ["metrics one", "metrics two two"]  # the second finds "metrics " in the cache
    answers = [
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True}
        )
        for prompt in prompts
    ]
    cached = sum(a.usage.prompt_tokens_details.cached_tokens for a in answers)
    after = scrape(server)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved('radixinfer_requests_total{finish_reason="length"}') == 2
    assert moved("radixinfer_generation_tokens_total") == 10
    assert moved("radixinfer_prompt_tokens_total") == sum(len(p) for p in prompts)
    assert moved("radixinfer_prefix_cache_queried_tokens_total") == sum(len(p) for p in prompts)
    assert moved("radixinfer_prefix_cache_hit_tokens_total") == cached > 0
    assert moved("radixinfer_time_to_first_token_seconds_count") == 2
    assert moved("radixinfer_e2e_request_latency_seconds_count") == 2
    assert moved("radixinfer_inter_token_latency_seconds_count") == 8  # 4 gaps each
    # one request at a time: 4 decode steps each after the prefill's token, each reading the weights
    assert moved("radixinfer_decode_steps_total") == 8
    assert moved("radixinfer_decode_read_bytes_total") > 8 * 1e6
    assert (
        after["radixinfer_num_requests_running"] == 0
        and after["radixinfer_num_requests_waiting"] == 0
    )
    assert after["radixinfer_kv_blocks_used"] + after["radixinfer_kv_blocks_free"] == 1024
    # the prefix cache holds what the requests computed
    assert after["radixinfer_kv_blocks_used"] > 0
    assert "radixinfer_preemptions_total" in after


def test_the_api_key_is_enforced(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    url = f"{server.url}/v1/completions"
    assert httpx.post(url, json=body).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    no_scheme = {"Authorization": KEY}
    assert httpx.post(url, json=body, headers=no_scheme).status_code == 401
    assert httpx.post(url, json=body, headers=AUTH).status_code == 200
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # open: a load balancer's probe
    assert httpx.get(f"{server.url}/metrics").status_code == 200  # open: a Prometheus scraper


def test_models_and_a_wrong_model_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError, match="model"):
        client.completions.create(model="another", prompt="x", max_tokens=1)


@pytest.mark.parametrize(
    "field, value",
    [
        ("echo", True),
        ("best_of", 3),
        ("presence_penalty", 2.5),  # outside [-2, 2]
        ("logit_bias", {"x": 5}),  # not a token id
        ("logit_bias", {"1": 101}),  # outside [-100, 100]
        ("min_tokens", 2),  # more than max_tokens
    ],
)  # unsupported fields, and invalid values of supported ones
def test_fields_that_would_change_the_result_are_refused_by_name(server, field, value):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, field: value}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH)
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith(field)


def test_logit_bias_and_penalties_reach_the_engine(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    biased = {**body, "logit_bias": {str(ord("q")): 100}, "presence_penalty": 0.5, "min_p": 0.1}
    answer = httpx.post(f"{server.url}/v1/completions", json=biased, headers=AUTH)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "q" * 6


def test_neutral_values_of_unsupported_fields_are_accepted(server):
    body = {
        "model": MODEL,
        "prompt": "x",
        "max_tokens": 1,
        "n": 1,
        "stop": None,
        "logprobs": None,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "user": "someone",
        "unknown_field": [1],
    }
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH).status_code == 200


def test_a_stream_interval_sends_fewer_larger_chunks_with_the_same_text(expected):
    with running_server(LLM("tiny", block_size=4, num_blocks=256), stream_interval=3) as running:
        body = {
            "prompt": PROMPTS[0],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        with httpx.stream("POST", f"{running.url}/v1/completions", json=body) as response:
            chunks = [
                json.loads(line[6:])["choices"][0]
                for line in response.iter_lines()
                if line.startswith("data: {")
            ]
    sizes = [len(c["token_ids"]) for c in chunks]  # [3, 3, 2] unless the server fell behind
    assert sum(sizes) == 8 and min(sizes[:-1]) >= 3 and len(sizes) <= 3
    assert "".join(c["text"] for c in chunks) == expected[0]


def test_reset_prefix_cache_refuses_while_requests_run(server):
    body = {
        "model": MODEL,
        "prompt": "long",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as running:
        lines = running.iter_lines()  # kept: a dropped iterator closes the connection
        next(lines)  # streaming: it holds KV
        refused = httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH)
        assert refused.status_code == 409 and "running" in refused.json()["error"]["message"]
    # the disconnect aborted it; once it is gone the reset goes through
    for _ in range(500):
        if httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH).status_code == 200:
            break
    else:
        pytest.fail("reset_prefix_cache never succeeded")
    assert scrape(server)["radixinfer_kv_blocks_used"] == 0


def test_serve_flags_default_to_loopback_and_bad_ones_exit_with_usage(capsys):
    args = parse_args(["serve"])
    assert (args.host, args.port, args.model, args.api_key) == ("127.0.0.1", 8000, "tiny", None)
    for flags in (["--port", "70000"], ["--max-waiting", "0"], ["--request-timeout", "0"]):
        with pytest.raises(SystemExit) as info:
            parse_args(["serve", *flags])
        assert info.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_radixinfer_serve_runs_as_a_process_and_stops_on_sigint():
    with serve_process("--api-key", KEY, "--num-blocks", "64") as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key=KEY, max_retries=0)
        answer = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        assert answer.usage.completion_tokens == 3
        running.process.send_signal(signal.SIGINT)
        assert running.process.wait(timeout=30) == 0
