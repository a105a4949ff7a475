"""Micro-benchmarks of the prefix-cache core (CPU only, no model).

    python benchmarks/bench_cache.py            # a table
    python benchmarks/bench_cache.py --json     # one JSON object

Each case times one call with `time.perf_counter_ns`, state rebuilt outside the timed region where the call
mutates it, and reports the median (and p90) over many runs; the whole case is repeated (``--repeat``) and
the repetition with the lowest median is kept, which filters out other processes on a shared machine:

* ``match_8k``: `RadixTree.match` of an 8k-token prompt on a warm tree holding a few hundred other paths,
  half of which branch off the prompt's own path (so the walk crosses ~150 nodes).
* ``insert_8k``: `RadixTree.insert` of 8k tokens the tree does not hold (block_size 16).
* ``evict_1k``: `RadixTree.evict` of 1k blocks from a 10k-node tree of unlocked leaves.
* ``append_cow_256`` / ``append_256``: one decode step's `KVCacheManager.reserve` for 256 sequences, all
  of which must copy their shared, partially filled boundary block / none of which must.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from radixinfer.cache.block_pool import BlockPool
from radixinfer.cache.kv_manager import KVCacheManager
from radixinfer.cache.radix_tree import RadixTree
from radixinfer.cache.tree_node import as_token_array

BLOCK_SIZE = 16
PROMPT_LEN = 8192
BATCH = 256
TARGETS_US = {
    "match_8k": 100.0,
    "insert_8k": 300.0,
    "append_cow_256": 2.0 * BATCH,
    "append_256": 2.0 * BATCH,
}


def measure(
    call: Callable[[], object], setup: Callable[[], object] | None = None, runs: int = 200
) -> list[float]:
    """Microseconds per run of ``call`` (``setup`` runs before each, untimed)."""
    times = []
    for _ in range(runs):
        if setup is not None:
            setup()
        t0 = time.perf_counter_ns()
        call()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return times


def fresh_blocks(pool: BlockPool, num_tokens: int) -> list[int]:
    return pool.allocate(-(-num_tokens // pool.block_size))


def bench_match(rng: np.random.Generator) -> list[float]:
    pool = BlockPool(num_blocks=200_000, block_size=BLOCK_SIZE)
    tree = RadixTree(pool)
    prompt = as_token_array(rng.integers(0, 32_000, PROMPT_LEN))
    tree.insert(prompt, fresh_blocks(pool, PROMPT_LEN))
    for i in range(300):
        shared = int(rng.integers(1, PROMPT_LEN)) if i % 2 == 0 else 0
        tail = rng.integers(0, 32_000, int(rng.integers(64, 1024)))
        other = as_token_array(np.concatenate([prompt[:shared], tail]))
        tree.insert(other, fresh_blocks(pool, len(other)))
    assert tree.match(prompt).length == PROMPT_LEN
    return measure(lambda: tree.match(prompt), runs=2000)


def bench_insert(rng: np.random.Generator) -> list[float]:
    pool = BlockPool(num_blocks=200_000, block_size=BLOCK_SIZE)
    tree = RadixTree(pool)
    runs = 300
    paths = [
        as_token_array(np.concatenate([[i], rng.integers(0, 32_000, PROMPT_LEN - 1)]))
        for i in range(runs)
    ]
    blocks = [fresh_blocks(pool, PROMPT_LEN) for _ in range(runs)]
    jobs = iter(zip(paths, blocks))
    return measure(lambda: tree.insert(*next(jobs)), runs=runs)


def bench_evict(rng: np.random.Generator) -> list[float]:
    """100 shared one-block prefixes with 99 one-block leaves each: 10k nodes, 9.9k evictable leaves."""
    state = {}

    def build() -> None:
        pool = BlockPool(num_blocks=10_100, block_size=BLOCK_SIZE)
        tree = RadixTree(pool)
        for p in range(100):
            prefix = rng.integers(0, 32_000, BLOCK_SIZE)
            prefix[0] = p
            for leaf in range(99):
                tail = rng.integers(0, 32_000, BLOCK_SIZE)
                tail[0] = leaf
                path = as_token_array(np.concatenate([prefix, tail]))
                held = tree.match(path).blocks
                fresh = fresh_blocks(pool, len(path) - len(held) * BLOCK_SIZE)
                tree.insert(path, held + fresh)
                pool.decref(fresh)  # the tree is the only holder
        assert len(tree.nodes()) == 10_000
        tree.check_integrity()
        state["tree"] = tree

    return measure(lambda: state["tree"].evict(1000), setup=build, runs=15)


def _decode_batch(cow: bool) -> tuple[KVCacheManager, Callable[[], None], Callable[[], object]]:
    """256 live sequences at position 24 of block_size-16 blocks (offset 8 in their last block).

    With ``cow`` they all matched one published 24-token prefix whose boundary block its publisher filled
    to 32 positions, so each must copy it before writing position 24; without, each owns its last block."""
    mgr = KVCacheManager(num_blocks=4 * BATCH + 16, block_size=BLOCK_SIZE)
    prefix = list(range(24))
    state: dict[str, list] = {"seqs": []}
    if cow:
        publisher = mgr.admit(prefix + [99] * 8)
        mgr.reserve([publisher], [32])
        mgr.publish(publisher, prefix)
        mgr.mark_written()

    def setup() -> None:
        for seq in state["seqs"]:
            mgr.release(seq)
        if cow:
            seqs = [mgr.admit(prefix) for _ in range(BATCH)]
        else:
            seqs = [mgr.admit([i, *prefix[1:]]) for i in range(1000, 1000 + BATCH)]
            mgr.reserve(seqs, [24] * BATCH)
        mgr.mark_written()
        state["seqs"] = seqs

    def step() -> object:
        seqs = state["seqs"]
        return mgr.reserve(seqs, [s.num_kv + 1 for s in seqs])

    return mgr, setup, step


def bench_append(cow: bool) -> list[float]:
    mgr, setup, step = _decode_batch(cow)
    setup()
    plan = step()
    assert len(plan.copies) == (BATCH if cow else 0), len(plan.copies)
    return measure(step, setup=setup, runs=300)


CASES: dict[str, Callable[[np.random.Generator], list[float]]] = {
    "match_8k": bench_match,
    "insert_8k": bench_insert,
    "evict_1k": bench_evict,
    "append_cow_256": lambda rng: bench_append(cow=True),
    "append_256": lambda rng: bench_append(cow=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )
    parser.add_argument("--only", nargs="*", choices=list(CASES), help="run only these cases")
    parser.add_argument(
        "--repeat", type=int, default=3, help="repetitions of each case (best median kept)"
    )
    args = parser.parse_args()
    results = {}
    for name in args.only or CASES:
        runs = [sorted(CASES[name](np.random.default_rng(seed))) for seed in range(args.repeat)]
        times = min(runs, key=statistics.median)
        median = statistics.median(times)
        per_seq = median / BATCH if name.startswith("append") else None
        target = TARGETS_US.get(name)
        results[name] = {
            "median_us": round(median, 2),
            "p90_us": round(times[int(0.9 * (len(times) - 1))], 2),
            "runs": len(times),
            "repeats": args.repeat,
            "per_seq_us": None if per_seq is None else round(per_seq, 3),
            "target_us": target,
            "meets_target": None if target is None else median <= target,
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'case':<16} {'median µs':>10} {'p90 µs':>10} {'µs/seq':>8} {'target µs':>10}  ok")
    for name, r in results.items():
        per_seq = "" if r["per_seq_us"] is None else f"{r['per_seq_us']:.2f}"
        target = "" if r["target_us"] is None else f"{r['target_us']:.0f}"
        ok = {None: "", True: "yes", False: "NO"}[r["meets_target"]]
        print(
            f"{name:<16} {r['median_us']:>10.1f} {r['p90_us']:>10.1f} {per_seq:>8} {target:>10}  {ok}"
        )


if __name__ == "__main__":
    main()
