"""Test-wide setup. Without CUDA, Triton kernels run through Triton's interpreter (read once, when
Triton is first imported, so it is set before any test module imports it).

`gpt2_checkpoint_dir`: a one-layer GPT-2 checkpoint with the byte-level BPE tokenizer of the
GPT-2-small comparison checkpoint (50,257 ids), built once per session by
``benchmarks/make_gpt2_checkpoint.py``."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def checkpoint_script():
    """``benchmarks/make_gpt2_checkpoint.py`` as a module (benchmarks/ is not a package)."""
    path = REPO / "benchmarks" / "make_gpt2_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_gpt2_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def gpt2_checkpoint_dir(tmp_path_factory, checkpoint_script) -> Path:
    out = tmp_path_factory.mktemp("gpt2-bpe")
    args = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--n-positions", "64"]
    assert checkpoint_script.main([str(out), *args]) == 0  # ~5 s: trains the tokenizer
    return out
