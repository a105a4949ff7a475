"""Test-wide setup. Without CUDA, Triton kernels run through Triton's interpreter (read once, when Triton is
first imported, so it is set before any test module imports it)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
