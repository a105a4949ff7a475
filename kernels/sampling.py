"""Sampling from filtered softmaxes without sorting the vocabulary: temperature, min-p, top-k and
top-p, each row with its own parameters.

Every filter keeps an *upper set* of a row's logits (every token at least as large as some
threshold), so the filters compose into one threshold per row, and a token is drawn from the tokens
at or above it with the Gumbel-max trick: ``argmax(logits / T + Gumbel noise)`` over the kept
tokens, the noise a hash of ``(row key, vocab id)`` (`gumbel_from_keys`). The filters apply in
vLLM's order: min-p (``p >= min_p * p_max``), then top-k (ties at the k-th value are kept), then
top-p over the probabilities renormalised to what min-p and top-k kept (the smallest upper set whose
mass is at least ``top_p``). A row with ``inv_temperature == 0`` is greedy: the first index of its
maximum.

Thresholds are found as keys: a float32's bits mapped to an unsigned 32-bit integer of the same
order (``-0.0`` as ``+0.0``; negative values' bits inverted, positive ones' sign bit set). The
Triton kernels search the key a digit per pass over the row, most significant first (the largest
bucket whose suffix still meets the target wins), instead of a sort. A count search (top-k) counts
8 key bits a pass through ``tl.histogram`` (256 counts a program): 2 passes in bf16. A mass search
(top-p) weighs 4 bits a pass (each logit adds ``exp(s - max)`` to one of 16 sums a lane holds)
until 8 bits are left, then counts those 8 in one pass: there each bucket holds one value (the
dtype has no lower bits), so its mass is its count times that value's weight, computed once per
bucket instead of once per logit: 3 passes in bf16 (2 weighted, 1 counted), 7 in float32. The
widths are `Tiles` settings. The result is exact: the kernels keep the same tokens as the sorting
reference (`sample_ref`) up to float rounding of the top-p masses, and with the same noise draw the
same token.

Top-p without top-k first tries the cheaper path: draw from every token min-p keeps, and keep the
draw when it lies in the nucleus, which it does with probability at least ``top_p``; only the
other rows search their threshold and draw again (`sample_triton`). The tokens are the same.

Performance: `sample_triton` cuts each row into chunks, one program each, so every pass streams the
batch from all SMs (a pass reads 78 MB at batch 256 x 151,936 bf16); a pass's programs leave
per-chunk bucket sums and the next launch's programs each merge their row's (up to a few thousand
floats) to pick the digit, so there is no separate reduction launch. Passes run only for the
filters some row uses (min-p and top-p need the row maximum, top-k the count search, top-p the
mass search, every row the draw). `sample_triton_rowwise`, one program per row, is the
benchmarks' baseline. The search and draw passes are compute-bound, not memory-bound: compiled for
sm_90 (Triton 3.9, default `Tiles`), PTX instructions a logit: a weighted digit pass ~77 (48 of
them the 16 bucket select-adds), a counted pass ~29 whatever its width (``tl.histogram`` is one
shared-memory atomic a logit), the draw ~111 where a block keeps a token (the hash and two exact
logs, ``__nv_logf``) and ~23 where none does (the block skips the noise), the max pass ~12. Top-p
in bf16 so costs ~306 instructions a logit, top-k ~81 to ~170 (before: 4 weighted or 4 counted
4-bit passes, ~420 and ~216); at ~33 T thread-instructions/s that is ~360 us and under ~200 us at
batch 256 x 151,936 on an H100, against ~25 us to read the logits once (estimates from instruction
counts; `benchmarks/sweep_sampling.py` measures).

Why a counted pass stops at 8 bits: what a program spends on its buckets rather than its logits
grows with ``2**bits``. ``tl.histogram``'s bins are zeroed, read back and added to the program's
counts once a block (4,096 bins against a 2,048-logit block at 12 bits: two adds a logit; 1/8 at
8), and every program of the next launch merges its row's sums from all the row's chunks
(``chunks x 2**bits`` floats: at batch 256 x 151,936 on an H200, 9 chunks a row, 9 KB a program at
8 bits, 147 KB at 12), then weighs each bucket (an ``exp``) and scans them. A 12-bit counted pass
(its counts added across chunks atomically instead) made top-p 5.5x slower on an H200 (4.18 ms
against 0.76 ms with 4 weighted 4-bit passes); at 8 bits these costs are 1/16 of that.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.argmax import MERGE_BLOCK, _argmax_merge_kernel
from kernels.device import num_sms
from kernels.pdl import launch_options

_MIX = 0x45D9F3B
DIGIT_BITS = 4  # bits of the threshold key found per pass of the rowwise kernel: 16 buckets
# significant high bits of a float32 key per logit dtype (its float32 value's low bits are zero)
KEY_BITS = {torch.bfloat16: 16, torch.float16: 19, torch.float32: 32}
# integer arguments that follow the batch's rows, never specialized on (`kernels.argmax.MERGE_BLOCK`)
NOT_SPECIALIZED = ["rows", "num_chunks"]


def gumbel_from_keys(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` float32 Gumbel noise, a pure function of ``(keys[row], column)``: a
    32-bit hash, its top 23 bits as a uniform in (0, 1) (exact in float32), then ``-log(-log(u))``.
    """
    cols = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    h = keys[:, None] ^ cols[None, :]
    for _ in range(2):
        h = (((h >> 16) ^ h) * _MIX) & 0xFFFFFFFF
    h = (h >> 16) ^ h
    u = ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)
    return -torch.log(-torch.log(u))


