"""Bad input is refused when it is given, with a ``ValueError`` (or, on the command line, a usage error)
naming the user's field; the engine keeps serving afterwards and holds no KV block for what it refused.
Also: 64-bit sampling seeds give distinct streams."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from radixinfer import LLM, SamplingParams
from radixinfer.async_llm import AsyncLLM
from radixinfer.bench import runner
from radixinfer.cli import main, parse_args
from radixinfer.models import PRESET_NAMES

GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", block_size=4, num_blocks=NUM_BLOCKS)


def assert_serving_and_leak_free(llm: LLM) -> None:
    """A good request still runs; once the cache is emptied every block is free again."""
    assert len(llm.generate(["still serving"], GREEDY)[0].token_ids) == 3
    assert not llm.engine.has_unfinished()
    llm.reset_prefix_cache()
    stats = llm.cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"] == NUM_BLOCKS


# ------------------------------------------------------------------------------------ SamplingParams
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": "3"}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": -1e-9}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": True}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": False}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"ignore_eos": None}, "ignore_eos"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": "ab"}, "stop_token_ids"),
        ({"stop_token_ids": {1: 2}}, "stop_token_ids"),
        ({"stop_token_ids": [1, True]}, "stop_token_ids"),
        ({"stop_token_ids": [1, -3]}, "stop_token_ids"),
        ({"stop_token_ids": (1, 2.0)}, "stop_token_ids"),
        ({"detokenize": 0}, "detokenize"),
        ({"n": 0}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": True}, "n"),
        ({"n": 2**10}, "n"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a", 3]}, "stop"),
        ({"stop": {"a"}}, "stop"),
        ({"stop": "a", "detokenize": False}, "stop"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": "2"}, "prompt_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 1.0}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # more than max_tokens (16)
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"7": 1.0}}, "logit_bias"),
        ({"logit_bias": {7: 101.0}}, "logit_bias"),
        ({"logit_bias": {7: math.nan}}, "logit_bias"),
        ({"logit_bias": {7: "1"}}, "logit_bias"),
    ],
)
def test_sampling_params_refuse_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_what_they_accept():
    p = SamplingParams(
        max_tokens=np.int64(5),
        temperature=np.float32(0.5),
        top_k=-1,
        seed=2**64 - 1,
        stop_token_ids=[np.int32(7), 9],
    )
    assert type(p.max_tokens) is int and p.max_tokens == 5
    assert type(p.temperature) is float and p.temperature == 0.5
    assert p.top_k == 0  # vLLM's -1: no top-k filter, as 0
    assert p.seed == 2**64 - 1 and p.stop_token_ids == (7, 9)
    assert all(type(t) is int for t in p.stop_token_ids)
    assert SamplingParams(stop="x").stop == ("x",) and SamplingParams(stop=[]).stop is None
    assert SamplingParams(n=np.int64(3)).n == 3
    q = SamplingParams(logit_bias={np.int64(3): np.float32(-1.5)}, min_p=np.float64(0.1))
    assert q.logit_bias == {3: -1.5} and type(next(iter(q.logit_bias))) is int
    assert type(q.min_p) is float


@pytest.mark.parametrize(
    "kwargs, engine_text",
    [
        ({}, False),  # plain text: a front end may decode it
        ({"n": 2}, True),
        ({"stop": "x"}, True),
        ({"logprobs": 0}, True),
        ({"prompt_logprobs": 1}, True),
        ({"detokenize": False}, False),  # no text at all
        ({"detokenize": False, "n": 2, "logprobs": 1}, False),
    ],
)
def test_the_engine_decodes_text_only_where_it_reads_it(kwargs, engine_text):
    assert SamplingParams(**kwargs).needs_engine_text is engine_text


# ------------------------------------------------------------------------------------ seeds
def test_64_bit_seeds_give_distinct_reproducible_streams(llm):
    base = 12345
    seeds = [base, base + 2**32, base + 2**63, 2**64 - 1, 2**32 - 1, 2**32]
    params = [
        SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in seeds
    ]
    first = [o.token_ids for o in llm.generate(["same prompt"] * len(seeds), params)]
    assert len({tuple(t) for t in first}) == len(seeds)  # no two seeds share a stream
    again = [o.token_ids for o in llm.generate(["same prompt"] * len(seeds), params[::-1])][::-1]
    assert again == first  # each seed reproduces its stream, whatever the batch order
    assert_serving_and_leak_free(llm)


# ------------------------------------------------------------------------------------ requests
@pytest.mark.parametrize("salt", [1, 1.0, True, b"tenant", ("a",), ["unhashable"], {"a": 1}, ""])
def test_cache_salt_must_be_a_non_empty_string(llm, salt):
    with pytest.raises(ValueError, match="^cache_salt"):
        llm.generate(["fine prompt", "another"], GREEDY, cache_salt=salt)
    with pytest.raises(ValueError, match="^cache_salt"):
        list(llm.stream("fine prompt", GREEDY, cache_salt=salt))
    out = llm.generate(["salted"], GREEDY, cache_salt="tenant-a")[0]  # a later salt still works
    assert len(out.token_ids) == 3
    assert_serving_and_leak_free(llm)


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        (["a"], {"max_tokens": 2}, "^sampling_params must be a SamplingParams or a list .* dict"),
        (["a"], "greedy", "^sampling_params must be a SamplingParams or a list .* got str"),
        (["a", "b"], [GREEDY, {"max_tokens": 2}], "^params must be a SamplingParams, got dict"),
        (["a", "b"], [GREEDY], "^sampling_params: got 1 SamplingParams for 2 prompts"),
        (["fine", "bad \udc80 surrogate"], GREEDY, "^prompt is not valid Unicode text"),
        (["fine", "\ud83d"], GREEDY, "^prompt is not valid Unicode text"),
        (
            ["fine"],
            SamplingParams(stop_token_ids=[257]),
            r"^stop_token_ids: 257 is outside the vocabulary",
        ),
        (["fine"], SamplingParams(logprobs=258), "^logprobs: 258 is more than the vocabulary"),
        (["fine"], SamplingParams(prompt_logprobs=300), "^prompt_logprobs: 300 is more than"),
        (["fine"], SamplingParams(logprobs=21), "^logprobs: 21 is more than the 20 alternatives"),
        (["fine"], SamplingParams(prompt_logprobs=21), "^prompt_logprobs: 21 is more than the 20"),
        (
            ["fine"],
            SamplingParams(n=65, presence_penalty=0.5),
            r"^n: 65 penalised samples need a token-count row each, more than the 64",
        ),
        ([{"prompt_ids": [1, 2]}], GREEDY, "^prompt: a dict prompt must be"),
        ([{"prompt": [1, 2]}], GREEDY, "^prompt: a dict prompt must be"),
        ([{"prompt_token_ids": [1, 999]}], GREEDY, "^prompt: token id 999 is outside"),
    ],
)
def test_bad_requests_are_refused_at_submission_and_leak_nothing(llm, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params)
    assert_serving_and_leak_free(llm)


@pytest.mark.parametrize(
    "messages",
    [[], "hi", [{"role": "user"}], [{"role": "user", "content": 3}], [["user", "hi"]], [[]]],
)
def test_chat_refuses_messages_that_are_not_role_and_content(llm, messages):
    with pytest.raises(ValueError, match=r"^messages\b"):
        llm.chat(messages, GREEDY)
    assert_serving_and_leak_free(llm)


def test_generate_takes_sampling_params_under_one_name_only(llm):
    with pytest.raises(ValueError, match="^params: give sampling_params or params"):
        llm.generate(["a"], GREEDY, params=GREEDY)
    by_old_name = llm.generate(["a"], params=GREEDY)[0]
    assert by_old_name.token_ids == llm.generate(["a"], GREEDY)[0].token_ids
    assert_serving_and_leak_free(llm)


def test_stream_refuses_params_that_are_not_sampling_params(llm):
    for params in ({"max_tokens": 2}, {}):  # an empty dict is not the defaults either
        with pytest.raises(ValueError, match="got dict"):
            list(llm.stream("fine prompt", params))
    assert_serving_and_leak_free(llm)


def test_the_async_front_refuses_a_bad_salt_and_keeps_serving(llm):
    async def collect(salt) -> list:
        return [delta async for delta in front.generate("fine prompt", GREEDY, cache_salt=salt)]

    with AsyncLLM(llm) as front:
        with pytest.raises(ValueError, match="^cache_salt"):
            asyncio.run(collect(["x"]))
        deltas = asyncio.run(collect("tenant"))
        assert sum(len(d.token_ids) for d in deltas) == 3 and deltas[-1].finished
    assert_serving_and_leak_free(llm)


# ------------------------------------------------------------------------------------ LLM(...)
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_batch_size": 2.0}, "max_batch_size"),
        ({"prefill_max_batch_size": 0}, "prefill_max_batch_size"),
        ({"prefill_max_tokens": 0}, "prefill_max_tokens"),
        ({"prefill_max_tokens": True}, "prefill_max_tokens"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 1.5}, "num_blocks"),
        ({"prefill_admission_policy": "lifo"}, "prefill_admission_policy"),
        ({"prefill_admission_lookahead": 0}, "prefill_admission_lookahead"),
        ({"prefill_force_fifo_every": -1}, "prefill_force_fifo_every"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"enable_prefix_cache": "yes"}, "enable_prefix_cache"),
        ({"chunked_prefill": 1}, "chunked_prefill"),
        ({"decode_first": None}, "decode_first"),
        ({"freeze_gc": "yes"}, "freeze_gc"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"dtype": "int8"}, "dtype"),
        ({"dtype": torch.int32}, "dtype"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": "0.5", "num_blocks": 8}, "gpu_memory_utilization"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"device": "tpu"}, "device"),
        ({"device": 3.0}, "device"),
        ({"model": 5}, "model"),
    ],
)
def test_llm_arguments_are_refused_under_the_callers_name(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b") as info:
        LLM(**kwargs)
    assert "max_requests" not in str(info.value)  # the admission config's own name for the batch


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
def test_cuda_without_cuda_says_so():
    for device in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(ValueError, match="^device .*CUDA is not available"):
            LLM(device=device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_index_past_the_machines_devices_is_refused():
    with pytest.raises(ValueError, match="^device .*CUDA device"):
        LLM(device=f"cuda:{torch.cuda.device_count()}")


def test_a_directory_without_config_json_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="^model=.*no config.json"):
        LLM(model=tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')  # no model_type
    with pytest.raises(ValueError, match="^model=.*config.json cannot be read"):
        LLM(model=str(tmp_path))


def test_an_unknown_model_lists_the_presets(tmp_path):
    with pytest.raises(ValueError, match="^model=.*neither a preset") as info:
        LLM(model=str(tmp_path / "absent"))
    assert all(name in str(info.value) for name in PRESET_NAMES)


# ------------------------------------------------------------------------------------ the command line
def usage_error(capsys, *flags: str) -> str:
    """Run ``radixinfer bench`` with ``flags``; it must exit 2 with one ``error:`` line and no traceback."""
    with pytest.raises(SystemExit) as info:
        main(["bench", *flags])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1
    return errors[0]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--device", "tpu"], "--device"),
        (["--device", "cuda:x"], "--device"),
        (["--dtype", "int8"], "--dtype"),
        (["--model", "no-such-preset"], "--model"),
        (["--block-size", "0"], "--block-size"),
        (["--max-batch-size", "0"], "--max-batch-size"),
        (["--num-blocks", "0"], "--num-blocks"),
        (["--prefill-max-batch-size", "0"], "--prefill-max-batch-size"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--seed", "-1"], "--seed"),
        (["--prompt-repeats", "512,x"], "--prompt-repeats"),
        (["--prompt-repeats", "3,0"], "--prompt-repeats"),
    ],
)
def test_bad_flags_are_usage_errors(capsys, flags, named):
    assert named in usage_error(capsys, *flags)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
def test_cuda_flag_without_cuda_is_a_usage_error(capsys):
    assert "CUDA is not available" in usage_error(capsys, "--device", "cuda")


def test_a_model_directory_without_config_json_is_a_usage_error(capsys, tmp_path):
    assert "config.json" in usage_error(capsys, "--model", str(tmp_path))


def test_an_unwritable_json_path_fails_before_the_run(capsys, tmp_path, monkeypatch):
    def run_bench(args):
        raise AssertionError("the benchmark ran before --json was checked")

    monkeypatch.setattr(runner, "main", run_bench)
    for path in (tmp_path / "missing-dir" / "out.json", tmp_path):  # no such folder; a folder
        assert "--json" in usage_error(capsys, "--json", str(path))


def test_a_writable_json_path_is_left_as_it_was(tmp_path):
    """The check creates no file: a run that fails later leaves no empty result behind."""
    path = tmp_path / "out.json"
    assert parse_args(["bench", "--json", str(path)]).json == str(path)
    assert not path.exists()
