"""The transformers baseline (``--backend hf``): the same workload through transformers on the same weights.

Two ways to drive transformers, behind the one `Backend` interface:

- ``continuous`` (transformers >= 5 with ``init_continuous_batching``): its `ContinuousBatchingManager`,
  streaming, with per-token timestamps recorded where it samples (``record_timestamps``), paged KV and
  block-level prefix sharing (``allow_block_sharing``) following ``--no-prefix-cache``.
- ``sequential``: ``model.generate`` one request at a time on a worker thread, timestamps taken by a
  streamer as each token is produced. The fallback where continuous batching is missing.

Presets have no checkpoint: `export_checkpoint` writes the preset's shapes with random weights as a
transformers checkpoint dir, and every backend of the run loads that dir, so both run the same weights.
"""

from __future__ import annotations

import inspect
import os
import queue
import threading
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from radixinfer.core_messages import StreamEvents, StreamFailure
from radixinfer.models import resolve_dtype
from radixinfer.models.loader import RANDOM_INIT_STD
from radixinfer.models.presets import preset_config
from radixinfer.outputs import StreamDelta
from radixinfer.sampling_params import SamplingParams
from radixinfer.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

# Same rule as radixinfer.models: a checkpoint with any of these files brings its own tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BATCHING_MODES = ("auto", "continuous", "sequential")
# transformers sizes its cache from free memory; on a CPU that is most of the machine's RAM, so cap it
CPU_KV_TOKENS = 16384


def export_checkpoint(preset: str, directory: Path, device: str, dtype: str, seed: int) -> Path:
    """Write preset ``preset`` as a checkpoint dir without tokenizer files (radixinfer then uses its byte
    tokenizer, as for the preset). Weights are seeded and as large as the presets' (matrices
    ~ N(0, RANDOM_INIT_STD)), so greedy outputs stay diverse and can be compared token for token."""
    config = preset_config(preset)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=resolve_dtype(dtype, config, torch.device(device))
        )
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, RANDOM_INIT_STD, generator=generator)
    model.save_pretrained(directory)
    return directory


def _has_continuous_batching(model: PreTrainedModel) -> bool:
    """transformers 5's continuous batching API (manager + its own config class) is there."""
    return hasattr(transformers, "ContinuousBatchingConfig") and hasattr(
        model, "init_continuous_batching"
    )


def _finish_reason(token_ids: list[int], eos_token_ids: list[int]) -> str:
    return "stop" if token_ids and token_ids[-1] in eos_token_ids else "length"


class _ContinuousDriver:
    """transformers' continuous batching. Its outputs are cumulative (every streamed output holds all tokens
    so far); a pump thread turns them into one delta per new token, stamped with that token's time."""

    def __init__(
        self,
        model: PreTrainedModel,
        max_batch_size: int,
        prefix_cache: bool,
        kv_tokens: int | None,
        kv_memory_fraction: float,
        seed: int,
    ) -> None:
        self._model = model
        page_size = getattr(transformers.ContinuousBatchingConfig, "page_size", 256)
        wanted = dict(
            max_requests_per_batch=max_batch_size,
            allow_block_sharing=prefix_cache,
            num_blocks=None if kv_tokens is None else -(-kv_tokens // page_size),
            max_memory_percent=kv_memory_fraction,
            auto_switch_to_flash=False,  # --hf-attn-implementation decides; no hub download on a closed box
            seed=seed,
        )
        # The config's fields move between transformers releases: pass the ones this release has.
        accepted = inspect.signature(transformers.ContinuousBatchingConfig).parameters
        self._config = transformers.ContinuousBatchingConfig(
            **{k: v for k, v in wanted.items() if k in accepted}
        )
        self._lock = threading.Lock()
        self._requests: dict[
            str, tuple[queue.SimpleQueue[StreamEvents], list[int]]
        ] = {}  # id -> (sink, eos ids)
        self._seen: dict[str, int] = {}  # tokens already delivered per request (pump thread only)
        self._start()

    def _start(self) -> None:
        generation_config = GenerationConfig(do_sample=False, eos_token_id=[])
        self._manager = self._model.init_continuous_batching(generation_config, self._config)
        if hasattr(self._manager, "warmup"):  # newer releases compile / size their buffers here
            self._manager.warmup()
        self._manager.start()
        self._stopping = False
        self._pump = threading.Thread(target=self._pump_outputs, name="hf-cb-pump")
        self._pump.start()

    def submit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        eos_token_ids: list[int],
        sink: queue.SimpleQueue[StreamEvents],
    ) -> None:
        with self._lock:
            self._requests[request_id] = (sink, eos_token_ids)
        self._manager.add_request(
            prompt,
            request_id=request_id,
            max_new_tokens=params.max_tokens,
            streaming=True,
            record_timestamps=True,
            eos_token_id=eos_token_ids,
        )

    def _pump_outputs(self) -> None:
        while not self._stopping:
            output = self._manager.get_result(timeout=0.1)
            if output is not None:
                self._deliver(output)
            elif not self._manager.is_running():
                self._fail_all(RuntimeError("transformers' continuous batching loop stopped"))
                return

    def _deliver(self, output) -> None:
        request_id = output.request_id
        with self._lock:
            if request_id not in self._requests:  # failed already
                return
            sink, eos_token_ids = self._requests[request_id]
        if output.error is not None:
            self._forget(request_id)
            sink.put([StreamFailure(request_id, RuntimeError(output.error))])
            return
        tokens, times = output.generated_tokens, output.timestamps or []
        start = self._seen.get(request_id, 0)
        finished = output.is_finished()
        reason = _finish_reason(tokens, eos_token_ids) if finished else None
        events: StreamEvents = []
        for i in range(start, len(tokens)):
            last = finished and i == len(tokens) - 1
            events.append(
                StreamDelta(
                    request_id, [tokens[i]], "", last, reason if last else None, None, times[i]
                )
            )
        self._seen[request_id] = len(tokens)
        if finished:
            self._forget(request_id)
            if start == len(tokens):  # the final output brought no new token
                now = times[-1] if times else time.perf_counter()
                events.append(StreamDelta(request_id, [], "", True, reason, None, now))
        if events:
            sink.put(events)

    def _forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)
        with self._lock:
            del self._requests[request_id]

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            requests, self._requests = self._requests, {}
        for request_id, (sink, _) in requests.items():
            sink.put([StreamFailure(request_id, error)])

    def reset_cache(self) -> None:
        """transformers has no call to drop shared blocks: a new manager starts with an empty cache."""
        self.close()
        self._start()

    def close(self) -> None:
        self._stopping = True
        self._pump.join()
        self._manager.stop(block=True)
        self._fail_all(RuntimeError("the transformers backend was closed"))


