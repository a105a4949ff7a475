"""A front killed with SIGKILL (no cleanup of its own runs) leaves no process of radixinfer's alive:
its engine processes, and theirs, exit with it (`radixinfer.lifetime.exit_with_parent`), whether
they were generating or waiting for work, for an `AsyncLLM` over an engine process, a
`DataParallelLLM` of two, and ``radixinfer serve --api-server-count 2``. Linux only: the process
tree is read from ``/proc``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.http_server import REPO, serve_process

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

EXIT_SECONDS = 10.0  # what every descendant gets to exit once its front is killed

FRONT = """
import asyncio, sys
from radixinfer import AsyncLLM, EngineProcess, SamplingParams
from radixinfer.data_parallel import DataParallelLLM

ENGINE = {"model": "tiny", "block_size": 4, "num_blocks": 512, "max_batch_size": 8}

async def main(front, generating):
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    async def one(prompt):
        async for _ in front.generate(prompt, params):
            print("GENERATING", flush=True)
            await asyncio.sleep(3600)
    if generating:  # one request a replica (round robin), each stopped after its first token
        await asyncio.gather(*(one(list(range(i + 1, i + 30))) for i in range(NUM_REPLICAS)))
    print("IDLE", flush=True)
    await asyncio.sleep(3600)

if __name__ == "__main__":
    NUM_REPLICAS = int(sys.argv[1])
    if NUM_REPLICAS == 0:
        NUM_REPLICAS, front = 1, AsyncLLM(EngineProcess(**ENGINE))
    else:
        replicas = [EngineProcess(**ENGINE) for _ in range(NUM_REPLICAS)]
        front = DataParallelLLM(replicas, policy="round_robin")
    asyncio.run(main(front, sys.argv[2] == "generating"))
"""


def _parent_pids() -> dict[int, int]:
    """Every live process's parent, by process id (zombies count as gone)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited while being read
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    return parents


def _descendants(pid: int) -> set[int]:
    parents = _parent_pids()
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        children = [child for child, p in parents.items() if p == parent]
        found.update(children)
        todo += children
    return found


def _kill_and_check(process: subprocess.Popen, expected_children: int) -> None:
    """SIGKILL ``process``; every process under it (at least ``expected_children``) must exit
    within `EXIT_SECONDS`. Those still alive then are killed, and named in the failure."""
    descendants = _descendants(process.pid)
    assert len(descendants) >= expected_children, descendants
    process.kill()
    process.wait()
    deadline = time.monotonic() + EXIT_SECONDS
    while (alive := descendants & set(_parent_pids())) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"processes left alive after their front was killed: {sorted(alive)}"


@pytest.mark.parametrize(
    ("num_replicas", "state"),
    [(0, "idle"), (0, "generating"), (2, "generating")],
    ids=["engine-process-idle", "engine-process-generating", "data-parallel-2-generating"],
)
def test_a_killed_front_leaves_no_engine_process_alive(num_replicas, state):
    script = textwrap.dedent(FRONT)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(num_replicas), state],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == state.upper()
        _kill_and_check(process, expected_children=max(1, num_replicas))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_killed_serve_with_api_servers_leaves_none_of_its_processes_alive():
    flags = ["--api-server-count", "2", "--block-size", "4", "--num-blocks", "512"]
    with serve_process(*flags) as server:
        _kill_and_check(server.process, expected_children=3)  # an engine, two API servers
