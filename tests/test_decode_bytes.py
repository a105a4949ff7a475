"""What a decode step reads at the least (`radixinfer.engine.decode_bytes`): the weights a token passes
through, and the KV positions it attends to with shared prefixes read once per tile; and the engine's
count of it over its decode steps."""

import numpy as np
import pytest
import torch
from torch import nn

from radixinfer import LLM, SamplingParams
from radixinfer.bench.bandwidth import measure_memory_tbps
from radixinfer.engine.decode_bytes import decode_kv_positions, decode_weight_bytes


class Toy(nn.Module):
    """Token and position lookups, one layer, an output projection: float32 throughout."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.positions = nn.Embedding(8, 4)
        self.layer = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def test_a_step_reads_every_weight_but_a_lookup_table_and_a_tied_one_once():
    layer, head = (4 * 4 + 4) * 4, 10 * 4 * 4  # bytes
    assert decode_weight_bytes(Toy(tied=False)) == layer + head
    assert decode_weight_bytes(Toy(tied=True)) == layer + head  # the table, read as the head


def test_the_engines_model_counts_its_output_projection_and_not_its_embedding():
    model = LLM("tiny", num_blocks=64).engine.runner.model
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.model.embed_tokens.weight
    assert not model.config.tie_word_embeddings
    assert decode_weight_bytes(model) == everything - table.numel() * table.element_size()


def test_kv_positions_count_a_tiles_shared_prefix_once():
    contexts = np.array([10, 12, 5], np.int32)
    assert decode_kv_positions(contexts) == 27
    # the first two share 8 positions in one tile (an idle tile beside it)
    kv_starts, tile_lens = np.array([8, 8, 0], np.int32), np.array([8, 0], np.int32)
    assert decode_kv_positions(contexts, kv_starts, tile_lens) == 2 + 4 + 5 + 8


def test_the_engine_counts_what_each_decode_step_reads():
    """One request of 5 prompt tokens and 3 new ones decodes twice (the first token comes from the
    prefill), at contexts of 6 and 7 positions: the weights twice and 13 positions' K and V."""
    llm = LLM("tiny", block_size=4, num_blocks=64)
    runner = llm.engine.runner
    before = llm.cache_stats()
    llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    after = llm.cache_stats()
    assert after["decode_forwards"] - before["decode_forwards"] == 2
    position_bytes = runner.kv.bytes_per_position
    assert position_bytes == 2 * runner.kv.k[:, 0, 0].numel() * runner.kv.k.element_size()
    assert (
        after["decode_read_bytes"] - before["decode_read_bytes"]
        == 2 * runner.weight_read_bytes + 13 * position_bytes
    )
    # the last step's own figure: the weights and the 7 positions of its context
    assert runner.last_decode_read_bytes == runner.weight_read_bytes + 7 * position_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_bench_measures_the_memory_bandwidth_and_gives_its_buffers_back():
    device = torch.device("cuda")
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved(device)
    tbps = measure_memory_tbps(device)
    assert 1.0 < tbps < 20.0  # any HBM GPU, well beyond a cached copy's or a host's rate
    assert torch.cuda.memory_reserved(device) <= reserved
