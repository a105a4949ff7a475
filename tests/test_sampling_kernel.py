"""The sorting-free sampling kernel against its sorting PyTorch reference, and both against the
filtered softmax they sample from (min-p, top-k, top-p as vLLM applies them).

Without CUDA the kernels run in Triton's interpreter at tiny sizes (tiny blocks, so rows split into
several chunks); the ``gpu`` test repeats the comparison at a real batch and vocabulary."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.argmax import MERGE_BLOCK
from kernels.sampling import (
    Tiles,
    gumbel_from_keys,
    sample_ref,
    sample_triton,
    sample_triton_rowwise,
)
from tests import _triton_env  # noqa: F401  (without CUDA, Triton runs interpreted)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# 4 chunks of 64 logits a row at a vocabulary of 203 (the last one 11 long), 2 blocks a chunk
SPLIT = Tiles(block=32, search_block=32, chunks=4, count_block=32)


def random_rows(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """Logits and per-row parameters mixing greedy rows, each filter alone and filters combined."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(dtype)
    inv_temperature = torch.rand(rows, generator=gen) * 2
    inv_temperature[::7] = 0
    top_k = torch.randint(0, 40, (rows,), generator=gen)
    top_k[::3] = 0
    top_p = torch.rand(rows, generator=gen)
    top_p[::2] = 1
    min_p = torch.rand(rows, generator=gen) * 0.3
    min_p[1::2] = 0
    keys = torch.randint(0, 2**32, (rows,), generator=gen)
    return tuple(t.to(DEVICE) for t in (logits, inv_temperature, top_k, top_p, min_p, keys))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_draws_the_reference_tokens(dtype):
    args = random_rows(32, 203, dtype, seed=hash(str(dtype)) % 1000)
    assert sample_triton(*args).tolist() == sample_ref(*args).tolist()
    assert sample_triton_rowwise(*args).tolist() == sample_ref(*args).tolist()


@pytest.mark.parametrize(
    ("dtype", "tiles"),
    [
        (torch.bfloat16, SPLIT),
        (
            torch.bfloat16,
            Tiles(block=32, search_block=16, chunks=3, histogram=False, count_bits=4, exact_bits=0),
        ),
        (torch.bfloat16, Tiles(block=16, search_block=16, chunks=4, count_block=64, unroll=2)),
        (torch.bfloat16, Tiles(block=32, search_block=32, chunks=2, count_bits=3, exact_bits=4)),
        (torch.float16, Tiles(block=32, search_block=32, chunks=4, count_bits=5, exact_bits=8)),
        (
            torch.float16,
            Tiles(
                block=64,
                search_block=64,
                chunks=2,
                digit_bits=2,
                buckets_first=False,
                count_block=64,
            ),
        ),
        (torch.float32, SPLIT),
    ],
)
def test_split_rows_draw_the_reference_tokens(dtype, tiles):
    """Rows cut into chunks (the vocabulary not a multiple of the chunk), with greedy rows, each
    filter alone and combined; top-k counted by histogram (its block wider than the others', 3 to
    8 key bits a pass) or by bucket sums, mass passes reading two blocks an iteration, 4-bit or
    2-bit weighted digits, a mass search's last 4, 7 or 8 key bits counted in one pass (each
    bucket one value, negative values' keys with their low bits set in fp16) or weighed like the
    others, both layouts of the bucket sums."""
    args = random_rows(14, 203, dtype, seed=7)
    assert sample_triton(*args, tiles=tiles).tolist() == sample_ref(*args).tolist()


@pytest.mark.parametrize(
    "filters",
    [(False, False, False), (True, False, False), (False, True, False), (False, False, True)],
)
def test_launch_plans_for_the_filters_in_use(filters):
    """A batch whose sampled rows use only the filters named (greedy rows beside them): the kernel
    launches only those filters' passes and still draws the reference's tokens, also for rows that
    keep every token (top-k at the vocabulary, min-p and top-p too small to cut)."""
    logits, inv_t, top_k, top_p, min_p, keys = random_rows(10, 203, torch.bfloat16, seed=9)
    use_k, use_p, use_min_p = filters
    top_k = torch.where(torch.tensor(use_k, device=DEVICE), top_k.clamp(min=1), 0)
    top_k[1] = 203 if use_k else 0
    top_p = torch.where(torch.tensor(use_p, device=DEVICE), top_p.clamp(max=0.9), 1.0)
    top_p[2] = 0.999999 if use_p else 1.0
    min_p = torch.where(torch.tensor(use_min_p, device=DEVICE), min_p.clamp(min=0.05), 0.0)
    min_p[3] = 1e-30 if use_min_p else 0.0
    args = (logits, inv_t, top_k, top_p, min_p, keys)
    ref = sample_ref(*args).tolist()
    assert sample_triton(*args, filters=filters, tiles=SPLIT).tolist() == ref


