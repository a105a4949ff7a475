"""The benchmark: the run loop (`radixinfer.bench.run_loop`) driven over every variant (backend x prefix
cache x admission policy) at once.

Measured one after another (open, warm up, measure, close, next), the ratios between variants drifted by
10-14% with process state and order: the first variant of a process always ran first. That is far more than
the effects compared (a cache that costs < 2% throughput), so every variant now runs side by side:

1. every variant's backend opens up front and stays open to the end (all close in a ``finally``).
   They split the GPU: each radixinfer engine may use ``--gpu-memory-utilization / len(variants)`` of it (its
   weights, activations and CUDA graphs measured, `radixinfer.engine.memory`); without
   ``--num-blocks`` the first sizes its KV pool from its share and the others take as many blocks,
   so every variant runs with the same pool. (Closing each before opening the next would give each
   the whole budget, but the variants must stay open to run in alternating rounds, below.)
2. every variant's ``--warmup-runs`` unmeasured runs, before any measured run;
3. ``--repeat-runs`` rounds; round r runs one measured repeat of each variant, in variant order for even r
   and reversed for odd r (A B, B A, A B, ...): the variants of a round run back to back in the same process
   state, and alternating the order cancels a steady drift over each two rounds. The report pairs the
   rounds (`radixinfer.bench.report.comparisons`): their spread shows how far a pooled speedup is resolved.

Each measured run empties the prefix cache first with ``--cold-cache``, moves what earlier runs left alive
out of the collector's reach, records GC pauses, and takes cache counters as ``cache_stats()`` deltas.

The collector's young-generation threshold is raised while the bench runs (``--gc-threshold``). Streaming
creates a delta and a token list per token, nearly all dead within the step, but a 512-wide step allocates
~1,000 of them before the consumer frees any, so Python's default of 700 net allocations started a young
collection every step (the shared-prefix workload of 16 groups x 32 on the stub engine, CPU: ~150 young
and ~15 middle collections a run; on an H200, 25-36 ms of pauses a run). What survives a run (requests,
records) is a few thousand objects, far below 50,000.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from radixinfer.bench.backends import Backend, open_radixinfer
from radixinfer.bench.bandwidth import measure_memory_tbps
from radixinfer.bench.client_processes import ClientProcesses
from radixinfer.bench.hf import HFBackend, export_checkpoint
from radixinfer.bench.metrics import (
    RequestRecord,
    add_cache_deltas,
    cache_delta,
    gc_pause_summary,
    summarize,
)
from radixinfer.bench.report import comparisons, format_report
from radixinfer.bench.run_loop import run_workload
from radixinfer.bench.workloads import Session, arrival_offsets, build_workload, fit_to_context
from radixinfer.gc_pauses import GCPauses
from radixinfer.models import PRESET_NAMES


class Labelled(Protocol):
    """What `measure` needs of a compared setting: its label, and whether it sends each of a
    request's ``--n`` completions as a request of its own (`Variant` or another bench's)."""

    @property
    def label(self) -> str: ...

    @property
    def separate_samples(self) -> bool: ...


@dataclass(frozen=True)
class Variant:
    backend: str
    prefix_cache: bool
    policy: str | None  # admission policy; None for hf and openai, which schedule on their own
    host_cache: bool = False  # radixinfer with a host KV tier of --host-cache-gb
    separate_samples: bool = False  # each of a request's --n completions a request of its own

    @property
    def label(self) -> str:
        parts = [self.backend, "cache=on" if self.prefix_cache else "cache=off"]
        parts += ["host=on"] if self.host_cache else []
        parts += ["samples=separate"] if self.separate_samples else []
        return " ".join(parts + ([self.policy] if self.policy else []))


def plan_variants(args: argparse.Namespace) -> list[Variant]:
    """The product of the compared settings, baseline (radixinfer, cache on, first policy) first."""
    backends = ["radixinfer", "hf"] if args.compare_backends else [args.backend]
    caches = [True, False] if args.compare_no_cache else [not args.no_prefix_cache]
    policies = args.compare_policies or [args.prefill_admission_policy]
    hosts = [True, False] if args.compare_host_cache else [bool(args.host_cache_gb)]
    splits = [False, True] if args.compare_separate_samples else [False]
    variants = [
        Variant(
            backend,
            cache,
            policy if backend == "radixinfer" else None,
            host and cache and backend == "radixinfer",  # the tier holds cached prefixes
            split,
        )
        for backend in backends
        for cache in caches
        for policy in (policies if backend == "radixinfer" else [None])
        for host in hosts
        for split in splits
    ]
    return list(dict.fromkeys(variants))


@dataclass
class _Arm:
    """One variant while the benchmark runs: its open backend, its workload and its measured runs so far."""

    variant: Labelled
    backend: Backend
    sessions: list[Session]
    offsets: list[float]
    clients: ClientProcesses | None  # reading the streams of an openai backend, else None
    runs: list[tuple[list[RequestRecord], float, dict | None, GCPauses]] = field(
        default_factory=list
    )

    @classmethod
    def prepare(
        cls,
        variant: Labelled,
        backend: Backend,
        args: argparse.Namespace,
        clients: ClientProcesses | None = None,
    ) -> _Arm:
        """The workload in the backend's own tokens; fails before any run if a prompt cannot fit.
        With ``separate_samples`` every session comes ``--n`` times, at the same arrival.
        ``clients``: the processes that run it instead of this one (``--client-processes``)."""
        sessions = build_workload(args, backend.tokenizer, backend.vocab_size)
        for session in sessions:
            fit_to_context(session.prompt, backend.max_context_len, args.truncate_prompts)
        offsets = arrival_offsets(
            len(sessions),
            args.request_rate,
            args.submit_interval_ms,
            np.random.default_rng(args.seed + 1),
        )
        if variant.separate_samples:
            sessions = [s for s in sessions for _ in range(args.n)]
            offsets = [o for o in offsets for _ in range(args.n)]
        return cls(variant, backend, sessions, offsets, clients)

    def run(self, args: argparse.Namespace, what: str) -> tuple[list[RequestRecord], float]:
        if self.variant.separate_samples:  # its sessions hold the copies: one completion each
            args = argparse.Namespace(**{**vars(args), "n": 1})
        desc = f"{self.variant.label} {what}"
        if self.clients is not None:
            return self.clients.run(self.sessions, self.offsets, args, desc)
        return run_workload(self.backend, self.sessions, self.offsets, args, desc)

    def measure(self, args: argparse.Namespace, what: str) -> None:
        if args.cold_cache:
            self.backend.reset_cache()
        before = self.backend.cache_stats()
        # What earlier runs left behind (their records, the workloads) stays alive: move it out of the
        # collector's reach so each run's collections scan only that run's objects, not every run's so far.
        gc.collect()
        gc.freeze()
        with GCPauses() as gc_pauses:
            records, wall = self.run(args, what)
        self.runs.append(
            (records, wall, cache_delta(before, self.backend.cache_stats()), gc_pauses)
        )

    def result(self, hbm_tbps: float | None) -> dict:
        """The pooled summary and, with several measured runs, each run's own (in round order);
        decode floors at ``hbm_tbps`` (None: none)."""
        runs = self.runs
        pooled = summarize(
            [r for records, _, _, _ in runs for r in records],
            sum(w for _, w, _, _ in runs),
            add_cache_deltas([c for _, _, c, _ in runs]),
            hbm_tbps,
        )
        pooled["gc_pauses"] = gc_pause_summary([p for *_, pauses in runs for p in pauses.pauses_ms])
        repeats = [
            {**summarize(*run[:3], hbm_tbps), "gc_pauses": gc_pause_summary(run[3].pauses_ms)}
            for run in runs
        ]
        return {
            "label": self.variant.label,
            **asdict(self.variant),
            "info": self.backend.info,
            "metrics": pooled,
            "repeats": repeats if len(runs) > 1 else [],
        }


def round_orders(num_variants: int, rounds: int) -> list[list[int]]:
    """Variant indices per measured round: in order for even rounds, reversed for odd ones (ABBA...), so a
    drift over the process's life favours no variant."""
    order = list(range(num_variants))
    return [order if r % 2 == 0 else order[::-1] for r in range(rounds)]


