"""`GCPauses`: the pauses of Python's garbage collector while it is entered. A full pass stops every
thread of the process, so a stall can be told apart from the GPU or the scheduler: the benchmark
records each run's pauses, and the engine's step trace the pauses within each step."""

from __future__ import annotations

import gc
import time


class GCPauses:
    """While entered (or between `start` and `stop`), every pause of the collector, in ``pauses_ms``
    and summed in ``total_s`` (read before and after a stretch of work: the pauses within it)."""

    def __init__(self) -> None:
        self.pauses_ms: list[float] = []
        self.total_s = 0.0
        self._start = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            pause = time.perf_counter() - self._start
            self.pauses_ms.append(pause * 1e3)
            self.total_s += pause

    def start(self) -> GCPauses:
        """Record from now on (until `stop`)."""
        gc.callbacks.append(self._on_gc)
        return self

    def stop(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def __enter__(self) -> GCPauses:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
