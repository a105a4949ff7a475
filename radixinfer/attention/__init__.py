"""Attention over the paged KV cache: per-forward metadata, the backend interface, and backends."""

from radixinfer.attention.backend import AttentionBackend, AttentionPlanner, ForwardContext
from radixinfer.attention.metadata import AttentionMetadata, SharedPrefixTiles

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionPlanner",
    "ForwardContext",
    "SharedPrefixTiles",
    "get_backend",
]


def get_backend(device: str) -> AttentionBackend:
    """Triton on CUDA, the PyTorch reference elsewhere."""
    from radixinfer.attention.torch_backend import TorchAttentionBackend

    if str(device).startswith("cuda"):
        from radixinfer.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    return TorchAttentionBackend()