def _tie_group_mass(sorted_x: torch.Tensor, sorted_w: torch.Tensor) -> torch.Tensor:
    """For logits sorted descending and their weights: the weight of every token ``>=`` each one."""
    cum = sorted_w.cumsum(-1)
    last = torch.ones_like(sorted_x, dtype=torch.bool)
    last[:, :-1] = sorted_x[:, :-1] != sorted_x[:, 1:]  # a tie group's last position
    ends = torch.where(last, cum, float("inf"))
    return ends.flip(-1).cummin(-1).values.flip(-1)


def sample_ref(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
) -> torch.Tensor:
    """Sampled ids ``[rows]`` int64 from ``logits [rows, vocab]`` (any float dtype): per row
    ``inv_temperature`` float32 (0: greedy), ``top_k`` int64 (0: off), ``top_p`` and ``min_p``
    float32 (1 and 0: off), ``keys`` int64 noise keys. Sorts the vocabulary (the reference and the
    CPU path)."""
    rows, vocab = logits.shape
    x = logits.float()
    greedy = inv_temperature == 0
    s = x * torch.where(greedy, 1.0, inv_temperature)[:, None]
    m = s.max(-1, keepdim=True).values
    keep = s >= m + torch.log(min_p)[:, None]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        keep &= x >= sorted_x.gather(1, (k - 1)[:, None])
        w = torch.where(keep, torch.exp(s - m), 0.0)
        target = top_p[:, None] * w.sum(-1, keepdim=True)
        mass = _tie_group_mass(sorted_x, w.gather(1, order))
        first = (mass < target).sum(-1, keepdim=True).clamp(max=vocab - 1)
        keep &= (x >= sorted_x.gather(1, first)) | (top_p[:, None] >= 1)
    noise = torch.where(greedy[:, None], 0.0, gumbel_from_keys(keys, vocab))
    return torch.where(keep, s + noise, float("-inf")).argmax(-1)


@triton.jit
def _row_values(row_ptr, cols, valid, scale):
    """Logits at ``cols`` as float32 (``-0.0`` as ``+0.0``): their order keys, times ``scale``."""
    x = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return key, x * scale


@triton.jit
def _gumbel(row_key, cols):
    h = row_key ^ cols.to(tl.uint32)
    h = ((h >> 16) ^ h) * 0x45D9F3B
    h = ((h >> 16) ^ h) * 0x45D9F3B
    h = (h >> 16) ^ h
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _digits(
    row_ptr, cols, valid, scale, row_max, base, min_key, min_s, shift, MASS: tl.constexpr,
    BUCKETS: tl.constexpr,
):  # fmt: skip
    """Each logit's digit of its key in the window ``[base, base + BUCKETS << shift)`` (``BUCKETS``
    above it) and its weight: 1 (count) or ``exp(s - row_max)`` (``MASS``) for a candidate (key
    ``>= base`` and ``>= min_key``, scaled logit ``>= min_s``), 0 for any other; and whether it is
    one."""
    key, s = _row_values(row_ptr, cols, valid, scale)
    inside = valid & (key >= base) & (key >= min_key) & (s >= min_s)
    if MASS:
        weight = tl.where(inside, tl.exp(s - row_max), 0.0)
    else:
        weight = tl.where(inside, 1.0, 0.0)
    digit = (key - base) >> shift
    return tl.where(digit < BUCKETS, digit, BUCKETS).to(tl.int32), weight, inside


@triton.jit
def _choose_digit(hist, above, target, BUCKETS: tl.constexpr):
    """The largest bucket of a window's ``BUCKETS`` sums ``hist`` whose suffix, plus ``above`` (what
    lies above the window), still meets ``target``; and ``above`` plus the sums above that
    bucket."""
    buckets = tl.arange(0, BUCKETS)
    suffix = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    best = tl.max(tl.where(above + suffix >= target, buckets, 0), axis=0)
    return best, above + tl.sum(tl.where(buckets > best, hist, 0.0), axis=0)


@triton.jit
def _draw_block(row_ptr, cols, valid, scale, threshold, min_s, noise_scale, row_key, best, idx):
    """Fold the logits at ``cols`` into each lane's Gumbel-max of the kept tokens (``best``, and
    ``idx`` its first index). A block keeping no token draws no noise (the hash and two logs are
    most of a draw pass's work; top-k and top-p keep few blocks of a peaked row)."""
    key, s = _row_values(row_ptr, cols, valid, scale)
    keep = valid & (key >= threshold) & (s >= min_s)
    if tl.max(keep.to(tl.int32), axis=0) > 0:
        v = tl.where(keep, s + noise_scale * _gumbel(row_key, cols), float("-inf"))
        take = ((v > best) | ((v == best) & (cols < idx))) & valid
        best = tl.where(take, v, best)
        idx = tl.where(take, cols, idx)
    return best, idx


