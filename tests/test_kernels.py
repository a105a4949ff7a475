"""Each Triton kernel against its PyTorch reference on random data.

Without CUDA the kernels run in Triton's interpreter at tiny sizes; the ``gpu`` tests repeat them at real
sizes (batch 300, head_dim 128, long contexts). Every output is NaN-poisoned before the kernel runs, so an
element the kernel forgets to write fails the comparison.
"""

import dataclasses
from typing import NamedTuple

import numpy as np
import pytest
import torch

from kernels.block_copy import copy_blocks_ref, copy_blocks_triton
from kernels.paged_attention import (
    NewKV,
    SharedPrefixTiles,
    extend_block_m,
    paged_attention_ref,
    paged_attention_triton,
    paged_decode_attention_triton,
    plan_extend_work,
    shared_prefix_chunks,
    shared_prefix_seqs_per_tile,
)
from kernels.rotary import Rotary
from kernels.store_kv import store_kv_ref, store_kv_triton
from radixinfer.attention import AttentionMetadata, ForwardContext
from radixinfer.attention.shared_prefix import SharedPrefixPlanner
from radixinfer.attention.torch_backend import TorchAttentionBackend
from radixinfer.attention.triton_backend import TritonAttentionBackend
from tests import _triton_env  # noqa: I001  (first: without CUDA, Triton must start in interpreter mode)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def gpu_test(fn):
    """The ``gpu`` marker, and a skip where there is no CUDA."""
    return pytest.mark.gpu(
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn)
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def randn(*shape, dtype, gen) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


class PagedBatch(NamedTuple):
    """A ragged batch over a random paged cache whose block tables are random (out-of-order) block ids."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata

    def args(self, scale: float) -> tuple:
        """The arguments `paged_attention_ref` and `paged_attention_triton` take for this batch."""
        m = self.meta
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            m.block_tables,
            m.context_lens,
            m.query_start_loc,
            m.max_query_len,
            m.max_context_len,
            scale,
        )

    def ref(self, scale: float) -> torch.Tensor:
        return paged_attention_ref(*self.args(scale))


def make_batch(
    prefix_lens, query_lens, *, num_heads, num_kv_heads, head_dim, block_size, dtype, seed
):
    gen = torch.Generator(DEVICE).manual_seed(seed)
    context_lens = [p + n for p, n in zip(prefix_lens, query_lens)]
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody reads
    perm = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32)
    width = (
        max(blocks_per_seq) + 2
    )  # padded past every sequence's end with 0, as the metadata promises
    block_tables = torch.zeros(len(context_lens), width, dtype=torch.int32, device=DEVICE)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = perm[used : used + n]
        used += n
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # the extend kernel's work list, with idle items past the plan as a captured graph's list has
    work = np.zeros(
        (2, sum(-(-n // extend_block_m(dtype)) for n in query_lens) + 3), dtype=np.int32
    )
    plan_extend_work(np.array(query_lens), np.array(context_lens), extend_block_m(dtype), work)
    meta = AttentionMetadata(
        slot_mapping=torch.full((sum(query_lens),), -1, dtype=torch.int64, device=DEVICE),
        block_tables=block_tables,
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(
            [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
        ),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        extend_work=torch.from_numpy(work).to(DEVICE),
    )
    return PagedBatch(
        q=randn(sum(query_lens), num_heads, head_dim, dtype=dtype, gen=gen),
        k_cache=randn(*cache_shape, dtype=dtype, gen=gen),
        v_cache=randn(*cache_shape, dtype=dtype, gen=gen),
        meta=meta,
    )


def check_attention(batch: PagedBatch, dtype, num_splits=None):
    """The general launcher (``num_splits`` None) or the decode launcher with ``num_splits`` against
    the reference."""
    if num_splits is not None:
        check_decode(batch, dtype, num_splits)
        return
    scale = batch.q.shape[-1] ** -0.5
    out = nan_like(batch.q)
    paged_attention_triton(*batch.args(scale), out=out, extend_work=batch.meta.extend_work)
    err = rel_err(out, batch.ref(scale))
    assert err < TOLERANCE[dtype], err


def check_decode(
    batch: PagedBatch,
    dtype,
    num_splits: int | None,
    shared: SharedPrefixTiles | None = None,
    shared_chunks: int | None = None,
):
    """The decode launcher (``num_splits`` and ``shared_chunks`` None: its own choice), reading ``shared``'s
    tiles when given, against the reference."""
    scale = batch.q.shape[-1] ** -0.5
    m = batch.meta
    assert m.is_decode
    out = nan_like(batch.q)
    paged_decode_attention_triton(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        m.block_tables,
        m.context_lens,
        m.max_context_len,
        scale,
        num_splits=num_splits,
        out=out,
        shared=shared,
        shared_chunks=shared_chunks,
    )
    err = rel_err(out, batch.ref(scale))
    assert err < TOLERANCE[dtype], err


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def skip_bf16_dot_in_interpreter(dtype):
    """Triton's interpreter multiplies bf16 bit patterns in tl.dot (unsupported upstream:
    triton-lang/triton#11584); fp16 covers the 16-bit path here, the gpu tests cover bf16."""
    if dtype == torch.bfloat16 and _triton_env.INTERPRETED:
        pytest.skip("bf16 tl.dot is unsupported by Triton's interpreter")


