"""The skinny GEMM (a linear layer for a few tokens) and its fusion with SwiGLU's gate, against
``F.linear`` and ``silu_and_mul_ref``; its launch-shape rule; and the layers' choice between it and
cuBLAS.

Without CUDA the kernel runs in Triton's interpreter at tiny sizes, with small tiles so that N and K
are not multiples of them; the ``gpu`` tests repeat it at the real per-rank shapes of qwen2.5-0.5b and
llama-3.1-8b.
"""

from tests import _triton_env  # noqa: F401, I001  (first: without CUDA, Triton must start interpreted)

import pytest
import torch

from kernels.skinny_gemm import (
    MAX_REDUCE_M,
    REDUCE_PRODUCTS,
    GemmConfig,
    linear_ref,
    linear_silu_and_mul_ref,
    linear_silu_and_mul_triton,
    linear_triton,
    skinny_config,
)
from radixinfer.models import layers, load_model
from tests.test_fused_ops import model_logits, rounds_like_torch
from tests.test_kernels import DEVICE, TOLERANCE, gpu_test, randn, rel_err
from tests.test_kernels import skip_bf16_dot_in_interpreter
from tests.test_models import ARCHS
from tests.test_sampling_kernel import compiled_variants

HALF = [torch.float16, torch.bfloat16]


