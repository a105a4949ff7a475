"""The GPU memory plan: how much of the device an engine may use and how that budget is split,
decided once at start-up so that no step can run out of memory later.

An engine on CUDA may use ``gpu_memory_utilization`` of the whole GPU (vLLM's meaning: a share of
the device's total memory, per engine, not a share of what happens to be free). Everything but the
KV pool is measured before the pool exists; the pool takes the rest of the budget, in whole blocks::

    whole GPU (total)
    ├── held before the engine started: other processes, other engines, this process's CUDA context
    └── budget = gpu_memory_utilization x total; must be free when the engine starts
        ├── weights      the model's parameters and buffers, as loaded
        ├── other        the runner's step buffers, cuBLAS workspaces, kernel code, rounding
        ├── CUDA graphs  the graphs' memory pool and their static outputs
        ├── activations  the peak of the worst-case step outside the graphs: the LM head's rows, the
        │                engine's sampler in its most expensive mode (the filters' scratch,
        │                the logprobs' log-softmax), the penalties' token-count rows, eager
        │                passes and their attention workspaces
        ├── host staging with a host tier (``host_cache_gb``): its write-back staging, as many
        │                blocks as one step can evict (`radixinfer.engine.host_kv`)
        └── KV cache     the rest: num_blocks = rest // bytes_per_block

How the figures are taken (`ModelRunner.profile_memory`, before the pool is allocated): the runner
starts on a scratch store of one block, captures every CUDA graph it will use against it (the graph
figure is the device memory that capture holds), then runs the worst-case step its sizes allow (the
largest prefill pass, ``prefill_max_tokens`` over ``prefill_max_seqs`` sequences, and the largest
decode batch, each through the LM head and the sampler at its most rows, attention at
``max_model_len``), tracking the peak allocation with ``torch.cuda.max_memory_allocated``; then it
drops the graphs again and captures them anew once the real pool is bound.

The sampler the profile runs is the engine's own (`Sampler.sample_with_logprobs`, owned by the
runner), on stand-in requests in its most expensive mode (`radixinfer.engine.worst_case`): every
row with temperature, top-k, top-p, min-p, a ``logit_bias``, ``min_tokens`` and `MAX_LOGPROBS`
logprobs (the most a request may ask), and ``max_batch_size`` rows with every penalty. The
penalties' token-count rows (`TokenCounts`, ``max_batch_size x vocab`` bool + int32) live between
steps once a penalised request came, so they are planned as activations, not grown: they are
allocated whole by the first penalised request (in the profile, inside the measured step; then
released), and the scheduler never lets more penalised sequences hold KV than they have rows.
The engine keeps a prefill pass's logits work within the rows the profile sampled
(``prefill_max_seqs``): the forked samples of ``n`` > 1 requests take their first tokens that
many rows at a time, and prompt logprobs are scored that many positions at a time. "other" is what the
device shows in use beyond the weights once profiling is over (``torch.cuda.mem_get_info``), so
memory outside torch's allocator is charged too.

A configuration that cannot fit raises ``ValueError`` before the pool is allocated, naming what to
lower: less free memory than the budget, weights and activations over the budget, an explicit
``num_blocks`` over what is left, or a pool too small for one sequence of ``max_model_len`` tokens.

On a CPU nothing is measured: the pool is ``num_blocks`` or `CPU_KV_BYTES` worth of blocks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

GiB = 2**30
CPU_KV_BYTES = 256 * 2**20  # the KV pool on a CPU when no num_blocks is given


def blocks_for_sequence(num_tokens: int, block_size: int) -> int:
    """KV blocks one sequence of ``num_tokens`` tokens may hold at once: its positions plus one
    block for a copy-on-write of its boundary block (the engine's per-request check counts the
    same)."""
    return -(-num_tokens // block_size) + 1


def check_utilization(gpu_memory_utilization: float) -> float:
    """``gpu_memory_utilization`` as a float in (0, 1]; ValueError otherwise."""
    u = gpu_memory_utilization
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
    return float(u)


def resolve_max_model_len(max_model_len: int | None, model_context_len: int) -> int:
    """The context the engine serves: ``max_model_len``, or the model's own when None. ValueError
    when it is not a positive integer or exceeds the model's context (positions past it have no
    meaning)."""
    if max_model_len is None:
        return model_context_len
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(f"max_model_len must be a positive integer or None, got {max_model_len!r}")
    if max_model_len > model_context_len:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's context of {model_context_len} "
            "tokens"
        )
    return max_model_len


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage once (tied weights share one)."""
    tensors = {t.data_ptr(): t.nbytes for t in [*module.parameters(), *module.buffers()]}
    return sum(tensors.values())


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a CUDA device: the driver's view (``free`` / ``total``, every process and
    every allocator) and torch's (``allocated`` by live tensors, ``reserved`` by its caching
    allocator)."""

    free: int
    total: int
    allocated: int
    reserved: int

    @property
    def used(self) -> int:
        return self.total - self.free

    @classmethod
    def read(cls, device: torch.device) -> DeviceMemory:
        """After the device's queued work has finished (so frees have happened)."""
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return cls(
            free, total, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        )


