"""The device's memory bandwidth, for the decode floor in the bench's report (`metrics.decode_floor`):
measured once before the engines open, on a CUDA device, unless ``--hbm-tbps`` gives it."""

from __future__ import annotations

import statistics

import torch

# Large enough that the L2 cache does not matter, small beside any GPU's memory.
BANDWIDTH_PROBE_BYTES = 1 << 30


def measure_memory_tbps(device: torch.device, repeats: int = 10) -> float:
    """The device's memory bandwidth in TB/s: the better of a copy (bytes read plus written) and a sum
    (bytes read) of a 1 GiB buffer, each the median of ``repeats`` CUDA-event timings. Empties the
    allocator's cache after, so an engine opened later plans its memory without the buffers."""
    if device.type != "cuda":
        raise ValueError(f"measures a CUDA device's memory, not {device}'s")
    rate = max(_copy_and_sum_rates(device, repeats))
    torch.cuda.empty_cache()
    return rate / 1e12


def _copy_and_sum_rates(device: torch.device, repeats: int) -> tuple[float, float]:
    """Bytes per second of a copy and of a sum over `BANDWIDTH_PROBE_BYTES`."""
    x = torch.empty(BANDWIDTH_PROBE_BYTES // 2, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)

    def median_s(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    copy = 2 * BANDWIDTH_PROBE_BYTES / median_s(lambda: y.copy_(x))
    return copy, BANDWIDTH_PROBE_BYTES / median_s(lambda: x.sum(dtype=torch.float32))
