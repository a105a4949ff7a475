"""The device's memory bandwidth, for the decode floor in the bench's report (`metrics.decode_floor`):
measured once before the engines open, on a CUDA device, unless ``--hbm-tbps`` gives it. The benchmark
scripts' ceilings (``benchmarks/bench_kernels.py``) take their bandwidth from here too."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

# Large enough that the L2 cache does not matter, small beside any GPU's memory.
BANDWIDTH_PROBE_BYTES = 1 << 30


def cuda_median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn()`` on the current CUDA stream over ``repeats`` calls after one
    unmeasured call, CUDA events around each."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def memory_rates(device: torch.device, repeats: int = 10) -> tuple[float, float]:
    """Bytes per second of a copy (bytes read plus written) and of a sum (bytes read) over
    `BANDWIDTH_PROBE_BYTES` of ``device``'s memory, each the median of ``repeats`` calls."""
    if device.type != "cuda":
        raise ValueError(f"measures a CUDA device's memory, not {device}'s")
    x = torch.empty(BANDWIDTH_PROBE_BYTES // 2, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    copy = 2 * BANDWIDTH_PROBE_BYTES / cuda_median_s(lambda: y.copy_(x), repeats)
    return copy, BANDWIDTH_PROBE_BYTES / cuda_median_s(lambda: x.sum(dtype=torch.float32), repeats)


def measure_memory_tbps(device: torch.device, repeats: int = 10) -> float:
    """The device's memory bandwidth in TB/s: the better of `memory_rates`' two. Empties the
    allocator's cache after, so an engine opened later plans its memory without the buffers."""
    rate = max(memory_rates(device, repeats))
    torch.cuda.empty_cache()
    return rate / 1e12
