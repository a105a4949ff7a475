"""What a decode step must read from device memory at the least, in bytes: its floor.

At decode a step computes one token per sequence, so its time is bound by what it reads:

- every weight a token passes through, once (an embedding table that is only looked up gives a few rows and
  is not counted, unless the output projection reads it whole as its own weight: a tied embedding);
- the K and V of every position each sequence attends to, where the positions of a prefix shared by a tile of
  sequences count once for the tile (the shared-prefix decode reads them once: `SharedPrefixTiles` in
  ``kernels/paged_attention.py``).

Over the device's memory bandwidth that is the step's floor; ``radixinfer bench`` reports the mean step's
beside the inter-token latency (``--hbm-tbps``). With tensor parallelism both count one rank's shard.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from radixinfer.models.parallel import VocabParallelEmbedding


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of the distinct parameters a decode step reads whole: every module's but an embedding
    lookup's, unless another module (the output projection of a tied model) holds that weight too."""
    read: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding) or type(module) is VocabParallelEmbedding:
            continue  # a lookup table (ParallelLMHead, its subclass, is the output projection)
        for p in module.parameters(recurse=False):
            read[p.data_ptr()] = p
    return sum(p.numel() * p.element_size() for p in read.values())


def decode_kv_positions(
    context_lens: np.ndarray,  # [n] each sequence's context, the new position included
    kv_starts: np.ndarray | None = None,  # [n] where each sequence's own reads start (shared tiles)
    tile_lens: np.ndarray | None = None,  # [tiles] each tile's shared positions (0: an idle tile)
) -> int:
    """The KV positions a decode step reads: each sequence's whole context, or with shared-prefix
    tiles its positions past its tile's prefix plus each tile's prefix once."""
    positions = int(context_lens.sum(dtype=np.int64))
    if kv_starts is not None:
        positions += int(tile_lens.sum(dtype=np.int64)) - int(kv_starts.sum(dtype=np.int64))
    return positions
