"""What the scheduler hands the engine for a prefill round: plain values (docs/request-lifecycle.md,
Prefill rounds and In-batch dedup)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from radixinfer.engine.admission import Grant
from radixinfer.engine.request import Request

# A slot entry of `ModelRunner.prefill`: the position's K/V is already stored, write nothing.
STORED = -1


@dataclass
class PrefillItem:
    """One request's share of a prefill pass: positions ``[start, end)`` computed (``slots`` per
    position, `STORED` for one already stored), or nothing computed when the first token comes from
    ``payload`` (an exact repeat) or ``leader`` (an identical prompt computed in the same pass)."""

    req: Request
    start: int
    end: int
    slots: list[int]
    payload: Any = None
    leader: PrefillItem | None = None
    row: int | None = None  # row of its last computed position in the pass's hidden states

    @property
    def computes(self) -> bool:
        return self.end > self.start


@dataclass(frozen=True)
class ReservedChunk:
    """Prompt positions ``[start, end)`` of a request, reserved in the cache: written to ``slots``
    (one per position) after the block ``copies`` run. A request admitted while its cached prefix
    is still loading from the host tier holds one until the loads complete: its positions are
    neither computed nor published until then, so a release publishes only up to ``start``."""

    start: int
    end: int
    slots: list[int]
    copies: list[tuple[int, int]]

    def writes(self, table: list[int], block_size: int) -> tuple[list[int], list[int]]:
        """The blocks of ``table`` (its owner's) that the chunk's forward writes, and the first
        slot of each it writes (`KVCacheManager.note_in_place_writes`'s arguments). A copied
        boundary block counts from slot 0: even its first slots arrive only with the copy."""
        blocks = table[self.start // block_size : (self.end - 1) // block_size + 1]
        first = 0 if self.copies else self.start % block_size
        return blocks, [first] + [0] * (len(blocks) - 1)


@dataclass
class PrefillPass:
    """One prefill forward: its items, the block copies to run before it, and the first item
    computing each full prompt, its leader (identical prompts of the pass take their first token
    from its row)."""

    items: list[PrefillItem] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    leaders: dict[tuple[Hashable, bytes], PrefillItem] = field(default_factory=dict)

    def ragged_inputs(self, computed: list[PrefillItem]) -> tuple[np.ndarray, ...]:
        """`ModelRunner.prefill`'s arguments for the ``computed`` items, concatenated without
        padding: ``(input_ids, positions, slots, tables, context_lens, query_lens)``. Sets each
        item's ``row``."""
        lengths = np.array([it.end - it.start for it in computed], dtype=np.int64)
        ends = np.cumsum(lengths)
        for it, end in zip(computed, ends.tolist()):
            it.row = end - 1
        # a row's position: the row plus (its item's start - its item's first row)
        starts = np.array([it.start for it in computed], dtype=np.int64)
        positions = np.arange(int(ends[-1])) + np.repeat(starts - (ends - lengths), lengths)
        input_ids = np.concatenate([it.req.token_array()[it.start : it.end] for it in computed])
        slots = list(itertools.chain.from_iterable([it.slots for it in computed]))
        return (
            input_ids,
            positions,
            slots,
            [it.req.seq.table for it in computed],
            [it.end for it in computed],
            lengths.tolist(),
        )

    @staticmethod
    def last_hidden(finishing: list[PrefillItem], hidden: torch.Tensor | None) -> torch.Tensor:
        """The final hidden state of each finishing item's prompt ``[len(finishing), hidden]``: its
        payload, or its own (or its leader's) last row of the pass's ``hidden``."""
        rows = []
        for it in finishing:
            if it.payload is not None:
                rows.append(it.payload[None])
            else:
                source = it.leader if it.leader is not None else it
                rows.append(hidden[source.row : source.row + 1])
        return torch.cat(rows)


class PrefillPlan(NamedTuple):
    """A prefill round: its first pass, and the grants deferred to a second pass right after it
    (they would copy a block the first pass is still writing). A tuple: one is built every step."""

    first: PrefillPass
    deferred: list[Grant[Request]]
