"""``n``, ``stop`` and log-probabilities through the OpenAI server with the official client: the
answers equal `LLM.generate`'s for the same `SamplingParams`, whole and streamed, one choice per
completion with its index, ``finish_reason`` and ``stop_reason``."""

from __future__ import annotations

from collections import defaultdict

import httpx
import openai
import pytest

from radixinfer import LLM, SamplingParams
from radixinfer.chat import chat_prompt_ids
from tests.http_server import MODEL, running_server

PROMPT = "Sampling through the server"
MESSAGES = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def server():
    with running_server(LLM("tiny", block_size=4, num_blocks=512)) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def generate(server, prompt, params: SamplingParams):
    """`LLM.generate` on the server's own engine (through its front, between requests)."""
    return server.engine.call(lambda llm: llm.generate([prompt], params)).result()[0]


def test_n_completions_whole_and_streamed(server, client):
    expected = generate(server, PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3))
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=3)
    whole = client.completions.create(**args)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == [c.text for c in expected.outputs]
    assert whole.usage.completion_tokens == sum(len(c.token_ids) for c in expected.outputs)
    texts, reasons = defaultdict(str), {}
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [c.text for c in expected.outputs]
    assert reasons == {0: "length", 1: "length", 2: "length"}


def test_stop_strings_end_the_text_and_name_the_stop_reason(server, client):
    base = generate(server, PROMPT, SamplingParams(max_tokens=16, ignore_eos=True)).text
    stop = next(base[i : i + 2] for i in range(3, 14) if "\ufffd" not in base[i : i + 2])
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "zz"])
    body = {"ignore_eos": True}
    whole = client.completions.create(**args, extra_body=body).choices[0]
    assert whole.text == base[: base.find(stop)] and whole.finish_reason == "stop"
    assert whole.model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(**args, stream=True, extra_body=body))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.text
    assert streamed[-1].choices[0].finish_reason == "stop"
    kept = client.completions.create(
        **args, extra_body={**body, "include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == base[: base.find(stop) + 2]


def test_completion_logprobs_are_the_engines(server, client):
    expected = generate(server, PROMPT, SamplingParams(max_tokens=5, logprobs=2)).outputs[0]
    choice = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2
    ).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(expected.token_ids) == 5
    for j, (token, position) in enumerate(zip(expected.token_ids, expected.logprobs)):
        assert logprobs.token_logprobs[j] == pytest.approx(position[token].logprob)
        assert logprobs.tokens[j] == position[token].decoded_token
        best = sorted(position.values(), key=lambda e: e.rank)[:2]
        assert logprobs.top_logprobs[j] == {e.decoded_token: pytest.approx(e.logprob) for e in best}
    assert logprobs.text_offset[0] == 0


def test_chat_logprobs_are_the_engines(server, client):
    prompt = server.engine.call(lambda llm: chat_prompt_ids(llm.tokenizer, MESSAGES)).result()
    expected = generate(server, prompt, SamplingParams(max_tokens=4, logprobs=3)).outputs[0]
    answer = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == 4
    for item, token, position in zip(content, expected.token_ids, expected.logprobs):
        assert item.logprob == pytest.approx(position[token].logprob)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(
            sorted((e.logprob for e in position.values() if e.rank <= 3), reverse=True)
        )
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, n=2
    )
    assert [c.index for c in plain.choices] == [0, 1] and plain.choices[0].logprobs is None


def test_bad_sampling_fields_are_400s_naming_them(server):
    for body, field in (
        ({"prompt": "x", "n": 5000}, "n"),
        ({"prompt": "x", "logprobs": 100000}, "logprobs"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ):
        route = "chat/completions" if "messages" in body else "completions"
        answer = httpx.post(f"{server.url}/v1/{route}", json={"max_tokens": 2, **body})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["message"].startswith(field)
