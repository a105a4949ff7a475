"""Host (Python) cost per engine step, this tree against another tree of radixinfer, on the CPU with
the model's forward stubbed: what the GPU suite's host-bound runs (a small model, small batches)
pay per step, for two versions of the engine side by side.

    mkdir -p /tmp/before && git archive 284315e | tar -x -C /tmp/before   # once: the other tree
    PYTHONPATH=. python benchmarks/host_step_ab.py --other /tmp/before
    PYTHONPATH=. python benchmarks/host_step_ab.py --workloads fixed65,shared_prefix --repeats 7
    PYTHONPATH=. python benchmarks/host_step_ab.py --profile fixed65 --top 25   # this tree's hot spots

Each tree runs in a child process of its own (``PYTHONPATH=TREE``), so each imports its own
``radixinfer``; both build ``LLM("tiny", device="cpu")`` and have the forward replaced by
`bench_serve.install_stub` (the embedding lookup: no layers, no attention) and its KV block copies
made no-ops (device work as well), so what is left is the
engine's host side: intake, admission, the radix tree, the scheduler, the decode batch, the
sampler's setup (its argmax over the byte vocabulary is a few µs) and output processing.

Every workload adds all its requests at once (token ids, ``ignore_eos``, ``detokenize=False``;
prompts converted and params built before the clock starts, as ``radixinfer bench`` has them) and
steps the engine until it has nothing unfinished; each tree sees the same requests, so both take the
same number of steps. Each tree's child runs every workload ``--repeats`` times, and ``--rounds``
children per tree alternate ABBA (the machine's load drifts).
Per workload and tree: ``wall us`` and ``cpu us`` are medians over all timed runs of the run's wall
(process CPU) time / steps, torch on one thread; ``floor us`` the least wall time of each phase
(adding the requests, then each step by its index) over all timed runs, summed, per step: the
steadiest time on a loaded machine, where other processes only ever add to a phase;
``calls/step`` the Python function calls per step under cProfile (one more run; deterministic).
The last columns are this tree's over the other's. Workloads whose cache is warm run once untimed
first (like the suite's ``--warmup-runs 1``); the cold ones reset the
prefix cache before every run. The shapes follow ``benchmarks/gpu_suite.sh``, scaled to a CPU:

* ``fixed65``: 256 requests of one 65-token prompt, 128 new tokens, batch 64;
* ``hello65``: 512 requests of one 65-token prompt, 2 new tokens, batch 16 (warm: exact repeats);
* ``shared_prompt``: a 200-token prompt + 8 tokens of each request's own, 256 requests, 64 new
  tokens, batch 256, prefill batch 64, cold;
* ``head_of_line``: one 512-token prompt per three of 16, 128 requests, 32 new tokens, batch 8,
  prefill budget 256 tokens, FIFO forced every 8 rounds, no prefix cache;
* ``shared_prefix``: 8 groups x 16 prompts of a 512-token group prefix + 64 tokens, 64 new, batch
  128, cold;
* ``random``: 128 distinct prompts of 16 to 512 tokens, 64 new tokens, batch 128, cold;
* ``no_reuse`` / ``no_reuse_host``: 256 distinct 512-token prompts, 32 new tokens, batch 64, a
  1,024-block pool (half of what a full batch holds: eviction all the time), cold; without and with
  a host tier of 4,096 blocks, which writes every evicted tail back (the host tier's cost when
  nothing is reused; its copies are stubbed like the block copies, the host's work around them
  is measured).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# name -> (engine options, requests, new tokens each, warm cache); the prompts: `prompts`
WORKLOADS = {
    "fixed65": (dict(max_batch_size=64), 256, 128, True),
    "hello65": (dict(max_batch_size=16, prefill_max_batch_size=16), 512, 2, True),
    "shared_prompt": (dict(max_batch_size=256, prefill_max_batch_size=64), 256, 64, False),
    "head_of_line": (
        dict(
            max_batch_size=8,
            prefill_max_batch_size=128,
            prefill_max_tokens=256,
            prefill_force_fifo_every=8,
            enable_prefix_cache=False,
        ),
        128,
        32,
        True,
    ),
    "shared_prefix": (dict(max_batch_size=128), 128, 64, False),
    "random": (dict(max_batch_size=128), 128, 64, False),
    # distinct prompts through a pool of half their KV: eviction all the time, with the host tier
    # of 4,096 blocks (the tiny model's 64 KiB each) writing every evicted tail back, or without
    "no_reuse": (dict(max_batch_size=64, num_blocks=1024), 256, 32, False),
    "no_reuse_host": (dict(max_batch_size=64, num_blocks=1024, host_cache_gb=0.25), 256, 32, False),
}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]  # printable bytes of the byte tokenizer


def prompts(name: str, count: int) -> list[list[int]]:
    """The workload's prompts, the same in every tree (seeded)."""
    rng = random.Random(0)
    if name in ("fixed65", "hello65"):
        return [_tokens(rng, 65)] * count
    if name == "shared_prompt":
        shared = _tokens(rng, 200)
        return [shared + _tokens(rng, 8) for _ in range(count)]
    if name == "head_of_line":
        return [_tokens(rng, 512 if i % 4 == 0 else 16) for i in range(count)]
    if name == "shared_prefix":
        groups = [_tokens(rng, 512) for _ in range(8)]
        return [groups[i // 16] + _tokens(rng, 64) for i in range(count)]
    if name == "random":
        return [_tokens(rng, rng.randrange(16, 513)) for _ in range(count)]
    if name in ("no_reuse", "no_reuse_host"):
        return [_tokens(rng, 512) for _ in range(count)]
    raise ValueError(f"unknown workload {name!r}")


# ---------------------------------------------------------------------------------- the child process
def _prepare(llm, name: str) -> list:
    """The workload's ``(prompt, params)`` pairs as ``radixinfer bench`` has them before its clock
    starts: each prompt converted by the engine (`Backend.native_prompt`), params of its own each."""
    from radixinfer import SamplingParams

    new_tokens = WORKLOADS[name][2]
    return [
        (
            llm.engine.prompt_ids(prompt),
            SamplingParams(max_tokens=new_tokens, ignore_eos=True, detokenize=False),
        )
        for prompt in prompts(name, WORKLOADS[name][1])
    ]


def _run(llm, name: str, requests: list, times: list[float] | None = None) -> int:
    """Add the prepared requests and step until done; the number of steps. ``times``: gets the
    wall time of adding the requests, then of each step, in seconds."""
    options, _, _, warm = WORKLOADS[name]
    engine = llm.engine
    if not warm and options.get("enable_prefix_cache", True):
        engine.reset_prefix_cache()
    clock = time.perf_counter
    start = clock()
    for prompt, params in requests:
        engine.add_request(prompt, params)
    steps = 0
    while engine.has_unfinished():
        if times is not None:
            times.append(clock() - start)
            start = clock()
        engine.step()
        steps += 1
    if times is not None:
        times.append(clock() - start)
    return steps


def _forget(llm) -> None:
    """Pop every finished request (untimed): engines keep them until their outputs are read."""
    for request_id in list(llm.engine.requests):
        llm.engine.pop_finished(request_id)


def _build(name: str):
    from radixinfer import LLM

    llm = LLM(model="tiny", device="cpu", **WORKLOADS[name][0])
    # The copy-on-write block copies are device work (one kernel launch on a GPU; on the CPU a copy
    # of every layer's blocks, ~0.5 ms a step at hello65): the stub writes no K/V, so copy nothing.
    llm.engine.runner.kv._copy = lambda k, v, src, dst: None
    # The host tier's gathers, scatters and bus copies are device work too.
    host_kv = llm.engine.host_kv
    if host_kv is not None:
        host_kv._offload = host_kv._load = lambda *args: None
    gc.collect()
    gc.freeze()  # as a served engine does (`freeze_gc`; the old LLM always froze)
    return llm


def worker(names: list[str], repeats: int, profile: str | None, top: int) -> dict:
    """Measure every workload in this process's tree; a dict of results."""
    import torch

    import radixinfer  # this tree's, before bench_serve puts the repo on sys.path

    torch.set_num_threads(1)  # the little tensor work left runs inline, not on a contended pool

    sys.path.insert(0, str(HERE))
    from bench_serve import install_stub

    install_stub()
    out: dict = {"tree": str(Path(radixinfer.__file__).parents[1])}
    for name in names:
        llm = _build(name)
        _run(llm, name, _prepare(llm, name))  # warm-up: imports, allocations (and a warm cache)
        _forget(llm)
        per_step, cpu_per_step, phases = [], [], []
        for _ in range(repeats):
            requests, times = _prepare(llm, name), []
            start, cpu_start = time.perf_counter(), time.process_time()
            steps = _run(llm, name, requests, times)
            cpu_per_step.append((time.process_time() - cpu_start) / steps * 1e6)
            per_step.append((time.perf_counter() - start) / steps * 1e6)
            phases.append(times)
            _forget(llm)
        requests = _prepare(llm, name)
        prof = cProfile.Profile()
        prof.enable()
        steps = _run(llm, name, requests)
        prof.disable()
        _forget(llm)
        stats = pstats.Stats(prof)
        out[name] = {
            "steps": steps,
            "wall_us": per_step,
            "cpu_us": cpu_per_step,
            "phase_min_s": [min(run[i] for run in phases) for i in range(steps + 1)],
            "calls_per_step": stats.total_calls / steps,
        }
        if name == profile:
            stats.sort_stats("tottime").print_stats(top)
            stats.sort_stats("ncalls").print_stats(top)
    return out


# --------------------------------------------------------------------------------- the parent process
def measure(tree: Path, args: argparse.Namespace) -> dict:
    """Run the workloads in a child process importing ``tree``'s radixinfer."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, __file__, "--worker", "--workloads", ",".join(args.workloads)]
    command += ["--repeats", str(args.repeats), "--top", str(args.top)]
    if args.profile:
        command += ["--profile", args.profile]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)
    *printed, last = done.stdout.rstrip("\n").split("\n")
    if printed:
        print("\n".join(printed))
    return json.loads(last)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--other", type=Path, default=None, help="the tree to compare against")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per child process")
    parser.add_argument("--rounds", type=int, default=2, help="child processes per tree")
    parser.add_argument(
        "--profile", default=None, help="print this workload's cProfile, each tree's"
    )
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    if args.worker:
        result = worker(args.workloads, args.repeats, args.profile, args.top)
        print(json.dumps(result))
        return
    trees = {"this": REPO, "other": args.other.resolve()} if args.other else {"this": REPO}
    results: dict[str, dict] = {}
    order = list(trees)
    for round_ in range(args.rounds):  # ABBA: each tree goes first as often
        for key in order if round_ % 2 == 0 else order[::-1]:
            merge(results.setdefault(key, {}), measure(trees[key], args))
    print_table(results, args.workloads)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def merge(into: dict, result: dict) -> None:
    """Pool one child's timed runs into the tree's earlier ones."""
    for name, numbers in result.items():
        if name == "tree":
            into[name] = numbers
        elif name in into:
            into[name]["wall_us"] += numbers["wall_us"]
            into[name]["cpu_us"] += numbers["cpu_us"]
            into[name]["phase_min_s"] = list(
                map(min, into[name]["phase_min_s"], numbers["phase_min_s"])
            )
        else:
            into[name] = numbers


def print_table(results: dict, names: list[str]) -> None:
    """Per workload and tree: calls per step, the medians of wall and CPU time per step and the
    floor per step; with two trees, this tree's over the other's."""
    cols = f"{'steps':>6} {'calls/step':>10} {'wall us':>8} {'cpu us':>8} {'floor us':>8}"
    print(f"\n{'':<14} " + "  ".join(f"{key + ': ' + results[key]['tree']:<46}" for key in results))
    head = f"{'workload':<14} " + "  ".join(cols for _ in results)
    if "other" in results:
        head += f"  {'calls':>6} {'wall':>6} {'cpu':>6} {'floor':>7}"
    print(head)
    for name in names:
        line = f"{name:<14}"
        row = {}
        for key, result in results.items():
            numbers = result[name]
            row[key] = (
                numbers["calls_per_step"],
                statistics.median(numbers["wall_us"]),
                statistics.median(numbers["cpu_us"]),
                sum(numbers["phase_min_s"]) / numbers["steps"] * 1e6,
            )
            line += f" {numbers['steps']:>6} " + " ".join(
                f"{x:>{w}.0f}" for x, w in zip(row[key], (10, 8, 8, 8))
            )
            line += " "
        if "other" in results:
            ratios = [a / b for a, b in zip(row["this"], row["other"])]
            line += " " + " ".join(f"{r:>{w}.3f}" for r, w in zip(ratios, (6, 6, 6, 7)))
            if result[name]["steps"] != results["this"][name]["steps"]:
                line += "  (steps differ)"
        print(line)
    if "other" in results:
        print("last four columns: this tree / the other (< 1: this tree is cheaper)")


if __name__ == "__main__":
    main()
