"""Host (CPU) time per engine step: what a small model pays in Python per decode step and per admission round.

    python benchmarks/bench_engine_step.py                      # CPU, stub model: a table
    python benchmarks/bench_engine_step.py --json out.json      # ... and every number as JSON ("-" = stdout)
    python benchmarks/bench_engine_step.py --device cuda        # stub model on CUDA: pinned buffers, CUDA graphs
    python benchmarks/bench_engine_step.py --device cuda --model gpt2 --dtype float16   # + a real model

The **stub model** is a `PagedCausalLM` whose forward returns a slice of a preallocated hidden tensor and whose
``compute_logits`` returns a slice of preallocated ``[rows, vocab]`` logits, so what remains is the host side of
the real `LLMEngine`, `KVCacheManager`, `ModelRunner` and sampler, built from the same classes `api.LLM` uses.
Its KV pool is one layer of one 8-wide head (copies cost nothing either). On the CPU the "device" tensor work
that remains (argmax over the small stub vocabulary, the sampler's noise when sampling) runs inline and is
counted; keep the stub vocabulary small (``--vocab``) so it stays a minor term.

Cases (block_size 16, every time a median over many repetitions, `time.perf_counter_ns`):

* ``decode`` at batch 16 / 64 / 256, prompts of 600 distinct tokens (contexts 600 to ~1000 while measured):
  one `engine.step()` with every request decoding. First timed clean, then again with every phase wrapped
  in a timer (the wrappers cost ~0.2 µs per call): `cache.reserve_step`, `runner.copy_blocks`, `runner.decode`
  (inclusive; of it the block-table rows and, on CUDA, the graph replay), `cache.mark_written`, and
  `_sample` = `Sampler.sample` (of it `Sampler._row_params` = sampling setup, and the `sample` call), and
  `_read_back` = `OutputProcessor.read_back` =
  ``output processing``: reading back the previous step's tokens (steps overlap: step k's tokens are read
  after step k+1 is launched), stop checks, detokenizing and the stream deltas.
  ``engine other`` = instrumented step - those phases (the empty prefill round, batch lists, counters).
* ``admit``: one prefill round admitting 64 requests that share a cached 540-token prefix plus 60 tokens of
  their own (``decode_first=True``, so the step is the round alone): admit (match + lock), reserve, publish,
  the prefill pack + forward, the first token's sampling and its launch record (the token itself is read
  back and emitted by the next step). The tree holds just the prefix before each
  repetition (reset and re-warmed outside the timed region).
* ``--sampling both`` adds decode rows with temperature 0.8, top_p 0.95 (default: greedy only).

With ``--model NAME`` on CUDA the same decode batches run on a real model (`api.LLM`, distinct random prompts
of 600 tokens) and the GPU time of each step's decode graph replay and `sample` call is taken with CUDA events;
``host_us`` = the step with events - those two, i.e. the host time not hidden behind the GPU (host work
between the replay and the ``.tolist()`` sync overlaps it); all three from the same steps, which come after
the clean ones (``step_us``) and read ``--model-steps`` more positions each. The decode floor is (weight
bytes + KV bytes the step reads) / ``--hbm-tbps`` (measured by `bench_kernels.ceilings` when not given),
the weights those a step reads whole (`radixinfer.engine.decode_bytes`: an untied input embedding is only
looked up, not counted);
with ``--tensor-parallel-size N`` the model is sharded over N GPUs, the times are rank 0's (its graph
holds the all-reduces) and the weights and KV are rank 0's shard: the floor per GPU. The fraction
achieved is that floor over the graph's GPU time and over the whole step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import radixinfer.engine.sampler as sampler_module
import radixinfer.engine.step_buffers as step_buffers_module
from radixinfer.attention import get_backend
from radixinfer.cache.kv_manager import KVCacheManager
from radixinfer.distributed.group import TensorParallel
from radixinfer.engine.admission import AdmissionConfig
from radixinfer.engine.engine import EngineConfig, LLMEngine
from radixinfer.engine.kv_store import KVStore
from radixinfer.engine.model_runner import ModelRunner
from radixinfer.engine.step_buffers import BlockTableRows
from radixinfer.models.base import PagedCausalLM
from radixinfer.sampling_params import SamplingParams
from radixinfer.tokenizer import ByteTokenizer

BLOCK_SIZE = 16
PROMPT_LEN = 600
SHARED_PREFIX = 540
ADMIT_REQUESTS = 64
MAX_CONTEXT = 2048  # the stub's
GREEDY = SamplingParams(max_tokens=100_000, ignore_eos=True)
RANDOM = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.8, top_p=0.95)


# ---------------------------------------------------------------------------------------------- the stub model
class StubLM(PagedCausalLM):
    """A `PagedCausalLM` that computes nothing: hidden states and logits are slices of preallocated tensors.
    The logits favour printable ASCII bytes, so the byte tokenizer's detokenizer sees ordinary text."""

    def __init__(
        self, vocab_size: int, device: torch.device, max_tokens: int = 16384, max_rows: int = 1024
    ) -> None:
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            max_position_embeddings=MAX_CONTEXT,
        )
        super().__init__(config, TensorParallel.single())
        gen = torch.Generator().manual_seed(0)
        # [max_tokens, hidden]; a parameter, so the runner reads the model's dtype from it
        hidden = torch.randn(max_tokens, 8, generator=gen).to(device)
        self.hidden = torch.nn.Parameter(hidden, requires_grad=False)
        logits = torch.randn(max_rows, vocab_size, generator=gen)
        logits[:, 32:127] += 4.0
        self.all_logits = logits.to(device)  # [max_rows, vocab] float32
        # On CUDA a decode graph must capture at least one kernel: a 1-element add, replayed for free.
        self.tick = torch.zeros(1, device=device) if device.type == "cuda" else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
        if self.tick is not None:
            self.tick.add_(1)
        return self.hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.all_logits[: hidden.shape[0]]
        return logits if out is None else out.copy_(logits)