def check_linear(m, n, k, dtype, bias, fused, seed, config=None):
    """x as a token-strided view (rows padded, as a fused projection's slice is); the weight scaled
    like a real layer's so outputs are O(1)."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    x = randn(m, k + 3, dtype=dtype, gen=gen)[:, :k]
    rows = 2 * n if fused else n
    weight = (randn(rows, k, dtype=torch.float32, gen=gen) * k**-0.5).to(dtype)
    b = randn(rows, dtype=dtype, gen=gen) if bias else None
    triton_fn, ref_fn = (
        (linear_silu_and_mul_triton, linear_silu_and_mul_ref)
        if fused
        else (linear_triton, linear_ref)
    )
    out, ref = triton_fn(x, weight, b, config), ref_fn(x, weight, b)
    assert out.shape == ref.shape == (m, n) and out.dtype == dtype
    # the interpreter truncates to bf16; the fused gate rounds three times
    tolerance = TOLERANCE[dtype] * (1 if rounds_like_torch(dtype) or not fused else 3)
    assert rel_err(out, ref) < tolerance


# tokens -> a launch shape with tiles smaller than N = 40 and K = 100 (neither a multiple of them):
# 1 and 3 tokens on the CUDA-core path, 16 and 20 (two token blocks) through tl.dot
TINY_CONFIGS = {
    1: GemmConfig(1, 16, 32, num_warps=4, num_stages=2),
    3: GemmConfig(4, 8, 32, num_warps=4, num_stages=2),
    16: GemmConfig(16, 16, 32, num_warps=4, num_stages=2),
    20: GemmConfig(16, 16, 32, num_warps=4, num_stages=2),
}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fused", [False, True], ids=["linear", "silu_and_mul"])
def test_skinny_gemm_matches_reference(dtype, m, bias, fused):
    if TINY_CONFIGS[m].block_m >= 16:
        skip_bf16_dot_in_interpreter(dtype)
    check_linear(m, 40, 100, dtype, bias, fused, seed=m, config=TINY_CONFIGS[m])


@pytest.mark.parametrize("m", [1, 3, 16])
def test_skinny_gemm_default_config_matches_reference(m):
    check_linear(m, 72, 96, torch.float16, bias=True, fused=False, seed=m)
    check_linear(m, 72, 96, torch.float16, bias=False, fused=True, seed=m)


def test_no_tokens():
    x = torch.zeros(0, 32, dtype=torch.float16, device=DEVICE)
    weight = torch.zeros(16, 32, dtype=torch.float16, device=DEVICE)
    assert linear_triton(x, weight).shape == (0, 16)
    assert linear_silu_and_mul_triton(x, weight).shape == (0, 8)


@pytest.mark.parametrize("sms", [1, 132])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16, 17, 32, 64])
@pytest.mark.parametrize(
    "n, k", [(896, 896), (4864, 896), (896, 4864), (6144, 4096), (14336, 4096)]
)
@pytest.mark.parametrize("fused", [False, True], ids=["linear", "silu_and_mul"])
def test_config_covers_the_tokens_and_fills_the_device(sms, m, n, k, fused):
    cfg = skinny_config(m, n, k, sms, fused)
    assert cfg.block_m >= m and (cfg.block_m >= 16) == (m > MAX_REDUCE_M)
    for size in (cfg.block_m, cfg.block_n, cfg.block_k):
        assert size & (size - 1) == 0
    smallest = 4 if cfg.block_m < 16 else 16
    # as many programs as the rule wants, or the smallest tile
    assert n // cfg.block_n >= 2 * sms or cfg.block_n == smallest
    if cfg.block_m < 16:  # the CUDA-core accumulators fit their register budget
        accumulators = 2 if fused else 1
        assert accumulators * cfg.block_m * cfg.block_n * cfg.block_k <= REDUCE_PRODUCTS


def test_tokens_of_one_bucket_share_a_config():
    """A batch size never compiles a kernel of its own: M is not a constexpr nor specialised."""
    assert len({skinny_config(m, 4864, 896, 132) for m in range(17, 33)}) == 1
    assert len({skinny_config(m, 4864, 896, 132) for m in range(3, 5)}) == 1


def test_layers_choose_the_skinny_gemm_only_for_decode_sized_half_batches(monkeypatch):
    """On the CPU the layers compute F.linear exactly as before; with the Triton path on, the rule
    takes a half-precision batch of at most ``SKINNY_GEMM_MAX_TOKENS`` tokens; 0 turns it off."""
    x = torch.randn(3, 32, device=DEVICE)
    weight = torch.randn(48, 32, device=DEVICE)
    assert torch.equal(layers.linear(x, weight), torch.nn.functional.linear(x, weight))
    monkeypatch.setattr(layers, "use_triton", lambda x: True)
    half = x.half()
    assert layers.use_skinny_gemm(half)
    assert not layers.use_skinny_gemm(x)  # float32: cuBLAS
    long = torch.zeros(layers.SKINNY_GEMM_MAX_TOKENS + 1, 32, dtype=torch.float16)
    assert not layers.use_skinny_gemm(long)
    monkeypatch.setattr(layers, "SKINNY_GEMM_MAX_TOKENS", 0)
    assert not layers.use_skinny_gemm(half)


# --------------------------------------------------------------------------------------------- GPU sizes

# (N, K) per rank of qwen2.5-0.5b and llama-3.1-8b at TP=1 and 2: qkv, o_proj, gate_up's I, down_proj
GPU_SHAPES = [(1152, 896), (896, 448), (2432, 896), (896, 2432), (6144, 4096), (4096, 7168)]


@gpu_test
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", [1, 3, 8, 32, 64])
@pytest.mark.parametrize("n, k", GPU_SHAPES)
def test_skinny_gemm_gpu(dtype, m, n, k):
    check_linear(m, n, k, dtype, bias=True, fused=False, seed=m)
    check_linear(m, n, k, dtype, bias=False, fused=True, seed=m)


@gpu_test
def test_token_counts_of_one_bucket_compile_once():
    """After one call per bucket, every other token count of the bucket compiles nothing (a decode batch
    first seen mid-run must not stall on a compile), nor does another layer of the same launch shape."""
    from kernels import skinny_gemm

    def run(m, n, k):
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        linear_triton(x, torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16))

    for m in (1, 2, 4, 16, 32, 64):
        run(m, 4096, 4096)
    kernel = skinny_gemm._skinny_gemm_kernel
    before = compiled_variants(kernel)
    for m in (3, 5, 9, 17, 31, 33, 48, 63):
        run(m, 4096, 4096)
        run(m, 4096, 2048)  # another layer: the same launch shapes
    assert compiled_variants(kernel) == before


@gpu_test
@pytest.mark.parametrize("dtype", HALF)
def test_llama_forward_with_the_skinny_gemm_matches_cublas(dtype, monkeypatch):
    """A 16-token pass of a Llama model through the fused ops, its linear layers on the skinny GEMM
    against the same pass with the switch off (cuBLAS)."""
    model = load_model(ARCHS["llama3"][1], DEVICE, dtype, seed=1).model
    monkeypatch.setattr(layers, "SKINNY_GEMM_MAX_TOKENS", 0)
    ref = model_logits(model, dtype, use_triton=True, monkeypatch=monkeypatch)
    monkeypatch.setattr(layers, "SKINNY_GEMM_MAX_TOKENS", 64)
    out = model_logits(model, dtype, use_triton=True, monkeypatch=monkeypatch)
    assert rel_err(out, ref) < {torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
