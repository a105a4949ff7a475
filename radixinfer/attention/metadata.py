"""Per-forward attention metadata for a ragged batch over the paged KV cache.

One `AttentionMetadata` is built once per forward (prefill round or decode step) and read by every
attention layer; models never see block tables or slot arithmetic themselves.

Layout of sequence ``b`` in a batch (``block_size = 4``; ``P`` = cached prefix, ``N`` = new tokens)::

    positions      0 1 2 3 | 4 5 6 7 | 8 9
    block table    [  17   ,    3    ,  42 ...]      block_tables[b] (padded past the end)
    tokens         P P P P   P P N N   N N           prefix_len = 6, query_len = 4, context_len = 10

The new tokens of ``b`` are rows ``query_start_loc[b] : query_start_loc[b + 1]`` of ``q``; token ``i`` of them
sits at position ``prefix_len + i`` and attends to positions ``0 .. prefix_len + i`` of its own path, all read
from the cache (its own K/V is stored first, so a token whose slot is ``-1`` reads the identical K/V a
previous sequence of the same prefix stored there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_attention import SharedPrefixTiles


@dataclass(frozen=True)
class AttentionMetadata:
    """Tensors live on the model's device; the ints are host-side launch bounds.

    Invariants: ``query_start_loc[-1] == slot_mapping.numel() == num_tokens``; for every sequence
    ``1 <= query_len <= context_len``; ``block_tables[b, p // block_size]`` is valid for ``p < context_len[b]``.
    """

    slot_mapping: (
        torch.Tensor
    )  # [num_tokens] int64; slot to store each new token's K/V in, -1 = don't store
    # [num_seqs, max_blocks_per_seq] int32; entries past a sequence's end are 0 up to the batch's longest table
    # (beyond it they may be stale: nothing reads them)
    block_tables: torch.Tensor
    context_lens: (
        torch.Tensor
    )  # [num_seqs] int32; KV positions each sequence attends over, new tokens included
    query_start_loc: (
        torch.Tensor
    )  # [num_seqs + 1] int32; cumulative new-token counts (cu_seqlens_q)
    max_query_len: int
    max_context_len: int
    # decode only: sequences whose shared prefix the Triton backend reads once per tile (None: no grouping;
    # an optimisation of the same function, which backends without it ignore)
    shared_prefix: SharedPrefixTiles | None = None
    # prefill on the Triton backend: the extend kernel's work items, [2, capacity] int32 from
    # `plan_extend_work` (its capacity, not the batch's split, sets the grid; other backends ignore it)
    extend_work: torch.Tensor | None = None
    # True for the engine's decode steps: no sequence reads another's new slot in this forward (a new
    # token's slot is in its sequence's own block; copy-on-write ran before). Then a backend may store each
    # sequence's K/V just before that sequence attends instead of the whole batch's first (the Triton
    # decode kernel does). False for prefill passes, even with one new token a sequence: in-batch dedup
    # lets a sequence read positions another sequence of the pass is computing.
    new_slots_private: bool = False

    @property
    def num_seqs(self) -> int:
        return self.context_lens.numel()

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one new token (the decode kernel's shape)."""
        return self.max_query_len == 1

    @property
    def query_lens(self) -> torch.Tensor:  # [num_seqs] int32
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def prefix_lens(
        self,
    ) -> torch.Tensor:  # [num_seqs] int32; cached positions before the new tokens
        return self.context_lens - self.query_lens
