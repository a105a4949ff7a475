"""Attention over the paged KV cache: per-forward metadata, the backend interface, and backends."""

from radixinfer.attention.backend import AttentionBackend, ForwardContext
from radixinfer.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardContext", "get_backend"]


def get_backend(device: str) -> AttentionBackend:
    """Triton on CUDA, the PyTorch reference elsewhere."""
    from radixinfer.attention.torch_backend import TorchAttentionBackend

    if str(device).startswith("cuda"):
        from radixinfer.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    return TorchAttentionBackend()