def build_stub_engine(
    device: torch.device,
    vocab_size: int,
    max_batch_size: int,
    num_blocks: int,
    decode_first: bool = False,
) -> LLMEngine:
    """The engine `api.LLM` builds, around the stub model (same classes, same wiring)."""
    model = StubLM(vocab_size, device)
    kv = KVStore(
        model.num_layers,
        num_blocks,
        BLOCK_SIZE,
        model.num_kv_heads,
        model.head_dim,
        torch.float32,
        device,
    )
    runner = ModelRunner(model, kv, get_backend(str(device)), device, max_batch_size)
    cache = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_cache=True)
    admission = AdmissionConfig(max_requests=max_batch_size)
    config = EngineConfig(
        max_batch_size=max_batch_size, admission=admission, decode_first=decode_first
    )
    tokenizer = ByteTokenizer()
    return LLMEngine(runner, cache, tokenizer, (tokenizer.eos_token_id,), config)


# ---------------------------------------------------------------------------------------------- timing tools
_MISSING = object()


class PhaseTimer:
    """While entered, wraps callables (``(phase, owner, attribute name)``) so each call adds its wall time to
    its phase (inclusive of nested phases); leaving puts every original back."""

    def __init__(self, spec: list[tuple[str, Any, str]]) -> None:
        self.spec = spec
        self.ns: defaultdict[str, int] = defaultdict(int)
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> PhaseTimer:
        for phase, owner, name in self.spec:
            self._saved.append((owner, name, vars(owner).get(name, _MISSING)))
            setattr(owner, name, self._timed(phase, getattr(owner, name)))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, saved in reversed(self._saved):
            if saved is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, saved)
        self._saved.clear()

    def _timed(self, phase: str, inner: Callable) -> Callable:
        ns = self.ns

        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                ns[phase] += time.perf_counter_ns() - t0

        return timed

    def take(self) -> dict[str, int]:
        out = dict(self.ns)
        self.ns.clear()
        return out


