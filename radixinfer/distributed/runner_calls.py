"""The step plans rank 0 sends its workers: one small value per runner call, so that every rank
makes the same call on its own shard.

Rank 0's runner calls are mirrored one for one (`TensorParallelRunner`): each carries the call's
host arguments, and the block copies rank 0 made since the previous call (a step's copy-on-writes,
done before its forward on every rank). Device tensors a call takes from rank 0's
own device memory (the tokens sampled by the previous step, the hidden rows the output projection
reads) follow the plan on the device group.

Decode block tables travel as changes (`DecodeTableSender` / `DecodeTableReceiver`): a table
already sent is named by a key, and its entries are sent again only for the rows the engine says
may have changed, so a steady decode step sends a few rows' entries, not every table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PrefillCall:
    """`ModelRunner.prefill`'s arguments."""

    copies: list[tuple[int, int]]
    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    tables: list[list[int]]
    context_lens: np.ndarray
    query_lens: np.ndarray


@dataclass(frozen=True)
class DecodeCall:
    """`ModelRunner.decode`'s arguments; the tables as `DecodeTableSender` encodes them and the
    carried tokens as their count and dtype (they follow on the device group), ``num_carried`` 0
    when there are none."""

    copies: list[tuple[int, int]]
    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    table_keys: list[int]
    table_entries: dict[int, list[int]]
    context_lens: np.ndarray
    num_carried: int
    carried_dtype: torch.dtype | None
    carried_rows: list[int] | None
    changed_tables: list[int] | None


@dataclass(frozen=True)
class LogitsCall:
    """`ModelRunner.logits` of ``num_rows`` hidden rows (which follow on the device group)."""

    copies: list[tuple[int, int]]
    num_rows: int


@dataclass(frozen=True)
class StopCall:
    """Leave the step loop: the engine is closing."""


RunnerCall = PrefillCall | DecodeCall | LogitsCall | StopCall


def as_array(values: Sequence[int]) -> np.ndarray:
    """``values`` as an int64 array (pickles as one buffer, not an object per int)."""
    return np.asarray(values, dtype=np.int64)


class DecodeTableSender:
    """Rank 0's side: what each worker holds of the decode tables.

    Keyed by the identity of the sequence's own table list (the engine hands the same list every
    step); the lists sent are kept alive until they leave the batch, so a key is never reused for
    another table while a worker holds it."""

    def __init__(self) -> None:
        self._sent: dict[int, list[int]] = {}  # key -> the table list, as of the last plan

    def encode(
        self, tables: Sequence[list[int]], changed: Sequence[int] | None
    ) -> tuple[list[int], dict[int, list[int]]]:
        """``(keys, entries)``: a key per table, and the entries of every table the workers do
        not hold or that may have changed (`ModelRunner.decode`'s ``changed_tables``; None: any)."""
        keys = [id(table) for table in tables]
        may_change = range(len(tables)) if changed is None else changed
        entries = {keys[i]: list(tables[i]) for i in may_change}
        for key, table in zip(keys, tables):
            if key not in self._sent:
                entries[key] = list(table)
        self._sent = dict(zip(keys, tables))
        return keys, entries


class DecodeTableReceiver:
    """A worker's side: one list per table key, kept across steps and updated in place, so its
    runner sees the same table objects step after step (`BlockTableRows` keys on them) exactly as
    rank 0's runner does."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}

    def decode(self, keys: list[int], entries: dict[int, list[int]]) -> list[list[int]]:
        tables: dict[int, list[int]] = {}
        for key in keys:
            table = self._tables.get(key)
            if key in entries:
                if table is None:
                    table = []
                table[:] = entries[key]
            tables[key] = table
        self._tables = tables
        return [tables[key] for key in keys]
