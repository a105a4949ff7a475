"""Tensor parallelism on the CPU: two gloo ranks (the test process and one spawned worker), and four,
against one, on tiny checkpoints written here, with the prefix cache at work (hits, copy-on-write, an exact
repeat served from a cached hidden state, preemption in a small pool).

Greedy tokens and cache counters must equal the single-device engine's; so must the sharded loader's
weights, read slice by slice.
"""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import radixinfer.models.loader as loader_module
from radixinfer import LLM, SamplingParams
from radixinfer.distributed.driver import TensorParallelError
from radixinfer.distributed.group import TensorParallel
from radixinfer.distributed.runner_calls import DecodeTableReceiver, DecodeTableSender
from radixinfer.models import load_model

VOCAB = 301  # odd: the vocabulary-parallel shards are padded
_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    eos_token_id=None,
    bos_token_id=None,
)
ARCHS = {
    # 2 KV heads: one per rank
    "llama": (LlamaForCausalLM, LlamaConfig(**_SMALL, num_key_value_heads=2)),
    # 1 KV head: replicated on both ranks; q/k norm; biases on q/k/v and o_proj (row-parallel)
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config(**_SMALL, num_key_value_heads=1, head_dim=16, attention_bias=True),
    ),
    # one fused c_attn tensor stored transposed; tied output projection; learned positions
    "gpt2": (
        GPT2LMHeadModel,
        GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128),
    ),
}
ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_batch_size=8, seed=0)