def test_rows_cut_into_more_chunks_than_a_merge_reads_at_once():
    """A few rows of a wide vocabulary, each cut into 38 chunks: every program merges the row's
    chunk maxima and bucket sums over several iterations of `MERGE_BLOCK` chunks, and the chunks'
    draws are merged the same way."""
    args = random_rows(6, 600, torch.bfloat16, seed=11)
    tiles = Tiles(block=16, search_block=16, chunks=40, count_block=16)
    assert tiles.num_chunks(6, 600, torch.device(DEVICE))[0] > 2 * MERGE_BLOCK
    assert sample_triton(*args, tiles=tiles).tolist() == sample_ref(*args).tolist()


@pytest.mark.parametrize("top_p", [0.05, 0.6, 0.97])
def test_top_p_rows_keep_their_unrestricted_draw_only_inside_the_nucleus(top_p):
    """Top-p rows first draw from every token min-p keeps, and keep that draw when it lies in the
    nucleus; the others are searched and drawn again. The reference's own draws show both kinds
    of row in the batch, and the kernel matches it on each."""
    logits, inv_t, top_k, _, min_p, keys = random_rows(48, 203, torch.bfloat16, seed=21)
    inv_t = inv_t.clamp(min=0.3)  # every row samples
    top_k = torch.zeros_like(top_k)
    top_p = torch.full_like(inv_t, top_p)
    args = (logits, inv_t, top_k, top_p, min_p, keys)
    ref = sample_ref(*args)
    unrestricted = sample_ref(logits, inv_t, top_k, torch.ones_like(top_p), min_p, keys)
    assert (ref == unrestricted).any() and (ref != unrestricted).any()
    assert sample_triton(*args, tiles=SPLIT).tolist() == ref.tolist()
    assert sample_triton(*args).tolist() == ref.tolist()


