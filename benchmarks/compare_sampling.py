"""The sampling kernel against an older version of itself, side by side in one process: the same
logits, parameters and timing for both, so the ratio does not depend on the machine's mood.

    python benchmarks/compare_sampling.py [--old-commit main] [--old PATH] [--json PATH]

Needs CUDA. The old kernel is ``kernels/sampling.py`` of ``--old-commit`` (read with ``git show``,
so the checkout needs its history) or the file at ``--old`` (``git show 50cc1ef:kernels/sampling.py
> /tmp/old_sampling.py`` elsewhere), loaded as a module of its own; both run with their default
`Tiles` unless ``RADIXINFER_SAMPLING_TILES`` sets the new one's (``--old-tiles`` the old one's,
in its own fields). Shapes and configurations are
`sweep_sampling.py`'s: ``[256, 151936]`` and ``[64, 128256]`` bf16 logits, N(0, 2^2), temperature 0.8
with top-p 0.95, top-k 50, min-p 0.05, all three, and temperature 1.0 alone. Per shape and
configuration: microseconds per call of each (median, one CUDA graph replay per call), old over
new, and each one's mismatches against `sample_ref` (top-p boundary tokens under float rounding:
up to 2 per 256 rows are expected).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import graph_ms, table  # noqa: E402
from sweep_sampling import CONFIGS, SHAPES, batch_for, random_logits, tensors  # noqa: E402

from kernels import sampling as new  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def load_old(commit: str, path: str | None, tiles: str):
    """The old ``kernels/sampling.py`` as module ``sampling_old``, its ``TILES`` read from
    ``tiles`` (the environment variable is set to it while the module loads)."""
    if path is None:
        text = subprocess.run(
            ["git", "show", f"{commit}:kernels/sampling.py"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        handle = tempfile.NamedTemporaryFile("w", suffix="_sampling_old.py", delete=False)
        handle.write(text)
        handle.close()
        path = handle.name
    saved = os.environ.get("RADIXINFER_SAMPLING_TILES")
    os.environ["RADIXINFER_SAMPLING_TILES"] = tiles
    try:
        spec = importlib.util.spec_from_file_location("sampling_old", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["sampling_old"] = module  # (its dataclass looks its module up)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            os.environ.pop("RADIXINFER_SAMPLING_TILES", None)
        else:
            os.environ["RADIXINFER_SAMPLING_TILES"] = saved
    return module


def compare(old) -> list[dict]:
    """One row per shape and configuration: both kernels' microseconds and mismatches."""
    rows_out = []
    for rows, vocab in SHAPES:
        logits = random_logits(rows, vocab)
        for name, fields in CONFIGS.items():
            if not fields:
                continue
            batch = batch_for(rows, fields)
            t = tensors(batch)
            ref = new.sample_ref(logits, *t)
            row = {"shape": f"{rows} x {vocab}", "config": name}
            for label, module in (("old", old), ("new", new)):

                def call(m=module, x=logits, t=t, f=batch.filters):
                    return m.sample_triton(x, *t, filters=f)

                row[f"{label} us"] = graph_ms([call]) * 1e3
                row[f"{label} mismatches"] = int((call() != ref).sum())
            row["old / new"] = row["old us"] / row["new us"]
            rows_out.append(row)
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--old-commit", default="main")
    parser.add_argument("--old", default=None, metavar="PATH", help="the old sampling.py itself")
    parser.add_argument("--old-tiles", default="", help="the old kernel's tiles (its defaults)")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    old = load_old(args.old_commit, args.old, args.old_tiles)
    results = compare(old)
    print(f"{torch.cuda.get_device_name()}; old tiles {old.TILES}; new tiles {new.TILES}")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                               "old_tiles": str(old.TILES),
                                               "new_tiles": str(new.TILES),
                                               "results": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
