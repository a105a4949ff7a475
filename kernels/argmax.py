"""Row-wise argmax of the logits, the greedy sampler's one reduction.

torch's argmax reduces each row of ``[batch, vocab]`` logits in one block: at batch 512 and a 152k vocabulary
that reads 155 MB at ~1.6 TB/s (98 us per decode step on an H200, 4% of qwen2.5-0.5b's step). Here each row
is cut into ``chunks`` ranges read by separate programs (two-stage: partial maxima, then a merge per row), so
a batch of any size keeps many programs per SM streaming: 58-60 us there with 4 to 8 chunks a row (swept:
BLOCK 1,024-4,096, 1-8 chunks, 4 or 8 warps; `benchmarks/bench_kernels.py` has the comparison). Ties go
to the lowest index, as in torch; rows are assumed free of NaN (torch would return a NaN's index).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device import num_sms
from kernels.pdl import launch_options, let_next_kernel_start, wait_for_inputs

BLOCK = 2048  # logits a program holds per iteration
PROGRAMS_PER_SM = 16
# Chunk results a program merges per iteration, fixed so that one compiled kernel serves every batch size:
# the chunk count follows the rows, and a width that followed it (its next power of two, as a constexpr)
# compiled every kernel again for each new class of batch sizes, a stall of a fraction of a second each time
# in the middle of serving. Likewise no kernel of a row count specializes an integer argument that follows it
# (Triton compiles a variant for an int equal to 1 and one for a multiple of 16): see ``do_not_specialize``.
MERGE_BLOCK = 16


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> [rows] int64
    return logits.argmax(dim=-1)


@triton.jit(do_not_specialize=["num_chunks"])
def _argmax_partial_kernel(
    x_ptr, val_ptr, idx_ptr, stride_row, vocab, chunk_len, num_chunks, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk): the maximum of positions ``[chunk * chunk_len, (chunk + 1) * chunk_len)`` and its
    first index. Each lane keeps its own best (strictly greater replaces, so a lane keeps its first
    occurrence, lanes visiting increasing positions), then the lanes reduce to the lowest index of the max."""
    let_next_kernel_start(USE_PDL)
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    start = chunk * chunk_len
    end = tl.minimum(start + chunk_len, vocab)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    for off in range(start, end, BLOCK):
        cols = off + offs
        x = tl.load(x_ptr + row * stride_row + cols, mask=cols < end, other=float("-inf")).to(
            tl.float32
        )
        # strictly greater replaces; an equal value only from an earlier position (so a row of -inf still
        # names its first index), never from past the chunk's end
        take = ((x > best) | ((x == best) & (cols < best_idx))) & (cols < end)
        best = tl.where(take, x, best)
        best_idx = tl.where(take, cols, best_idx)
    top = tl.max(best, 0)
    tl.store(val_ptr + row * num_chunks + chunk, top)
    tl.store(
        idx_ptr + row * num_chunks + chunk, tl.min(tl.where(best == top, best_idx, 2147483647), 0)
    )


@triton.jit(do_not_specialize=["num_chunks"])
def _argmax_merge_kernel(
    val_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr
):
    """Program (row): the chunk with the largest maximum, the earliest among equals (chunks are in order),
    ``BLOCK_C`` chunks an iteration."""
    let_next_kernel_start(USE_PDL)
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 2147483647, tl.int32)
    for first in range(0, num_chunks, BLOCK_C):
        c = first + tl.arange(0, BLOCK_C)
        mask = c < num_chunks
        vals = tl.load(val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
        idxs = tl.load(idx_ptr + row * num_chunks + c, mask=mask, other=2147483647)
        top = tl.max(vals, 0)
        take = (top > best) | (first == 0)  # a later block only with a strictly larger maximum
        best_idx = tl.where(take, tl.min(tl.where(vals == top, idxs, 2147483647), 0), best_idx)
        best = tl.maximum(best, top)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


def argmax_triton(logits: torch.Tensor, chunks: int | None = None) -> torch.Tensor:
    """Same function as `argmax_ref` for a 2-D ``[rows, vocab]`` tensor with unit column stride, in two
    launches and no host sync (CUDA-graph capturable). ``chunks`` (None: enough for `PROGRAMS_PER_SM` programs
    per SM) only changes the speed."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if chunks is None:
        chunks = triton.cdiv(PROGRAMS_PER_SM * num_sms(logits.device), rows)
    chunks = max(1, min(chunks, triton.cdiv(vocab, BLOCK)))
    chunk_len = triton.cdiv(triton.cdiv(vocab, chunks), BLOCK) * BLOCK
    chunks = triton.cdiv(vocab, chunk_len)  # none empty
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    _argmax_partial_kernel[(rows, chunks)](
        logits, vals, idxs, logits.stride(0), vocab, chunk_len, chunks, BLOCK=BLOCK, num_warps=8,
        **launch_options(logits.device),
    )  # fmt: skip
    _argmax_merge_kernel[(rows,)](
        vals, idxs, out, chunks, BLOCK_C=MERGE_BLOCK, **launch_options(logits.device)
    )
    return out