# ------------------------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "context_lens, heads, head_dim, block_size, num_splits",
    [
        ([37], (4, 1), 64, 16, None),  # batch 1, one KV head for all query heads
        ([37], (4, 1), 64, 16, 3),  # the log-sum-exp merge, the last split partial
        (
            [1, 16, 17, 100],
            (14, 2),
            80,
            3,
            2,
        ),  # qwen group of 7, non-power-of-2 head_dim and block_size
        ([5, 70], (2, 2), 64, 1, 8),  # no GQA, one position per block, empty splits
    ],
)
def test_decode_matches_reference(dtype, context_lens, heads, head_dim, block_size, num_splits):
    skip_bf16_dot_in_interpreter(dtype)
    batch = make_batch(
        [c - 1 for c in context_lens],
        [1] * len(context_lens),
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=len(context_lens) * 31 + head_dim + block_size,
    )
    check_attention(batch, dtype, num_splits)


def test_decode_padding_rows_give_zeros():
    """CUDA-graph padding: a row with context_len 0 attends to nothing and must not produce NaN."""
    batch = make_batch(
        [40, 0],
        [1, 1],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=5,
    )
    context_lens = batch.meta.context_lens.clone()
    context_lens[1] = 0
    for num_splits in (1, 3):
        out = paged_decode_attention_triton(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.meta.block_tables,
            context_lens,
            41,
            1.0,
            num_splits=num_splits,
        )
        assert torch.equal(out[1], torch.zeros_like(out[1])) and not out[0].isnan().any()


def share_prefixes(
    batch: PagedBatch, groups: list[list[int]], shared_blocks: list[int]
) -> PagedBatch:
    """Make each group's sequences hold their first member's leading ``shared_blocks[g]`` block ids, as the
    prefix cache does for a shared prompt (the reference then reads the same K/V for all of them)."""
    tables = batch.meta.block_tables.clone()
    for members, blocks in zip(groups, shared_blocks):
        tables[members, :blocks] = tables[members[0], :blocks]
    return batch._replace(meta=dataclasses.replace(batch.meta, block_tables=tables))


