"""What the launchers need to know about the device they size their grids for."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (Triton's interpreter: fewer programs run
    faster)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
