"""The engine's options (`EngineConfig`) and its monotonic counters, with the rules for counting
prompt tokens (`EngineCounters`), and the stats dict they make with the cache's (`cache_stats`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixinfer.cache.host_tier import HostCounters
from radixinfer.engine.admission import AdmissionConfig

if TYPE_CHECKING:
    from radixinfer.cache.kv_manager import KVCacheManager
    from radixinfer.engine.prefill_plan import PrefillItem
    from radixinfer.engine.request import Request


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 64  # sequences decoded in one step
    # Requests holding KV at once (prefilled + decoding). None: bounded only by KV memory and the
    # per-round prefill batch, so a request's first token never waits for a decode slot (its later
    # ones may).
    max_num_seqs: int | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    decode_first: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 or None, got {self.max_num_seqs}")


@dataclass
class EngineCounters:
    """Engine counters. Taken at a request's successful admission, never at a failed attempt, so
    once no prompt is part-way through prefill
    ``prompt_tokens == cached_tokens + computed_prompt_tokens`` (a prompt aborted part-way counts
    only what was read or computed; one preempted before its first token counts afresh at its next
    admission)."""

    prompt_tokens: int = 0  # prompt tokens of admitted requests (counted once per request)
    cached_tokens: int = 0  # of those, read from the prefix cache (`Request.num_cached_tokens`)
    # Of those, loaded back from the host tier first. Equals the host tier's ``loaded_tokens``
    # (`HostCounters`: a load is made only for a request admitted in that step) but for loads no
    # hit counts: a preempted request is admitted (and may load) again, and its hits count at one
    # admission only; one aborted or preempted while it waits for its loads counts none; and a
    # prompt loaded whole computes its last position again (for fresh logits), not a hit.
    host_hit_tokens: int = 0
    computed_prompt_tokens: int = 0  # of those, run through prefill forwards
    recomputed_tokens: int = 0  # rows computed again after a preemption (prompt and generated)
    prefill_forwards: int = 0
    decode_forwards: int = 0
    # what those decode forwards had to read at the least (`radixinfer.engine.decode_bytes`)
    decode_read_bytes: int = 0
    preemptions: int = 0

    def count_admission(self, req: Request, num_cached_tokens: int, num_loaded: int = 0) -> None:
        """A request's first successful admission: what it reads from the cache is final
        (``num_loaded`` of it loaded back from the host tier)."""
        req.num_cached_tokens = num_cached_tokens
        req.num_host_hit_tokens = num_loaded
        self.prompt_tokens += len(req.prompt_ids)
        self.cached_tokens += num_cached_tokens
        self.host_hit_tokens += num_loaded

    def count_computed(self, items: Iterable[PrefillItem]) -> None:
        """The rows a prefill forward computed for ``items``: prompt tokens, or recomputed rows for
        a request resumed after a preemption (its prompt was counted once already)."""
        for it in items:
            rows = it.end - it.start
            if it.req.num_sampled:
                self.recomputed_tokens += rows
            else:
                it.req.num_computed_prompt_tokens += rows
                self.computed_prompt_tokens += rows

    def count_preemption(self, req: Request) -> None:
        """A preempted request. One preempted before its first token is admitted afresh later, so
        its prompt's counts are taken back (what it computed becomes recomputed work); one that
        never had a pass planned (it waited for loads) counted nothing yet."""
        self.preemptions += 1
        if req.num_sampled or req.num_cached_tokens is None:
            return
        self.prompt_tokens -= len(req.prompt_ids)
        self.cached_tokens -= req.num_cached_tokens
        self.host_hit_tokens -= req.num_host_hit_tokens
        self.computed_prompt_tokens -= req.num_computed_prompt_tokens
        self.recomputed_tokens += req.num_computed_prompt_tokens
        req.num_cached_tokens, req.num_computed_prompt_tokens = None, 0
        req.num_host_hit_tokens = 0

    def count_abort(self, req: Request) -> None:
        """A request aborted while it holds KV. If its prompt was part-way through prefill, the
        part never read or computed is taken back from ``prompt_tokens``."""
        if req.num_cached_tokens is not None:
            self.prompt_tokens -= (
                len(req.prompt_ids) - req.num_cached_tokens - req.num_computed_prompt_tokens
            )


def cache_stats(
    counters: EngineCounters, cache: KVCacheManager, loads: dict[str, float | int]
) -> dict[str, float | int]:
    """`LLMEngine.cache_stats`: the engine's ``counters``, the pools' state in ``cache`` and the
    host tier's ``loads`` (`HostKVPool.load_stats`)."""
    c = counters
    host = cache.host
    host_counters = host.counters if host is not None else HostCounters()
    return {
        "prompt_tokens": c.prompt_tokens,
        "cached_tokens": c.cached_tokens,
        "hit_rate": c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        "gpu_hit_tokens": c.cached_tokens - c.host_hit_tokens,
        "host_hit_tokens": c.host_hit_tokens,
        "loaded_tokens": host_counters.loaded_tokens,
        "offloaded_tokens": host_counters.offloaded_tokens,
        "written_through_tokens": host_counters.written_through_tokens,
        "evicted_to_copy_tokens": host_counters.evicted_to_copy_tokens,
        **loads,
        "host_free_blocks": host.pool.num_free if host is not None else 0,
        "host_total_blocks": host.num_blocks if host is not None else 0,
        "computed_prompt_tokens": c.computed_prompt_tokens,
        "recomputed_tokens": c.recomputed_tokens,
        "cow_copies": cache.counters.cow_copies,
        "evicted_blocks": cache.tree.counters.evicted_blocks,
        "free_blocks": cache.num_free_blocks,
        "total_blocks": cache.num_blocks,
        "preemptions": c.preemptions,
        "prefill_forwards": c.prefill_forwards,
        "decode_forwards": c.decode_forwards,
        "decode_read_bytes": c.decode_read_bytes,
    }
