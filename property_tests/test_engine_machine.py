"""Random request traffic through the whole engine (tiny model, CPU) in pools small enough that
admission, eviction, chunked prefill and preemption fight over every block; half the engines have a
host KV tier of 8 blocks under the pool, so eviction writes back, admission loads back, and both can
fail.

Rules submit requests (prompts built from earlier prompts' prefixes, so partial hits, exact repeats and
multi-turn continuations are common), abort them, and step the engine. After every rule:

* the cache's invariants hold for the live sequences (`KVCacheManager.check_integrity`);
* accounting is honest: a request whose prompt is complete read ``num_cached_tokens`` from the cache and
  computed the rest, ``num_cached_tokens + num_computed_prompt_tokens == len(prompt)``; in total,
  ``prompt_tokens == cached_tokens + computed_prompt_tokens`` once no prompt is part-way.

At the end every request still open must finish within a bounded number of steps (no livelock: each one
fits the pool alone, as `add_request` checks), and after a reset every block is free.
"""

from __future__ import annotations

import functools

from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixinfer import LLM, SamplingParams
from radixinfer.engine.request import Status

TOKENS = st.integers(1, 3)
PICK = st.integers(0, 15)
# Every request fits the pool alone: a prompt of at most MAX_PROMPT plus MAX_NEW tokens, with block size
# and pool chosen in `setup` so even the smallest pool holds one such request and its copy-on-write block.
MAX_PROMPT = 24
MAX_NEW = 6


@functools.cache
def _llm(
    block_size: int, num_blocks: int, prefill_max_tokens: int, host_blocks: int, write_through: bool
) -> LLM:
    """Engines are reused across examples (a fresh one costs a model load); `setup` resets them.
    ``host_blocks``: the size of the host KV tier under the pool, in blocks (0: none), with
    write-through after one hit or without."""
    block_bytes = LLM("tiny", block_size=block_size, num_blocks=1).memory_plan.bytes_per_block
    return LLM(
        "tiny",
        block_size=block_size,
        num_blocks=num_blocks,
        max_batch_size=4,
        prefill_max_tokens=prefill_max_tokens,
        prefill_max_batch_size=3,
        host_cache_gb=host_blocks * block_bytes / (1 << 30),
        host_write_through_hits=1 if write_through else None,
    )


class EngineMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([2, 4]),
        spare=st.integers(0, 4),
        budget=st.sampled_from([8, 64]),
        host_blocks=st.sampled_from([0, 8]),
        write_through=st.booleans(),
    )
    def setup(
        self, block_size: int, spare: int, budget: int, host_blocks: int, write_through: bool
    ) -> None:
        need = -(-(MAX_PROMPT + MAX_NEW) // block_size) + 1
        self.llm = _llm(
            block_size, need + spare, budget, host_blocks, write_through and host_blocks
        )
        self.engine = self.llm.engine
        for request_id in list(self.engine.requests):  # a previous example's leftovers
            self.engine.abort(request_id)
            self.engine.pop_finished(request_id)
        while self.engine.has_unfinished():
            self.engine.step()
        self.engine.reset_prefix_cache()
        self.start = dict(self.llm.cache_stats())
        self.history: list[list[int]] = []
        self.open: list[str] = []

    @rule(
        base=PICK,
        keep=st.integers(0, MAX_PROMPT),
        suffix=st.lists(TOKENS, min_size=1, max_size=MAX_PROMPT),
        max_new=st.integers(1, MAX_NEW),
        salt=st.sampled_from([None, "tenant-a"]),
    )
    def submit(
        self, base: int, keep: int, suffix: list[int], max_new: int, salt: str | None
    ) -> None:
        prefix = self.history[base % len(self.history)][:keep] if self.history else []
        prompt = (prefix + suffix)[:MAX_PROMPT]
        note(f"submit {prompt} max_tokens={max_new} salt={salt}")
        params = SamplingParams(max_tokens=max_new, ignore_eos=True)
        self.open.append(self.engine.add_request(prompt, params, cache_salt=salt))
        self.history = [*self.history[-7:], prompt]

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self.engine.step()
        self._forget_finished()

    @rule()
    def drain(self) -> None:
        """Step until every open request finished: each fits the pool alone, so none may wait forever."""
        self._run_to_completion()

    @precondition(lambda self: self.open)
    @rule(pick=PICK)
    def abort(self, pick: int) -> None:
        request_id = self.open[pick % len(self.open)]
        note(f"abort {request_id}")
        self.engine.abort(request_id)
        self._forget_finished()

    @invariant()
    def cache_integrity(self) -> None:
        if hasattr(self, "engine"):
            self.engine.cache.check_integrity([r.seq for r in self.engine.active])

    @invariant()
    def accounting_is_honest(self) -> None:
        if not hasattr(self, "engine"):
            return
        for req in self.engine.requests.values():
            if req.num_sampled and req.num_cached_tokens is not None:
                assert req.num_cached_tokens + req.num_computed_prompt_tokens == len(
                    req.prompt_ids
                ), req
        if not self.engine.prefilling:
            stats = self.llm.cache_stats()
            prompt, cached, computed = (
                stats[k] - self.start[k]
                for k in ("prompt_tokens", "cached_tokens", "computed_prompt_tokens")
            )
            assert prompt == cached + computed, stats

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        self._run_to_completion()
        self.engine.reset_prefix_cache()
        stats = self.llm.cache_stats()
        assert stats["free_blocks"] == stats["total_blocks"]
        assert stats["host_free_blocks"] == stats["host_total_blocks"]

    def _run_to_completion(self) -> None:
        engine = self.engine
        bound = 10 * (len(self.open) + 1) * (MAX_PROMPT + MAX_NEW)
        for _ in range(bound):
            if not engine.has_unfinished():
                break
            engine.step()
            self.cache_integrity()
        assert not engine.has_unfinished(), f"requests still open after {bound} steps: a livelock"
        self._forget_finished()
        assert not self.open

    def _forget_finished(self) -> None:
        requests = self.engine.requests
        for request_id in [r for r in self.open if requests[r].status is Status.FINISHED]:
            req = self.engine.pop_finished(request_id)
            assert req.num_cached_tokens is None or len(req.output_ids) <= req.params.max_tokens
            self.open.remove(request_id)


TestEngineMachine = EngineMachine.TestCase
# Each step runs real forwards: fewer, shorter examples than the cache-only machines.
TestEngineMachine.settings = settings(
    settings.default,
    max_examples=min(settings.default.max_examples, 80),
    stateful_step_count=min(settings.default.stateful_step_count, 30),
)