def write_checkpoint(arch: str, path) -> None:
    """A tiny checkpoint with large random weights (greedy decoding is decisive), in two files."""
    model_class, config = ARCHS[arch]
    torch.manual_seed(0)
    model = model_class(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            base = 0.0 if name.endswith("bias") else 1.0
            p.copy_(noise * 0.2 if p.dim() >= 2 else noise * 0.1 + base)
    model.save_pretrained(path, max_shard_size="60KB")


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_checkpoint(request.param, path)
    return path


def run_workload(llm: LLM) -> tuple[list[list[int]], dict]:
    """Shared prefixes that end inside a block (copy-on-write), a second round that hits them and
    repeats a prompt exactly, and more decoding than the pool holds at once (preemption)."""
    # EOS may stop them (their length unknown), so admission leaves no room for their outputs
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    prefix = [(7 * i) % VOCAB for i in range(1, 7)]  # 6 tokens: ends inside the second block
    first = [prefix + [100 + i, 200 + i, 50 + i] for i in range(6)]
    second = [
        prefix + [100, 200, 50],
        prefix + [100, 9],
        [3, 1, 4, 1, 5],
        prefix + [240 + i for i in range(5)],
    ]
    outputs = [o.token_ids for o in llm.generate(first, greedy)]
    outputs += [o.token_ids for o in llm.generate(second, greedy)]
    stats = llm.cache_stats()
    llm.reset_prefix_cache()
    stats["free_after_reset"] = llm.cache_stats()["free_blocks"]
    return outputs, stats


def matches_one_device(checkpoint, ranks: int, device: str = "cpu") -> dict:
    """Run the workload on one device and on ``ranks`` ranks (gloo on the CPU, NCCL on CUDA); the
    tokens and cache counters must be equal, but the bytes the decode steps read, which count rank
    0's shard: fewer. Returns the counters."""
    engine = {**ENGINE, "device": device}
    # 24 blocks of 4 tokens: six requests of 19 tokens (5 blocks + 1 for copy-on-write) do not fit
    one = LLM(str(checkpoint), num_blocks=24, **engine)
    expected, expected_stats = run_workload(one)
    del one  # on CUDA: its graphs and memory, before the ranks start
    sharded = LLM(str(checkpoint), num_blocks=24, tensor_parallel_size=ranks, **engine)
    try:
        tokens, stats = run_workload(sharded)
    finally:
        sharded.close()
    assert tokens == expected
    shard_bytes, one_device_bytes = (
        stats.pop("decode_read_bytes"),
        expected_stats.pop("decode_read_bytes"),
    )
    assert 0 < shard_bytes < one_device_bytes
    assert stats == expected_stats
    return stats


def test_two_ranks_match_one_device(checkpoint):
    stats = matches_one_device(checkpoint, 2)
    assert stats["cached_tokens"] > 0 and stats["cow_copies"] > 0 and stats["preemptions"] > 0
    assert stats["free_after_reset"] == stats["total_blocks"]


def test_four_ranks_match_one_device(tmp_path):
    """Four gloo ranks (three spawned workers): one query head per rank and the two KV heads each
    replicated on two ranks, the MLP and the padded vocabulary split four ways; tokens and
    counters as on one device."""
    write_checkpoint("llama", tmp_path)
    stats = matches_one_device(tmp_path, 4)
    assert stats["cow_copies"] > 0 and stats["preemptions"] > 0


def test_each_rank_reads_only_its_slices(tmp_path, monkeypatch):
    """Both ranks of a sharded load, in this process: no tensor is read whole when it is sharded,
    each sharded tensor's reads are that rank's rows or columns, and the shards put together are the
    unsharded model's weights."""
    write_checkpoint("qwen3", tmp_path)
    reads: list[tuple[str, tuple, int]] = []  # (tensor, its shape, elements read)
    real_safe_open = loader_module.safe_open

    class RecordingSlice:
        def __init__(self, name, source):
            self.name, self.source = name, source

        def get_shape(self):
            return self.source.get_shape()

        def __getitem__(self, index):
            part = self.source[index]
            reads.append((self.name, tuple(self.source.get_shape()), part.numel()))
            return part

    class RecordingFile:
        def __init__(self, *args, **kwargs):
            self.file = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self.opened = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.opened.keys()

        def get_slice(self, name):
            return RecordingSlice(name, self.opened.get_slice(name))

        def get_tensor(self, name):
            raise AssertionError(f"{name} read whole through get_tensor")

    monkeypatch.setattr(loader_module, "safe_open", RecordingFile)
    full = load_model(tmp_path, "cpu").model.state_dict()
    reads.clear()
    shards = []
    for rank in range(2):
        shards.append(load_model(tmp_path, "cpu", tp=TensorParallel(rank, 2)).model.state_dict())
    read_elements = {}
    for name, _, numel in reads:
        read_elements[name] = read_elements.get(name, 0) + numel
    total = {name: int(torch.Size(shape).numel()) for name, shape, _ in reads}
    for name in total:
        sharded = any(p in name for p in ("q_proj", "o_proj.weight", "mlp.", "embed", "lm_head"))
        # replicated tensors (norms, the one KV head, biases summed after the reduce) are read by
        # both ranks; sharded ones half by each
        expected = total[name] if sharded else 2 * total[name]
        assert read_elements[name] == expected, name
    q = "model.layers.0.self_attn.qkv_proj.weight"
    rows = 64 // 2  # this rank's two query heads of 16
    for rank, shard in enumerate(shards):
        torch.testing.assert_close(shard[q][:rows], full[q][rank * rows : (rank + 1) * rows])
        torch.testing.assert_close(shard[q][rows:], full[q][64:])  # the replicated k and v head
    down = "model.layers.1.mlp.down_proj.weight"
    torch.testing.assert_close(torch.cat([s[down] for s in shards], dim=1), full[down])
    embed = "model.embed_tokens.weight"
    joined = torch.cat([s[embed] for s in shards])
    torch.testing.assert_close(joined[:VOCAB], full[embed])
    assert not joined[VOCAB:].any()  # the padding row


def test_random_weights_equal_the_unsharded_models():
    full = load_model("tiny", "cpu", seed=3).model.state_dict()
    shard = load_model("tiny", "cpu", seed=3, tp=TensorParallel(1, 2)).model.state_dict()
    gate_up = "model.layers.2.mlp.gate_up_proj.weight"
    half = 768 // 2
    torch.testing.assert_close(shard[gate_up][:half], full[gate_up][half:768])
    torch.testing.assert_close(shard[gate_up][half:], full[gate_up][768 + half :])
    torch.testing.assert_close(shard["model.norm.weight"], full["model.norm.weight"])


def test_unshardable_config_is_refused_before_starting_workers():
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        LLM("tiny", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM("tiny", tensor_parallel_size=0)


def test_close_stops_the_worker_and_a_dead_worker_is_an_error():
    llm = LLM("tiny", num_blocks=32, tensor_parallel_size=2, **ENGINE)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]], params)[0].token_ids) == 4
    (pid,) = llm.engine.runner.worker_pids
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="exited with code -9"):
        llm.generate([[4, 5, 6]], params)
    assert time.monotonic() - start < 30
    with pytest.raises(TensorParallelError):  # and stays failed, at once
        llm.generate([[4, 5, 6]], params)
    llm.close()

    for end in ("close", "drop"):
        llm = LLM("tiny", num_blocks=32, tensor_parallel_size=2, **ENGINE)
        (pid,) = llm.engine.runner.worker_pids
        if end == "close":
            llm.close()
        else:
            del llm
            gc.collect()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_decode_tables_travel_as_changes():
    sender, receiver = DecodeTableSender(), DecodeTableReceiver()
    a, b = [1, 2], [3]
    keys, entries = sender.encode([a, b], None)
    assert len(entries) == 2 and receiver.decode(keys, entries) == [[1, 2], [3]]
    held_a, held_b = receiver.decode(keys, {})  # a step without changes sends no entries
    b.append(4)  # b crossed a block boundary: the engine names its row as changed
    keys, entries = sender.encode([a, b], [1])
    assert list(entries.values()) == [[3, 4]]
    tables = receiver.decode(keys, entries)
    assert tables == [[1, 2], [3, 4]]
    assert tables[0] is held_a and tables[1] is held_b  # the same lists, edited in place
    c = [5]  # a newcomer is sent whole even when no row is named as changed
    keys, entries = sender.encode([b, c], [])
    assert list(entries.values()) == [[5]]
    assert receiver.decode(keys, entries) == [[3, 4], [5]]


def test_tensor_parallel_size_flag():
    from radixinfer.cli import parse_args
    from radixinfer.engine_args import llm_kwargs

    args = parse_args(["bench", "--model", "tiny", "--tensor-parallel-size", "2"])
    assert llm_kwargs(args)["tensor_parallel_size"] == 2
    with pytest.raises(SystemExit):
        parse_args(["bench", "--model", "tiny", "--tensor-parallel-size", "0"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_match_one(checkpoint):
    """NCCL, Triton kernels and CUDA graphs (their all-reduces captured) on two GPUs."""
    stats = matches_one_device(checkpoint, 2, device="cuda")
    assert stats["cached_tokens"] > 0 and stats["cow_copies"] > 0 and stats["preemptions"] > 0
