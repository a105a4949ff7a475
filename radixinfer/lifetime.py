"""A spawned process never outlives the process that started it.

Every process radixinfer starts (an engine process, `radixinfer.engine_process`; a tensor-parallel
worker rank, `radixinfer.distributed.launch`; an API server process of ``radixinfer serve``,
`radixinfer.server.api_servers`; a benchmark client process, `radixinfer.bench.client_processes`)
calls `exit_with_parent` first thing. A front killed by SIGKILL, or by a SIGTERM it does not handle
(``timeout`` ending a benchmark), runs none of its cleanup; without this, an engine process waiting
for work, or a worker rank waiting for its engine, would go on holding its GPU memory, and the next
run on those GPUs would find it taken. The chain ends from the top: a front's engine processes
exit, then their worker ranks, each noticing its own parent.

How: multiprocessing's spawn start method hands the child the read end of a pipe whose write end
only the parent holds (``multiprocessing.parent_process().sentinel``); the kernel closes that end
when the parent exits, however it exits, and the read end then reports EOF. A daemon thread waits
for that and ends the process at once (``os._exit``: with its parent gone no one is left to hand
anything to). Unlike Linux's ``PR_SET_PDEATHSIG`` it follows the parent process, not the thread that
started the child (a data-parallel front starts its replicas from threads that end at once), it
has no race with a parent that exits before the child is set up (the EOF stays), and it works on
every platform. What must hold: only the parent holds the write end, until it exits. A parent that
forks a child with the fork start method hands that child a copy (the sentinel then waits for it
too); one that lets its ``Process`` object be collected while the child runs closes it early (the
child then exits: radixinfer's owners keep theirs until the child has ended, and multiprocessing
keeps every live child's).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from multiprocessing.process import BaseProcess

PARENT_GONE_EXIT_CODE = 1


def exit_with_parent() -> None:
    """End this process (``os._exit(PARENT_GONE_EXIT_CODE)``, saying so on stderr) as soon as the
    process that started it has exited. Call it first in the body of a process of multiprocessing's
    spawn context; ``RuntimeError`` in a process that multiprocessing did not start."""
    parent = multiprocessing.parent_process()
    if parent is None:
        raise RuntimeError("exit_with_parent: this process was not started by multiprocessing")
    name = multiprocessing.current_process().name
    threading.Thread(
        target=_exit_when_gone, args=(parent, name), name="radixinfer-parent-watch", daemon=True
    ).start()


def _exit_when_gone(parent: BaseProcess, name: str) -> None:
    parent.join()  # returns when the parent's end of the sentinel pipe has closed
    print(f"{name}: parent process {parent.pid} has exited; exiting", file=sys.stderr, flush=True)
    os._exit(PARENT_GONE_EXIT_CODE)
