"""What a request asks for beyond its tokens: ``n`` completions off one prefill, stop strings, and
log-probabilities, in vLLM's result shapes (`RequestOutput.outputs`)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from radixinfer import LLM, AsyncLLM, SamplingParams
from tests.engine_helpers import hf_model, logprob_table, save_tiny_checkpoint

PROMPT_300 = [random.Random(3).randrange(256) for _ in range(300)]


def sampled(seed: int, **kwargs) -> SamplingParams:
    options = dict(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)
    return SamplingParams(**{**options, **kwargs})


def assert_leak_free(llm: LLM) -> None:
    assert not llm.engine.requests and not llm.engine.active and not llm.engine.waiting
    while llm.engine.has_unfinished():  # an aborted request's last launch, still to read back
        llm.engine.step()
    llm.reset_prefix_cache()
    stats = llm.cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", block_size=16, num_blocks=256)


# ------------------------------------------------------------------------------------ n samples
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_n_samples_compute_their_prompt_once(prefix_cache):
    llm = LLM("tiny", block_size=16, num_blocks=128, enable_prefix_cache=prefix_cache)
    out = llm.generate([PROMPT_300], sampled(7, n=4))[0]
    stats = llm.cache_stats()
    assert stats["prompt_tokens"] == stats["computed_prompt_tokens"] == 300
    assert stats["prefill_forwards"] == 1
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert out.num_cached_tokens == 0 and out.finished and out.prompt_token_ids == PROMPT_300
    assert out.token_ids == out.outputs[0].token_ids  # the convenience fields: sample 0's
    assert_leak_free(llm)


def test_sample_i_draws_from_seed_plus_i_whatever_shares_its_batch(llm):
    group = llm.generate([PROMPT_300], sampled(7, n=4))[0]
    llm.reset_prefix_cache()
    others = [[5, 6, 7] * 20, PROMPT_300[:100]]
    singles = llm.generate(
        [others[0], *([PROMPT_300] * 4), others[1]],
        [sampled(1), *(sampled(7 + i) for i in range(4)), sampled(2, n=3)],
    )
    assert [s.token_ids for s in singles[1:5]] == [c.token_ids for c in group.outputs]
    again = llm.generate([PROMPT_300, others[0]], [sampled(7, n=4), sampled(1, n=2)])[0]
    assert again.outputs == group.outputs
    assert_leak_free(llm)


def test_n_samples_survive_preemption_and_abort():
    # each sample fits the pool alone; four at once do not: samples are preempted and resumed
    llm = LLM("tiny", block_size=4, num_blocks=30)
    prompt = PROMPT_300[:40]
    params = sampled(11, n=4, max_tokens=40)
    out = llm.generate([prompt], params)[0]
    assert llm.cache_stats()["preemptions"] > 0
    singles = llm.generate([prompt] * 4, [sampled(11 + i, max_tokens=40) for i in range(4)])
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in singles]
    stream = llm.stream(prompt, params)
    first = [next(stream) for _ in range(5)]
    assert {d.index for d in first} <= {0, 1, 2, 3} and not any(d.finished for d in first)
    stream.close()  # aborts every sample
    assert_leak_free(llm)


def test_max_num_seqs_counts_every_sample():
    llm = LLM("tiny", block_size=16, num_blocks=128, max_num_seqs=4)
    engine = llm.engine
    ids = [engine.add_request(PROMPT_300[:20], sampled(s, n=3, max_tokens=4)) for s in (1, 2)]
    ids.append(engine.add_request(PROMPT_300[:20], sampled(3, n=6, max_tokens=4)))  # more than 4
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine.active))
    assert all(len(engine.pop_finished(i).group) in (3, 6) for i in ids)
    assert most == 6  # three, then three, then the six alone
    assert_leak_free(llm)


def test_a_stream_of_n_samples_carries_each_samples_index(llm):
    deltas = list(llm.stream(PROMPT_300[:50], sampled(3, n=3, max_tokens=6)))
    assert deltas[-1].finished and sum(d.finished for d in deltas) == 1
    ends = [d for d in deltas if d.finish_reason is not None]
    assert sorted(d.index for d in ends) == [0, 1, 2]
    whole = llm.generate([PROMPT_300[:50]], sampled(3, n=3, max_tokens=6))[0]
    for c in whole.outputs:
        mine = [d for d in deltas if d.index == c.index]
        assert [t for d in mine for t in d.token_ids] == c.token_ids
        assert "".join(d.text for d in mine) == c.text
    assert_leak_free(llm)


def test_the_async_front_streams_each_samples_index(llm):
    async def collect() -> list:
        params = sampled(4, n=2, max_tokens=5)
        return [delta async for delta in front.generate(PROMPT_300[:30], params)]

    with AsyncLLM(llm) as front:
        deltas = asyncio.run(collect())
    assert deltas[-1].finished and sum(d.finished for d in deltas) == 1
    by_index = {i: [t for d in deltas if d.index == i for t in d.token_ids] for i in (0, 1)}
    whole = llm.generate([PROMPT_300[:30]], sampled(4, n=2, max_tokens=5))[0]
    assert [by_index[0], by_index[1]] == [c.token_ids for c in whole.outputs]
    assert_leak_free(llm)


# ------------------------------------------------------------------------------------ stop strings
def stop_across_tokens(decode, token_ids: list[int]) -> tuple[str, int]:
    """A 4-character stop string that straddles a token boundary of ``decode(token_ids)``, first
    found there: ``(string, its index in the text)``."""
    text = decode(token_ids)
    for j in range(1, len(token_ids)):
        head = decode(token_ids[:j])
        b = len(head)
        stop = text[b - 2 : b + 2]
        if (
            b >= 2 and text.startswith(head) and len(stop) == 4
            and "\ufffd" not in stop and text.find(stop) == b - 2
        ):  # fmt: skip
            return stop, b - 2
    raise AssertionError(f"no stop string straddles two tokens of {text!r}")


def check_stop_strings(llm: LLM, prompt, max_tokens: int) -> None:
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    base = llm.generate([prompt], greedy)[0]
    stop, at = stop_across_tokens(llm.tokenizer.decode, base.token_ids)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=[stop, "never seen"])
    out = llm.generate([prompt], params)[0]
    assert out.text == base.text[:at]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert base.token_ids[: len(out.token_ids)] == out.token_ids  # it stopped at the token
    kept = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, stop=stop, include_stop_str_in_output=True
    )
    assert llm.generate([prompt], kept)[0].text == base.text[: at + len(stop)]
    # a stream never sends what may turn out to begin a stop string
    sent = ""
    for delta in llm.stream(prompt, params):
        sent += delta.text
        assert out.text.startswith(sent)
        if not delta.finished:
            assert not any(sent.endswith(stop[:size]) for size in range(1, len(stop)))
    assert sent == out.text
    assert_leak_free(llm)


def test_stop_strings_split_across_byte_tokens(llm):
    check_stop_strings(llm, "The quick brown fox", 24)


def test_stop_strings_split_across_bpe_tokens(gpt2_checkpoint_dir):
    llm = LLM(str(gpt2_checkpoint_dir), block_size=4, num_blocks=64)
    check_stop_strings(llm, "the cat sat on", 20)


def test_a_stop_token_is_the_stop_reason(llm):
    base = llm.generate(["stop here"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    token = base.token_ids[4]
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[token])
    out = llm.generate(["stop here"], params)[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(token) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", token)
    assert base.stop_reason is None and base.finish_reason == "length"


# ------------------------------------------------------------------------------------ logprobs
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))


def hf_logprobs(checkpoint, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]``: log_softmax of transformers' logits at each position (fp32)."""
    with torch.no_grad():
        logits = hf_model(str(checkpoint))(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_position(position: dict, reference: torch.Tensor, token: int, k: int) -> None:
    """One position's logprobs: the chosen ``token`` and the top ``k``, against ``reference``."""
    top = reference.topk(k)
    assert set(position) == set(top.indices.tolist()) | {token}
    for token_id, entry in position.items():
        assert entry.logprob == pytest.approx(reference[token_id].item(), abs=1e-4)
        assert entry.rank == int((reference > reference[token_id]).sum()) + 1


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_log_softmax_of_the_raw_logits(checkpoint, temperature):
    llm = LLM(str(checkpoint), block_size=4, num_blocks=64, dtype="float32")
    prompt = [random.Random(5).randrange(1, 300) for _ in range(13)]
    params = SamplingParams(
        max_tokens=6, temperature=temperature, seed=3, ignore_eos=True, logprobs=3, n=2
    )
    out = llm.generate([prompt], params)[0]
    for completion in out.outputs:
        reference = hf_logprobs(checkpoint, prompt + completion.token_ids)
        assert len(completion.logprobs) == len(completion.token_ids)
        for j, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert_position(position, reference[len(prompt) + j - 1], token, 3)
    assert out.prompt_logprobs is None
    assert_leak_free(llm)


@pytest.mark.parametrize("prefill_max_batch_size", [None, 1])
def test_prompt_logprobs_compute_the_prompt_even_when_cached(checkpoint, prefill_max_batch_size):
    """Chunked: a prefill round takes at most 8 tokens. One request per round scores its chunk's
    positions 2 at a time (the rows a pass samples at once: that request and a continuing chunk)."""
    llm = LLM(
        str(checkpoint), block_size=4, num_blocks=64, dtype="float32", prefill_max_tokens=8,
        prefill_max_batch_size=prefill_max_batch_size,
    )  # fmt: skip
    prompt = [random.Random(6).randrange(1, 300) for _ in range(21)]
    llm.generate([prompt], SamplingParams(max_tokens=2))  # now cached
    computed = llm.cache_stats()["computed_prompt_tokens"]
    out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
    assert out.num_cached_tokens == 0
    assert llm.cache_stats()["computed_prompt_tokens"] - computed == len(prompt)
    reference = hf_logprobs(checkpoint, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        assert_position(out.prompt_logprobs[p], reference[p - 1], prompt[p], 2)
    again = llm.generate([prompt], SamplingParams(max_tokens=2))[0]
    assert again.num_cached_tokens == len(prompt)  # one that does not ask still reads the cache
    assert_leak_free(llm)


def test_samples_beyond_the_rows_a_pass_samples_at_once_sample_as_alone():
    """One request per round: a pass samples at most 2 rows at once (the memory plan's), so 5
    samples take their first tokens in 3 pieces; each still draws what the request of its seed
    draws alone, logprobs included."""
    llm = LLM("tiny", block_size=16, num_blocks=128, prefill_max_batch_size=1)
    out = llm.generate(["abc"], sampled(7, n=5, logprobs=2))[0]
    alone = [llm.generate(["abc"], sampled(7 + i, logprobs=2))[0] for i in range(5)]
    assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
    expected = logprob_table([a.outputs[0] for a in alone])
    assert logprob_table(out.outputs) == pytest.approx(expected, abs=1e-4)
    assert_leak_free(llm)


def test_logprob_tokens_carry_their_text(llm):
    out = llm.generate(["abc"], SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1))[0]
    positions = out.outputs[0].logprobs + out.prompt_logprobs[1:]
    assert len(positions) == 3 + 2
    for position in positions:
        for token_id, entry in position.items():
            assert entry.decoded_token == llm.tokenizer.decode([token_id])
    ids_only = SamplingParams(max_tokens=3, logprobs=2, detokenize=False)
    for position in llm.generate(["abc"], ids_only)[0].outputs[0].logprobs:
        assert all(entry.decoded_token is None for entry in position.values())
    assert_leak_free(llm)


# ------------------------------------------------------------------------------------ calls
def test_prompts_as_dicts_and_chat(llm):
    by_ids = llm.generate({"prompt_token_ids": [104, 105]}, SamplingParams(max_tokens=4))[0]
    by_text = llm.generate([{"prompt": "hi"}], sampling_params=SamplingParams(max_tokens=4))[0]
    assert (
        by_ids.token_ids == by_text.token_ids and by_text.prompt == "hi" and by_ids.prompt is None
    )
    messages = [{"role": "user", "content": "hi"}]
    chat = llm.chat(messages, SamplingParams(max_tokens=4))[0]
    expected = llm.tokenizer.encode("<|user|>\nhi\n<|assistant|>\n")
    assert chat.prompt_token_ids == expected
    both = llm.chat([messages, messages], SamplingParams(max_tokens=4))
    assert [o.token_ids for o in both] == [chat.token_ids] * 2
    assert_leak_free(llm)