class EventTimer(PhaseTimer):
    """A `PhaseTimer` that records CUDA events around each call instead: the GPU time of the work the call
    enqueues (the device is idle when the call starts, as every engine step ends with a sync)."""

    def __init__(self, spec: list[tuple[str, Any, str]]) -> None:
        super().__init__(spec)
        self.events: defaultdict[str, list] = defaultdict(list)

    def _timed(self, phase: str, inner: Callable) -> Callable:
        events = self.events[phase]

        def timed(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return inner(*args, **kwargs)
            finally:
                end.record()
                events.append((start, end))

        return timed

    def median_us(self, phase: str) -> float:
        """Median GPU µs of the phase's calls; 0 when it was never called."""
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) * 1e3 for start, end in self.events[phase]]
        return statistics.median(times) if times else 0.0


def median_us(values_ns: list[float]) -> float:
    return statistics.median(values_ns) / 1e3


def decode_phases(engine: LLMEngine) -> list[tuple[str, Any, str]]:
    spec = [
        ("reserve", engine.cache, "reserve_step"),
        ("copy_blocks", engine.runner, "copy_blocks"),
        ("runner.decode", engine.runner, "decode"),
        ("block tables", BlockTableRows, "update"),
        ("mark_written", engine.cache, "mark_written"),
        ("_sample", engine.sampler, "sample"),
        ("sampling setup", engine.sampler, "_row_params"),
        ("_read_back", engine.output, "read_back"),
        ("sample", sampler_module, "sample"),
    ]
    if engine.runner.device.type == "cuda":
        spec.append(("graph replay", torch.cuda.CUDAGraph, "replay"))
    return spec


def random_prompts(
    rng: np.random.Generator, n: int, vocab: int, shared: list[int] | None = None
) -> list[list[int]]:
    """``n`` prompts of PROMPT_LEN tokens: ``shared`` then distinct tokens (ids 1..255 for the byte tokenizer's
    sake when the vocabulary allows; any id below ``vocab`` otherwise)."""
    shared = shared or []
    high = 256 if vocab > 256 else vocab
    return [shared + rng.integers(1, high, PROMPT_LEN - len(shared)).tolist() for _ in range(n)]


