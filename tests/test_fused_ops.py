"""The fused element-wise kernels (residual add + RMSNorm, SiLU-and-mul) and the sampler's argmax against
their references, and
a Llama-family forward through the kernels against the same model through the references (rotary,
fused into the KV store, is tested with it in ``tests/test_kernels.py``).

Without CUDA the kernels run in Triton's interpreter at tiny sizes; the ``gpu`` tests repeat them at real
sizes (512 tokens, hidden 896 to 5120, head_dim 64 and 128). Inputs are strided views, as the models
pass them (q/k/v of one fused projection, gate|up of another).
"""

from tests import _triton_env  # noqa: I001  (first: without CUDA, Triton must start in interpreter mode)

import dataclasses

import numpy as np
import pytest
import torch

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.argmax import argmax_ref, argmax_triton
from kernels.rms_norm import rms_norm_ref, rms_norm_triton
from radixinfer.attention import AttentionMetadata, ForwardContext
from radixinfer.attention.torch_backend import TorchAttentionBackend
from radixinfer.attention.triton_backend import TritonAttentionBackend
from radixinfer.models import layers, load_model
from tests.test_kernels import DEVICE, DTYPES, TOLERANCE, gpu_test, poison_allocator, randn, rel_err
from tests.test_models import ARCHS


def rounds_like_torch(dtype) -> bool:
    """Whether a kernel's float32 -> ``dtype`` cast rounds like PyTorch's (the interpreter truncates to bf16)."""
    return not (dtype == torch.bfloat16 and _triton_env.INTERPRETED)


# ------------------------------------------------------------------------------------------------ rms norm


def check_rms_norm(num_tokens, hidden, dtype, seed, with_residual=True):
    """x and the residual as token-strided views (every row padded), hidden of any size."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    x = randn(num_tokens, hidden + 5, dtype=dtype, gen=gen)[:, :hidden]
    residual = (
        randn(num_tokens, hidden + 3, dtype=dtype, gen=gen)[:, 3:] * 4 if with_residual else None
    )
    weight = (randn(hidden, dtype=torch.float32, gen=gen) * 0.1 + 1).to(dtype)
    out, new_residual = rms_norm_triton(x, weight, 1e-6, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
    assert rel_err(new_residual, ref_residual) < TOLERANCE[dtype]
    if rounds_like_torch(dtype):
        assert torch.equal(new_residual, ref_residual)  # one rounding of the same sum in both
    assert rel_err(out, ref_out) < TOLERANCE[dtype]
    assert out.dtype == dtype


def check_head_norm(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed):
    """Qwen3's q/k norms: per-head rows of q and k viewed in one fused qkv projection."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim :][:, : num_kv_heads * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    weight = (randn(head_dim, dtype=torch.float32, gen=gen) * 0.1 + 1).to(dtype)
    for x in (q, k):
        out, same = rms_norm_triton(x, weight, 1e-6)
        assert same is x and out.shape == x.shape
        assert rel_err(out, rms_norm_ref(x, weight, 1e-6)[0]) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 72])  # 72: not a power of 2
def test_rms_norm_matches_reference(dtype, hidden):
    check_rms_norm(num_tokens=5, hidden=hidden, dtype=dtype, seed=hidden)
    check_rms_norm(num_tokens=3, hidden=hidden, dtype=dtype, seed=hidden + 1, with_residual=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_rms_norm_matches_reference(dtype):
    check_head_norm(num_tokens=4, num_heads=6, num_kv_heads=2, head_dim=24, dtype=dtype, seed=3)


def test_empty_batch():
    x = torch.empty(0, 8, 16, device=DEVICE)
    assert rms_norm_triton(x[:, 0], torch.ones(16, device=DEVICE), 1e-6, x[:, 1])[0].shape == (
        0,
        16,
    )
    assert silu_and_mul_triton(x[:, 0]).shape == (0, 8)


# ---------------------------------------------------------------------------------------------- activation


def check_silu_and_mul(num_tokens, intermediate, dtype, seed):
    gen = torch.Generator(DEVICE).manual_seed(seed)
    gate_up = (
        randn(num_tokens, 2 * intermediate + 7, dtype=dtype, gen=gen)[:, : 2 * intermediate] * 3
    )
    out = silu_and_mul_triton(gate_up)
    ref = silu_and_mul_ref(gate_up)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [32, 1100])  # 1100: two blocks, the last partial
def test_silu_and_mul_matches_reference(dtype, intermediate):
    check_silu_and_mul(num_tokens=3, intermediate=intermediate, dtype=dtype, seed=intermediate)


# ------------------------------------------------------------------------------------------------- argmax


