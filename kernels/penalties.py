"""Repetition, presence and frequency penalties applied in place to chosen rows of a batch's logits,
reading each row's token counts from rows of persistent count tensors.

vLLM's semantics: a token seen in the prompt (``prompt_seen``) or the output (``output_counts > 0``)
has a positive logit divided by the row's repetition penalty and a negative one multiplied by it;
then ``frequency`` times its output count and ``presence`` once if it occurs in the output are
subtracted. The arithmetic is float32; the result is stored in the logits' dtype. Each count row
has its request's three penalties in a row of ``penalties`` ``[rows, 3]`` float32 (repetition,
presence, frequency), so a step passes only which batch row reads which count row. `count_tokens`
adds a step's sampled tokens to the counts.

Performance: the Triton kernels are one launch each, with no host work besides. The penalty kernel
reads each penalised row's logits, counts and prompt marks once and writes the logits in place once
(no ``[rows, vocab]`` temporaries); the reference builds several.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


def penalize_ref(
    logits: torch.Tensor,
    positions: torch.Tensor,
    count_rows: torch.Tensor,
    prompt_seen: torch.Tensor,
    output_counts: torch.Tensor,
    penalties: torch.Tensor,
) -> None:
    """Penalise rows ``positions [n]`` of ``logits [batch, vocab]`` in place, row ``positions[i]``
    with row ``count_rows[i]`` of ``prompt_seen`` (bool) and ``output_counts`` (int32)
    ``[rows, vocab]`` and of ``penalties`` ``[rows, 3]`` float32."""
    repetition, presence, frequency = penalties[count_rows].unbind(1)
    x = logits[positions].float()
    counts = output_counts[count_rows]
    in_output = counts > 0
    rep = repetition[:, None]
    penalised = torch.where(x > 0, x / rep, x * rep)
    x = torch.where(prompt_seen[count_rows] | in_output, penalised, x)
    x = x - frequency[:, None] * counts - presence[:, None] * in_output
    logits[positions] = x.to(logits.dtype)


@triton.jit
def _penalize_kernel(
    logits_ptr, stride_logits, positions_ptr, count_rows_ptr, seen_ptr, counts_ptr,
    stride_counts, penalties_ptr, vocab, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (i, block): columns ``[block * BLOCK, (block + 1) * BLOCK)`` of penalised row i, in
    place."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    row = tl.load(positions_ptr + i).to(tl.int64)
    count_row = tl.load(count_rows_ptr + i).to(tl.int64)
    rep = tl.load(penalties_ptr + count_row * 3)
    presence = tl.load(penalties_ptr + count_row * 3 + 1)
    frequency = tl.load(penalties_ptr + count_row * 3 + 2)
    x = tl.load(logits_ptr + row * stride_logits + cols, mask=valid, other=0.0)
    xf = x.to(tl.float32)
    counts = tl.load(counts_ptr + count_row * stride_counts + cols, mask=valid, other=0)
    seen = tl.load(seen_ptr + count_row * stride_counts + cols, mask=valid, other=0) != 0
    in_output = counts > 0
    penalised = tl.where(xf > 0, xf / rep, xf * rep)
    xf = tl.where(seen | in_output, penalised, xf)
    xf = xf - frequency * counts.to(tl.float32) - tl.where(in_output, presence, 0.0)
    tl.store(logits_ptr + row * stride_logits + cols, xf.to(x.dtype), mask=valid)


def penalize_triton(
    logits: torch.Tensor,
    positions: torch.Tensor,
    count_rows: torch.Tensor,
    prompt_seen: torch.Tensor,
    output_counts: torch.Tensor,
    penalties: torch.Tensor,
) -> None:
    """Same function as `penalize_ref` (up to float32 division rounding), one launch; ``logits``
    with unit column stride, the other tensors contiguous."""
    assert logits.stride(1) == 1
    n = positions.shape[0]
    vocab = logits.shape[1]
    if n == 0:
        return
    block = min(BLOCK, triton.next_power_of_2(vocab))
    _penalize_kernel[(n, triton.cdiv(vocab, block))](
        logits, logits.stride(0), positions, count_rows, prompt_seen.view(torch.uint8),
        output_counts, output_counts.stride(0), penalties, vocab, BLOCK=block, num_warps=8,
    )  # fmt: skip


def count_tokens_ref(
    output_counts: torch.Tensor, count_rows: torch.Tensor, tokens: torch.Tensor
) -> None:
    """Add one to ``output_counts[count_rows[i], tokens[i]]`` for each ``i`` (``[n]`` int64 each;
    a pair may repeat): one scatter-add into the flattened counts (an accumulating ``index_put_``
    sorts its indices first, and in older torch reads their range back to the host)."""
    flat = count_rows * output_counts.shape[1] + tokens
    output_counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=output_counts.dtype))


# entries a program of the count kernel adds: fixed, as a block that followed the batch compiled the
# kernel again for each power of two of it (a stall mid-run)
COUNT_BLOCK = 1024


@triton.jit(do_not_specialize=["n"])  # one compiled kernel for any number of entries
def _count_kernel(counts_ptr, stride_counts, count_rows_ptr, tokens_ptr, n, BLOCK: tl.constexpr):
    """Program: entries ``[pid * BLOCK, (pid + 1) * BLOCK)``, each one atomic add."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    row = tl.load(count_rows_ptr + i, mask=valid, other=0).to(tl.int64)
    token = tl.load(tokens_ptr + i, mask=valid, other=0).to(tl.int64)
    tl.atomic_add(counts_ptr + row * stride_counts + token, 1, mask=valid)


def count_tokens_triton(
    output_counts: torch.Tensor, count_rows: torch.Tensor, tokens: torch.Tensor
) -> None:
    """Same function as `count_tokens_ref`, one launch (the reference's index arithmetic is three
    launches more); ``count_rows`` and ``tokens`` of any integer dtype."""
    n = count_rows.shape[0]
    if n == 0:
        return
    _count_kernel[(triton.cdiv(n, COUNT_BLOCK),)](
        output_counts, output_counts.stride(0), count_rows, tokens, n, BLOCK=COUNT_BLOCK
    )
