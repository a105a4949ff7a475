"""The runner's CUDA graphs: decode steps per batch-size bucket, prefill passes per token bucket.

A small model's decode step is hundreds of kernel launches, and launching them from Python costs far
more than running them; an eager prefill pass of a small model likewise spends milliseconds launching
kernels that run in a fraction of that. So the runner captures both once and replays them: a decode
batch is padded up to its bucket (`graph_batch_sizes`), a prefill pass up to its token bucket
(`prefill_graph_token_counts`) with tokens that store nothing and belong to no sequence. Passes beyond
the largest bucket run eagerly (there the GPU time dominates).

A graph replays the forward it captured on the runner's step buffers (its static inputs), so what
must stay fixed for a bucket is the attention backend's business (see
`radixinfer/attention/triton_backend.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

# Prefill passes above this many tokens run eagerly: their GPU time dwarfs the launches, and a graph's
# activations would hold that much more memory.
MAX_PREFILL_GRAPH_TOKENS = 16384


def prefill_graph_token_counts(max_tokens: int) -> list[int]:
    """Token buckets a prefill pass is padded up to: four per doubling from 64 (padding adds at most a quarter
    of a pass's tokens), up to the first that holds ``max_tokens`` or `MAX_PREFILL_GRAPH_TOKENS`."""
    sizes = [64]
    while sizes[-1] < min(max_tokens, MAX_PREFILL_GRAPH_TOKENS):
        sizes.append(sizes[-1] + (1 << (sizes[-1].bit_length() - 1)) // 4)
    return sizes


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Buckets a decode batch is padded up to: fine-grained where small batches are common."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sizes + [max_batch_size]


# (num_seqs, reads shared prefixes once, logits out [num_seqs, vocab]) -> the logits
DecodeForward = Callable[[int, bool, torch.Tensor], torch.Tensor]
# (num_tokens, hidden states out [num_tokens, hidden]) -> the hidden states
PrefillForward = Callable[[int, torch.Tensor], torch.Tensor]


class StepGraphs:
    """The captured graphs of one runner, all in one memory pool, and the outputs they write.

    ``decode`` maps ``(batch bucket, reads shared prefixes once)`` to ``(graph, its logits)``;
    ``prefill`` maps a token bucket to ``(graph, its hidden states)``. Both are empty until `capture`
    and after `release` (steps then run eagerly). Replays never overlap, so every graph writes its
    output into one shared tensor per kind (a logits tensor per decode bucket would be ~20 GB at batch
    1,024 and a 152k vocabulary) and the pool holds one pass's temporaries.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.decode: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.prefill: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.decode_sizes: list[int] = []  # ascending; empty: decode batches are not padded
        # every graph's output lives in one of these: [max_batch_size, vocab] logits and
        # [largest prefill bucket, hidden] hidden states
        self._outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stream: torch.cuda.Stream | None = None

    @torch.inference_mode()
    def capture(
        self,
        decode_forward: DecodeForward,
        decode_sizes: list[int],
        shared_variants: tuple[bool, ...],
        prefill_forward: PrefillForward,
        prefill_sizes: list[int],
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
    ) -> None:
        """Capture a decode graph per batch bucket and variant, then a prefill graph per token bucket,
        largest first. The caller has left the step buffers idle (no slot stored, no context, every
        work item idle). The warm-up passes' cached blocks are returned to the device afterwards."""
        pool = torch.cuda.graph_pool_handle()
        if self._stream is None:  # one per runner: cuBLAS keeps a workspace per stream
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        dev = self.device
        self._outputs = (
            torch.empty((max(decode_sizes), vocab_size), dtype=dtype, device=dev),
            torch.empty((prefill_sizes[-1], hidden_size), dtype=dtype, device=dev),
        )

        def capture(forward, *args) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
            forward(*args)  # warm up: compile, autotune
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = forward(*args)
            return graph, out

        sizes = sorted(decode_sizes, reverse=True)
        with torch.cuda.stream(stream):
            for size, shared in itertools.product(sizes, shared_variants):
                logits = self._outputs[0][:size]
                self.decode[size, shared] = capture(decode_forward, size, shared, logits)
            for num_tokens in reversed(prefill_sizes):
                hidden = self._outputs[1][:num_tokens]
                self.prefill[num_tokens] = capture(prefill_forward, num_tokens, hidden)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.decode_sizes = sorted(sizes)

    def replay_decode(self, bucket: int, shared: bool, num_seqs: int) -> torch.Tensor | None:
        """Replay the decode graph of ``(bucket, shared)``: its logits' first ``num_seqs`` rows (valid
        until the next replay), or None when there is no such graph."""
        graph = self.decode.get((bucket, shared))
        if graph is None:
            return None
        graph[0].replay()
        return graph[1][:num_seqs]

    def replay_prefill(self, bucket: int, num_tokens: int) -> torch.Tensor | None:
        """Replay the prefill graph of ``bucket`` tokens: its hidden states' first ``num_tokens`` rows
        (valid until the next replay), or None when there is no such graph."""
        graph = self.prefill.get(bucket)
        if graph is None:
            return None
        graph[0].replay()
        return graph[1][:num_tokens]

    def release(self) -> None:
        """Drop every graph and its outputs, and give their memory back to the device."""
        for graph, _ in itertools.chain(self.decode.values(), self.prefill.values()):
            graph.reset()
        self.decode.clear()
        self.prefill.clear()
        self.decode_sizes = []
        self._outputs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
