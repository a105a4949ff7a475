"""Penalties, ``logit_bias`` and ``min_tokens``: each against a plain per-token reference on random
logits and histories, the device token counts against the histories they count (across steps, a
preemption and reused rows), and through the engine."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.penalties import count_tokens_ref, count_tokens_triton, penalize_ref, penalize_triton
from radixinfer import LLM, SamplingParams
from radixinfer.engine import logits_processing
from radixinfer.engine.logits_processing import LogitsProcessor
from radixinfer.engine.request import Request
from tests import _triton_env  # noqa: F401  (without CUDA, Triton runs interpreted)
from tests.engine_helpers import logprob_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 50


def penalised_by_hand(
    logits: list[float], prompt: list[int], output: list[int], rep: float, pres: float, freq: float
) -> list[float]:
    """vLLM's penalties, one token at a time."""
    out = []
    for token, x in enumerate(logits):
        if token in prompt or token in output:
            x = x / rep if x > 0 else x * rep
        count = output.count(token)
        out.append(x - freq * count - (pres if count else 0.0))
    return out


@pytest.mark.parametrize("penalize", [penalize_ref, penalize_triton])
def test_each_penalty_matches_the_per_token_reference(penalize):
    """Rows 1, 3, 4, ... of a batch penalised in place with count rows in another order; the rows
    not named stay as they were."""
    rng = random.Random(0)
    rows = 12
    logits = torch.randn(rows + 3, VOCAB, generator=torch.Generator().manual_seed(0))
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 30))] for _ in range(rows)]
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 30))] for _ in range(rows)]
    # one penalty at a time, then all three
    settings = [(1.7, 0, 0), (1, 0.8, 0), (1, 0, 0.6), (0.5, -1.2, 1.5)] * 3
    seen = torch.zeros(rows + 2, VOCAB, dtype=torch.bool)
    counts = torch.zeros(rows + 2, VOCAB, dtype=torch.int32)
    count_rows = [(5 * r + 2) % (rows + 2) for r in range(rows)]  # distinct
    for r, c in enumerate(count_rows):
        seen[c, prompts[r]] = True
        for t in outputs[r]:
            counts[c, t] += 1
    positions = [r + 1 + (r > 1) for r in range(rows)]  # 1, 3, 4, ...
    penalties = torch.zeros(rows + 2, 3)
    penalties[count_rows] = torch.tensor(settings, dtype=torch.float32)
    out = logits.clone().to(DEVICE)
    penalize(
        out, torch.tensor(positions, device=DEVICE), torch.tensor(count_rows, device=DEVICE),
        seen.to(DEVICE), counts.to(DEVICE), penalties.to(DEVICE),
    )  # fmt: skip
    out = out.cpu()
    for r, p in enumerate(positions):
        expected = penalised_by_hand(logits[p].tolist(), prompts[r], outputs[r], *settings[r])
        assert out[p].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    untouched = [p for p in range(rows + 3) if p not in positions]
    assert torch.equal(out[untouched], logits[untouched])


