"""Test-wide setup. Without CUDA, Triton kernels run through Triton's interpreter (read once, when Triton is
first imported, so it is set before any test module imports it). Fixtures every module may use:
``bpe_tokenizer_dir``."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def bpe_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer's files, trained for this session (`tests.bpe_tokenizer`)."""
    from tests.bpe_tokenizer import save_bpe_tokenizer

    return save_bpe_tokenizer(tmp_path_factory.mktemp("bpe-tokenizer"))
