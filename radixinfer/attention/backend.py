"""The attention backend interface, the planner of a backend's per-step work lists, and the
per-forward context the model layers call into."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from kernels.rotary import Rotary
from radixinfer.attention.metadata import AttentionMetadata


class AttentionPlanner(Protocol):
    """Plans on the host what a backend's kernels read beside the block tables: the extend kernel's
    work list (`AttentionMetadata.extend_work`) and decode's shared-prefix tiles
    (`AttentionMetadata.shared_prefix`), written into arrays the runner owns and uploads with the rest
    of a step's inputs.

    Capacities are fixed when the runner is built (`extend_work_capacity`, `max_shared_prefix_tiles`)
    and every plan fits them, so a CUDA graph captured at a capacity serves every step. A backend that
    reads neither plans nothing: capacity 0, no tiles, every plan returns 0.
    """

    # sequences per shared-prefix tile (0: decode reads every prefix per sequence)
    seqs_per_tile: int
    # positions: sequences sharing fewer than this are never tiled (the worst-case decode step the
    # runner profiles shares twice this)
    min_shared_len: int

    def extend_work_capacity(self, max_tokens: int, max_seqs: int) -> int:
        """Work items the largest prefill pass of ``max_tokens`` over ``max_seqs`` sequences needs."""
        ...

    def plan_extend_work(
        self,
        query_lens: np.ndarray,  # [num_seqs] new tokens per sequence
        context_lens: np.ndarray,  # [num_seqs] positions per sequence, new tokens included
        work: np.ndarray,  # out: [2, capacity] int32
    ) -> int:
        """Fill ``work`` for a prefill pass (items past the plan idle); returns the items planned."""
        ...

    def max_shared_prefix_tiles(self, num_seqs: int) -> int:
        """The most tiles `plan_shared_prefixes` lays out for ``num_seqs`` sequences (the grid a
        captured graph reads; 0: never any)."""
        ...

    def plan_shared_prefixes(
        self,
        tables: np.ndarray,  # [>= n, width] int32 block tables, rows 0..n-1 are the batch
        context_lens: np.ndarray,  # [n]
        tile_seqs: np.ndarray,  # out: [max_shared_prefix_tiles(n) or more, seqs_per_tile] int32
        tile_lens: np.ndarray,  # out: [the same number of tiles] int32
        kv_starts: np.ndarray,  # out: [n] int32
    ) -> int:
        """Fill the tile arrays for a decode batch; returns the tiles used (0: decode reads every
        prefix per sequence this step)."""
        ...


class AttentionBackend(Protocol):
    """Stores new K/V into paged slots and computes attention of the new tokens over the cache.

    ``k_cache``/``v_cache`` are one layer's pages: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    `planner` gives the host-side planner of the metadata this backend's attention reads beyond the
    block tables, for one model's head layout; the runner asks it every step.
    """

    def planner(
        self, block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
    ) -> AttentionPlanner: ...

    def store_and_attend(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        cos: torch.Tensor | None = None,  # [num_tokens, head_dim // 2]
        sin: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write K and V into their slots (``meta.slot_mapping``, -1 = skip), then attend every new
        token over the cache: the result of storing the whole batch before any token attends. Where
        ``meta.new_slots_private`` (the engine's decode steps: no sequence reads a slot another one
        writes in the same step) a backend may instead store each sequence's K/V right before that
        sequence attends (the Triton backend does, in one launch). A prefill pass never allows it,
        even at one new token a sequence: in-batch dedup reads the pass's other new tokens.

        Given ``cos``/``sin``, rotary embedding first: q and k rotated (k on its way to the cache).
        ``k`` and ``v`` are only read; q, k and v may be views into one fused qkv projection. q's
        contents afterwards are unspecified (rotated in place, or left as they were): nothing may
        read q after this."""
        ...


class KernelBackend:
    """An `AttentionBackend` made of two functions of `kernels/`: `store` (`store_kv_ref`'s
    arguments: rotary and the store in one call) and `attention` (`paged_attention_ref`'s
    arguments, read from the metadata, then the keyword arguments `attention_options` gives),
    which `store_and_attend` runs one after the other. Subclasses set `name` and both functions
    (as static methods), and write `planner`; one that can fuse the two overrides
    `store_and_attend`."""

    name: ClassVar[str]
    store: Callable[..., None]
    attention: Callable[..., torch.Tensor]

    def planner(
        self, block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
    ) -> AttentionPlanner:
        raise NotImplementedError

    def attention_options(self, meta: AttentionMetadata) -> dict[str, Any]:
        """What `attention` reads of the metadata beyond the reference's arguments: nothing here."""
        return {}

    def store_and_attend(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`store` for the whole batch (q rotated in place), then `attend`."""
        rotary = Rotary(q, cos, sin) if cos is not None else None
        self.store(k_cache, v_cache, k, v, meta.slot_mapping, rotary)
        return self.attend(q, k_cache, v_cache, meta, scale)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return self.attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.query_start_loc,
            meta.max_query_len,
            meta.max_context_len,
            scale,
            **self.attention_options(meta),
        )


@dataclass(frozen=True)
class ForwardContext:
    """Everything an attention layer needs for one forward, built once per step (nano-vllm's pattern).

    ``k_cache``/``v_cache`` are the whole pool: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    meta: AttentionMetadata
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    backend: AttentionBackend

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store this layer's new K/V, then attend over the cache (`AttentionBackend.store_and_attend`).
        Returns ``[num_tokens, num_heads, head_dim]``. Given ``cos``/``sin`` (``[num_tokens, head_dim //
        2]``), q and k are rotated first, in the store's launch or, at a decode step on the Triton backend, in
        the attention's; q must not be read afterwards (it may or may not be rotated in place).

        The result is that of storing for the whole batch before attending, which is what lets a request
        read, in the same forward, prefix K/V that another request of the batch is computing (in-batch
        prefix sharing, at prefill).
        """
        k_layer, v_layer = self.k_cache[layer], self.v_cache[layer]
        return self.backend.store_and_attend(k_layer, v_layer, q, k, v, self.meta, scale, cos, sin)
