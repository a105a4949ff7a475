"""Programmatic dependent launch (`kernels.pdl`): when it is on, and that a decode layer's kernels launched
with it, captured in a CUDA graph, compute bit for bit what they compute launched one after another.

A kernel that read its input before `wait_for_inputs` would read what the kernel before it has not written
yet: the graph's outputs would then differ from the plain launches' at some replay, as the overlap varies.
"""

from tests import _triton_env  # noqa: F401, I001  (first: without CUDA, Triton must start interpreted)

import pytest
import torch
import torch.nn.functional as F

from kernels import pdl
from kernels.activation import silu_and_mul_triton
from kernels.argmax import argmax_triton
from kernels.paged_attention import NewKV, paged_decode_attention_triton
from kernels.rms_norm import rms_norm_triton
from kernels.rotary import Rotary
from kernels.skinny_gemm import linear_triton
from kernels.store_kv import store_kv_triton
from tests.test_kernels import gpu_test

# qwen2.5-0.5b's per-layer shapes: the launches are as short as the engine's at batch 1
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 896, 14, 2, 64, 4864, 32_000
BLOCK_SIZE, CONTEXT, LAYERS = 16, 1024, 4


def test_no_pdl_off_cuda():
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}


@gpu_test
def test_on_from_hopper_unless_switched_off(monkeypatch):
    device = torch.device("cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    pdl.programmatic_launch.cache_clear()
    try:
        assert pdl.programmatic_launch(device) == hopper
        monkeypatch.setenv("RADIXINFER_PDL", "0")
        pdl.programmatic_launch.cache_clear()
        assert pdl.launch_options(device) == {"USE_PDL": False}
    finally:
        monkeypatch.undo()
        pdl.programmatic_launch.cache_clear()


def decode_layers(x, weights, k_cache, v_cache, tables, lens, slots, cos, sin):
    """``LAYERS`` pre-norm decoder layers for one token, then the argmax over a vocabulary: each
    Triton kernel a decode step launches, with a cuBLAS matmul (no PDL) between them. Even layers
    store K/V in the decode kernel (the engine's decode), odd ones in the store kernel before it
    (its decode with shared-prefix tiles)."""
    residual = None
    for layer, w in enumerate(weights):
        h, residual = rms_norm_triton(x, w["norm"], 1e-6, residual)
        qkv = linear_triton(h, w["qkv"])
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
        q = q.view(-1, HEADS, HEAD_DIM)
        k, v = k.view(-1, KV_HEADS, HEAD_DIM), v.view(-1, KV_HEADS, HEAD_DIM)
        new_kv = NewKV(k, v, slots, cos, sin) if layer % 2 == 0 else None
        if new_kv is None:
            store_kv_triton(k_cache, v_cache, k, v, slots, Rotary(q, cos, sin))
        attn = paged_decode_attention_triton(
            q, k_cache, v_cache, tables, lens, CONTEXT, HEAD_DIM**-0.5, num_splits=4, new_kv=new_kv
        )
        x = linear_triton(attn.view(-1, HEADS * HEAD_DIM), w["o"])
        h, residual = rms_norm_triton(x, w["norm"], 1e-6, residual)
        x = linear_triton(silu_and_mul_triton(F.linear(h, w["gate_up"])), w["down"])
    h, _ = rms_norm_triton(x, weights[0]["norm"], 1e-6, residual)
    logits = F.linear(h, weights[0]["lm_head"])
    return argmax_triton(logits), logits


@gpu_test
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="PDL needs compute capability 9.0",
)
def test_a_graph_of_pdl_launches_equals_plain_launches(monkeypatch):
    gen = torch.Generator("cuda").manual_seed(0)

    def weight(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda") * shape[-1] ** -0.5).to(
            torch.bfloat16
        )

    weights = [
        {
            "norm": 1 + weight(HIDDEN) * 0.1,
            "qkv": weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
            "o": weight(HIDDEN, HEADS * HEAD_DIM),
            "gate_up": weight(2 * INTER, HIDDEN),
            "down": weight(HIDDEN, INTER),
            "lm_head": weight(VOCAB, HIDDEN),
        }
        for _ in range(LAYERS)
    ]
    num_blocks = CONTEXT // BLOCK_SIZE + 1
    cache_shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = weight(*cache_shape), weight(*cache_shape)
    tables = torch.arange(num_blocks, dtype=torch.int32, device="cuda")[None, :]
    x = torch.empty(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    lens = torch.empty(1, dtype=torch.int32, device="cuda")
    slots = torch.empty(1, dtype=torch.int64, device="cuda")
    cos, sin = (torch.empty(1, HEAD_DIM // 2, dtype=torch.bfloat16, device="cuda") for _ in "cs")

    def fill(step):
        x.copy_(weight(1, HIDDEN) * HIDDEN**0.5)
        lens.fill_(CONTEXT - 64 + step)
        slots.fill_(CONTEXT - 65 + step)
        angles = torch.rand(cos.shape, generator=gen, device="cuda") * CONTEXT
        cos.copy_(angles.cos())
        sin.copy_(angles.sin())

    def run():
        return decode_layers(x, weights, k_cache, v_cache, tables, lens, slots, cos, sin)

    pdl.programmatic_launch.cache_clear()
    try:
        assert pdl.launch_options(x.device)["USE_PDL"]
        fill(0)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # compile outside capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                token, logits = run()
        torch.cuda.current_stream().wait_stream(stream)
        monkeypatch.setenv("RADIXINFER_PDL", "0")
        pdl.programmatic_launch.cache_clear()
        assert not pdl.launch_options(x.device)["USE_PDL"]
        caches = k_cache.clone(), v_cache.clone()
        for step in range(32):
            fill(step)
            graph.replay()
            graph_caches = k_cache.clone(), v_cache.clone()
            k_cache.copy_(caches[0])
            v_cache.copy_(caches[1])
            plain_token, plain_logits = run()
            torch.cuda.synchronize()
            assert torch.equal(logits, plain_logits), step
            assert torch.equal(token, plain_token), step
            assert torch.equal(graph_caches[0], k_cache) and torch.equal(graph_caches[1], v_cache)
            caches = k_cache.clone(), v_cache.clone()
    finally:
        monkeypatch.undo()
        pdl.programmatic_launch.cache_clear()