class _StreamerToSink(BaseStreamer):
    """A ``generate`` streamer: the first ``put`` is the prompt, each later one a new token."""

    def __init__(
        self, request_id: str, eos_token_ids: list[int], sink: queue.SimpleQueue[StreamEvents]
    ) -> None:
        self._request_id, self._eos, self._sink = request_id, eos_token_ids, sink
        self._prompt_seen = False
        self._tokens: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        token = int(value.reshape(-1)[0])
        self._tokens.append(token)
        self._sink.put([StreamDelta(self._request_id, [token], "", False, None, None, now)])

    def end(self) -> None:
        reason = _finish_reason(self._tokens, self._eos)
        self._sink.put(
            [StreamDelta(self._request_id, [], "", True, reason, None, time.perf_counter())]
        )


class _SequentialDriver:
    """``model.generate`` for one request at a time, in submission order, on a worker thread."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._work, name="hf-generate")
        self._worker.start()

    def submit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        eos_token_ids: list[int],
        sink: queue.SimpleQueue[StreamEvents],
    ) -> None:
        self._jobs.put((request_id, prompt, params, eos_token_ids, sink))

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            request_id, prompt, params, eos_token_ids, sink = job
            try:
                ids = torch.tensor([prompt], device=self._model.device)
                config = GenerationConfig(
                    max_new_tokens=params.max_tokens,
                    do_sample=False,
                    eos_token_id=eos_token_ids,
                    pad_token_id=0,
                )
                with torch.no_grad():
                    self._model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        generation_config=config,
                        streamer=_StreamerToSink(request_id, eos_token_ids, sink),
                    )
            except Exception as exc:  # noqa: BLE001 - the consumer must hear of it
                sink.put([StreamFailure(request_id, exc)])

    def reset_cache(self) -> None:
        """Nothing is shared between ``generate`` calls."""

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join()


class HFBackend:
    """A transformers model from a checkpoint dir, served continuously or sequentially (``batching``).

    ``kv_tokens``: KV capacity of continuous batching in tokens (radixinfer's ``num_blocks * block_size``);
    None takes ``kv_memory_fraction`` of free GPU memory, or `CPU_KV_TOKENS` on a CPU.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        device: str,
        dtype: str,
        max_batch_size: int,
        prefix_cache: bool,
        kv_tokens: int | None,
        kv_memory_fraction: float,
        attn_implementation: str,
        batching: str,
        seed: int,
    ) -> None:
        config = AutoConfig.from_pretrained(model_dir)
        torch_dtype = resolve_dtype(dtype, config, torch.device(device))
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch_dtype, attn_implementation=attn_implementation
        )
        self.model = model.to(device).eval()
        has_tokenizer = any((Path(model_dir) / name).is_file() for name in _TOKENIZER_FILES)
        self.tokenizer: Tokenizer = (
            HFTokenizer.from_pretrained(model_dir) if has_tokenizer else ByteTokenizer()
        )
        self.vocab_size: int = config.vocab_size
        self.max_context_len: int = config.max_position_embeddings
        eos = [self.tokenizer.eos_token_id]
        if has_tokenizer:  # like radixinfer: the config's EOS ids only mean something with the checkpoint's tokenizer
            generation_eos = self.model.generation_config.eos_token_id
            eos += generation_eos if isinstance(generation_eos, list) else [generation_eos]
        self.eos_token_ids = [
            i for i in dict.fromkeys(eos) if i is not None and 0 <= i < self.vocab_size
        ]
        if batching == "auto":
            batching = "continuous" if _has_continuous_batching(self.model) else "sequential"
        self.info = {
            "transformers": transformers.__version__,
            "batching": batching,
            "attn_implementation": attn_implementation,
        }
        self._driver = (
            _ContinuousDriver(
                self.model,
                max_batch_size,
                prefix_cache,
                CPU_KV_TOKENS
                if kv_tokens is None and self.model.device.type == "cpu"
                else kv_tokens,
                kv_memory_fraction,
                seed,
            )
            if batching == "continuous"
            else _SequentialDriver(self.model)
        )
        self._ids = 0

    def submit(
        self, prompt: list[int], params: SamplingParams, sink: queue.SimpleQueue[StreamEvents]
    ) -> str:
        request_id = f"hf-{self._ids}"
        self._ids += 1
        self._driver.submit(
            request_id, prompt, params, [] if params.ignore_eos else self.eos_token_ids, sink
        )
        return request_id

    def native_prompt(self, prompt: list[int]) -> list[int]:
        return prompt  # transformers takes lists

    def cache_stats(self) -> None:
        return None

    def reset_cache(self) -> None:
        self._driver.reset_cache()

    def close(self) -> None:
        self._driver.close()