def measure(
    variants: Sequence[Labelled],
    backends: list[Backend],
    args: argparse.Namespace,
    clients: ClientProcesses | None = None,
) -> list[dict]:
    """Every variant's warm-up runs, then ``--repeat-runs`` rounds of one measured run of each variant (see
    `round_orders`); one result per variant, in variant order. ``clients``: the client processes
    that run the one variant of ``--backend openai --client-processes K``."""
    arms = [
        _Arm.prepare(variant, backend, args, clients)
        for variant, backend in zip(variants, backends)
    ]
    for arm in arms:
        for i in range(args.warmup_runs):
            arm.run(args, f"warmup {i + 1}/{args.warmup_runs}")
    for r, order in enumerate(round_orders(len(arms), args.repeat_runs)):
        for i in order:
            arms[i].measure(args, f"run {r + 1}/{args.repeat_runs}")
    return [arm.result(args.hbm_tbps) for arm in arms]


def open_backend(
    variant: Variant,
    model: str,
    args: argparse.Namespace,
    gpu_memory_utilization: float,
    num_blocks: int | None = None,
) -> Backend:
    """The variant's backend with a KV pool of ``num_blocks`` (of ``--block-size`` tokens), or when None of
    what ``gpu_memory_utilization`` leaves (transformers: that fraction of the memory free after
    loading)."""
    if variant.backend == "openai":
        from radixinfer.bench.openai_backend import OpenAIBackend

        return OpenAIBackend(args.base_url, model)
    if variant.backend == "hf":
        return HFBackend(
            model,
            device=args.device,
            dtype=args.dtype,
            max_batch_size=args.max_batch_size,
            prefix_cache=variant.prefix_cache,
            kv_tokens=num_blocks * args.block_size if num_blocks else None,
            kv_memory_fraction=gpu_memory_utilization,
            attn_implementation=args.hf_attn_implementation,
            batching=args.hf_batching,
            seed=args.seed,
        )
    return open_radixinfer(
        model, args, variant.prefix_cache, variant.policy, gpu_memory_utilization, num_blocks,
        host_cache=variant.host_cache,
    )  # fmt: skip