def plan_shared(batch: PagedBatch, min_shared_len: int, dtype) -> SharedPrefixTiles | None:
    m = batch.meta
    num_heads, (_, block_size, num_kv_heads, _) = batch.q.shape[1], batch.k_cache.shape
    planner = SharedPrefixPlanner(
        block_size, shared_prefix_seqs_per_tile(num_heads, num_kv_heads, dtype), min_shared_len
    )
    n = m.num_seqs
    tile_seqs = np.zeros((planner.max_tiles(n), planner.seqs_per_tile), dtype=np.int32)
    tile_lens = np.zeros(planner.max_tiles(n), dtype=np.int32)
    kv_starts = np.zeros(n, dtype=np.int32)
    if not planner.plan(
        m.block_tables.cpu().numpy(), m.context_lens.cpu().numpy(), tile_seqs, tile_lens, kv_starts
    ):
        return None
    as_tensor = lambda a: torch.from_numpy(a).to(DEVICE)  # noqa: E731
    return SharedPrefixTiles(as_tensor(tile_seqs), as_tensor(tile_lens), as_tensor(kv_starts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits, shared_chunks", [(1, 4), (3, 4), (3, 2), (1, 1)])
def test_decode_reads_shared_prefixes_once_with_the_same_result(dtype, num_splits, shared_chunks):
    """Seven sequences with qwen's group of 7 (fp32 tiles hold 4 sequences, fp16 tiles 9): a group of four
    sharing 300 positions (a member's own tail is its one new position), a pair sharing 27, a loner. In four
    chunks the 300 are read as 128, 128 and 44 with the fourth chunk empty; in two as 160 and 140 (fp32's
    32-position tiles) or 192 and 108; the 27 are one chunk and the rest empty. Neither shared length is a
    multiple of the kernel's KV tile, so the masked tail of the tile kernel runs."""
    context_lens = [310, 305, 320, 301, 30, 33, 44]
    batch = make_batch(
        [c - 1 for c in context_lens],
        [1] * 7,
        num_heads=14,
        num_kv_heads=2,
        head_dim=80,
        block_size=3,
        dtype=dtype,
        seed=11,
    )
    batch = share_prefixes(batch, [[0, 1, 2, 3], [4, 5]], [100, 9])
    shared = plan_shared(batch, min_shared_len=8, dtype=dtype)
    assert shared is not None
    assert shared.kv_starts.tolist() == [300, 300, 300, 300, 27, 27, 0]
    check_decode(batch, dtype, num_splits, shared, shared_chunks)


def test_shared_prefix_chunks_fill_the_device_with_few_partials():
    """The fewest chunks (1, 2, 4) that give the full tiles two programs per SM, or 4: on 132 SMs a batch of
    1,024 with 9 sequences a tile and 2 KV heads (226 programs a chunk) takes 2; 512 and 256 take 4; with 8 KV
    heads and 16 a tile 1,024 takes 1, 512 2 and 256 4; fewer sequences than a tile, 4."""
    assert shared_prefix_chunks(1024, 9, 2, sms=132) == 2
    assert shared_prefix_chunks(512, 9, 2, sms=132) == 4
    assert shared_prefix_chunks(256, 9, 2, sms=132) == 4
    assert shared_prefix_chunks(1024, 16, 8, sms=132) == 1
    assert shared_prefix_chunks(512, 16, 8, sms=132) == 2
    assert shared_prefix_chunks(256, 16, 8, sms=132) == 4
    assert shared_prefix_chunks(8, 9, 2, sms=132) == 4
    assert shared_prefix_chunks(7, 9, 2, sms=1) == 4  # Triton's interpreter counts one SM


# ------------------------------------------------------------------------------------------------ extend


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "prefix_lens, query_lens, heads, head_dim, block_size",
    [
        ([21], [9], (4, 2), 64, 16),  # batch 1, prefix ending mid-block
        (
            [0, 13, 16, 35, 3],
            [5, 7, 1, 20, 70],
            (14, 2),
            80,
            3,
        ),  # misses and hits, a decode row among them
        ([0, 45], [33, 2], (2, 2), 64, 1),
    ],
)
def test_extend_matches_reference(dtype, prefix_lens, query_lens, heads, head_dim, block_size):
    skip_bf16_dot_in_interpreter(dtype)
    batch = make_batch(
        prefix_lens,
        query_lens,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=sum(query_lens) + block_size,
    )
    check_attention(batch, dtype)


def test_extend_work_list_covers_every_query_tile_once_longest_span_first():
    query_lens = np.array([1, 64, 65, 200, 0, 7])
    context_lens = np.array([1, 100, 65, 900, 0, 7])
    work = np.full((2, 12), 99, dtype=np.int32)
    n = plan_extend_work(query_lens, context_lens, 64, work)
    assert n == 1 + 1 + 2 + 4 + 0 + 1
    items = sorted(zip(work[0, :n].tolist(), work[1, :n].tolist()))
    assert items == [(0, 0), (1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2), (3, 3), (5, 0)]
    assert (work[1, n:] == -1).all()  # idle padding
    spans = (context_lens - query_lens)[work[0, :n]] + 64 * work[1, :n]
    assert (np.diff(spans) <= 0).all()
    with pytest.raises(ValueError, match="capacity"):
        plan_extend_work(query_lens, context_lens, 64, np.zeros((2, n - 1), dtype=np.int32))


# ------------------------------------------------------------------------------------------- store / copy


def check_store_kv(num_tokens, num_blocks, block_size, heads, head_dim, dtype, seed, rotary=True):
    """The store step against its reference, q/k/v as strided views into one fused projection (the
    way a model produces them), a quarter of the slots -1. With ``rotary``: q rotated in place (every
    row, slot -1 included), k rotated into the cache. Either way k and v stay as they were, every
    slot not written keeps its bits, and slot -1 rows write nothing."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator(DEVICE).manual_seed(seed)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (randn(*cache_shape, dtype=dtype, gen=gen) for _ in range(2))
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size + 3, dtype=dtype, gen=gen)[:, 3:]

    # the model dtype, as RotaryEmbedding keeps them; angles of positions far apart
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen, device=DEVICE) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen, device=DEVICE) < 0.25] = -1

    def store(fn, qkv, k_cache, v_cache):
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, num_heads, head_dim)
        k, v = (t.view(num_tokens, num_kv_heads, head_dim) for t in (k, v))
        fn(k_cache, v_cache, k, v, slots, Rotary(q, cos, sin) if rotary else None)

    before = qkv.clone(), k_cache.clone(), v_cache.clone()
    ref_qkv, ref_k, ref_v = (t.clone() for t in before)
    store(store_kv_ref, ref_qkv, ref_k, ref_v)
    store(store_kv_triton, qkv, k_cache, v_cache)
    assert torch.equal(qkv[:, q_size:], before[0][:, q_size:])  # k, v only read
    if rotary:  # the kernel rounds once, the reference after every step
        assert rel_err(qkv[:, :q_size], ref_qkv[:, :q_size]) < TOLERANCE[dtype]
        assert not torch.equal(qkv[:, :q_size], before[0][:, :q_size])
    else:
        assert torch.equal(qkv[:, :q_size], before[0][:, :q_size])
    stored = slots[slots >= 0]
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[stored] = False
    for out, ref, orig, rotated in (
        (k_cache, ref_k, before[1], rotary),
        (v_cache, ref_v, before[2], False),
    ):
        out, ref, orig = (t.view(-1, num_kv_heads, head_dim) for t in (out, ref, orig))
        assert torch.equal(out[untouched], orig[untouched])
        if rotated:
            assert rel_err(out[stored], ref[stored]) < TOLERANCE[dtype]
        else:
            assert torch.equal(out[stored], ref[stored])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", [True, False], ids=["rotary", "plain"])
@pytest.mark.parametrize(
    "heads, head_dim", [((4, 2), 16), ((6, 3), 24), ((3, 3), 80)]
)  # 24 and 80: head_dim and half not powers of 2; (3, 3): GPT-2's as many KV heads as query heads
def test_store_kv_matches_reference(dtype, rotary, heads, head_dim):
    check_store_kv(
        num_tokens=23,
        num_blocks=11,
        block_size=3,
        heads=heads,
        head_dim=head_dim,
        dtype=dtype,
        seed=head_dim,
        rotary=rotary,
    )


def test_store_kv_of_an_empty_batch_launches_nothing():
    x = torch.empty(0, 8, 16, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    slots = torch.empty(0, dtype=torch.int64, device=DEVICE)
    rotary = Rotary(x[:, :4], x[:, 0, :8], x[:, 1, :8])
    store_kv_triton(cache, cache.clone(), x[:, 4:6], x[:, 6:], slots, rotary)
    assert not cache.any()


def check_copy_blocks(
    num_layers, num_blocks, block_size, num_kv_heads, head_dim, num_copies, dtype, seed
):
    gen = torch.Generator(DEVICE).manual_seed(seed)
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(*shape, dtype=dtype, gen=gen), randn(*shape, dtype=dtype, gen=gen)
    perm = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32)
    pairs = perm[: 2 * num_copies].view(
        num_copies, 2
    )  # [num_copies, (src, dst)]: strided index columns
    src, dst = pairs[:, 0], pairs[:, 1]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    copy_blocks_ref(k_ref, v_ref, src, dst)
    copy_blocks_triton(k_cache, v_cache, src, dst)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_reference(dtype):
    check_copy_blocks(
        num_layers=3,
        num_blocks=20,
        block_size=3,
        num_kv_heads=2,
        head_dim=80,
        num_copies=7,
        dtype=dtype,
        seed=2,
    )


# ------------------------------------------------------------------------------------- decode store fused


class DecodeStep(NamedTuple):
    """A decode step's attention inputs as a model produces them: q, k and v strided views into one
    fused projection, cos/sin (None: no rotary), and the metadata with each new token's slot."""

    q: torch.Tensor  # [num_seqs, num_heads, head_dim]
    k: torch.Tensor  # [num_seqs, num_kv_heads, head_dim]
    v: torch.Tensor
    cos: torch.Tensor | None  # [num_seqs, head_dim // 2]
    sin: torch.Tensor | None
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_decode_step(
    context_lens, no_slot, *, heads, head_dim, block_size, dtype, rotary, seed
) -> DecodeStep:
    """Sequence ``b``'s new token at position ``context_lens[b] - 1``, stored into its slot there,
    except the rows ``no_slot`` (slot -1: store nothing, read what the cache holds). A context_len
    of 0 is a CUDA-graph padding row (slot -1)."""
    num_heads, num_kv_heads = heads
    batch = make_batch(
        [max(c - 1, 0) for c in context_lens],
        [1] * len(context_lens),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
    )
    gen = torch.Generator(DEVICE).manual_seed(seed + 1)
    n, q_size, kv_size = len(context_lens), num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(n, q_size + 2 * kv_size + 3, dtype=dtype, gen=gen)[:, 3:]
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    angles = torch.rand(n, head_dim // 2, generator=gen, device=DEVICE) * 100
    cos, sin = (angles.cos().to(dtype), angles.sin().to(dtype)) if rotary else (None, None)
    tables = batch.meta.block_tables
    slots = [
        tables[b, (c - 1) // block_size].item() * block_size + (c - 1) % block_size
        if c > 0 and b not in no_slot
        else -1
        for b, c in enumerate(context_lens)
    ]
    meta = dataclasses.replace(
        batch.meta,
        slot_mapping=torch.tensor(slots, device=DEVICE),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        new_slots_private=True,  # every sequence in its own blocks, as a decode step is
    )
    return DecodeStep(
        q.view(n, num_heads, head_dim),
        k.view(n, num_kv_heads, head_dim),
        v.view(n, num_kv_heads, head_dim),
        cos,
        sin,
        batch.k_cache,
        batch.v_cache,
        meta,
    )


def check_decode_store(step: DecodeStep, dtype, num_splits: int | None):
    """The split kernel storing the step's new K/V itself (`NewKV`) against the two launches it
    replaces, `store_kv_triton` then the decode kernel: the same output and caches bit for bit, and
    q, k and v left as they were. Against the references (`store_kv_ref`, `paged_attention_ref`,
    which round after every rotary step): the same output and K within tolerance, V exactly, every
    slot but the new tokens' keeps its bits, padding rows (context_len 0) give zeros."""
    m, scale = step.meta, step.q.shape[-1] ** -0.5
    rotary = step.cos is not None
    inputs = step.q.clone(), step.k.clone(), step.v.clone()

    def decode(q, k_cache, v_cache, new_kv=None):
        out = nan_like(q)
        paged_decode_attention_triton(
            q, k_cache, v_cache, m.block_tables, m.context_lens, m.max_context_len, scale,
            num_splits=num_splits, out=out, new_kv=new_kv,
        )  # fmt: skip
        return out

    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    new_kv = NewKV(step.k, step.v, m.slot_mapping, step.cos, step.sin)
    out = decode(step.q, k_cache, v_cache, new_kv)
    assert all(torch.equal(a, b) for a, b in zip((step.q, step.k, step.v), inputs))

    two_k, two_v, two_q = step.k_cache.clone(), step.v_cache.clone(), step.q.clone()
    rotation = Rotary(two_q, step.cos, step.sin) if rotary else None
    store_kv_triton(two_k, two_v, step.k, step.v, m.slot_mapping, rotation)
    assert torch.equal(decode(two_q, two_k, two_v), out)
    assert torch.equal(k_cache, two_k) and torch.equal(v_cache, two_v)

    ref_k, ref_v, ref_q = step.k_cache.clone(), step.v_cache.clone(), step.q.clone()
    rotation = Rotary(ref_q, step.cos, step.sin) if rotary else None
    store_kv_ref(ref_k, ref_v, step.k, step.v, m.slot_mapping, rotation)
    ref = paged_attention_ref(
        ref_q, ref_k, ref_v, m.block_tables, m.context_lens, m.query_start_loc, 1,
        m.max_context_len, scale,
    )  # fmt: skip
    attends = m.context_lens > 0
    assert rel_err(out[attends], ref[attends]) < TOLERANCE[dtype]
    assert torch.equal(out[~attends], torch.zeros_like(out[~attends]))
    num_kv_heads, head_dim = k_cache.shape[2:]
    stored = m.slot_mapping[m.slot_mapping >= 0]
    untouched = torch.ones(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[stored] = False
    k_cache, v_cache, ref_k, ref_v, before_k, before_v = (
        t.view(-1, num_kv_heads, head_dim)
        for t in (k_cache, v_cache, ref_k, ref_v, step.k_cache, step.v_cache)
    )
    assert torch.equal(k_cache[untouched], before_k[untouched])
    assert torch.equal(v_cache[untouched], before_v[untouched])
    assert torch.equal(v_cache[stored], ref_v[stored])
    if rotary:  # the kernel rounds once, the reference after every step
        assert rel_err(k_cache[stored], ref_k[stored]) < TOLERANCE[dtype]
        assert not torch.equal(k_cache[stored], before_k[stored])
    else:
        assert torch.equal(k_cache[stored], ref_k[stored])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", [True, False], ids=["rotary", "plain"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_stores_new_kv_in_the_split_kernel(dtype, rotary, num_splits):
    """GQA (groups of 3), head_dim 24 (its half not a power of 2), blocks of 3 positions. In three
    splits of 32-position (fp32) or 64-position (fp16) tiles the new position falls in the middle
    split (100, 40 in fp32, 33 in fp32), the last one (150) or the first (40 and 33 in fp16), and the
    later splits of a sequence are empty; row 3 is padding (context_len 0, slot -1) and row 4 stores
    nothing (slot -1) but attends, reading what its slot holds."""
    skip_bf16_dot_in_interpreter(dtype)
    step = make_decode_step(
        [100, 150, 40, 0, 33],
        no_slot={4},
        heads=(6, 2),
        head_dim=24,
        block_size=3,
        dtype=dtype,
        rotary=rotary,
        seed=13,
    )
    check_decode_store(step, dtype, num_splits)


# ----------------------------------------------------------------------------------------------- backend


@pytest.mark.parametrize("rotary", [True, False], ids=["rotary", "plain"])
def test_backend_stores_then_attends_like_the_reference_backend(rotary):
    """Through ForwardContext: a hit whose new tokens are stored (slot set) next to tokens already in the
    cache (slot -1 reads what is there), for both backends on identical caches; with ``rotary`` the
    store step rotates q and k first (the kernel rounds once, the reference after every step)."""
    batch = make_batch(
        [5, 0],
        [6, 9],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=4,
        dtype=torch.float32,
        seed=7,
    )
    gen = torch.Generator(DEVICE).manual_seed(8)
    num_tokens = batch.q.shape[0]
    k, v = (randn(num_tokens, 2, 64, dtype=torch.float32, gen=gen) for _ in range(2))
    angles = torch.rand(num_tokens, 32, generator=gen, device=DEVICE) * 100
    cos, sin = (angles.cos(), angles.sin()) if rotary else (None, None)
    block_size = batch.k_cache.shape[1]
    m = batch.meta
    slots = []
    for b in range(m.num_seqs):
        for p in range(m.prefix_lens[b].item(), m.context_lens[b].item()):
            slots.append(m.block_tables[b, p // block_size].item() * block_size + p % block_size)
    slot_mapping = torch.tensor(slots, device=DEVICE)
    slot_mapping[::3] = -1
    meta = dataclasses.replace(m, slot_mapping=slot_mapping)
    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        pool_k, pool_v = batch.k_cache.clone()[None], batch.v_cache.clone()[None]  # one layer
        ctx = ForwardContext(meta=meta, k_cache=pool_k, v_cache=pool_v, backend=backend)
        q = batch.q.clone()  # rotated in place
        out = ctx.attention(0, q, k, v, scale=0.125, cos=cos, sin=sin)
        outs.append((out, q, pool_k, pool_v))
    (ref, ref_q, ref_k, ref_v), (out, out_q, out_k, out_v) = outs
    assert torch.equal(out_v, ref_v)
    if rotary:
        assert rel_err(out_q, ref_q) < TOLERANCE[torch.float32]
        assert rel_err(out_k, ref_k) < TOLERANCE[torch.float32]
    else:
        assert torch.equal(out_q, batch.q) and torch.equal(out_k, ref_k)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("rotary", [True, False], ids=["rotary", "plain"])
def test_triton_backend_stores_in_the_decode_kernel_like_the_reference_backend(rotary, monkeypatch):
    """Through ForwardContext at decode (no shared-prefix tiles): the Triton backend launches no store
    of its own, and gives the reference backend's output and caches (V and unrotated K exactly);
    a padding row and a slot -1 row among them."""
    step = make_decode_step(
        [30, 0, 17, 9],
        no_slot={3},
        heads=(4, 2),
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        rotary=rotary,
        seed=21,
    )
    stores = []
    monkeypatch.setattr(
        TritonAttentionBackend, "store", staticmethod(lambda *args: stores.append(args))
    )
    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        pool_k, pool_v = step.k_cache.clone()[None], step.v_cache.clone()[None]  # one layer
        ctx = ForwardContext(meta=step.meta, k_cache=pool_k, v_cache=pool_v, backend=backend)
        q = step.q.clone()
        out = ctx.attention(0, q, step.k, step.v, scale=0.25, cos=step.cos, sin=step.sin)
        outs.append((out, pool_k, pool_v))
    assert not stores
    (ref, ref_k, ref_v), (out, out_k, out_v) = outs
    attends = step.meta.context_lens > 0
    assert rel_err(out[attends], ref[attends]) < TOLERANCE[torch.float32]
    assert torch.equal(out_v, ref_v)
    if rotary:  # the kernel rounds once, the reference after every step
        assert rel_err(out_k, ref_k) < TOLERANCE[torch.float32]
    else:
        assert torch.equal(out_k, ref_k)


@pytest.mark.parametrize("rotary", [True, False], ids=["rotary", "plain"])
def test_a_prefill_pass_of_one_token_a_sequence_stores_the_whole_batch_first(rotary):
    """In-batch dedup: sequence 1 computes position 7 of a prompt; sequence 0, the same prompt and one
    token more, reads that position from sequence 1's block while computing position 8, in the same
    pass. One new token each is the decode kernel's shape, but the pass is not a decode step
    (``new_slots_private`` False): the Triton backend must store every new K/V before anyone attends.
    Sequence 0 comes first so that Triton's interpreter, running programs in order, would have it read
    the slot before sequence 1's program wrote it, were the store fused."""
    step = make_decode_step(
        [9, 8],
        no_slot=set(),
        heads=(4, 2),
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        rotary=rotary,
        seed=5,
    )
    tables = step.meta.block_tables.clone()
    tables[0, :2] = tables[1, :2]  # sequence 0's positions 0-7 are sequence 1's (its new one too)
    meta = dataclasses.replace(step.meta, block_tables=tables, new_slots_private=False)
    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        pool_k, pool_v = step.k_cache.clone()[None], step.v_cache.clone()[None]  # one layer
        ctx = ForwardContext(meta=meta, k_cache=pool_k, v_cache=pool_v, backend=backend)
        outs.append(ctx.attention(0, step.q.clone(), step.k, step.v, 0.25, step.cos, step.sin))
    assert rel_err(outs[1], outs[0]) < TOLERANCE[torch.float32]


# --------------------------------------------------------------------------------------------- GPU sizes


def poison_allocator():
    """Fill memory the caching allocator will hand out next with NaN, so kernel workspaces start poisoned."""
    junk = [torch.full((n,), float("nan"), device="cuda") for n in [1 << 26] + [1 << 17] * 64]
    del junk


def random_lengths(n, low, high, seed):
    return torch.randint(low, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads, head_dim, block_size",
    [((14, 2), 64, 16), ((32, 8), 128, 16), ((12, 4), 80, 3), ((32, 8), 128, 1)],
)
@pytest.mark.parametrize("batch_size, max_len", [(1, 5000), (300, 700)])
def test_decode_gpu(dtype, heads, head_dim, block_size, batch_size, max_len):
    context_lens = random_lengths(batch_size, 1, max_len, seed=batch_size + head_dim)
    batch = make_batch(
        [c - 1 for c in context_lens],
        [1] * batch_size,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=head_dim + block_size,
    )
    for num_splits in (None, 1, 7):
        poison_allocator()
        check_attention(batch, dtype, num_splits)


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads, head_dim, block_size", [((14, 2), 64, 16), ((32, 8), 128, 1), ((12, 4), 80, 16)]
)
@pytest.mark.parametrize("batch_size", [1, 300])
def test_extend_gpu(dtype, heads, head_dim, block_size, batch_size):
    prefix_lens = random_lengths(batch_size, 0, 600, seed=batch_size)
    query_lens = random_lengths(batch_size, 1, 1000 if batch_size == 1 else 80, seed=batch_size + 1)
    prefix_lens[0] = 0  # at least one miss
    batch = make_batch(
        prefix_lens,
        query_lens,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=head_dim + block_size,
    )
    check_attention(batch, dtype)


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, head_dim", [((14, 2), 64), ((32, 8), 128), ((12, 12), 64)])
def test_decode_shared_prefix_gpu(dtype, heads, head_dim):
    """Batch 300 in 12 groups of 25 sharing ~1,000 positions each (several tiles per group), own tails of
    1-200 positions, and a few loners; with the splits the grid picks and with 4."""
    gen = torch.Generator().manual_seed(head_dim)
    shared_lens = torch.randint(900, 1100, (12,), generator=gen).tolist()
    context_lens = [
        shared_lens[s % 12] + 1 + int(torch.randint(0, 200, (), generator=gen)) for s in range(300)
    ]
    batch = make_batch(
        [c - 1 for c in context_lens],
        [1] * 300,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        seed=head_dim,
    )
    groups = [[s for s in range(300) if s % 12 == g and s < 290] for g in range(12)]
    batch = share_prefixes(batch, groups, [n // 16 for n in shared_lens])
    shared = plan_shared(batch, min_shared_len=128, dtype=dtype)
    assert (
        shared is not None
        and (shared.kv_starts[:290] > 0).all()
        and (shared.kv_starts[290:] == 0).all()
    )
    for num_splits in (None, 4):
        poison_allocator()
        check_decode(batch, dtype, num_splits, shared)


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_and_copy_gpu(dtype):
    for heads, head_dim in [((14, 2), 64), ((32, 8), 128), ((16, 8), 128)]:
        for rotary in (True, False):
            check_store_kv(
                num_tokens=3000,
                num_blocks=500,
                block_size=16,
                heads=heads,
                head_dim=head_dim,
                dtype=dtype,
                seed=3,
                rotary=rotary,
            )
    check_copy_blocks(
        num_layers=24,
        num_blocks=700,
        block_size=16,
        num_kv_heads=2,
        head_dim=64,
        num_copies=256,
        dtype=dtype,
        seed=4,
    )


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", [True, False], ids=["rotary", "plain"])
def test_decode_store_gpu(dtype, rotary):
    """The split kernel storing the new K/V itself at batch 300, llama's heads, long and short
    contexts, a few padding rows and slot -1 rows, with the splits the grid picks and with 7."""
    context_lens = random_lengths(300, 1, 2000, seed=17)
    context_lens[::50] = [0] * 6
    step = make_decode_step(
        context_lens,
        no_slot=set(range(7, 300, 40)),
        heads=(32, 8),
        head_dim=128,
        block_size=16,
        dtype=dtype,
        rotary=rotary,
        seed=17,
    )
    for num_splits in (None, 7):
        poison_allocator()
        check_decode_store(step, dtype, num_splits)


@gpu_test
def test_decode_step_replays_in_a_cuda_graph():
    """Capture rotary + store + attend once (one launch fewer: the decode kernel stores), then change
    lengths, tables and inputs in place and replay: the graph must compute the new step exactly like
    the reference (no host sync, no length-dependent grid)."""
    batch_size, heads, head_dim, block_size, max_len = 64, (32, 8), 128, 16, 4096
    num_blocks = batch_size * max_len // block_size
    gen = torch.Generator("cuda").manual_seed(9)
    shape = (1, num_blocks, block_size, heads[1], head_dim)
    k_pool, v_pool = (
        randn(*shape, dtype=torch.bfloat16, gen=gen),
        randn(*shape, dtype=torch.bfloat16, gen=gen),
    )
    q = torch.empty(batch_size, heads[0], head_dim, dtype=torch.bfloat16, device="cuda")
    k, v = (
        torch.empty(batch_size, heads[1], head_dim, dtype=torch.bfloat16, device="cuda")
        for _ in range(2)
    )
    cos, sin = (
        torch.empty(batch_size, head_dim // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(2)
    )
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch_size, dtype=torch.int64, device="cuda"),
        block_tables=torch.zeros(
            batch_size, max_len // block_size, dtype=torch.int32, device="cuda"
        ),
        context_lens=torch.ones(batch_size, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32, device="cuda"),
        max_query_len=1,
        max_context_len=max_len,
        new_slots_private=True,
    )
    ctx = ForwardContext(
        meta=meta, k_cache=k_pool, v_cache=v_pool, backend=TritonAttentionBackend()
    )

    def fill_step(seed):
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(1, max_len + 1, (batch_size,), generator=g)
        tables = torch.randperm(num_blocks, generator=g)[: batch_size * (max_len // block_size)]
        meta.block_tables.copy_(tables.view(batch_size, -1))
        meta.context_lens.copy_(lens)
        last = lens - 1
        slots = (
            meta.block_tables.cpu().gather(1, (last // block_size)[:, None])[:, 0] * block_size
            + last % block_size
        )
        slots[::5] = -1  # padding rows store nothing
        meta.slot_mapping.copy_(slots)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=g))
        angles = torch.rand(cos.shape, generator=g) * max_len
        cos.copy_(angles.cos())
        sin.copy_(angles.sin())

    fill_step(0)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ctx.attention(0, q, k, v, head_dim**-0.5, cos, sin)  # compile outside capture
        with torch.cuda.graph(graph, stream=stream):
            out = ctx.attention(0, q, k, v, head_dim**-0.5, cos, sin)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        fill_step(seed)
        q_ref, k_ref, v_ref = q.clone(), k_pool.clone(), v_pool.clone()
        store_kv_ref(k_ref[0], v_ref[0], k, v, meta.slot_mapping, Rotary(q_ref, cos, sin))
        ref = paged_attention_ref(
            q_ref,
            k_ref[0],
            v_ref[0],
            meta.block_tables,
            meta.context_lens,
            meta.query_start_loc,
            1,
            max_len,
            head_dim**-0.5,
        )
        graph.replay()
        torch.cuda.synchronize()
        # rotated k: the kernel rounds once, the reference after every step (an ulp apart); q is
        # rotated in the decode kernel's registers, not in memory
        assert torch.allclose(k_pool.float(), k_ref.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(v_pool, v_ref)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
