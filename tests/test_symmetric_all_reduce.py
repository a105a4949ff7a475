"""Which all-reduce a tensor-parallel group uses (`radixinfer/distributed/symmetric_memory.py`):
symmetric memory only where every rank can map the others' GPU memory and the flag allows it,
the process group's backend (NCCL, gloo) everywhere else, and never a crash for it. On two GPUs:
a CUDA graph of chained all-reduces whose inputs change from call to call sums exactly what NCCL
sums."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from radixinfer import LLM, SamplingParams
from radixinfer.distributed import symmetric_memory
from radixinfer.distributed.group import TensorParallel
from radixinfer.distributed.symmetric_memory import MAX_BYTES, SymmetricAllReduce, why_not

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def test_why_not_names_each_reason():
    assert "turned off" in why_not(CUDA, 2, enabled=False)
    assert "cpu" in why_not(CPU, 2, enabled=True)
    assert "3 ranks" in why_not(CUDA, 3, enabled=True)
    assert why_not(CUDA, 2, enabled=True) is None  # this torch has the two-shot op


def test_only_small_contiguous_aligned_bf16_or_fp32_messages_fit():
    path = SymmetricAllReduce(torch.empty(1024, dtype=torch.uint8), "unused")
    assert path.fits(torch.zeros(2, 256, dtype=torch.bfloat16))  # 1024 bytes: the cap
    assert path.fits(torch.zeros(256, dtype=torch.float32))
    assert not path.fits(torch.zeros(2, 257, dtype=torch.bfloat16))  # over the cap
    assert not path.fits(torch.zeros(4, 4, dtype=torch.float16))  # a dtype the kernel lacks
    assert not path.fits(torch.zeros(8, 4, dtype=torch.float32).t())  # not contiguous
    assert not path.fits(torch.zeros(3, dtype=torch.float32))  # 12 bytes: not whole vectors


class FakeGroup:
    """What `symmetric_memory.connect` reads of a device group: rank 0 of two."""

    group_name = "fake"

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


def peers_say(*answers):
    """An ``all_gather`` whose other rank answers ``answers`` in turn."""
    replies = iter(answers)
    return lambda value: [value, next(replies)]


def test_any_rank_that_cannot_makes_every_rank_fall_back(caplog):
    group, store = FakeGroup(), dist.HashStore()
    caplog.set_level("INFO", logger=symmetric_memory.__name__)
    # the peer is turned off (every rank gathers every reason, so all of them agree)
    assert symmetric_memory.connect(group, store, CUDA, True, peers_say(("h", "off"))) is None
    # the peer is on another host: nothing to map
    assert symmetric_memory.connect(group, store, CUDA, True, peers_say(("far", None))) is None
    assert "several hosts" in caplog.text
    # same host, but the allocation fails here (no GPU): logged, not raised
    host = symmetric_memory.socket.gethostname()
    assert symmetric_memory.connect(group, store, CUDA, True, peers_say((host, None), None)) is None
    assert "rendezvous failed" in caplog.text


def test_two_engines_gloo_groups_under_their_own_names():
    """Two CPU engines of two gloo ranks open at once: no symmetric path, and each device group
    registered under its own name."""
    engine = dict(device="cpu", dtype="float32", num_blocks=32, tensor_parallel_size=2)
    llms = [LLM("tiny", **engine) for _ in range(2)]
    try:
        groups = [llm.engine.runner.tp for llm in llms]
        assert all(tp.symmetric is None for tp in groups)
        assert groups[0].device_group.group_name != groups[1].device_group.group_name
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        first, second = (llm.generate([[1, 2, 3]], params)[0].token_ids for llm in llms)
        assert first == second
    finally:
        for llm in llms:
            llm.close()


def test_the_flag_reaches_the_runner_spec():
    from radixinfer.api import _LLM_DEFAULTS
    from radixinfer.cli import parse_args
    from radixinfer.engine_args import llm_kwargs
    from radixinfer.llm_args import engine_options

    for flags, expected in (([], True), (["--disable-custom-all-reduce"], False)):
        kwargs = llm_kwargs(parse_args(["bench", "--model", "tiny", *flags]))
        _, spec, _ = engine_options(**{**_LLM_DEFAULTS, **kwargs})
        assert spec.symmetric_all_reduce is expected


# ---------------------------------------------------------------------------------- two GPUs
HIDDEN = 4096
CALLS = 48


def chained_all_reduces(tp: TensorParallel, x: torch.Tensor, big: torch.Tensor) -> None:
    """``CALLS`` all-reduces of ``x`` in place, each input made from the previous sum and the
    rank, so consecutive calls carry different data; every eighth also sums ``big`` (above the
    cap: NCCL inside the same graph). Values stay small integers: bf16 sums are exact."""
    column = torch.arange(x.shape[-1], device=x.device) % 3
    for call in range(CALLS):
        tp.all_reduce(x)
        x.remainder_(7).add_(column + tp.rank + call % 5)
        if call % 8 == 0:
            tp.all_reduce(big)
            big.remainder_(5).add_(tp.rank)


def start_values(rows: int, rank: int, seed: int) -> torch.Tensor:
    return (torch.arange(rows * HIDDEN).view(rows, HIDDEN) * (seed + 1) + rank) % 11


def _two_gpu_rank(rank: int, port: int) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    fast = TensorParallel.connect(dist.PrefixStore("fast", store), rank, 2, device, True)
    nccl = TensorParallel.connect(dist.PrefixStore("nccl", store), rank, 2, device, False)
    assert fast.symmetric is not None and nccl.symmetric is None
    big_rows = MAX_BYTES[2] // (HIDDEN * 2) + 1
    for rows in (1, 64):
        x = torch.empty(rows, HIDDEN, dtype=torch.bfloat16, device=device)
        big = torch.empty(big_rows, HIDDEN, dtype=torch.bfloat16, device=device)
        x.copy_(start_values(rows, rank, 0))
        big.copy_(start_values(big_rows, rank, 1))
        chained_all_reduces(fast, x, big)  # eager, and the warm-up before the capture
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            chained_all_reduces(fast, x, big)
        for seed in (2, 3, 4):  # replays from different inputs, each against NCCL eagerly
            start, start_big = start_values(rows, rank, seed), start_values(big_rows, rank, 9)
            x.copy_(start)
            big.copy_(start_big)
            graph.replay()
            want, want_big = start.to(device, torch.bfloat16), start_big.to(device, torch.bfloat16)
            chained_all_reduces(nccl, want, want_big)
            torch.cuda.synchronize()
            assert torch.equal(x, want) and torch.equal(big, want_big), (rows, seed)
        del graph
        torch.cuda.synchronize()
    fast.close()
    nccl.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_graphed_symmetric_all_reduces_equal_nccl():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(_two_gpu_rank, args=(store.port,), nprocs=2)