def check_argmax(rows, vocab, dtype, seed, chunks=None):
    """Random rows (strided: every row padded) plus planted ties: row 0 has its maximum at two positions in
    different chunks, row 1 twice inside one, and the last row is all -inf (index 0, as torch answers)."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    logits = randn(rows, vocab + 9, dtype=dtype, gen=gen)[:, :vocab]
    logits[0, [vocab // 3, vocab - 2]] = 50.0
    logits[1, [7, 9]] = 50.0
    logits[-1] = float("-inf")
    out = argmax_triton(logits, chunks)
    assert out.dtype == torch.int64
    assert out.tolist() == argmax_ref(logits).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "vocab, chunks", [(300, None), (5000, 1), (5000, 3), (4097, 64), (41000, 20)]
)  # 64: capped; 20: merged over two iterations
def test_argmax_matches_reference_first_index_of_ties(dtype, vocab, chunks):
    check_argmax(rows=4, vocab=vocab, dtype=dtype, seed=vocab, chunks=chunks)


# ------------------------------------------------------------------------------------------------- models


def model_logits(model, dtype, use_triton, monkeypatch, decode=False) -> torch.Tensor:
    """A ragged prefill of two prompts (5 and 11 tokens, block size 4) with the fused ops' and the
    attention backend's Triton kernels (``use_triton``: in the interpreter without CUDA) or their
    references; logits of every token. ``decode``: then one decode step of both sequences (a token
    each, at positions 5 and 11), and its logits: on the Triton path the step that stores K/V in the
    decode kernel and, in half precision, takes the skinny GEMM (SiLU-and-mul in its epilogue)."""
    monkeypatch.setattr(layers, "use_triton", lambda x: use_triton)
    backend = TritonAttentionBackend() if use_triton else TorchAttentionBackend()
    gen = torch.Generator().manual_seed(0)
    lens, block_size = [5, 11], 4
    tables = [[0, 1], [2, 3, 4]]
    block_tables = torch.tensor(
        [t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32, device=DEVICE
    )

    def slot(seq, pos):
        return tables[seq][pos // block_size] * block_size + pos % block_size

    positions = [p for n in lens for p in range(n)]
    seq_of = [s for s, n in enumerate(lens) for _ in range(n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slot(s, p) for s, p in zip(seq_of, positions)], device=DEVICE),
        block_tables=block_tables,
        context_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor([0, 5, 16], dtype=torch.int32, device=DEVICE),
        max_query_len=11,
        max_context_len=11,
    )
    cache_shape = (model.num_layers, 5, block_size, model.num_kv_heads, model.head_dim)
    k_cache, v_cache = (torch.zeros(cache_shape, dtype=dtype, device=DEVICE) for _ in range(2))
    if use_triton:  # the extend kernel's work list, as the runner plans it
        planner = backend.planner(block_size, model.num_heads, model.num_kv_heads, dtype)
        work = np.zeros((2, planner.extend_work_capacity(sum(lens), len(lens))), dtype=np.int32)
        planner.plan_extend_work(np.array(lens), np.array(lens), work)
        meta = dataclasses.replace(meta, extend_work=torch.from_numpy(work).to(DEVICE))
    ctx = ForwardContext(meta, k_cache, v_cache, backend)
    input_ids = torch.randint(256, (sum(lens) + len(lens),), generator=gen).to(DEVICE)
    with torch.inference_mode():
        logits = model.compute_logits(
            model(input_ids[: sum(lens)], torch.tensor(positions, device=DEVICE), ctx)
        )
        if not decode:
            return logits
        step = AttentionMetadata(
            slot_mapping=torch.tensor([slot(s, n) for s, n in enumerate(lens)], device=DEVICE),
            block_tables=block_tables,
            context_lens=torch.tensor([n + 1 for n in lens], dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
            max_query_len=1,
            max_context_len=max(lens) + 1,
            new_slots_private=True,
        )
        ctx = ForwardContext(step, k_cache, v_cache, backend)
        new_positions = torch.tensor(lens, device=DEVICE)
        return model.compute_logits(model(input_ids[sum(lens) :], new_positions, ctx))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])  # qwen3: the per-head q/k norms
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_llama_family_forward_through_kernels_matches_references(arch, dtype, decode, monkeypatch):
    if not rounds_like_torch(dtype):
        pytest.skip(
            "the interpreter's truncation to bf16 drifts over a whole model; bf16 is checked per kernel"
        )
    model = load_model(ARCHS[arch][1], DEVICE, dtype, seed=1).model
    ref = model_logits(model, dtype, False, monkeypatch, decode)
    out = model_logits(model, dtype, True, monkeypatch, decode)
    # large random weights amplify each rounding difference (rotary rounds once) through the layers: fp16 drifts
    # by ~1e-3, bf16 (3 mantissa bits fewer) by ~1e-2; a wrong kernel is off by O(1)
    assert (
        rel_err(out, ref) < {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    )


# --------------------------------------------------------------------------------------------- GPU sizes


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [896, 4096, 5120])
def test_rms_norm_gpu(dtype, hidden):
    for with_residual in (True, False):
        poison_allocator()
        check_rms_norm(
            num_tokens=512, hidden=hidden, dtype=dtype, seed=hidden, with_residual=with_residual
        )


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, head_dim", [((14, 2), 64), ((32, 8), 128), ((16, 8), 128)])
def test_head_rms_norm_gpu(dtype, heads, head_dim):
    poison_allocator()
    check_head_norm(
        num_tokens=512,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        dtype=dtype,
        seed=head_dim,
    )


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab", [(512, 151936), (3, 50257), (300, 32000)])
def test_argmax_gpu(dtype, rows, vocab):
    check_argmax(rows=rows, vocab=vocab, dtype=dtype, seed=rows)


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [4864, 14336])
def test_silu_and_mul_gpu(dtype, intermediate):
    poison_allocator()
    check_silu_and_mul(num_tokens=512, intermediate=intermediate, dtype=dtype, seed=intermediate)