def fill_decode_batch(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> list[str]:
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.waiting or any(engine.requests[i].output_ids == [] for i in ids):
        engine.step()
    return ids


def abort_all(engine: LLMEngine, ids: list[str]) -> None:
    for i in ids:
        engine.abort(i)
        engine.pop_finished(i)


def time_steps(
    engine: LLMEngine, steps: int, timer: PhaseTimer | None = None
) -> tuple[list[int], list[dict]]:
    totals, phases = [], []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        engine.step()
        totals.append(time.perf_counter_ns() - t0)
        if timer is not None:
            phases.append(timer.take())
    return totals, phases


def summarise_phases(totals: list[int], phases: list[dict]) -> dict[str, float]:
    """Median µs per phase; derived rows: ``engine other``, ``decode other`` and ``output processing``."""
    names = sorted({k for p in phases for k in p})
    out = {name: median_us([p.get(name, 0) for p in phases]) for name in names}
    top = ("reserve", "copy_blocks", "runner.decode", "mark_written", "_sample", "_read_back")
    out["engine other"] = median_us(
        [t - sum(p.get(k, 0) for k in top) for t, p in zip(totals, phases)]
    )
    out["decode other"] = median_us(
        [
            p.get("runner.decode", 0) - p.get("block tables", 0) - p.get("graph replay", 0)
            for p in phases
        ]
    )
    out["output processing"] = median_us([p.get("_read_back", 0) for p in phases])
    out["step (instrumented)"] = median_us(totals)
    return out


# ---------------------------------------------------------------------------------------------- the cases
def bench_decode(
    engine: LLMEngine,
    batch: int,
    params: SamplingParams,
    steps: int,
    warmup: int,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """Clean step times, then the same number of steps with every phase timed."""
    ids = fill_decode_batch(engine, random_prompts(rng, batch, engine.vocab_size), params)
    running = [engine.requests[i] for i in ids]
    time_steps(engine, warmup)
    forwards = engine.counters.decode_forwards, engine.counters.prefill_forwards
    clean, _ = time_steps(engine, steps)
    with PhaseTimer(decode_phases(engine)) as timer:
        totals, phases = time_steps(engine, steps, timer)
    assert engine.counters.decode_forwards - forwards[0] == 2 * steps, "a step ran no decode"
    assert engine.counters.prefill_forwards == forwards[1], "a step ran a prefill"
    assert all(r.finish_reason is None for r in running), "a request ended early"
    contexts = [len(r.prompt_ids) + len(r.output_ids) for r in running]
    abort_all(engine, ids)
    step_us = median_us(clean)
    return {
        "batch": batch,
        "sampling": "greedy" if params.temperature == 0 else "random",
        "steps": steps,
        "context_at_end": int(np.mean(contexts)),
        "step_us": step_us,
        "per_seq_us": step_us / batch,
        "p90_step_us": float(np.percentile(clean, 90)) / 1e3,
        "phases_us": summarise_phases(totals, phases),
    }


def bench_admit(
    device: torch.device, vocab: int, reps: int, rng: np.random.Generator
) -> dict[str, Any]:
    """One prefill round of ADMIT_REQUESTS requests sharing a cached SHARED_PREFIX-token prefix; clean and
    instrumented repetitions alternate."""
    num_blocks = 4 * ADMIT_REQUESTS * (PROMPT_LEN // BLOCK_SIZE + 2)
    engine = build_stub_engine(
        device, vocab, max_batch_size=256, num_blocks=num_blocks, decode_first=True
    )
    prefix = rng.integers(1, 256, SHARED_PREFIX).tolist()
    spec = [
        ("admit (match+lock)", engine.cache, "admit"),
        ("cached_prefix_len (policy)", engine.cache, "cached_prefix_len"),
        ("reserve", engine.cache, "reserve_step"),
        ("publish", engine.cache, "publish"),
        ("copy_blocks", engine.runner, "copy_blocks"),
        ("runner.prefill", engine.runner, "prefill"),
        ("pack_block_tables (prefill)", step_buffers_module, "pack_block_tables"),
        ("_sample", engine.sampler, "sample"),
        ("_launch", engine.pipeline, "launch"),
    ]
    clean, adds, totals, phases = [], [], [], []
    for rep in range(2 * reps + 2):
        engine.reset_prefix_cache()
        (warm,) = fill_decode_batch(
            engine, [prefix], SamplingParams(max_tokens=1)
        )  # publishes the prefix
        engine.pop_finished(warm)
        prompts = random_prompts(rng, ADMIT_REQUESTS, vocab, shared=prefix)
        t0 = time.perf_counter_ns()
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        t1 = time.perf_counter_ns()
        if rep % 2:
            with PhaseTimer(spec) as timer:
                t1 = time.perf_counter_ns()
                engine.step()
                t2 = time.perf_counter_ns()
        else:
            engine.step()
            t2 = time.perf_counter_ns()
        assert all(engine.requests[i].num_cached_tokens >= SHARED_PREFIX for i in ids)
        first = [engine.requests[i] for i in ids]
        assert all(
            r.num_sampled == 1 and not r.output_ids for r in first
        )  # first tokens sampled, read next step
        abort_all(engine, ids)
        if rep < 2:  # warm-up
            continue
        if rep % 2:
            totals.append(t2 - t1)
            phases.append(timer.take())
        else:
            clean.append(t2 - t1)
            adds.append(t1 - t0)
    names = sorted({k for p in phases for k in p})
    phase_us = {name: median_us([p.get(name, 0) for p in phases]) for name in names}
    phase_us["step (instrumented)"] = median_us(totals)
    round_us = median_us(clean)
    return {
        "requests": ADMIT_REQUESTS,
        "shared_prefix": SHARED_PREFIX,
        "prompt_len": PROMPT_LEN,
        "reps": reps,
        "round_us": round_us,
        "per_request_us": round_us / ADMIT_REQUESTS,
        "add_request_us_per_request": median_us(adds) / ADMIT_REQUESTS,
        "phases_us": phase_us,
    }


# ---------------------------------------------------------------------------------------------- a real model (CUDA)
def bench_model_decode(
    engine: LLMEngine,
    batch: int,
    params: SamplingParams,
    steps: int,
    warmup: int,
    rng: np.random.Generator,
    hbm_tbps: float,
) -> dict[str, Any]:
    """Wall time per step, then GPU time of each step's decode forward (CUDA events around the graph replay),
    and the decode floor: (weights + KV the step reads) / HBM bandwidth."""
    ids = fill_decode_batch(engine, random_prompts(rng, batch, engine.vocab_size), params)
    running = [engine.requests[i] for i in ids]
    time_steps(engine, warmup)
    clean, _ = time_steps(engine, steps)
    context_start = np.mean([len(r.prompt_ids) + len(r.output_ids) for r in running])
    spec = [("forward", torch.cuda.CUDAGraph, "replay"), ("sample", engine.sampler, "sample")]
    with EventTimer(spec) as timer:
        evented, _ = time_steps(engine, steps)
    context_end = np.mean([len(r.prompt_ids) + len(r.output_ids) for r in running])
    assert all(r.finish_reason is None for r in running), "a request ended early"
    abort_all(engine, ids)
    kv_bytes_per_token = engine.runner.kv.bytes_per_position
    mean_context = (context_start + context_end) / 2
    floor_bytes = engine.runner.weight_read_bytes + batch * mean_context * kv_bytes_per_token
    floor_us = floor_bytes / (hbm_tbps * 1e12) * 1e6
    step_us = median_us(clean)
    gpu_us, sample_us = timer.median_us("forward"), timer.median_us("sample")
    evented_us = median_us(evented)  # later steps than the clean ones: contexts `steps` longer
    return {
        "batch": batch,
        "sampling": "greedy" if params.temperature == 0 else "random",
        "steps": steps,
        "graph_replays": len(timer.events["forward"]),
        "mean_context": float(mean_context),
        "step_us": step_us,
        "per_seq_us": step_us / batch,
        "step_us_with_events": evented_us,
        "gpu_forward_us": gpu_us,
        "gpu_sample_us": sample_us,
        "host_us": evented_us - gpu_us - sample_us,  # all three from the same steps
        "floor_MB": floor_bytes / 1e6,
        "floor_us": floor_us,
        "floor_fraction_of_gpu_forward": floor_us / gpu_us,
        "floor_fraction_of_step": floor_us / step_us,
    }


# ---------------------------------------------------------------------------------------------- report
def machine() -> dict[str, str]:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info["cpu_threads"] = str(torch.get_num_threads())
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def print_decode(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    phase_names = [
        "reserve",
        "copy_blocks",
        "runner.decode",
        "block tables",
        "graph replay",
        "decode other",
        "mark_written",
        "_sample",
        "sampling setup",
        "sample",
        "output processing",
        "engine other",
        "step (instrumented)",
    ]
    header = f"{'phase (median µs)':<24}" + "".join(
        f"{r['batch']:>8} {r['sampling'][:1]}" for r in rows
    )
    print(header)
    print(f"{'step (clean)':<24}" + "".join(f"{r['step_us']:>10.1f}" for r in rows))
    print(f"{'  per sequence':<24}" + "".join(f"{r['per_seq_us']:>10.2f}" for r in rows))
    for name in phase_names:
        if any(name in r["phases_us"] for r in rows):
            print(f"{name:<24}" + "".join(f"{r['phases_us'].get(name, 0.0):>10.1f}" for r in rows))


def sampling_modes(args: argparse.Namespace, max_tokens: int | None = None) -> list[SamplingParams]:
    """The sampling modes asked for; ``max_tokens`` bounds each request's output (the engine refuses
    a request whose prompt plus ``max_tokens`` cannot fit its KV pool, and a real model's pool is
    sized for the steps measured)."""
    modes = [GREEDY] if args.sampling == "greedy" else [GREEDY, RANDOM]
    if max_tokens is not None:
        modes = [dataclasses.replace(m, max_tokens=max_tokens) for m in modes]
    return [dataclasses.replace(m, detokenize=False) for m in modes] if args.ids_only else modes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument(
        "--steps", type=int, default=200, help="timed decode steps per batch (twice: clean, phases)"
    )
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--admit-reps", type=int, default=40)
    parser.add_argument("--vocab", type=int, default=512, help="the stub model's vocabulary")
    parser.add_argument("--sampling", choices=("greedy", "both"), default="greedy")
    parser.add_argument(
        "--ids-only",
        action="store_true",
        help="requests stream token ids only (detokenize=False), as `radixinfer bench` asks",
    )
    parser.add_argument(
        "--model", help="also run this real model (preset or checkpoint dir) through api.LLM"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model-steps", type=int, default=100)
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="--model over this many GPUs [1]"
    )
    parser.add_argument(
        "--hbm-tbps",
        type=float,
        default=None,
        help="HBM bandwidth for the decode floor (default: measured, bench_kernels.ceilings)",
    )
    parser.add_argument("--skip-stub", action="store_true")
    parser.add_argument(
        "--json", nargs="?", const="-", help="write every number as JSON to this path (- = stdout)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    # The engine's host work is one thread; on a small shared CPU, torch's intra-op pool only adds jitter.
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {"machine": machine(), "device": str(device), "args": vars(args)}

    def dump() -> None:
        if args.json and args.json != "-":
            Path(args.json).write_text(json.dumps(result, indent=1))

    if not args.skip_stub:
        max_batch = max(batches)
        num_blocks = (
            max_batch * -(-(PROMPT_LEN + args.warmup + 2 * args.steps + 16) // BLOCK_SIZE) + 64
        )
        engine = build_stub_engine(device, args.vocab, max_batch, num_blocks)
        modes = sampling_modes(args)
        result["stub_decode"] = [
            bench_decode(engine, b, params, args.steps, args.warmup, rng)
            for params in modes
            for b in batches
        ]
        print_decode(result["stub_decode"], f"stub model, {device}: host time per decode step")
        dump()
        result["stub_admit"] = admit = bench_admit(device, args.vocab, args.admit_reps, rng)
        print(
            f"\nadmission round: {admit['requests']} requests x {admit['prompt_len']} tokens sharing a cached "
            f"{admit['shared_prefix']}-token prefix: {admit['round_us']:.0f} µs ({admit['per_request_us']:.1f} "
            f"µs/request; add_request {admit['add_request_us_per_request']:.1f} µs/request)"
        )
        for name, us in admit["phases_us"].items():
            print(f"  {name:<28}{us:>10.1f}")
        dump()
    if args.model:
        from radixinfer import LLM

        context = PROMPT_LEN + args.warmup + 2 * args.model_steps + 16
        t0 = time.perf_counter()
        if args.hbm_tbps is None and device.type == "cuda":
            from bench_kernels import ceilings  # this script's folder: benchmarks/

            args.hbm_tbps = ceilings()["hbm_TBps"]
            print(f"HBM bandwidth for the floor: {args.hbm_tbps:.2f} TB/s (measured)")
        result["hbm_tbps"] = args.hbm_tbps
        llm = LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            max_batch_size=max(batches),
            freeze_gc=True,
            num_blocks=max(batches) * -(-context // BLOCK_SIZE) + 64,
        )
        result["model_build_s"] = time.perf_counter() - t0
        engine = llm.engine
        rows = []
        for params in sampling_modes(args, max_tokens=context - PROMPT_LEN):
            for b in batches:
                try:  # one failing case (say, out of memory at the largest batch) keeps the others
                    if device.type == "cuda":
                        rows.append(
                            bench_model_decode(
                                engine, b, params, args.model_steps, args.warmup, rng, args.hbm_tbps
                            )
                        )
                    else:
                        rows.append(
                            bench_decode(engine, b, params, args.model_steps, args.warmup, rng)
                        )
                except Exception as exc:  # noqa: BLE001 - reported, then the next case runs
                    traceback.print_exc()
                    rows.append({"batch": b, "sampling": params.temperature, "error": repr(exc)})
                    abort_all(
                        engine, [i for i, r in engine.requests.items() if r.finish_reason is None]
                    )
                print(json.dumps(rows[-1]))
                result[f"model_decode:{args.model}"] = rows
                dump()
        llm.close()
    if args.json == "-":
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