def test_kernel_handles_ties_infinities_and_signed_zeros():
    """bf16 rows full of equal values, -inf entries and both zeros: ties at a threshold are kept
    together, and the greedy row takes the first index of its maximum."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(-3, 3, (12, 64), generator=gen).float()
    logits[:, ::5] = float("-inf")
    logits[:, 1::9] = -0.0
    logits = logits.to(torch.bfloat16).to(DEVICE)
    inv_t = torch.tensor([0.0] + [1.0] * 11, device=DEVICE)
    top_k = torch.tensor([0, 3, 0, 1, 10, 0, 2, 0, 5, 0, 64, 100], device=DEVICE)
    top_p = torch.tensor([1, 1, 0.5, 1, 0.7, 0.01, 1, 0.9, 0.3, 1, 1, 1.0], device=DEVICE)
    min_p = torch.tensor([0, 0, 0, 0, 0.2, 0, 0.5, 0, 0, 0.9, 0, 0.0], device=DEVICE)
    keys = torch.arange(12, device=DEVICE) * 7919
    args = (logits, inv_t, top_k, top_p, min_p, keys)
    ref = sample_ref(*args).tolist()
    assert sample_triton(*args).tolist() == ref
    # chunks of 16 logits: every chunk boundary falls inside some tie group
    tiles = Tiles(block=16, search_block=16, chunks=4, count_block=16)
    assert sample_triton(*args, tiles=tiles).tolist() == ref


def filtered_softmax(logits: list[float], top_k: int, top_p: float, min_p: float) -> list[float]:
    """The distribution vLLM samples from, on a tiny vocabulary (temperature 1), by plain Python:
    min-p on the full softmax, top-k, then the smallest set of the best tokens holding ``top_p``
    of what is left."""
    peak = max(logits)
    weights = [math.exp(x - peak) for x in logits]
    keep = [w >= min_p for w in weights]  # p >= min_p * p_max, with p_max's weight 1
    ranked = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k:
        keep = [k and i in ranked[:top_k] for i, k in enumerate(keep)]
    total = sum(w for w, k in zip(weights, keep) if k)
    mass, kept = 0.0, set()
    for i in ranked:
        if keep[i] and mass < top_p * total:
            kept.add(i)
            mass += weights[i]
    z = sum(weights[i] for i in kept)
    return [weights[i] / z if i in kept else 0.0 for i in range(len(logits))]


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"),
    [(0, 1.0, 0.0), (4, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (5, 0.9, 0.05)],
)
def test_samples_follow_the_filtered_softmax(top_k, top_p, min_p):
    """Chi-square of 4,000 draws (one row each, fixed keys) against the filtered softmax, no draw
    outside the kept tokens, and the kernel drawing the reference's tokens row for row (all of
    them on a GPU; the first 24 in Triton's interpreter, which runs ~0.1 s a row)."""
    row = [2.0, 1.5, 1.2, 1.0, 0.6, 0.3, -0.5, -1.0, -2.5, -3.0]
    probs = filtered_softmax(row, top_k, top_p, min_p)
    draws = 4000
    logits = torch.tensor(row, device=DEVICE).expand(draws, len(row)).contiguous()

    def column(value, dtype):
        return torch.full((draws,), value, dtype=dtype, device=DEVICE)

    keys = torch.randint(0, 2**32, (draws,), generator=torch.Generator().manual_seed(11))
    args = (
        logits, column(1.0, torch.float32), column(top_k, torch.int64),
        column(top_p, torch.float32), column(min_p, torch.float32), keys.to(DEVICE),
    )  # fmt: skip
    tokens = sample_ref(*args)
    checked = draws if torch.cuda.is_available() else 24
    assert sample_triton(*(a[:checked] for a in args)).tolist() == tokens[:checked].tolist()
    counts = torch.bincount(tokens.cpu(), minlength=len(row)).double()
    kept = [i for i, p in enumerate(probs) if p > 0]
    assert counts.sum() == counts[kept].sum()  # nothing outside the filters
    expected = torch.tensor([probs[i] for i in kept], dtype=torch.float64) * draws
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    # p = 0.001 critical values of the chi-square with len(kept) - 1 degrees of freedom
    critical = {
        1: 10.83,
        2: 13.82,
        3: 16.27,
        4: 18.47,
        5: 20.52,
        6: 22.46,
        7: 24.32,
        8: 26.12,
        9: 27.88,
    }
    assert chi2 < critical[len(kept) - 1]


def test_noise_is_gumbel_distributed():
    """The hashed noise's mean and variance are the Gumbel distribution's (0.5772, pi^2 / 6)."""
    g = gumbel_from_keys(torch.arange(64, dtype=torch.int64) * 104729, 4096).double()
    assert abs(g.mean().item() - 0.5772) < 0.01
    assert abs(g.var().item() - math.pi**2 / 6) < 0.03


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_draws_the_reference_tokens_at_a_real_vocabulary():
    args = random_rows(256, 151936, torch.bfloat16, seed=5)
    out, ref = sample_triton(*args), sample_ref(*args)
    # top-p masses are float sums in a different order: a boundary token may flip on a rare row
    assert (out != ref).sum().item() <= 2


def compiled_variants(*kernels) -> int:
    """How many compiled variants the Triton kernels hold, over every device."""
    return sum(len(caches[0]) for k in kernels for caches in k.device_caches.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "filters",
    [(False, False, False), (True, False, False), (False, True, True), (True, True, True)],
)
def test_one_compiled_kernel_serves_every_batch_size(filters):
    """After one call, sampling any other number of rows (1, a multiple of 16, neither; one chunk a
    row or 75) compiles nothing: a batch size first seen mid-run must not stall on a compile."""
    from kernels import argmax, sampling

    kernels = (
        sampling._search_kernel,
        sampling._draw_kernel,
        sampling._chunk_max_kernel,
        argmax._argmax_merge_kernel,
    )
    sample_triton(*random_rows(256, 151936, torch.bfloat16, seed=1), filters=filters)
    before = compiled_variants(*kernels)
    for rows in (1, 3, 16, 100, 2200):
        sample_triton(*random_rows(rows, 151936, torch.bfloat16, seed=rows), filters=filters)
    assert compiled_variants(*kernels) == before


