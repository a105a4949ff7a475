"""Where a bench workload's wall time goes, step by step: host time of each engine phase and GPU time of
each forward, for the same workload driven two ways side by side.

    PYTHONPATH=. python benchmarks/trace_steps.py <radixinfer bench flags> [--trace-json PATH]

* ``served``: through the streaming server with the bench's consumer thread reading every token (what
  ``radixinfer bench`` measures);
* ``direct``: the engine stepped in a loop on the server's thread, deltas dropped (no consumer thread, no
  queues): the engine's own cost;
* with ``--host-profile N``, ``direct`` once more under cProfile (slower; its top N functions by self and by
  cumulative time).

Each variant runs ``--warmup-runs`` times untraced, then once traced with a cold cache when ``--cold-cache``
is given. Per step it records the wall time of ``engine.step`` and, inside it, of the prefill round and the
decode phase (both include any wait for the GPU: the prefill round reads its first tokens back, the decode
phase reads the previous step's), the prompt tokens computed, the decode batch, and the GPU time of each
prefill forward and decode launch (CUDA events around the call; the events queue behind earlier work, so the
pair brackets only that call's kernels). Steps are grouped into *prefill steps* (the round computed tokens)
and *decode-only steps*; ``gap`` is wall time outside ``engine.step`` (the serving loop, other threads).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from radixinfer.bench.args import add_bench_arguments, check_bench_arguments
from radixinfer.bench.backends import open_radixinfer
from radixinfer.bench.run_loop import request_for, run_workload
from radixinfer.bench.workloads import arrival_offsets, build_workload
from radixinfer.engine.engine import LLMEngine
from radixinfer.sampling_params import SamplingParams


@dataclass
class StepRecord:
    start: float
    end: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    decode_batch: int = 0
    gpu: list = field(default_factory=list)  # (kind, start event, end event)


class StepTracer:
    """Wraps one engine's ``step``, ``_prefill_round``, ``_decode`` and its runner's ``prefill`` / ``decode``
    (instance attributes shadow the methods; `detach` removes them)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.steps: list[StepRecord] = []
        self._timed = torch.cuda.is_available()
        eng, runner = engine, engine.runner
        eng.step = self._wrap_step(eng.step)
        eng._prefill_round = self._wrap_phase(eng._prefill_round, "prefill_s")
        eng._decode = self._wrap_phase(eng._decode, "decode_s")
        runner.prefill = self._wrap_gpu(runner.prefill, "prefill")
        runner.decode = self._wrap_gpu(runner.decode, "decode")

    def detach(self) -> None:
        for obj, names in (
            (self.engine, ("step", "_prefill_round", "_decode")),
            (self.engine.runner, ("prefill", "decode")),
        ):
            for name in names:
                vars(obj).pop(name, None)

    def _wrap_step(self, fn):
        @functools.wraps(fn)
        def step():
            counters = self.engine.counters
            computed = counters.computed_prompt_tokens
            record = StepRecord(time.perf_counter())
            self.steps.append(record)
            out = fn()
            record.end = time.perf_counter()
            record.prompt_tokens = counters.computed_prompt_tokens - computed
            return out

        return step

    def _wrap_phase(self, fn, attr: str):
        @functools.wraps(fn)
        def phase(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            setattr(self.steps[-1], attr, getattr(self.steps[-1], attr) + time.perf_counter() - t0)
            return out

        return phase

    def _wrap_gpu(self, fn, kind: str):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if kind == "decode":
                self.steps[-1].decode_batch = len(args[0])  # input ids, one per sequence
            if not self._timed:
                return fn(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.steps[-1].gpu.append((kind, start, end))
            return out

        return call

    def summary(self, wall_s: float) -> dict:
        if self._timed:
            torch.cuda.synchronize()
        groups: dict[str, dict] = {}
        for s in self.steps:
            g = groups.setdefault(
                "prefill steps" if s.prompt_tokens else "decode-only steps",
                {
                    "steps": 0,
                    "wall_ms": 0.0,
                    "prefill_round_ms": 0.0,
                    "decode_phase_ms": 0.0,
                    "prompt_tokens": 0,
                    "decode_rows": 0,
                    "gpu_prefill_ms": 0.0,
                    "gpu_decode_ms": 0.0,
                },
            )
            g["steps"] += 1
            g["wall_ms"] += (s.end - s.start) * 1e3
            g["prefill_round_ms"] += s.prefill_s * 1e3
            g["decode_phase_ms"] += s.decode_s * 1e3
            g["prompt_tokens"] += s.prompt_tokens
            g["decode_rows"] += s.decode_batch
            for kind, start, end in s.gpu:
                g[f"gpu_{kind}_ms"] += start.elapsed_time(end)
        in_steps = sum(s.end - s.start for s in self.steps)
        return {
            "wall_ms": wall_s * 1e3,
            "in_steps_ms": in_steps * 1e3,
            "gap_ms": (wall_s - in_steps) * 1e3,
            "groups": {
                k: {n: round(v, 3) if isinstance(v, float) else v for n, v in g.items()}
                for k, g in groups.items()
            },
        }

    def timeline(self) -> list[dict]:
        t0 = self.steps[0].start if self.steps else 0.0
        rows = []
        for s in self.steps:
            row = {
                "start_ms": (s.start - t0) * 1e3,
                "end_ms": (s.end - t0) * 1e3,
                "prefill_ms": s.prefill_s * 1e3,
                "decode_ms": s.decode_s * 1e3,
                "prompt_tokens": s.prompt_tokens,
                "decode_batch": s.decode_batch,
            }
            for kind, start, end in s.gpu:
                row[f"gpu_{kind}_ms"] = row.get(f"gpu_{kind}_ms", 0.0) + start.elapsed_time(end)
            rows.append(row)
        return rows


def drive_direct(
    engine: LLMEngine, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
) -> float:
    """Add every prompt, step until done; returns the wall seconds (burst arrival only)."""
    start = time.perf_counter()
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                engine.pop_finished(delta.request_id)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    parser.add_argument(
        "--trace-json", default=None, help="write both summaries and per-step timelines here"
    )
    parser.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="also profile the direct run's host side (cProfile) and print its top N functions",
    )
    args = parser.parse_args()
    check_bench_arguments(parser, args)
    backend = open_radixinfer(
        args.model, args, not args.no_prefix_cache, args.prefill_admission_policy
    )
    engine, server = backend.llm.engine, backend._server
    sessions = build_workload(args, backend.tokenizer, backend.vocab_size)
    if any(s.num_turns > 1 for s in sessions):
        sys.exit("trace_steps: single-turn workloads only")
    offsets = arrival_offsets(
        len(sessions),
        args.request_rate,
        args.submit_interval_ms,
        np.random.default_rng(args.seed + 1),
    )
    prompts, params = zip(
        *(request_for(s, s.prompt, backend.max_context_len, args) for s in sessions)
    )
    prompts = [
        backend.native_prompt(p) for p in prompts
    ]  # converted before the clock, as the bench does

    def served() -> float:
        return run_workload(backend, sessions, offsets, args, "trace")[1]

    def direct() -> float:
        return server.call(lambda eng: drive_direct(eng, prompts, params)).result()

    def direct_profiled() -> float:
        def run(eng: LLMEngine) -> float:
            profiler = cProfile.Profile()
            wall = profiler.runcall(drive_direct, eng, prompts, params)
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(args.host_profile)
            stats.sort_stats("cumulative").print_stats(args.host_profile)
            return wall

        return server.call(run).result()

    result = {}
    try:
        variants = [("served", served), ("direct", direct)]
        if args.host_profile:
            variants.append(("direct, cProfile", direct_profiled))
        for name, run in variants:
            for _ in range(args.warmup_runs):
                run()
            if args.cold_cache:
                backend.reset_cache()
            tracer = StepTracer(engine)
            wall = run()
            tracer.detach()
            result[name] = {"summary": tracer.summary(wall), "timeline": tracer.timeline()}
            print(name, json.dumps(result[name]["summary"], indent=1), flush=True)
    finally:
        backend.close()
    if args.trace_json:
        Path(args.trace_json).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
