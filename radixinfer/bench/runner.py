"""The benchmark: one run loop, driven once per variant (backend x prefix cache x admission policy).

For each variant: open the backend, build the workload with its tokenizer, run the workload
``--warmup-runs`` times unmeasured, then ``--repeat-runs`` times measured (emptying the prefix cache
first with ``--cold-cache``), take cache counters as ``cache_stats()`` deltas over the measured runs, and
close the backend before the next variant opens (each may claim most of the GPU's memory).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import queue
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from radixinfer.bench.backends import Backend, open_radixinfer
from radixinfer.bench.hf import HFBackend, export_checkpoint
from radixinfer.bench.metrics import (
    GCPauses,
    RequestRecord,
    add_cache_deltas,
    cache_delta,
    gc_pause_summary,
    summarize,
)
from radixinfer.bench.report import comparisons, format_report
from radixinfer.bench.workloads import Session, arrival_offsets, build_workload, fit_to_context
from radixinfer.models import PRESET_NAMES
from radixinfer.sampling_params import SamplingParams
from radixinfer.serving import StreamFailure


@dataclass(frozen=True)
class Variant:
    backend: str
    prefix_cache: bool
    policy: str | None  # admission policy; None for hf, which has its own scheduler

    @property
    def label(self) -> str:
        parts = [self.backend, "cache=on" if self.prefix_cache else "cache=off"]
        return " ".join(parts + ([self.policy] if self.policy else []))


def plan_variants(args: argparse.Namespace) -> list[Variant]:
    """The product of the compared settings, baseline (radixinfer, cache on, first policy) first."""
    backends = ["radixinfer", "hf"] if args.compare_backends else [args.backend]
    caches = [True, False] if args.compare_no_cache else [not args.no_prefix_cache]
    policies = args.compare_policies or [args.prefill_admission_policy]
    return [
        Variant(backend, cache, policy if backend == "radixinfer" else None)
        for backend in backends
        for cache in caches
        for policy in (policies if backend == "radixinfer" else [None])
    ]


@dataclass
class _Turn:
    session: Session
    index: int
    prompt: list[int]
    record: RequestRecord


def run_workload(
    backend: Backend, sessions: list[Session], offsets: list[float], args: argparse.Namespace, desc: str
) -> tuple[list[RequestRecord], float]:
    """Submit each session's first turn at its offset and each later turn as soon as the previous answer is
    complete; collect every token's timestamp. Returns the records (one per turn) and the wall time from
    the first submit to the last token. A failed request raises RuntimeError."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    arrivals = sorted(range(len(sessions)), key=offsets.__getitem__)
    inflight: dict[str, _Turn] = {}
    records: list[RequestRecord] = []
    progress = tqdm(total=sum(s.num_turns for s in sessions), desc=desc, unit="req", file=sys.stderr, leave=False)

    def submit(session: Session, index: int, prompt: list[int]) -> None:
        prompt = fit_to_context(prompt, backend.max_context_len, args.truncate_prompts)
        # like the engine, never ask for more than the context holds (a model could not index its positions)
        max_tokens = min(session.max_tokens, max(1, backend.max_context_len - len(prompt)))
        record = RequestRecord(time.perf_counter(), len(prompt))
        request_id = backend.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=args.ignore_eos), events)
        inflight[request_id] = _Turn(session, index, prompt, record)

    start = time.perf_counter()
    next_arrival = 0
    with progress:
        while next_arrival < len(arrivals) or inflight:
            while next_arrival < len(arrivals) and time.perf_counter() >= start + offsets[arrivals[next_arrival]]:
                session = sessions[arrivals[next_arrival]]
                submit(session, 0, session.prompt)
                next_arrival += 1
            timeout = None  # nothing left to submit: wait for tokens
            if next_arrival < len(arrivals):
                timeout = max(0.0, start + offsets[arrivals[next_arrival]] - time.perf_counter())
            try:
                batch = events.get(timeout=timeout)
            except queue.Empty:
                continue
            for event in batch:
                if isinstance(event, StreamFailure):
                    raise RuntimeError(f"request {event.request_id} failed: {event.error}") from event.error
                turn = inflight[event.request_id]
                turn.record.add(event)
                if not event.finished:
                    continue
                del inflight[event.request_id]
                records.append(turn.record)
                progress.update(1)
                session, index = turn.session, turn.index
                if index + 1 < session.num_turns:
                    submit(session, index + 1, session.next_prompt(index, turn.prompt, turn.record.token_ids))
    first_submit = min(r.submit_time for r in records)
    last_token = max((r.token_times[-1] for r in records if r.token_times), default=first_submit)
    return records, last_token - first_submit


