"""Programmatic dependent launch (PDL): a kernel starts while the one before it in the stream finishes.

A decode step at batch 1 is ~200 short launches (1.5-7 us each on an H200), and between two of them the GPU
drains one grid, then ramps the next up: the next kernel's programs are scheduled only after the last program
of the one before has exited. On Hopper and later a kernel launched with PDL may be scheduled as soon as
every program of the kernel before it has signalled (``gdc_launch_dependents``), and runs up to its
``gdc_wait``, which returns once that kernel has completed and its writes are visible. Work before the wait
overlaps the previous kernel: scheduling, address arithmetic, and reads of what no kernel of the step writes
(a linear layer's weight, a norm's weight).

What must hold, in every kernel launched this way (`launch_options` gives a launcher both switches):

- every program runs `wait_for_inputs` before it reads anything an earlier kernel writes and before its
  first store (a store before the wait could land under a reader still running);
- the wait runs in every program, unconditionally: a kernel completes only after its programs have waited,
  so a kernel two launches on, which waits only for its own predecessor, still sees this one's inputs'
  producers finished.

A kernel launched without PDL (cuBLAS, PyTorch's own kernels) starts after everything before it completes,
as always, so mixing the two is safe. CUDA graphs capture the launches as programmatic edges.

``RADIXINFER_PDL=0`` in the environment (read once per device, at the first launch) launches every kernel
without it, for an A/B of the same code.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: a CUDA device of compute capability 9.0 or later
    (the ``griddepcontrol`` instructions), unless ``RADIXINFER_PDL=0``."""
    if device.type != "cuda" or os.environ.get("RADIXINFER_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """The launch keywords of a kernel that takes ``USE_PDL: tl.constexpr``: the constexpr, and Triton's
    ``launch_pdl`` option when PDL is on (Triton's interpreter, on the CPU, never sees the option)."""
    if programmatic_launch(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def let_next_kernel_start(USE_PDL: tl.constexpr):
    """Signals that the next kernel in the stream may be scheduled once every program of this one has
    signalled. A hint, safe anywhere: the next kernel's `wait_for_inputs` still waits for this one to
    complete. Called first, so the next kernel's programs are placed while this one runs."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    """Returns once the kernel before this one in the stream has completed and its writes are visible
    (at once without PDL, where the launch itself waited)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