def test_tiles_read_from_their_text_form():
    tiles = Tiles.parse("block=1024, histogram=0,chunks=0,digit_bits=2,count_bits=4")
    assert (tiles.block, tiles.histogram, tiles.chunks, tiles.digit_bits) == (1024, False, None, 2)
    assert (tiles.count_bits, tiles.exact_bits) == (4, 8)
    assert Tiles.parse(str(tiles)) == tiles and Tiles.parse("") == Tiles()
    with pytest.raises(ValueError, match="unknown"):
        Tiles.parse("blocks=1")


COMPILE_SCRIPT = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.sampling as s

POINTERS = {"logits_ptr": "*bf16", "top_k_ptr": "*i64", "keys_ptr": "*i64", "out_ptr": "*i64",
            "state_ptr": "*i32", "idx_ptr": "*i32", "taken_ptr": "*i32", "drawn_ptr": "*i64"}

def compile_for_sm90(fn, num_warps, pointers=POINTERS, **constexprs):
    names = inspect.signature(fn.fn).parameters
    signature = {n: "constexpr" if n in constexprs
                 else pointers.get(n, "*fp32" if n.endswith("_ptr") else "i32") for n in names}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

search = dict(HAS_MAX=True, MERGE_BLOCK=16, BLOCK=512, UNROLL=1, STRIDE=256, TAKEN=True)
for mass, counts, first, buckets, prev, exact in [
    (True, False, True, 16, 256, False), (True, False, False, 16, 16, False),
    (False, True, True, 256, 256, False), (True, False, True, 4, 4, False),
    (True, True, True, 256, 16, False), (False, True, True, 16, 256, True),
]:
    compile_for_sm90(s._search_kernel, 8, MASS=mass, COUNTS=counts, BUCKETS_FIRST=first,
                     BUCKETS=buckets, PREV_BUCKETS=prev, PREV_EXACT=exact, **search)
compile_for_sm90(s._search_kernel, 8, MASS=False, COUNTS=True, BUCKETS_FIRST=True, BUCKETS=256,
                 PREV_BUCKETS=256, PREV_EXACT=False, STRIDE=256, HAS_MAX=True, MERGE_BLOCK=16,
                 BLOCK=2048, UNROLL=1, TAKEN=False)
compile_for_sm90(s._search_kernel, 8, MASS=True, COUNTS=False, BUCKETS_FIRST=True, BUCKETS=16,
                 PREV_BUCKETS=16, PREV_EXACT=False, STRIDE=256, HAS_MAX=True, MERGE_BLOCK=16,
                 BLOCK=256, UNROLL=2, TAKEN=False)
for taken in (False, True):
    compile_for_sm90(s._draw_kernel, 8, HAS_MAX=True, BUCKETS=256, EXACT=True, STRIDE=256,
                     MERGE_BLOCK=16, BLOCK=2048, TAKEN=taken)
compile_for_sm90(s._nucleus_mass_kernel, 8, MERGE_BLOCK=16, BLOCK=2048)
compile_for_sm90(s._take_kernel, 4, MERGE_BLOCK=16)
compile_for_sm90(s._chunk_max_kernel, 8, BLOCK=2048)
compile_for_sm90(s._rowwise_kernel, 16, PASSES=4, BLOCK=512)
compile_for_sm90(s._argmax_merge_kernel, 4, BLOCK_C=16, USE_PDL=True)
import kernels.penalties as pen
ints = {"positions_ptr": "*i64", "count_rows_ptr": "*i64", "tokens_ptr": "*i64", "seen_ptr": "*u8",
        "counts_ptr": "*i32", "logits_ptr": "*bf16", "out_ptr": "*bf16"}
compile_for_sm90(pen._penalize_kernel, 8, pointers=ints, BLOCK=2048)
compile_for_sm90(pen._count_kernel, 4, pointers=ints, BLOCK=256)
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles them in the other tests")
def test_kernels_compile_for_sm90():
    """Triton's interpreter runs code its compiler refuses (a local flag made of constexprs is not
    one), so without a GPU the kernels' variants (and the penalty kernels) are compiled for an H100
    (sm_90) in a process outside the interpreter; skipped where Triton has no CUDA toolchain."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT], cwd=root, env=env, capture_output=True, text=True
    )
    if "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("no ptxas")
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