def measure(backend: Backend, args: argparse.Namespace, label: str) -> dict:
    """Warm-up and measured runs of the workload on one backend; the pooled summary and, with several
    measured runs, each run's own."""
    sessions = build_workload(args, backend.tokenizer, backend.vocab_size)
    for session in sessions:  # fail before any run, not in the middle of one
        fit_to_context(session.prompt, backend.max_context_len, args.truncate_prompts)
    offsets = arrival_offsets(len(sessions), args.request_rate, args.submit_interval_ms,
                              np.random.default_rng(args.seed + 1))
    for i in range(args.warmup_runs):
        run_workload(backend, sessions, offsets, args, f"{label} warmup {i + 1}/{args.warmup_runs}")
    runs = []
    for i in range(args.repeat_runs):
        if args.cold_cache:
            backend.reset_cache()
        before = backend.cache_stats()
        # What earlier runs left behind (their records, the workload) stays alive: move it out of the
        # collector's reach so each run's collections scan only that run's objects, not every run's so far.
        gc.collect()
        gc.freeze()
        with GCPauses() as gc_pauses:
            records, wall = run_workload(backend, sessions, offsets, args, f"{label} run {i + 1}/{args.repeat_runs}")
        runs.append((records, wall, cache_delta(before, backend.cache_stats()), gc_pauses))
    pooled = summarize([r for records, _, _, _ in runs for r in records], sum(w for _, w, _, _ in runs),
                       add_cache_deltas([c for _, _, c, _ in runs]))
    pooled["gc_pauses"] = gc_pause_summary([p for *_, pauses in runs for p in pauses.pauses_ms])
    repeats = [{**summarize(*run[:3]), "gc_pauses": gc_pause_summary(run[3].pauses_ms)} for run in runs]
    return {"metrics": pooled, "repeats": repeats if len(runs) > 1 else []}


def open_backend(variant: Variant, model: str, args: argparse.Namespace) -> Backend:
    if variant.backend == "hf":
        return HFBackend(model, device=args.device, dtype=args.dtype, max_batch_size=args.max_batch_size,
                         prefix_cache=variant.prefix_cache,
                         kv_tokens=args.num_blocks * args.block_size if args.num_blocks else None,
                         kv_memory_fraction=args.kv_memory_fraction, attn_implementation=args.hf_attn_implementation,
                         batching=args.hf_batching, seed=args.seed)
    return open_radixinfer(model, args, variant.prefix_cache, variant.policy)


def _release_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_bench(args: argparse.Namespace) -> dict:
    """Every variant's metrics and the speedups of the first over the others (also written to --json)."""
    variants = plan_variants(args)
    with tempfile.TemporaryDirectory(prefix="radixinfer-bench-") as tmp:
        model = args.model
        if model in PRESET_NAMES and any(v.backend == "hf" for v in variants):
            model = str(export_checkpoint(model, Path(tmp), args.device, args.dtype, args.seed))
        results = []
        for variant in variants:
            backend = open_backend(variant, model, args)
            try:
                results.append({"label": variant.label, **asdict(variant), "info": backend.info,
                                **measure(backend, args, variant.label)})
            finally:
                backend.close()
                del backend
                _release_device_memory()
    config = {k: str(v) if isinstance(v, float) and math.isinf(v) else v for k, v in vars(args).items()}  # strict JSON
    return {"config": config, "runs": results, "comparisons": comparisons(results)}


def main(args: argparse.Namespace) -> dict:
    """Run, print the report, write ``--json``; returns the result."""
    result = run_bench(args)
    print(format_report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return result