@pytest.mark.parametrize("count", [count_tokens_ref, count_tokens_triton])
def test_counting_tokens_adds_each_pair_once_repeats_included(count):
    counts = torch.zeros(4, VOCAB, dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([2, 0, 2, 2, 3], device=DEVICE)
    tokens = torch.tensor([5, 5, 7, 5, VOCAB - 1], device=DEVICE)
    count(counts, rows, tokens)
    count(counts, rows[:1], tokens[:1])
    expected = torch.zeros(4, VOCAB, dtype=torch.int32)
    for r, t in [(2, 5), (0, 5), (2, 7), (2, 5), (3, VOCAB - 1), (2, 5)]:
        expected[r, t] += 1
    assert torch.equal(counts.cpu(), expected)


def test_the_penalty_kernel_keeps_the_logits_dtype():
    logits = torch.randn(4, VOCAB).to(torch.bfloat16).to(DEVICE)
    args = [torch.tensor([0, 2], device=DEVICE), torch.tensor([1, 0], device=DEVICE)]
    args += [
        torch.rand(2, VOCAB, device=DEVICE) < 0.3,
        torch.randint(0, 3, (2, VOCAB), device=DEVICE),
    ]
    args[-1] = args[-1].int()
    args += [torch.tensor([1.3, 0.7], device=DEVICE)[:, None].expand(2, 3).contiguous()]
    out, ref = logits.clone(), logits.clone()
    penalize_triton(out, *args)
    penalize_ref(ref, *args)
    assert out.dtype == torch.bfloat16
    # float32 results rounded to bf16: at most one bf16 step (2**-7 relative) apart
    assert torch.allclose(out.float(), ref.float(), rtol=2**-7, atol=0)
    assert not torch.equal(out, logits)


_arrivals = itertools.count()


def request(prompt: list[int], **params) -> Request:
    """A running request as the engine holds it (its sequence stands in for its KV)."""
    return Request(
        request_id=str(next(_arrivals)),
        prompt_ids=np.asarray(prompt, dtype=np.int64),
        params=SamplingParams(max_tokens=64, **params),
        salt=None,
        seed=0,
        arrival_index=0,
        detokenizer=None,
        arrival_time=0.0,
        seq=object(),
        stop_ids=frozenset({3, 7}),
    )


def test_device_counts_follow_the_histories_across_steps_preemption_and_reused_rows():
    """Random steps over a changing batch: each step's processed logits equal the reference built
    from the requests' prompts and outputs, tokens still unread by the host included."""
    rng = random.Random(1)
    processor = LogitsProcessor(VOCAB, torch.device("cpu"), 5)  # at most 5 live at once
    gen = torch.Generator().manual_seed(1)

    def fresh() -> Request:
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
        penalties = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)
        return request(prompt, **rng.choice([penalties, {"min_p": 0.1}, {"temperature": 0.7}]))

    live = [fresh() for _ in range(5)]
    for _step in range(40):
        logits = torch.randn(len(live), VOCAB, generator=gen)
        processed = logits.clone()
        pending = processor.process(live, processed)
        tokens = torch.randint(0, VOCAB, (len(live),), generator=gen)
        processor.record(pending, tokens)
        for r, req in enumerate(live):
            p = req.params
            expected = logits[r].tolist()
            if p.penalized:
                expected = penalised_by_hand(
                    expected, req.prompt_ids.tolist(), req.output_ids,
                    p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                )  # fmt: skip
            assert processed[r].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
            req.output_ids.append(int(tokens[r]))
            req.num_sampled += 1
        event = rng.random()
        if event < 0.2:  # finishes: its row is free for the next request
            live.pop(rng.randrange(len(live))).seq = None
            live.append(fresh())
        elif event < 0.3:  # preempted and admitted again: a new sequence, the output so far kept
            rng.choice(live).seq = object()
    assert processor.counts.output_counts.shape[0] == 5  # rows were reused, never more than 5


def test_logits_are_processed_in_place():
    """Every row penalised, or one row with ``min_tokens`` pending: the rows change in the logits
    handed over (no copy), step after step."""
    processor = LogitsProcessor(VOCAB, torch.device("cpu"), 4)
    reqs = [request([1, 2, i], presence_penalty=0.5, frequency_penalty=0.5) for i in range(3)]
    before = torch.randn(3, VOCAB)
    for step in range(3):
        logits = before.clone()
        pending = processor.process(reqs, logits)
        for r, req in enumerate(reqs):
            expected = penalised_by_hand(
                before[r].tolist(), req.prompt_ids.tolist(), req.output_ids, 1.0, 0.5, 0.5
            )
            assert logits[r].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
        tokens = torch.tensor([step, step, 5])
        processor.record(pending, tokens)
        for req, t in zip(reqs, tokens.tolist()):
            req.output_ids.append(t)
            req.num_sampled += 1
    early = request([1], presence_penalty=0.5, min_tokens=4)
    logits = before[:1].clone()
    processor.process([early], logits)
    assert logits[0, [3, 7]].tolist() == [float("-inf")] * 2


