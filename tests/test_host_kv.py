"""The host tier's tensors (`radixinfer.engine.host_kv`): the pool's segments, sized so that the
pinned allocator's rounding to a power of two adds less than a block each, and copies through
them that cross from one segment into the next."""

from __future__ import annotations

import math

import pytest
import torch

from radixinfer.cache.host_tier import TransferBatch
from radixinfer.engine.host_kv import HostKVPool, segment_blocks, write_back_blocks


def _pinned_bytes(count: int, block_bytes: int) -> int:
    """What the pinned allocator reserves for ``count`` blocks: the next power of two."""
    return 1 << (count * block_bytes - 1).bit_length()


@pytest.mark.parametrize(
    ("num_blocks", "block_bytes"),
    [(36_864, 2 << 20), (1000, 196_608), (7, 1), (1, 3), (12_345, 98_304)],
)
def test_segments_hold_every_block_and_pin_less_than_a_block_more_each(num_blocks, block_bytes):
    sizes = segment_blocks(num_blocks, block_bytes)
    assert sum(sizes) == num_blocks and all(count >= 1 for count in sizes)
    assert sizes == sorted(sizes, reverse=True)
    assert len(sizes) <= math.log2(num_blocks) + 2
    for count in sizes:
        extra = _pinned_bytes(count, block_bytes) - count * block_bytes
        assert extra < block_bytes


def test_a_72_gib_pool_of_2_mib_blocks_pins_72_gib_not_128():
    assert segment_blocks(36_864, 2 << 20) == [32_768, 4_096]  # 64 + 8 GiB


def test_the_write_back_staging_holds_what_one_step_can_evict_within_the_host_pool():
    # llama-3.1-8b in the host tier's benchmark: 8,192-token rounds of up to 128 requests, blocks
    # of 16, 128 decoding sequences: 512 + 128 + 128 blocks of 2 MiB, 1.5 GiB
    assert write_back_blocks(36_864, 16, 8192, 128, 128) == 768
    assert write_back_blocks(36_864, 16, 8193, 128, 128) == 769  # a partial block rounds up
    assert write_back_blocks(100, 16, 8192, 128, 128) == 100  # no more than the host pool


@pytest.mark.parametrize("staged_blocks", [23, 5])  # one gather, or five through one staging
def test_copies_across_segment_boundaries_round_trip_bit_exact(staged_blocks):
    # blocks of 2 * 3 layers * 2 positions * 1 head * 5 dims float32 = 240 bytes: not a power of two,
    # so 23 blocks make several segments
    layers, pool_blocks, host_blocks = 3, 40, 23
    k = torch.randn(layers, pool_blocks, 2, 1, 5)
    v = torch.randn(layers, pool_blocks, 2, 1, 5)
    host = HostKVPool(host_blocks, k, staged_blocks)
    assert len(host.segments) > 2 and host.num_blocks == host_blocks
    gpu = list(range(3, 3 + host_blocks))
    host_ids = list(range(host_blocks))[::-1]  # every block, one run across every segment
    want_k, want_v = k[:, gpu].clone(), v[:, gpu].clone()
    host.run([TransferBatch(True, gpu, host_ids)], k, v, ticket=1)
    k.zero_()
    v.zero_()
    back = list(range(pool_blocks - host_blocks, pool_blocks))
    host.run([TransferBatch(False, host_ids, back)], k, v, ticket=2)
    assert torch.equal(k[:, back], want_k) and torch.equal(v[:, back], want_v)
    assert host.finished_ticket() == 2