def _close_all(backends: list[Backend]) -> None:
    """Close every backend, even when closing one fails (that error is raised once the rest are closed)."""
    with contextlib.ExitStack() as stack:
        for backend in backends:
            stack.callback(backend.close)


@contextlib.contextmanager
def _gc_threshold(young: int):
    """Set the collector's young-generation threshold (0: leave it) for the block, then restore it."""
    saved = gc.get_threshold()
    if young:
        gc.set_threshold(young, *saved[1:])
    try:
        yield
    finally:
        gc.set_threshold(*saved)


FIRST_POOL_HEADROOM = 0.01  # of the first variant's share, left for the others' measurements


def _release_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_bench(args: argparse.Namespace) -> dict:
    """Every variant's metrics and the speedups of the first over the others (also written to --json)."""
    variants = plan_variants(args)
    # All backends are open at once, so they split the GPU: each radixinfer engine may use an equal
    # share of it, and the first sizes its KV pool from its share while the others take as many
    # blocks (an even split of what is free when each opens would shrink later ones). transformers'
    # continuous batching, given its pool size, gets the whole fraction as a ceiling only: it checks
    # that pool against that fraction of what is free when it opens (its share alone, of what the
    # first left, would refuse the pool). The first plans its pool within `FIRST_POOL_HEADROOM` of
    # its share: each engine measures its own non-KV memory (the caching allocator rounds it a little
    # differently each time), so the others must have room for the same pool.
    share = args.gpu_memory_utilization / len(variants)
    num_blocks = args.num_blocks
    device = torch.device(args.device)
    if args.hbm_tbps is None and device.type == "cuda":
        if any(v.backend == "radixinfer" for v in variants):  # the one whose counters give floors
            args.hbm_tbps = measure_memory_tbps(device)
    with tempfile.TemporaryDirectory(prefix="radixinfer-bench-") as tmp:
        model = args.model
        if model in PRESET_NAMES and any(v.backend == "hf" for v in variants):
            model = str(export_checkpoint(model, Path(tmp), args.device, args.dtype, args.seed))
        backends: list[Backend] = []
        clients = None
        try:
            for variant in variants:
                whole = variant.backend == "hf" and num_blocks is not None
                fraction = args.gpu_memory_utilization if whole else share
                if num_blocks is None and len(variants) > 1:
                    fraction *= 1 - FIRST_POOL_HEADROOM
                backends.append(open_backend(variant, model, args, fraction, num_blocks))
                num_blocks = num_blocks or backends[-1].info.get("kv_blocks")
            if args.client_processes > 1:
                clients = ClientProcesses(args.base_url, model, args.client_processes)
                backends[0].info["client_processes"] = args.client_processes
            with _gc_threshold(args.gc_threshold):
                results = measure(variants, backends, args, clients)
        finally:
            if clients is not None:
                clients.close()
            _close_all(backends)
            backends.clear()  # the last references: the release below can free their memory
            _release_device_memory()
    config = {
        k: str(v) if isinstance(v, float) and math.isinf(v) else v for k, v in vars(args).items()
    }  # strict JSON
    return {"config": config, "runs": results, "comparisons": comparisons(results)}


def main(args: argparse.Namespace) -> dict:
    """Run, print the report, write ``--json``; returns the result."""
    result = run_bench(args)
    print(format_report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return result