@triton.jit
def _key_search(
    row_ptr, vocab, scale, row_max, min_key, min_s, fraction, MASS: tl.constexpr,
    PASSES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The largest key ``K`` (a multiple of ``2**(32 - 4 * PASSES)``) such that the tokens with key
    ``>= K`` (among those with key ``>= min_key`` and scaled logit ``>= min_s``) number at least
    ``fraction`` (count search), or hold at least ``fraction`` of their mass (``MASS``). One pass
    per 4-bit digit, most significant first (`_choose_digit`)."""
    offs = tl.arange(0, BLOCK)
    buckets = tl.arange(0, 16)
    base = tl.zeros((), tl.uint32)
    above = tl.zeros((), tl.float32)
    target = fraction
    for i in tl.static_range(PASSES):
        shift = 28 - 4 * i
        acc = tl.zeros([BLOCK, 16], tl.float32)  # each lane's bucket sums: one reduction a pass
        for off in range(0, vocab, BLOCK):
            cols = off + offs
            digit, weight, _ = _digits(
                row_ptr, cols, cols < vocab, scale, row_max, base, min_key, min_s, shift, MASS, 16
            )
            acc += tl.where(digit[:, None] == buckets[None, :], weight[:, None], 0.0)
        hist = tl.sum(acc, axis=0)
        if MASS and i == 0:
            target = fraction * tl.sum(hist, axis=0)  # the first window covers every key
        best, above = _choose_digit(hist, above, target, 16)
        base += best.to(tl.uint32) << shift
    return base


@triton.jit
def _rowwise_kernel(
    logits_ptr, stride_row, vocab, inv_temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, keys_ptr, out_ptr,
    PASSES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (row): the row's threshold passes, then one pass drawing the Gumbel-max of the kept
    tokens (for a greedy row, the first index of its maximum)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    inv_temp = tl.load(inv_temp_ptr + row)
    greedy = inv_temp == 0.0
    scale = tl.where(greedy, 1.0, inv_temp)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    offs = tl.arange(0, BLOCK)
    row_max = tl.full((), float("inf"), tl.float32)
    min_s = tl.full((), float("-inf"), tl.float32)
    threshold = tl.zeros((), tl.uint32)
    if inv_temp != 0.0:
        if (min_p > 0.0) | (top_p < 1.0):
            acc = tl.full([BLOCK], float("-inf"), tl.float32)
            for off in range(0, vocab, BLOCK):
                cols = off + offs
                _, s = _row_values(row_ptr, cols, cols < vocab, scale)
                acc = tl.maximum(acc, s)
            row_max = tl.max(acc, axis=0)
            if min_p > 0.0:
                min_s = row_max + tl.log(min_p)
        if (top_k > 0) & (top_k < vocab):
            threshold = _key_search(
                row_ptr, vocab, scale, row_max, threshold, min_s, top_k.to(tl.float32),
                False, PASSES, BLOCK,
            )  # fmt: skip
        if top_p < 1.0:
            threshold = _key_search(
                row_ptr, vocab, scale, row_max, threshold, min_s, top_p, True, PASSES, BLOCK
            )
    noise_scale = tl.where(greedy, 0.0, 1.0)
    row_key = tl.load(keys_ptr + row).to(tl.uint32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    for off in range(0, vocab, BLOCK):
        cols = off + offs
        best, best_idx = _draw_block(
            row_ptr, cols, cols < vocab, scale, threshold, min_s, noise_scale, row_key, best,
            best_idx,
        )  # fmt: skip
    top = tl.max(best, axis=0)
    tl.store(
        out_ptr + row, tl.min(tl.where(best == top, best_idx, 2147483647), axis=0).to(tl.int64)
    )


def sample_triton_rowwise(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
    block: int = 512,
    num_warps: int = 8,
) -> torch.Tensor:
    """Same function as `sample_ref`, one program per row in one launch: every pass of a row
    streams the whole row from one SM. Kept as the baseline of `benchmarks/sweep_sampling.py`
    (`sample_triton` splits rows; 3.65 ms at batch 256 x 151,936 bf16 top-p on an H100 where this
    one's sort-free passes first replaced a 10.9 ms sort)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    passes = triton.cdiv(KEY_BITS[logits.dtype], DIGIT_BITS)
    block = min(block, triton.next_power_of_2(vocab))
    _rowwise_kernel[(rows,)](
        logits, logits.stride(0), vocab, inv_temperature, top_k, top_p, min_p, keys, out,
        PASSES=passes, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------- split rows: many programs a row


@triton.jit
def _row_setup(inv_temp_ptr, min_p_ptr, pmax_ptr, row, num_chunks, HAS_MAX: tl.constexpr,
               MERGE_BLOCK: tl.constexpr):  # fmt: skip
    """A row's ``(greedy, scale, row_max, min_s)``: the scale of its logits (1 for a greedy row),
    the maximum of its scaled logits (merged from the chunk maxima) and the min-p floor (``-inf``
    when off)."""
    inv_temp = tl.load(inv_temp_ptr + row)
    greedy = inv_temp == 0.0
    scale = tl.where(greedy, 1.0, inv_temp)
    row_max = tl.zeros((), tl.float32)
    min_s = tl.full((), float("-inf"), tl.float32)
    if HAS_MAX:
        row_max = tl.full((), float("-inf"), tl.float32)
        for first in range(0, num_chunks, MERGE_BLOCK):
            c = first + tl.arange(0, MERGE_BLOCK)
            chunk_max = tl.load(
                pmax_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf")
            )
            row_max = tl.maximum(row_max, tl.max(chunk_max, 0))
        min_p = tl.load(min_p_ptr + row)
        min_s = tl.where((min_p > 0.0) & ~greedy, row_max + tl.log(min_p), min_s)
    return greedy, scale, row_max, min_s


@triton.jit
def _key_weights(keys, scale, row_max):
    """``exp(s - row_max)`` of the value whose order key is ``keys`` (the inverse of
    `_row_values`' map), ``s`` that value times ``scale``."""
    bits = tl.where(keys >= 0x80000000, keys & 0x7FFFFFFF, keys ^ 0xFFFFFFFF)
    return tl.exp(bits.to(tl.float32, bitcast=True) * scale - row_max)


@triton.jit
def _resolve(state_ptr, partial_ptr, row, rows, num_chunks, top_p, prev_par, has_prev,
             prev_shift, scale, row_max, MERGE_BLOCK: tl.constexpr, BUCKETS: tl.constexpr,
             EXACT: tl.constexpr, STRIDE: tl.constexpr):  # fmt: skip
    """A row's search state ``(min_key, base, above, target)`` after the previous launch (none when
    ``has_prev`` is 0: all zero): the state that launch read, its digit chosen from its programs'
    ``BUCKETS`` bucket sums (a pending mass target, -1, becomes ``top_p`` times the first window's
    total; an inactive search, target ``inf``, keeps its base). ``EXACT``: that launch counted a
    mass digit whose buckets each hold one value (the dtype's last key bits), so a bucket's mass is
    its count times that value's weight (`_key_weights`), exact without a weight per logit: a
    value's key has its low ``prev_shift`` bits zero when positive and one when negative (bits
    below the dtype's precision)."""
    sp = state_ptr + (prev_par * rows + row) * 4
    prev = has_prev != 0
    min_key = tl.load(sp, mask=prev, other=0).to(tl.uint32, bitcast=True)
    base = tl.load(sp + 1, mask=prev, other=0).to(tl.uint32, bitcast=True)
    above = tl.load(sp + 2, mask=prev, other=0).to(tl.float32, bitcast=True)
    target = tl.load(sp + 3, mask=prev, other=0).to(tl.float32, bitcast=True)
    active = prev & (target != float("inf"))
    b = tl.arange(0, BUCKETS)
    hist = tl.zeros([BUCKETS], tl.float32)
    for first in range(0, num_chunks, MERGE_BLOCK):
        c = first + tl.arange(0, MERGE_BLOCK)
        parts = (
            partial_ptr + ((prev_par * rows + row) * num_chunks + c[:, None]) * STRIDE + b[None, :]
        )
        mask = tl.where(active, (c[:, None] < num_chunks) & (b[None, :] < BUCKETS), False)
        hist += tl.sum(tl.load(parts, mask=mask, other=0.0), axis=0)
    if EXACT:
        low = prev_shift.to(tl.uint32)
        keys = base + (b.to(tl.uint32) << low)  # a bucket's least key: a positive value's
        keys = tl.where(keys >= 0x80000000, keys, keys | ((1 << low) - 1))  # its greatest
        hist = tl.where(hist > 0.0, hist * _key_weights(keys, scale, row_max), 0.0)
    target = tl.where(target < 0.0, top_p * tl.sum(hist, axis=0), target)
    best, above = _choose_digit(hist, above, target, BUCKETS)
    base += tl.where(active, best, 0).to(tl.uint32) << prev_shift.to(tl.uint32)
    return min_key, base, above, target


@triton.jit(
    do_not_specialize=NOT_SPECIALIZED
    + ["par", "prev_par", "has_prev", "new_search", "shift", "prev_shift"]
)
def _search_kernel(
    logits_ptr, stride_row, vocab, chunk_len, num_chunks, rows, inv_temp_ptr, top_k_ptr,
    top_p_ptr, min_p_ptr, pmax_ptr, state_ptr, partial_ptr, par, prev_par, has_prev, new_search,
    shift, prev_shift, taken_ptr, MASS: tl.constexpr, HAS_MAX: tl.constexpr, COUNTS: tl.constexpr,
    BUCKETS_FIRST: tl.constexpr, BUCKETS: tl.constexpr, PREV_BUCKETS: tl.constexpr,
    PREV_EXACT: tl.constexpr, STRIDE: tl.constexpr, MERGE_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
    UNROLL: tl.constexpr, TAKEN: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk), one digit of a search (count, or ``MASS``): resolves the previous
    launch's digit (`_resolve`, its ``PREV_BUCKETS`` sums; ``new_search``: its threshold becomes
    the new search's ``min_key``, and the row's target is set, ``inf`` for a row without this
    filter), then sums its chunk's candidates into the ``BUCKETS`` buckets of the window
    ``[base, base + BUCKETS << shift)``. Reads state and bucket sums at ``prev_par``, writes them at
    ``par`` (chunk 0 the state): one launch's writes never meet its reads. ``COUNTS``: the buckets
    count candidates through ``tl.histogram`` (a count digit, or a mass digit whose buckets each
    hold one value: the next launch weighs them, `_resolve`'s ``EXACT``), else each candidate adds
    its weight, 1 or ``exp(s - row_max)``, to its bucket's sum held per lane; ``UNROLL``: blocks a
    loop iteration reads (more loads in flight for the same bucket sums); ``BUCKETS_FIRST``:
    bucket sums held ``[BUCKETS, BLOCK]`` (Triton's default layout then gives each thread whole
    columns: no logit computed by several threads), else ``[BLOCK, BUCKETS]``. Bucket sums are
    stored ``STRIDE`` apart (the widest digit's buckets). ``TAKEN``: a row whose unrestricted
    draw stands (``taken_ptr``, `_take_kernel`) searches nothing."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    shift = shift.to(tl.uint32)
    greedy, scale, row_max, min_s = _row_setup(
        inv_temp_ptr, min_p_ptr, pmax_ptr, row, num_chunks, HAS_MAX, MERGE_BLOCK
    )
    top_p = tl.load(top_p_ptr + row)
    min_key, base, above, target = _resolve(
        state_ptr, partial_ptr, row, rows, num_chunks, top_p, prev_par, has_prev, prev_shift,
        scale, row_max, MERGE_BLOCK, PREV_BUCKETS, PREV_EXACT, STRIDE,
    )  # fmt: skip
    fresh = new_search != 0
    if MASS:
        uses = ~greedy & (top_p < 1.0)
        if TAKEN:
            uses = uses & (tl.load(taken_ptr + row) == 0)
        fresh_target = tl.where(uses, -1.0, float("inf"))
    else:
        top_k = tl.load(top_k_ptr + row)
        uses = ~greedy & (top_k > 0) & (top_k < vocab)
        fresh_target = tl.where(uses, top_k.to(tl.float32), float("inf"))
    min_key = tl.where(fresh, tl.maximum(min_key, base), min_key)
    base = tl.where(fresh, tl.zeros((), tl.uint32), base)
    above = tl.where(fresh, 0.0, above)
    target = tl.where(fresh, fresh_target, target)
    if chunk == 0:
        sp = state_ptr + (par * rows + row) * 4
        tl.store(sp, min_key.to(tl.int32, bitcast=True))
        tl.store(sp + 1, base.to(tl.int32, bitcast=True))
        tl.store(sp + 2, above.to(tl.int32, bitcast=True))
        tl.store(sp + 3, target.to(tl.int32, bitcast=True))
    if target != float("inf"):
        row_ptr = logits_ptr + row * stride_row
        start = chunk * chunk_len
        end = tl.minimum(start + chunk_len, vocab)
        offs = tl.arange(0, BLOCK)
        buckets = tl.arange(0, BUCKETS)
        if COUNTS:
            acc = tl.zeros([BUCKETS], tl.int32)
        elif BUCKETS_FIRST:
            acc = tl.zeros([BUCKETS, BLOCK], tl.float32)
        else:
            acc = tl.zeros([BLOCK, BUCKETS], tl.float32)
        for off in range(start, end, BLOCK * UNROLL):
            for u in tl.static_range(UNROLL):  # UNROLL blocks' loads in flight, one acc
                cols = off + u * BLOCK + offs
                digit, weight, inside = _digits(
                    row_ptr, cols, cols < end, scale, row_max, base, min_key, min_s, shift,
                    MASS and not COUNTS, BUCKETS,
                )  # fmt: skip
                if COUNTS:
                    hit = inside & (digit < BUCKETS)  # (a digit of BUCKETS lies above the window)
                    acc += tl.histogram(tl.where(hit, digit, 0), BUCKETS, mask=hit)
                elif BUCKETS_FIRST:
                    acc += tl.where(buckets[:, None] == digit[None, :], weight[None, :], 0.0)
                else:
                    acc += tl.where(digit[:, None] == buckets[None, :], weight[:, None], 0.0)
        if COUNTS:
            hist = acc.to(tl.float32)
        elif BUCKETS_FIRST:
            hist = tl.sum(acc, axis=1)
        else:
            hist = tl.sum(acc, axis=0)
        part = partial_ptr + ((par * rows + row) * num_chunks + chunk) * STRIDE
        tl.store(part + buckets, hist)


@triton.jit(do_not_specialize=["num_chunks"])
def _chunk_max_kernel(
    logits_ptr, stride_row, vocab, chunk_len, num_chunks, inv_temp_ptr, top_p_ptr, min_p_ptr,
    pmax_ptr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk): the maximum of the chunk's scaled logits, for a row that samples with
    min-p or top-p (other rows write nothing)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    inv_temp = tl.load(inv_temp_ptr + row)
    needs = (inv_temp != 0.0) & (
        (tl.load(min_p_ptr + row) > 0.0) | (tl.load(top_p_ptr + row) < 1.0)
    )
    if needs:
        row_ptr = logits_ptr + row * stride_row
        start = chunk * chunk_len
        end = tl.minimum(start + chunk_len, vocab)
        offs = tl.arange(0, BLOCK)
        acc = tl.full([BLOCK], float("-inf"), tl.float32)
        for off in range(start, end, BLOCK):
            cols = off + offs
            _, s = _row_values(row_ptr, cols, cols < end, inv_temp)
            acc = tl.maximum(acc, s)
        tl.store(pmax_ptr + row * num_chunks + chunk, tl.max(acc, axis=0))


@triton.jit(do_not_specialize=NOT_SPECIALIZED + ["prev_par", "has_prev", "prev_shift"])
def _draw_kernel(
    logits_ptr, stride_row, vocab, chunk_len, num_chunks, rows, inv_temp_ptr, top_p_ptr,
    min_p_ptr, keys_ptr, pmax_ptr, state_ptr, partial_ptr, prev_par, has_prev, prev_shift,
    val_ptr, idx_ptr, taken_ptr, drawn_ptr, HAS_MAX: tl.constexpr, BUCKETS: tl.constexpr,
    EXACT: tl.constexpr, STRIDE: tl.constexpr, MERGE_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
    TAKEN: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk): resolves the last search digit (the row's threshold), then the
    Gumbel-max of the chunk's kept tokens and its first index (for a greedy row, the chunk's
    maximum), merged per row by `kernels.argmax`'s merge. ``TAKEN``: a row whose unrestricted
    draw stands (``taken_ptr``) hands that draw (``drawn_ptr``) to the merge instead."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if TAKEN:
        if tl.load(taken_ptr + row) != 0:
            first = chunk == 0
            tl.store(val_ptr + row * num_chunks + chunk, tl.where(first, 0.0, float("-inf")))
            drawn = tl.load(drawn_ptr + row).to(tl.int32)
            tl.store(idx_ptr + row * num_chunks + chunk, tl.where(first, drawn, 2147483647))
            return
    greedy, scale, row_max, min_s = _row_setup(
        inv_temp_ptr, min_p_ptr, pmax_ptr, row, num_chunks, HAS_MAX, MERGE_BLOCK
    )
    min_key, base, _, _ = _resolve(
        state_ptr, partial_ptr, row, rows, num_chunks, tl.load(top_p_ptr + row), prev_par,
        has_prev, prev_shift, scale, row_max, MERGE_BLOCK, BUCKETS, EXACT, STRIDE,
    )  # fmt: skip
    threshold = tl.maximum(min_key, base)
    noise_scale = tl.where(greedy, 0.0, 1.0)
    row_key = tl.load(keys_ptr + row).to(tl.uint32)
    row_ptr = logits_ptr + row * stride_row
    start = chunk * chunk_len
    end = tl.minimum(start + chunk_len, vocab)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    idx = tl.full([BLOCK], 2147483647, tl.int32)
    for off in range(start, end, BLOCK):
        cols = off + offs
        best, idx = _draw_block(
            row_ptr, cols, cols < end, scale, threshold, min_s, noise_scale, row_key, best, idx
        )
    top = tl.max(best, axis=0)
    tl.store(val_ptr + row * num_chunks + chunk, top)
    tl.store(idx_ptr + row * num_chunks + chunk, tl.min(tl.where(best == top, idx, 2147483647), 0))


@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def _nucleus_mass_kernel(
    logits_ptr, stride_row, vocab, chunk_len, num_chunks, inv_temp_ptr, top_p_ptr, min_p_ptr,
    pmax_ptr, drawn_ptr, sums_ptr, MERGE_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk), for a row sampling with top-p (no row uses top-k): the chunk's mass
    (``exp(s - row_max)``) of the tokens min-p keeps, and of those among them whose key is above
    the drawn token's, into ``sums [rows, chunks, 2]`` (other rows write zeros)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    greedy, scale, row_max, min_s = _row_setup(
        inv_temp_ptr, min_p_ptr, pmax_ptr, row, num_chunks, True, MERGE_BLOCK
    )
    checks = ~greedy & (tl.load(top_p_ptr + row) < 1.0)
    above = tl.zeros((), tl.float32)
    total = tl.zeros((), tl.float32)
    if checks:
        row_ptr = logits_ptr + row * stride_row
        drawn_key, _ = _row_values(row_ptr, tl.load(drawn_ptr + row), True, scale)
        start = chunk * chunk_len
        end = tl.minimum(start + chunk_len, vocab)
        offs = tl.arange(0, BLOCK)
        acc_above = tl.zeros([BLOCK], tl.float32)
        acc_total = tl.zeros([BLOCK], tl.float32)
        for off in range(start, end, BLOCK):
            cols = off + offs
            key, s = _row_values(row_ptr, cols, cols < end, scale)
            weight = tl.where((cols < end) & (s >= min_s), tl.exp(s - row_max), 0.0)
            acc_total += weight
            acc_above += tl.where(key > drawn_key, weight, 0.0)
        above = tl.sum(acc_above, axis=0)
        total = tl.sum(acc_total, axis=0)
    tl.store(sums_ptr + (row * num_chunks + chunk) * 2, above)
    tl.store(sums_ptr + (row * num_chunks + chunk) * 2 + 1, total)


@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def _take_kernel(
    sums_ptr, num_chunks, inv_temp_ptr, top_p_ptr, taken_ptr, MERGE_BLOCK: tl.constexpr
):  # fmt: skip
    """Program (row), no row using top-k: whether the row's unrestricted draw stands (1) or its
    top-p threshold must be searched (0). It stands for a greedy row, a row without top-p, and a
    top-p row whose drawn token lies in the nucleus: the mass strictly above it is below
    ``top_p`` of min-p's candidates' (`sample_triton` says why that is exact)."""
    row = tl.program_id(0).to(tl.int64)
    above = tl.zeros((), tl.float32)
    total = tl.zeros((), tl.float32)
    for first in range(0, num_chunks, MERGE_BLOCK):
        c = first + tl.arange(0, MERGE_BLOCK)
        at = sums_ptr + (row * num_chunks + c) * 2
        above += tl.sum(tl.load(at, mask=c < num_chunks, other=0.0), axis=0)
        total += tl.sum(tl.load(at + 1, mask=c < num_chunks, other=0.0), axis=0)
    top_p = tl.load(top_p_ptr + row)
    greedy = tl.load(inv_temp_ptr + row) == 0.0
    stands = greedy | (top_p >= 1.0) | (above < top_p * total)
    tl.store(taken_ptr + row, stands.to(tl.int32))


@dataclass(frozen=True)
class Tiles:
    """Launch settings of `sample_triton`; they change only its speed. ``block`` and ``warps``: the
    max and draw passes (streaming); ``search_block`` and ``search_warps``: the weighted digit
    passes (each logit adds to one of ``2**digit_bits`` bucket sums a lane holds:
    ``search_block << digit_bits`` floats a program); ``chunks`` per row, or (None) enough for
    ``programs_per_sm`` programs per SM; ``histogram``: count digits through ``tl.histogram``
    instead of bucket sums (needs ``count_bits`` <= 4); ``digit_bits`` (2 or 4): key bits a
    weighted mass pass finds; ``count_bits`` (1 to 8): key bits a count pass finds (8: top-k in 2
    passes in bf16, 256 counts a program); ``exact_bits`` (0 to 8): the last key bits of a mass
    search found by one counted pass (each bucket then holds one value, so its mass is its count
    times that value's weight: `_resolve`), the bits above by weighted passes (8: top-p in bf16
    with 2 weighted passes and 1 counted; 0: weighted passes only); ``buckets_first``: the bucket
    sums' layout (`_search_kernel`); ``count_block``: the block of the counted passes (their sums
    are counts a program, not a lane, so a wide block costs no registers and keeps more loads in
    flight); ``unroll``: blocks of ``search_block`` a loop iteration of the weighted passes reads
    (more loads in flight, the same bucket sums). Written as
    ``block=2048,warps=8,search_block=256,...,histogram=1`` in the environment variable
    ``RADIXINFER_SAMPLING_TILES`` (any subset), read at import (`TILES`). The defaults are the
    best of a sweep on an H200 (`benchmarks/sweep_sampling.py`), ``count_bits`` and
    ``exact_bits`` not yet swept."""

    block: int = 2048
    warps: int = 8
    search_block: int = 256
    search_warps: int = 8
    programs_per_sm: int = 16
    chunks: int | None = None
    histogram: bool = True
    digit_bits: int = 4
    buckets_first: bool = True
    count_block: int = 2048
    unroll: int = 1
    count_bits: int = 8
    exact_bits: int = 8

    def __post_init__(self) -> None:
        assert self.digit_bits in (2, 4), "4 or 16 buckets (a digit must divide 32 bits)"
        assert 1 <= self.count_bits <= 8 and 0 <= self.exact_bits <= 8, "at most 256 counts"
        assert self.histogram or self.count_bits <= 4, "bucket sums per lane: at most 16"

    @classmethod
    def parse(cls, text: str) -> Tiles:
        """``name=value`` pairs, comma-separated, over the defaults (``chunks=0``: None)."""
        values = dict(item.split("=", 1) for item in text.replace(" ", "").split(",") if item)
        fields = {}
        for name, value in values.items():
            if name not in cls.__dataclass_fields__:
                raise ValueError(f"unknown sampling tile setting {name!r} in {text!r}")
            number = int(value)
            if name in ("histogram", "buckets_first"):
                fields[name] = bool(number)
            else:
                fields[name] = None if name == "chunks" and number == 0 else number
        return cls(**fields)

    def __str__(self) -> str:
        return ",".join(f"{k}={int(v or 0)}" for k, v in self.__dict__.items())

    def num_chunks(self, rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
        """``(chunks, chunk_len)`` of a ``[rows, vocab]`` call: ``chunk_len`` a multiple of both
        blocks, no chunk empty."""
        step = max(self.block, self.search_block * self.unroll, self.count_block)
        chunks = self.chunks or triton.cdiv(self.programs_per_sm * num_sms(device), rows)
        chunks = max(1, min(chunks, triton.cdiv(vocab, step)))
        chunk_len = triton.cdiv(triton.cdiv(vocab, chunks), step) * step
        return triton.cdiv(vocab, chunk_len), chunk_len

    def digits(self, key_bits: int, mass: bool) -> list[tuple[int, int, bool]]:
        """A search's passes over keys whose top ``key_bits`` bits are significant, most
        significant first: ``(shift, bits, counted)``, each finding key bits
        ``[shift, shift + bits)`` below the last. A count search counts ``count_bits`` at a time;
        a mass search weighs ``digit_bits`` at a time until at most ``exact_bits`` remain, then
        counts the rest in one pass (exact masses: each bucket holds one value)."""
        low, top, passes = 32 - key_bits, 32, []
        while top > low:
            if not mass:
                bits, counted = min(self.count_bits, top - low), self.histogram
            elif top - low <= self.exact_bits:
                bits, counted = top - low, True
            else:
                bits, counted = self.digit_bits, False
            top = max(top - bits, 0)
            passes.append((top, bits, counted))
        return passes


TILES = Tiles.parse(os.environ.get("RADIXINFER_SAMPLING_TILES", ""))


def sample_triton(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
    filters: tuple[bool, bool, bool] = (True, True, True),
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Same function as `sample_ref` for ``[rows, vocab]`` logits with unit column stride, with no
    host sync. ``filters``: whether any row may use top-k, top-p, min-p (a launch plan covering
    more filters than the rows use is still exact, only slower; one covering fewer is wrong).

    Each row is cut into chunks, one program each (`Tiles`): a max pass (when top-p or min-p is on),
    one launch per digit of each search (`Tiles.digits`: with the default tiles top-k's count in 2
    passes in bf16, then top-p's mass in 3: 2 weighted and 1 counted), a draw pass and the merge
    of the chunks' draws: 6 launches (5 passes over the logits) for top-p alone in bf16, 4 for
    top-k, 3 for min-p, 2 for temperature alone. Rows without a filter skip its passes (their
    programs return at once).

    Top-p without top-k first draws each row from every token min-p keeps (one draw pass and a
    merge), then weighs, in one more pass, the mass strictly above the drawn token against
    ``top_p`` of the whole (`_nucleus_mass_kernel`, `_take_kernel`). A drawn token inside the
    nucleus is the row's answer: the Gumbel-max over a set is the Gumbel-max over any subset
    holding it, with the same noise, so the tokens are the search's own. It lies inside with
    probability at least ``top_p`` (the nucleus's mass under the distribution it was drawn from),
    so most rows skip the threshold search and the second draw, whose programs return at once for
    them: 3 passes over such a row instead of 5, the draw being the costliest."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    tiles = tiles or TILES
    device = logits.device
    out = torch.empty(rows, dtype=torch.int64, device=device)
    if rows == 0:
        return out
    use_top_k, use_top_p, use_min_p = filters
    chunks, chunk_len = tiles.num_chunks(rows, vocab, device)
    block, search_block, count_block = (
        min(b, triton.next_power_of_2(vocab))
        for b in (tiles.block, tiles.search_block, tiles.count_block)
    )
    has_max = use_top_p or use_min_p
    pmax = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    state = torch.empty(2, rows, 4, dtype=torch.int32, device=device)
    plan = [
        (mass, i == 0, digit)
        for mass in [False] * use_top_k + [True] * use_top_p
        for i, digit in enumerate(tiles.digits(KEY_BITS[logits.dtype], mass))
    ]
    stride = max([1 << bits for _, _, (_, bits, _) in plan], default=1)
    partial = torch.empty(2, rows, chunks, stride, dtype=torch.float32, device=device)
    grid = (rows, chunks)
    common = (logits, logits.stride(0), vocab, chunk_len, chunks)
    if has_max:
        _chunk_max_kernel[grid](
            *common, inv_temperature, top_p, min_p, pmax, BLOCK=block, num_warps=tiles.warps
        )
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    idxs = torch.empty(rows, chunks, dtype=torch.int32, device=device)
    taken = None  # top-p without top-k: which rows' unrestricted draw stands ([rows] int32)
    if use_top_p and not use_top_k:
        _draw_kernel[grid](
            *common, rows, inv_temperature, top_p, min_p, keys, pmax, state, partial, 0, 0, 0,
            vals, idxs, out, out, HAS_MAX=True, BUCKETS=1, EXACT=False, STRIDE=stride,
            MERGE_BLOCK=MERGE_BLOCK, BLOCK=block, TAKEN=False, num_warps=tiles.warps,
        )  # fmt: skip
        _argmax_merge_kernel[(rows,)](
            vals, idxs, out, chunks, BLOCK_C=MERGE_BLOCK, **launch_options(device)
        )
        sums = torch.empty(rows, chunks, 2, dtype=torch.float32, device=device)
        _nucleus_mass_kernel[grid](
            *common, inv_temperature, top_p, min_p, pmax, out, sums,
            MERGE_BLOCK=MERGE_BLOCK, BLOCK=block, num_warps=tiles.warps,
        )  # fmt: skip
        taken = torch.empty(rows, dtype=torch.int32, device=device)
        _take_kernel[(rows,)](sums, chunks, inv_temperature, top_p, taken, MERGE_BLOCK=MERGE_BLOCK)
    taken_arg = out if taken is None else taken  # (a pointer the kernels read only when TAKEN)
    shift, buckets, exact = 0, 1, False  # the previous launch's digit
    for launch, (mass, first, (digit_shift, bits, counted)) in enumerate(plan):
        digit_block, unroll = (count_block, 1) if counted else (search_block, tiles.unroll)
        _search_kernel[grid](
            *common, rows, inv_temperature, top_k, top_p, min_p, pmax, state, partial,
            launch % 2, (launch - 1) % 2, int(launch > 0), int(first), digit_shift, shift,
            taken_arg, MASS=mass, HAS_MAX=has_max, COUNTS=counted, BUCKETS_FIRST=tiles.buckets_first,
            BUCKETS=1 << bits, PREV_BUCKETS=buckets, PREV_EXACT=exact, STRIDE=stride,
            MERGE_BLOCK=MERGE_BLOCK, BLOCK=digit_block, UNROLL=unroll, TAKEN=taken is not None,
            num_warps=tiles.search_warps,
        )  # fmt: skip
        shift, buckets, exact = digit_shift, 1 << bits, mass and counted
    _draw_kernel[grid](
        *common, rows, inv_temperature, top_p, min_p, keys, pmax, state, partial,
        (len(plan) - 1) % 2, int(len(plan) > 0), shift, vals, idxs, taken_arg, out,
        HAS_MAX=has_max, BUCKETS=buckets, EXACT=exact, STRIDE=stride, MERGE_BLOCK=MERGE_BLOCK,
        BLOCK=block, TAKEN=taken is not None, num_warps=tiles.warps,
    )  # fmt: skip
    _argmax_merge_kernel[(rows,)](
        vals, idxs, out, chunks, BLOCK_C=MERGE_BLOCK, **launch_options(device)
    )
    return out