class _AtenOps(TorchDispatchMode):
    """The names of the aten ops run while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


# ops that on CUDA read a device value back to the host (so wait for the device), or copy from it
SYNC_LIKE = {"_local_scalar_dense", "nonzero", "unique", "_unique2", "masked_select", "_to_copy"}


def test_a_steady_penalised_step_reads_nothing_back_and_uploads_nothing(monkeypatch):
    """After a batch's first step (its plan made, its count rows filled), each step's processing
    and count update run no op that reads a device value back or copies across devices, build no
    tensor from host data and call no host read (``tolist``, ``item``, ``bool``): on CUDA the host
    never waits for the step it has just launched."""
    processor = LogitsProcessor(VOCAB, torch.device("cpu"), 4)
    reqs = [request([1, 2, i], presence_penalty=0.5, frequency_penalty=0.5) for i in range(3)]
    reqs.append(request([4], temperature=0.5))  # a row the penalties leave alone
    gen = torch.Generator().manual_seed(3)
    first = processor.process(reqs, torch.randn(4, VOCAB, generator=gen))
    processor.record(first, torch.ones(4, dtype=torch.int64))
    host_reads = []
    for name in ("tolist", "item", "__bool__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            host_reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    uploads = []
    monkeypatch.setattr(
        logits_processing, "upload", lambda *a: uploads.append(a) or logits_processing.upload(*a)
    )
    for _ in range(3):
        logits = torch.randn(4, VOCAB, generator=gen)
        tokens = torch.randint(0, VOCAB, (4,), generator=gen)
        with _AtenOps() as ops:
            processor.record(processor.process(reqs, logits), tokens)
        assert not SYNC_LIKE & set(ops.names), ops.names
        assert "lift_fresh" not in ops.names  # no tensor from Python data
    assert host_reads == [] and uploads == []


def test_a_batch_keeps_its_plan_until_its_requests_or_their_sequences_change():
    """Steps of one batch reuse its count rows on the device; another order, or a request
    preempted and admitted again (a new sequence: its row refilled), builds the plan again."""
    processor = LogitsProcessor(VOCAB, torch.device("cpu"), 4)
    reqs = [request([1, 2, i], frequency_penalty=0.5) for i in range(3)] + [request([4])]
    logits = torch.randn(4, VOCAB)
    plans = []
    for batch in (reqs, reqs, reqs[::-1], reqs[::-1], "preempt", reqs[::-1]):
        if batch == "preempt":
            reqs[0].seq = object()
            continue
        out = logits.clone()
        pending = processor.process(batch, out)
        for r, req in enumerate(batch):
            p = req.params
            expected = penalised_by_hand(
                logits[r].tolist(), req.prompt_ids.tolist(), req.output_ids,
                p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
            )  # fmt: skip
            assert out[r].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
        processor.record(pending, torch.full((4,), 9))
        for req in batch:
            req.output_ids.append(9)
        plans.append(processor._last)
    assert plans[1] is plans[0] and plans[3] is plans[2] and plans[4] is not plans[3]
    assert plans[2] is not plans[1]


def test_logit_bias_and_min_tokens_rows():
    processor = LogitsProcessor(VOCAB, torch.device("cpu"), 4)
    biased = request([1, 2], logit_bias={4: 5.0, 9: -100.0})
    early = request([1, 2], min_tokens=2)
    plain = request([1, 2], temperature=1.0)
    logits = torch.randn(3, VOCAB)
    out = logits.clone()
    pending = processor.process([biased, early, plain], out)
    assert pending is None
    expected = logits[0].clone()
    expected[4] += 5.0
    expected[9] -= 100.0
    assert torch.allclose(out[0], expected)
    assert out[1, [3, 7]].tolist() == [float("-inf")] * 2  # the stop ids, EOS among them
    assert torch.equal(out[1, [0, 1, 2, 4]], logits[1, [0, 1, 2, 4]])
    assert torch.equal(out[2], logits[2])
    early.num_sampled = 2
    out = logits[1:2].clone()
    processor.process([early], out)
    assert torch.equal(out[0], logits[1])  # min_tokens reached: stop tokens allowed again


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_processing_step_waits_for_the_device():
    """A batch's first step (count rows filled from the prompts), ``logit_bias`` and ``min_tokens``
    rows, and the steps after it, under torch's sync debug mode: any op that makes the host wait
    for the stream raises."""
    device = torch.device("cuda")
    processor = LogitsProcessor(VOCAB, device, 4)
    reqs = [
        request([1, 2, 3], presence_penalty=0.5, frequency_penalty=0.5),
        request([5, 6], repetition_penalty=1.3, min_tokens=3),
        request([7], logit_bias={4: 5.0}),
    ]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            logits = torch.randn(3, VOCAB, device=device)
            tokens = torch.randint(0, VOCAB, (3,), device=device)
            processor.record(processor.process(reqs, logits), tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits[1, [3, 7]].tolist() == [float("-inf")] * 2  # min_tokens applied


def test_batches_without_processing_are_returned_untouched():
    processor = LogitsProcessor(VOCAB, torch.device("cpu"), 4)
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    pending = processor.process([request([1]), request([2], temperature=0.5)], logits)
    assert torch.equal(logits, before) and pending is None


# ------------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", block_size=4, num_blocks=128)


def test_min_tokens_holds_back_stop_tokens(llm):
    greedy = llm.generate(["stop early"], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    stop = greedy.token_ids[1]
    params = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[stop], min_tokens=4)
    out = llm.generate(["stop early"], params)[0]
    assert len(out.token_ids) >= 4 and stop not in out.token_ids[:3]


def test_logit_bias_steers_greedy_decoding(llm):
    params = SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={65: 100.0})
    assert llm.generate(["anything"], params)[0].token_ids == [65] * 5


def test_logit_bias_past_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match="^logit_bias"):
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}))
    assert len(llm.generate(["still serving"], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_frequency_penalty_breaks_greedy_repeats(llm):
    """A greedy request that repeats itself stops repeating under a strong frequency penalty."""
    plain = llm.generate(["aaaa"], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself
    params = SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=2.0)
    penalised = llm.generate(["aaaa"], params)[0].token_ids
    assert len(set(penalised)) > len(set(plain))


def test_seeded_penalised_sampling_is_independent_of_batch_composition(llm):
    params = SamplingParams(
        max_tokens=8, temperature=0.8, min_p=0.05, top_p=0.95, seed=7, ignore_eos=True,
        presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, min_tokens=3,
    )  # fmt: skip
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = llm.generate(["same prompt"], params)[0].token_ids
    crowd = llm.generate(["other", "same prompt", "x y z"], [greedy, params, params])
    assert crowd[1].token_ids == alone
    stats = llm.cache_stats()
    llm.reset_prefix_cache()
    assert llm.cache_stats()["free_blocks"] == stats["total_blocks"]


def test_penalised_requests_beyond_the_count_rows_wait_for_a_row_and_sample_as_alone():
    """Twice as many penalised requests as ``max_batch_size`` (the token-count rows the memory plan
    holds): the rest wait to be admitted until rows free up, the rows are never more, and every
    seeded request samples what it samples alone."""
    llm = LLM("tiny", block_size=4, num_blocks=128, max_batch_size=3)
    prompts = [f"prompt {i}" for i in range(6)]
    params = [
        SamplingParams(
            max_tokens=5, temperature=0.9, seed=i, ignore_eos=True, repetition_penalty=1.3,
            frequency_penalty=0.4 if i % 2 else 0.0, logprobs=2,
        )
        for i in range(6)
    ]  # fmt: skip
    alone = [llm.generate([p], q)[0] for p, q in zip(prompts, params)]
    together = llm.generate(prompts + ["greedy"], params + [SamplingParams(max_tokens=5)])
    assert [o.token_ids for o in together[:6]] == [o.token_ids for o in alone]
    table = logprob_table([o.outputs[0] for o in together[:6]])
    assert table == pytest.approx(logprob_table([o.outputs[0] for o in alone]), abs=1e-4)
    counts = llm.engine.sampler.logits_processor.counts
    assert counts.output_counts.shape == (3, llm.engine.vocab_size)
