"""Import first in a test module that launches Triton kernels: without CUDA they run in Triton's interpreter.

`TRITON_INTERPRET` is read when `@triton.jit` decorates a function — Triton's own `triton.language`
helpers included — so it must be set before `triton` is first imported. In a pytest session other modules
usually got there first (torch's dynamo imports triton, the engine imports `kernels`), so the Python parts
of `triton` and `kernels` are dropped from `sys.modules` and imported again under the interpreter. Their
compiled extension (`triton._C`) is kept; earlier importers keep the old objects, which on a machine
without CUDA never launch a kernel. With CUDA nothing changes.
"""

import os
import sys

import torch

INTERPRETED = not torch.cuda.is_available()

if INTERPRETED and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in [n for n in sys.modules if n.partition(".")[0] in ("triton", "kernels")]:
        if not _name.startswith("triton._C"):
            del sys.modules[_name]
    sys.modules.pop("radixinfer.attention.triton_backend", None)
