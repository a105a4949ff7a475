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
Triton kernel searches the key one 4-bit digit per pass over the row (16 buckets' counts or masses
per pass; the largest bucket whose suffix still meets the target wins), so a bf16 row needs 4 passes
and a float32 row 8, instead of a sort. The result is exact: the kernel keeps the same tokens as the
sorting reference (`sample_ref`) up to float rounding of the top-p masses, and with the same noise
draws the same token.

Performance: one program per row, each pass streaming the row (300 KB in bf16 at a 152k
vocabulary); passes run only for the filters a row uses (min-p and top-p need the row maximum, top-k
the count search, top-p the mass search, every row the final sampling pass).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MIX = 0x45D9F3B
DIGIT_BITS = 4  # bits of the threshold key found per pass: 16 buckets
BLOCK = 512  # logits a program holds per iteration (16 bucket sums each in the searches)
# significant high bits of a float32 key per logit dtype (its float32 value's low bits are zero)
KEY_BITS = {torch.bfloat16: 16, torch.float16: 19, torch.float32: 32}


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
def _key_search(
    row_ptr, vocab, scale, row_max, min_key, min_s, fraction, MASS: tl.constexpr,
    PASSES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The largest key ``K`` (a multiple of ``2**(32 - 4 * PASSES)``) such that the tokens with key
    ``>= K`` (among those with key ``>= min_key`` and scaled logit ``>= min_s``) number at least
    ``fraction`` (count search), or hold at least ``fraction`` of their mass (``MASS``). One pass
    per 4-bit digit, most significant first: each pass sums the candidates of the 16 buckets of the
    current window and keeps the largest bucket whose suffix, plus what lies above the window, still
    meets the target."""
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
            valid = cols < vocab
            key, s = _row_values(row_ptr, cols, valid, scale)
            inside = valid & (key >= base) & (key >= min_key) & (s >= min_s)
            if MASS:
                weight = tl.where(inside, tl.exp(s - row_max), 0.0)
            else:
                weight = tl.where(inside, 1.0, 0.0)
            digit = ((key - base) >> shift).to(tl.int32)  # 0..15 inside the window, larger above
            hit = digit[:, None] == buckets[None, :]
            acc += tl.where(hit, weight[:, None], 0.0)
        hist = tl.sum(acc, axis=0)
        total = tl.sum(hist, axis=0)
        if MASS and i == 0:
            target = fraction * total  # the first window covers every key
        suffix = total - tl.cumsum(hist, axis=0) + hist
        best = tl.max(tl.where(above + suffix >= target, buckets, 0), axis=0)
        above += tl.sum(tl.where(buckets > best, hist, 0.0), axis=0)
        base += best.to(tl.uint32) << shift
    return base


@triton.jit
def _sample_kernel(
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
        valid = cols < vocab
        key, s = _row_values(row_ptr, cols, valid, scale)
        keep = valid & (key >= threshold) & (s >= min_s)
        v = tl.where(keep, s + noise_scale * _gumbel(row_key, cols), float("-inf"))
        take = ((v > best) | ((v == best) & (cols < best_idx))) & valid
        best = tl.where(take, v, best)
        best_idx = tl.where(take, cols, best_idx)
    top = tl.max(best, axis=0)
    tl.store(
        out_ptr + row, tl.min(tl.where(best == top, best_idx, 2147483647), axis=0).to(tl.int64)
    )


def sample_triton(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
    block: int = BLOCK,
    num_warps: int = 8,
) -> torch.Tensor:
    """Same function as `sample_ref` for ``[rows, vocab]`` logits with unit column stride, in one
    launch with no host sync (CUDA-graph capturable). ``block`` (a power of two) and ``num_warps``
    only change the speed."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    passes = triton.cdiv(KEY_BITS[logits.dtype], DIGIT_BITS)
    block = min(block, triton.next_power_of_2(vocab))
    _sample_kernel[(rows,)](
        logits, logits.stride(0), vocab, inv_temperature, top_k, top_p, min_p, keys, out,
        PASSES=passes, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return out
