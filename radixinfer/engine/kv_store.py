"""The KV tensors themselves: one K and one V pool shaped ``[num_layers, num_blocks, block_size, num_kv_heads,
head_dim]`` (one block id indexes every layer), and the batched block copy copy-on-write needs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.block_copy import copy_blocks_ref


class KVStore:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: masked-out positions are still multiplied by 0 in reference attention, and 0 * NaN
        # from uninitialised memory would poison the output.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            from kernels.block_copy import copy_blocks_triton

            self._copy = copy_blocks_triton
        else:
            self._copy = copy_blocks_ref

    @property
    def bytes_per_position(self) -> int:
        """Bytes of one position's K and V over every layer."""
        layers, _, _, heads, dim = self.k.shape
        return self.bytes_per_block(layers, 1, heads, dim, self.k.dtype)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2
            * num_layers
            * block_size
            * num_kv_heads
            * head_dim
            * torch.empty((), dtype=dtype).element_size()
        )

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Perform every (src, dst) copy of a step, all layers, K and V, in one launch."""
        if not copies:
            return
        src_dst = torch.tensor(list(zip(*copies)), dtype=torch.int64)  # [2, n]: each row contiguous
        if self.device.type == "cuda":
            src_dst = src_dst.pin_memory().to(self.device, non_blocking=True)
        self._copy(self.k, self.v, src_dst[0], src_dst[1])