@dataclass(frozen=True)
class ProfiledMemory:
    """What `ModelRunner.profile_memory` measured: ``activation_bytes`` is the peak allocated during
    the worst-case step above what was allocated before it, ``activation_reserved_bytes`` the
    caching allocator's growth for it (at least as much: it rounds and caches), ``cuda_graph_bytes``
    the device memory the captured graphs hold (0 without graphs)."""

    activation_bytes: int
    activation_reserved_bytes: int
    cuda_graph_bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    """How the engine's memory is split (see the module docstring). Sizes in bytes; the measured
    figures and the budget are None on a CPU, where nothing is measured."""

    device: str
    total_bytes: int | None  # the whole device
    budget_bytes: int | None  # gpu_memory_utilization x total
    gpu_memory_utilization: float | None
    weights_bytes: int
    other_bytes: int | None
    cuda_graph_bytes: int | None
    activation_bytes: int | None
    block_size: int
    bytes_per_block: int
    num_blocks: int
    max_model_len: int
    host_staging_bytes: int = 0  # the host tier's write-back staging (0 without a tier)

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def as_dict(self) -> dict:
        """Every field plus the KV pool's bytes and tokens (JSON-ready)."""
        return {**asdict(self), "kv_bytes": self.kv_bytes, "kv_tokens": self.kv_tokens}

    def summary(self) -> str:
        """One line for a start-up log: every figure in GiB, the pool in blocks and tokens."""
        parts = [f"weights {_gib(self.weights_bytes)}"]
        for name, value in (
            ("activations", self.activation_bytes),
            ("CUDA graphs", self.cuda_graph_bytes),
            ("other", self.other_bytes),
            ("host staging", self.host_staging_bytes or None),
        ):
            if value is not None:
                parts.append(f"{name} {_gib(value)}")
        parts.append(
            f"KV cache {_gib(self.kv_bytes)} = {self.num_blocks} blocks of {self.block_size} "
            f"tokens ({self.kv_tokens} tokens)"
        )
        head = f"memory plan on {self.device}"
        if self.budget_bytes is not None:
            head += (
                f": budget {_gib(self.budget_bytes)} ({self.gpu_memory_utilization:g} of "
                f"{_gib(self.total_bytes)})"
            )
        return f"{head}: {', '.join(parts)}; max_model_len {self.max_model_len}"


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def plan_gpu_memory(
    *,
    device: str,
    total_bytes: int,
    free_bytes_at_start: int,
    gpu_memory_utilization: float,
    weights_bytes: int,
    other_bytes: int,
    profiled: ProfiledMemory,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    num_blocks: int | None = None,
    host_staging_bytes: int = 0,
) -> MemoryPlan:
    """Split ``gpu_memory_utilization`` of ``total_bytes`` between what was measured and the KV
    pool.

    ``free_bytes_at_start``: free device memory before the engine loaded anything; the budget must
    fit in it. ``num_blocks`` given: the pool has exactly that many blocks and they must fit what is
    left; None: as many as fit, and at least one sequence of ``max_model_len`` tokens must. Raises
    ``ValueError`` saying what to lower (or raise) otherwise. The caching allocator's rounding above
    the activation peak (``profiled.activation_reserved_bytes - activation_bytes``) is charged to
    "other"."""
    utilization = check_utilization(gpu_memory_utilization)
    budget = int(utilization * total_bytes)
    if budget > free_bytes_at_start:
        fits = free_bytes_at_start / total_bytes
        raise ValueError(
            f"gpu_memory_utilization={utilization:g} asks for {_gib(budget)} of the GPU's "
            f"{_gib(total_bytes)}, but only {_gib(free_bytes_at_start)} was free when the engine "
            "started (other processes or engines hold the rest): lower gpu_memory_utilization to "
            f"at most {fits:.3f}"
        )
    other = other_bytes + max(0, profiled.activation_reserved_bytes - profiled.activation_bytes)
    non_kv = (
        weights_bytes
        + other
        + profiled.cuda_graph_bytes
        + profiled.activation_bytes
        + host_staging_bytes
    )
    kv_room = budget - non_kv
    plan = MemoryPlan(
        device=device,
        total_bytes=total_bytes,
        budget_bytes=budget,
        gpu_memory_utilization=utilization,
        weights_bytes=weights_bytes,
        other_bytes=other,
        cuda_graph_bytes=profiled.cuda_graph_bytes,
        activation_bytes=profiled.activation_bytes,
        block_size=block_size,
        bytes_per_block=bytes_per_block,
        num_blocks=max(0, kv_room) // bytes_per_block,
        max_model_len=max_model_len,
        host_staging_bytes=host_staging_bytes,
    )
    measured = (
        f"weights {_gib(weights_bytes)}, activations {_gib(profiled.activation_bytes)}, "
        f"CUDA graphs {_gib(profiled.cuda_graph_bytes)} and other {_gib(other)}"
    )
    if host_staging_bytes:
        measured += f", with the host tier's staging {_gib(host_staging_bytes)}"
    if plan.num_blocks < 1:
        raise ValueError(
            f"{measured} take {_gib(non_kv)}, leaving no room for a KV block in the budget of "
            f"{_gib(budget)} (gpu_memory_utilization={utilization:g}): raise "
            "gpu_memory_utilization, or lower max_batch_size, prefill_max_tokens or "
            "prefill_max_batch_size (activations), or use a smaller model"
        )
    if num_blocks is not None:
        if num_blocks > plan.num_blocks:
            raise ValueError(
                f"num_blocks={num_blocks} needs {_gib(num_blocks * bytes_per_block)} of KV memory, "
                f"but the budget of {_gib(budget)} (gpu_memory_utilization={utilization:g}) leaves "
                f"{_gib(kv_room)} after {measured}: lower num_blocks to at most "
                f"{plan.num_blocks} or raise gpu_memory_utilization"
            )
        return MemoryPlan(**{**asdict(plan), "num_blocks": num_blocks})
    needed = blocks_for_sequence(max_model_len, block_size)
    if plan.num_blocks < needed:
        longest = (plan.num_blocks - 1) * block_size
        raise ValueError(
            f"the KV pool fits {plan.num_blocks} blocks ({plan.kv_tokens} tokens) after "
            f"{measured}, fewer than one sequence of max_model_len={max_model_len} tokens needs "
            f"({needed} blocks): lower max_model_len to at most {longest}, raise "
            f"gpu_memory_utilization (now {utilization:g}), or lower max_batch_size / "
            "prefill_max_tokens (activations)"
        )
    return plan


def plan_cpu_memory(
    *,
    weights_bytes: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    num_blocks: int | None,
    host_staging_bytes: int = 0,
) -> MemoryPlan:
    """The CPU's plan: ``num_blocks``, or as many blocks as `CPU_KV_BYTES` holds (at least one);
    the host tier's staging beside it."""
    blocks = num_blocks if num_blocks is not None else max(1, CPU_KV_BYTES // bytes_per_block)
    return MemoryPlan(
        device="cpu",
        total_bytes=None,
        budget_bytes=None,
        gpu_memory_utilization=None,
        weights_bytes=weights_bytes,
        other_bytes=None,
        cuda_graph_bytes=None,
        activation_bytes=None,
        block_size=block_size,
        bytes_per_block=bytes_per_block,
        num_blocks=blocks,
        max_model_len=max_model_len,
        host_staging_bytes=host_staging_bytes,
    )
