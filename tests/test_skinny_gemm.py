"""The skinny GEMM (a linear layer for 1-4 tokens) against ``F.linear``; its launch-shape rule; and the
layers' choice between it and cuBLAS.

Without CUDA the kernel runs in Triton's interpreter at tiny sizes, with small tiles so that N and K
are not multiples of them; the ``gpu`` tests repeat it at the real per-rank shapes the layers' rule
sends to it (qwen2.5-0.5b's, TP 1 and 2).
"""

from tests import _triton_env  # noqa: F401, I001  (first: without CUDA, Triton must start interpreted)

import pytest
import torch
import torch.nn.functional as F

from kernels import skinny_gemm
from kernels.activation import silu_and_mul_triton
from kernels.skinny_gemm import (
    MAX_REDUCE_M,
    ROW_K,
    TILE_WEIGHTS,
    GemmConfig,
    linear_ref,
    linear_silu_and_mul_ref,
    linear_silu_and_mul_triton,
    linear_triton,
    skinny_config,
)
from radixinfer.models import layers
from tests.test_kernels import DEVICE, TOLERANCE, gpu_test, randn, rel_err
from tests.test_sampling_kernel import compiled_variants

HALF = [torch.float16, torch.bfloat16]


def check_linear(m, n, k, dtype, bias, seed, config=None, gated=False):
    """x as a token-strided view (rows padded, as a fused projection's slice is); the weight scaled
    like a real layer's so outputs are O(1). Two launches: the first of a launch shape gives every
    column block its own program, the next run the persistent grid (fewer programs, several blocks
    each; one program in Triton's interpreter); both must match the reference, and each other.
    ``gated``: SiLU-and-mul over a ``[2 n, k]`` gate/up weight (`linear_silu_and_mul_triton`), against the
    two launches it replaces (the plain kernel, then `silu_and_mul_triton`: the same roundings; Triton's
    interpreter rounds bfloat16 toward zero, so three roundings in a row drift from the reference by about
    the tolerance) and, in float16, against the reference too."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    rows = 2 * n if gated else n
    x = randn(m, k + 3, dtype=dtype, gen=gen)[:, :k]
    weight = (randn(rows, k, dtype=torch.float32, gen=gen) * k**-0.5).to(dtype)
    b = randn(rows, dtype=dtype, gen=gen) if bias else None
    fn = linear_silu_and_mul_triton if gated else linear_triton
    ref = linear_ref(x, weight, b)
    if gated:
        if dtype == torch.float16:
            reference = linear_silu_and_mul_ref(x, weight, b)
            assert rel_err(fn(x, weight, b, config), reference) < TOLERANCE[dtype]
        ref = silu_and_mul_triton(linear_triton(x, weight, b))
    first, persistent = (fn(x, weight, b, config) for _ in range(2))
    for out in (first, persistent):
        assert out.shape == ref.shape == (m, n) and out.dtype == dtype
        assert rel_err(out, ref) < TOLERANCE[dtype]
    assert torch.equal(first, persistent)  # the same sums in the same order, whichever program


# tokens -> a launch shape with tiles smaller than N = 40 and K = 100 (neither a multiple of them)
TINY_CONFIGS = {1: GemmConfig(1, 16, 32, num_warps=4), 3: GemmConfig(4, 8, 32, num_warps=4)}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_matches_reference(dtype, m, bias):
    check_linear(m, 40, 100, dtype, bias, seed=m, config=TINY_CONFIGS[m])


@pytest.mark.parametrize("m", [1, 3])
def test_skinny_gemm_default_config_matches_reference(m):
    check_linear(m, 72, 96, torch.float16, bias=True, seed=m)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("bias", [False, True])
def test_silu_and_mul_epilogue_matches_reference(dtype, m, bias):
    """SwiGLU's gate/up projection and SiLU-and-mul in one launch: each column block pairs the gate and
    up rows of its columns (tiles of half the rows of each), 40 output columns from 80 weight rows."""
    config = TINY_CONFIGS[m]._replace(block_n=TINY_CONFIGS[m].block_n // 2)
    check_linear(m, 40, 100, dtype, bias, seed=m, config=config, gated=True)
    check_linear(m, 40, 100, dtype, bias, seed=m + 10, gated=True)  # skinny_config(gated=True)


def test_no_tokens():
    x = torch.zeros(0, 32, dtype=torch.float16, device=DEVICE)
    weight = torch.zeros(16, 32, dtype=torch.float16, device=DEVICE)
    assert linear_triton(x, weight).shape == (0, 16)


def test_a_launch_shape_learns_its_persistent_grid_at_its_first_launch():
    """The first launch of a config gives each column block a program; it leaves the programs an SM holds
    (1 in the interpreter), so the next launches run the persistent grid."""
    config = GemmConfig(1, 4, 64, num_warps=4)
    key = (torch.device(DEVICE), torch.float16, config, False, False)
    skinny_gemm._resident.pop(key, None)
    x = torch.randn(1, 64, dtype=torch.float16, device=DEVICE)
    linear_triton(x, torch.randn(24, 64, dtype=torch.float16, device=DEVICE), config=config)
    assert skinny_gemm._resident[key] >= 1


@pytest.mark.parametrize("sms", [1, 132])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "n, k",
    [(896, 896), (1152, 896), (896, 4864), (9728, 896), (6144, 4096), (4096, 14336), (896, 448)],
)
def test_config_covers_the_tokens_and_fills_the_device(sms, m, n, k):
    cfg = skinny_config(m, n, k, sms)
    assert m <= cfg.block_m <= MAX_REDUCE_M
    for size in (cfg.block_m, cfg.block_n, cfg.block_k):
        assert size & (size - 1) == 0
    assert cfg.block_n * cfg.block_k <= TILE_WEIGHTS  # the weight tile's registers
    # all of K in one tile up to ROW_K / block_m
    assert cfg.block_k >= min(k, ROW_K // cfg.block_m) and cfg.block_k <= max(
        ROW_K // cfg.block_m, 16
    )
    # two column blocks per SM, or one column a block
    assert -(-n // cfg.block_n) >= 2 * sms or cfg.block_n == 1
    # SiLU-and-mul over n rows of gate and up: a tile of half as many columns, half gate, half up
    gated = skinny_config(m, n, k, sms, gated=True)
    assert gated == cfg._replace(block_n=max(1, cfg.block_n // 2))


def test_token_counts_of_one_block_share_a_config():
    """3 and 4 tokens compile one kernel: M is not a constexpr nor specialised."""
    assert skinny_config(3, 1152, 896, 132) == skinny_config(4, 1152, 896, 132)


def test_layers_choose_the_skinny_gemm_for_few_tokens_up_to_64_mib_or_128_mib_of_one_tile_rows(
    monkeypatch,
):
    """On the CPU the layers compute F.linear exactly as before; with the Triton path on, the rule takes
    a half-precision batch of at most SKINNY_MAX_TOKENS (2) tokens on a weight of at most
    SKINNY_MAX_WEIGHT_BYTES, or of at most SKINNY_MAX_ONE_TILE_WEIGHT_BYTES whose rows fit one tile at that
    token count (ROW_K at one token, half at two); ``SKINNY_GEMM`` off (``RADIXINFER_SKINNY_GEMM=0``)
    turns it off."""
    x = torch.randn(layers.SKINNY_MAX_TOKENS, 32)
    weight = torch.randn(48, 32)
    assert torch.equal(layers.linear(x, weight), F.linear(x, weight))
    monkeypatch.setattr(layers, "use_triton", lambda x: True)
    half, small = x.half(), weight.half()
    assert layers.use_skinny_gemm(half, small)
    assert not layers.use_skinny_gemm(x, weight)  # float32: cuBLAS
    three = torch.zeros(layers.SKINNY_MAX_TOKENS + 1, 32, dtype=torch.float16)
    assert not layers.use_skinny_gemm(three, small)
    suits, limit = layers.skinny_gemm_suits, layers.SKINNY_MAX_WEIGHT_BYTES
    one_tile_limit = layers.SKINNY_MAX_ONE_TILE_WEIGHT_BYTES
    assert suits(2, 14336, limit) and not suits(2, 14336, limit + 1)
    assert suits(1, ROW_K, one_tile_limit)  # llama-3.1-8b's TP=2 gate_up: 117 MB, K 4,096
    assert not suits(1, ROW_K, one_tile_limit + 1)  # its TP=1 gate_up: 235 MB
    assert not suits(1, ROW_K + 1, limit + 1)  # its TP=1 down_proj: 117 MB, K 14,336
    assert not suits(2, ROW_K, limit + 1)  # two tokens: two K tiles of 2,048
    assert suits(2, ROW_K // 2, one_tile_limit)
    assert not suits(layers.SKINNY_MAX_TOKENS + 1, 32, 3072)
    monkeypatch.setattr(layers, "SKINNY_GEMM", False)
    assert not layers.use_skinny_gemm(half, small)


# --------------------------------------------------------------------------------------------- GPU sizes

# (N, K) per rank of qwen2.5-0.5b's and llama-3.1-8b's qkv, o_proj, gate_up and down_proj at TP=1 and 2
# (the layers send llama-3.1-8b's TP=1 gate_up and down_proj to cuBLAS; the kernel takes any, up to 235 MB here)
QWEN_SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
QWEN_TP2_SHAPES = [(576, 896), (896, 448), (4864, 896), (896, 2432)]
LLAMA_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
LLAMA_TP2_SHAPES = [(3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)]


@gpu_test
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", QWEN_SHAPES + QWEN_TP2_SHAPES)
def test_skinny_gemm_gpu(dtype, m, n, k):
    check_linear(m, n, k, dtype, bias=m % 2 == 1, seed=m)


@gpu_test
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n, k", LLAMA_SHAPES + LLAMA_TP2_SHAPES)
def test_skinny_gemm_large_weights_gpu(m, n, k):
    check_linear(m, n, k, torch.bfloat16, bias=False, seed=m)


@gpu_test
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n, k", [(4864, 896), (2432, 896), (14336, 4096), (7168, 4096)])
def test_silu_and_mul_epilogue_gpu(m, n, k):
    """qwen2.5-0.5b's and llama-3.1-8b's gate/up projections (TP 1 and 2) with SiLU-and-mul fused."""
    check_linear(m, n, k, torch.bfloat16, bias=m == 2, seed=m, gated=True)


@gpu_test
def test_token_counts_of_one_block_compile_once():
    """After one call per token block (1, 2, 4), 3 tokens compile nothing (a decode batch first seen
    mid-run must not stall on a compile), nor does another layer of the same launch shape."""

    def run(m, n, k):
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        linear_triton(x, torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16))

    for m in (1, 2, 4):
        run(m, 896, 896)
    kernel = skinny_gemm._skinny_gemm_kernel
    before = compiled_variants(kernel)
    run(3, 896, 896)
    run(3, 896, 1792)  # another layer: the same launch shape
    assert compiled_variants(kernel) == before


@gpu_test
def test_layers_linear_gpu():
    """On CUDA the layers' linear takes the kernel at 1-2 tokens on any weight (close to F.linear) and
    cuBLAS at 3 (F.linear exactly)."""
    gen = torch.Generator(DEVICE).manual_seed(0)
    weight = randn(9728, 896, dtype=torch.bfloat16, gen=gen) * 896**-0.5  # 17.4 MB
    one, three = (
        randn(1, 896, dtype=torch.bfloat16, gen=gen),
        randn(3, 896, dtype=torch.bfloat16, gen=gen),
    )
    assert layers.use_skinny_gemm(one, weight) == layers.SKINNY_GEMM
    assert not layers.use_skinny_gemm(three, weight)
    assert rel_err(layers.linear(one, weight), F.linear(one, weight)) < TOLERANCE[torch.bfloat16]
    assert torch.equal(layers.linear(three, weight), F.linear(three, weight))
