"""Tensor parallelism over torch.distributed (docs/multi-gpu.md)."""
