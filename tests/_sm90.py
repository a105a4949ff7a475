"""Compiling Triton kernels for an H100 (sm_90) on a machine without a GPU.

Triton's interpreter runs code its compiler refuses (a local flag made of constexprs, a loop variable
whose type changes), so the CPU tests also compile the kernels' variants, in a process outside the
interpreter. A script given to `compile_outside_the_interpreter` calls
``compile_for_sm90(fn, num_warps, types, **constexprs)``: ``types`` maps an argument's name to its
Triton type (``"*bf16"``, ``"fp32"``); other names ending in ``_ptr`` are ``*fp32``, the rest ``i32``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compile_for_sm90(fn, num_warps, types, **constexprs):
    names = inspect.signature(fn.fn).parameters
    signature = {n: "constexpr" if n in constexprs
                 else types.get(n, "*fp32" if n.endswith("_ptr") else "i32") for n in names}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
"""


def compile_outside_the_interpreter(script: str) -> None:
    """Run ``script`` (after the helper) in a fresh process without ``TRITON_INTERPRET``; fails with
    the compiler's error, skips where Triton has no CUDA toolchain."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-c", HELPER + script + "\nprint('compiled')"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    if "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("no ptxas")
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
