"""Whether torchrun (or any launcher that sets ``RANK`` and ``WORLD_SIZE``) started this process,
read from the environment alone (the command line checks it before importing the engine)."""

from __future__ import annotations

import os


def torchrun_rank() -> int | None:
    """This process's rank when a launcher set ``RANK`` and ``WORLD_SIZE``, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None
