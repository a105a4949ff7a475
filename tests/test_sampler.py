"""The batched sampler: greedy rows, filters, seeded determinism, and that samples follow the softmax."""

from __future__ import annotations

import numpy as np
import torch

from kernels.sampling import gumbel_from_keys
from radixinfer import SamplingParams
from radixinfer.engine.cuda_graphs import graph_batch_sizes
from radixinfer.engine.request import Request
from radixinfer.engine.sampler import Sampler, SamplingBatch, row_keys, sample
from radixinfer.engine.step_buffers import pack_block_tables


def batch(rows: int, temperature=1.0, top_p=1.0, top_k=0, seeds=None, steps=None) -> SamplingBatch:
    return SamplingBatch.build(
        [temperature] * rows,
        [top_p] * rows,
        [top_k] * rows,
        seeds if seeds is not None else list(range(rows)),
        steps if steps is not None else [0] * rows,
        torch.device("cpu"),
    )


def noise(seeds: list[int], steps: list[int], vocab: int) -> torch.Tensor:
    return gumbel_from_keys(row_keys(torch.tensor(seeds), torch.tensor(steps)), vocab)


def test_noise_is_a_pure_function_of_seed_step_and_column():
    a = noise([5, 6], [0, 3], 50)
    b = noise([6, 5], [3, 0], 50)
    assert torch.equal(a, b.flip(0))
    assert torch.isfinite(a).all() and len(a[0].unique()) > 45
    assert not torch.equal(a[0], noise([5], [1], 50)[0])


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(6, 40)
    out = sample(logits, batch(6, temperature=0.0))
    assert torch.equal(out, logits.argmax(-1))


def test_half_precision_logits_sample_as_their_float32_values():
    """The model hands logits over in its dtype; greedy and seeded sampling see the same values as float32."""
    logits = torch.randn(6, 40).to(torch.bfloat16)
    for params in (
        batch(6, temperature=0.0),
        batch(6, temperature=0.9, top_p=0.8),
        batch(6, top_k=5),
    ):
        assert torch.equal(sample(logits, params), sample(logits.float(), params))


def test_filter_flags_name_the_filters_sampled_rows_use():
    """The kernel launches only the passes of filters some sampled row uses; a greedy row's
    parameters never count."""
    cpu = torch.device("cpu")

    def flags(temps, top_p, top_k, min_p):
        n = len(temps)
        return SamplingBatch.build(temps, top_p, top_k, [0] * n, [0] * n, cpu, min_p).filters

    assert flags([0.0, 0.0], [0.5, 1], [5, 0], [0.1, 0]) == (False, False, False)  # all greedy
    assert flags([0.0, 1.0], [0.5, 1], [5, 0], [0.1, 0]) == (False, False, False)
    assert flags([0.0, 1.0], [1, 0.9], [5, 3], [0.1, 0]) == (True, True, False)
    assert flags([0.7, 1.0], [1, 1], [0, 0], [0, 0.2]) == (False, False, True)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(8, 30)
    assert torch.equal(sample(logits, batch(8, temperature=1.5, top_k=1)), logits.argmax(-1))
    assert torch.equal(sample(logits, batch(8, temperature=1.5, top_p=1e-6)), logits.argmax(-1))


def test_top_k_never_samples_outside_the_k_best():
    logits = torch.randn(1, 20).expand(400, 20).contiguous()
    out = sample(logits, batch(400, temperature=5.0, top_k=3))
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(out.tolist()) <= allowed and len(set(out.tolist())) == 3


def test_samples_follow_the_softmax():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = probs.log().expand(n, 4).contiguous()
    counts = torch.bincount(sample(logits, batch(n, seeds=list(range(n)))), minlength=4).double()
    expected = probs.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


def test_pack_block_tables_pads_ragged_rows():
    out = np.full((4, 5), 7, dtype=np.int32)
    pack_block_tables([[3, 1], [], [9, 8, 7, 6, 5]], out)
    assert out[:3].tolist() == [[3, 1, 0, 0, 0], [0, 0, 0, 0, 0], [9, 8, 7, 6, 5]]
    assert out[3].tolist() == [7] * 5  # rows past the batch are left alone


def test_graph_batch_sizes_cover_every_batch():
    for max_batch in (1, 3, 16, 17, 64, 256):
        sizes = graph_batch_sizes(max_batch)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch
        assert all(any(s >= b for s in sizes) for b in range(1, max_batch + 1))


def test_a_vanishing_temperature_samples_the_argmax():
    logits = torch.randn(8, 30) * 50
    assert torch.equal(sample(logits, batch(8, temperature=1e-40, top_p=0.9)), logits.argmax(-1))


def test_a_sampler_keeps_a_batchs_parameters_only_while_its_requests_stay():
    """Steps of one batch reuse its parameters (only the keys change, with each request's step);
    a batch with other requests or another order builds them again; every step draws what a batch
    built from scratch draws."""
    rng = np.random.default_rng(0)
    reqs = [
        Request(
            request_id=str(i),
            prompt_ids=np.zeros(1, dtype=np.int64),
            params=SamplingParams(temperature=0.5 + i / 4, top_k=i % 3, top_p=0.9 + i / 100),
            salt=None,
            seed=1000 + i,
            arrival_index=i,
            detokenizer=None,
            arrival_time=0.0,
        )
        for i in range(5)
    ]
    sampler = Sampler(40, torch.device("cpu"), 5)
    built = []
    for batch_reqs in (reqs, reqs, reqs[::-1], reqs[1:]):
        logits = torch.from_numpy(rng.standard_normal((len(batch_reqs), 40)).astype(np.float32))
        params = [r.params for r in batch_reqs]
        fresh = SamplingBatch.build(
            [p.temperature for p in params],
            [p.top_p for p in params],
            [p.top_k for p in params],
            [r.seed for r in batch_reqs],
            [r.num_sampled for r in batch_reqs],
            torch.device("cpu"),
        )
        assert torch.equal(sampler.sample(batch_reqs, logits), sample(logits, fresh))
        assert sampler._last[0] == tuple(batch_reqs)
        built.append(sampler._last[1])
        for r in batch_reqs:
            r.num_sampled += 1
    assert built[1] is built[0] and len({id(b) for b in built}) == 3
