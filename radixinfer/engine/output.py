"""The output processor: reads launches back and turns their tokens into what the engine streams
(docs/request-lifecycle.md, Finish and Token pipelining): appends each token to its request,
detokenizes, checks stop ids, stop strings and lengths, attaches logprobs, finishes requests, and
emits `StreamDelta`s, or one `TokenBatch` for the rows of a decode step that go on."""

from __future__ import annotations

import time

import numpy as np

from radixinfer.engine.logprobs import unpack
from radixinfer.engine.pipeline import Launch
from radixinfer.engine.request import Request, Status
from radixinfer.engine.scheduler import Scheduler
from radixinfer.outputs import (
    CompletionOutput,
    EngineEvent,
    PositionLogprobs,
    RequestOutput,
    StreamDelta,
    TokenBatch,
)
from radixinfer.tokenizer import Tokenizer


class OutputProcessor:
    """Read-back, stop checks, detokenization and deltas for the requests of ``scheduler``."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer

    def read_back(self, launches: list[Launch], events: list[EngineEvent]) -> None:
        """Read back the tokens of ``launches``, oldest first: append each to its request, stream
        it, and finish requests that stop or reach their limit. Requests that finished or were
        aborted meanwhile are skipped (their later tokens were sampled for nothing).

        A decode launch of requests that do not detokenize needs a decision only for its rows that
        end (`Launch.last_rows`, stop tokens) and, when a request has stopped running since the
        launch (a departure), for the rows of those that did: the other rows are appended and go
        out as one `TokenBatch`. So the steps in which requests finish one after another (a batch
        admitted over several prefill rounds ends over as many steps) stream the rest of the batch
        as one event, not a delta per request."""
        finished = False
        scheduler, take_token = self.scheduler, self._take_token
        for launch in launches:
            tokens = launch.read()
            now = time.perf_counter()
            batch = launch.batch
            if batch is None or not batch.ids_only:
                scored = self._scored(launch, tokens)
                if not scored:  # (no row asks for logprobs: no look-up per row)
                    for req, token in zip(launch.reqs, tokens):
                        finished |= take_token(req, token, now, events)
                    continue
                for row, (req, token) in enumerate(zip(launch.reqs, tokens)):
                    finished |= take_token(req, token, now, events, scored.get(row))
                continue
            ending = launch.last_rows
            if batch.stop_ids.size:
                stops = np.isin(launch.host.numpy(), batch.stop_ids).nonzero()[0]
                if stops.size:
                    ending = np.union1d(ending, stops)
            reqs = launch.reqs
            gone: list[int] = []  # rows of requests that stopped running since: nothing to take
            if launch.departures != scheduler.departures:
                gone = [i for i, req in enumerate(reqs) if req.status is not Status.RUNNING]
            steady = TokenBatch(batch.request_ids, tokens, batch.num_cached_tokens, now)
            if ending.size or gone:
                for i in ending.tolist():
                    finished |= take_token(reqs[i], tokens[i], now, events)  # skips gone rows
                going_on = np.ones(len(reqs), dtype=bool)
                going_on[ending] = False
                going_on[gone] = False
                rows = going_on.nonzero()[0].tolist()
                reqs, steady = [reqs[i] for i in rows], steady.rows(rows)
            for req, token in zip(reqs, steady.token_ids):
                req.output_ids.append(token)
            if reqs:
                events.append(steady)
        if finished:
            scheduler.drop_finished()

    def _scored(self, launch: Launch, tokens: list[int]) -> dict[int, PositionLogprobs]:
        """The logprobs of a launch's scored rows, by row (empty when none asked)."""
        scores = launch.scores
        if scores is None:
            return {}
        out = {}
        for row, k, packed in zip(scores.rows, scores.ks, launch.read_scores()):
            req = launch.reqs[row]
            text = self.token_text if req.detokenizer is not None else None
            out[row] = unpack(packed, tokens[row], k, text)
        return out

    def _take_token(
        self,
        req: Request,
        token: int,
        now: float,
        events: list[EngineEvent],
        logprobs: PositionLogprobs | None = None,
    ) -> bool:
        """Append ``token`` to a request, stream it as a delta, and finish the request if it stops
        (a stop token or stop string) or reaches its limit (returns whether it finished). A request
        no longer running skips it."""
        if req.status is not Status.RUNNING:
            return False
        out = req.output_ids
        out.append(token)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        detokenizer = req.detokenizer
        stop_strings = req.stop_strings
        if detokenizer is not None:
            text = detokenizer.add(token)
            req.text += text
            # stop strings, like stop tokens, count only once ``min_tokens`` are out (as in vLLM)
            if stop_strings is not None and text and len(out) >= req.params.min_tokens:
                found = stop_strings.find(req.text, len(text))
                if found is not None:
                    req.stop_reason, kept = found
                    req.text = req.text[:kept]
                    return self._stop(req, "stop", token, logprobs, now, events)
        if token in req.stop_ids:
            if token in (req.params.stop_token_ids or ()):
                req.stop_reason = token
            return self._stop(req, "stop", token, logprobs, now, events, flush=True)
        if len(out) >= req.max_output_len:
            return self._stop(req, "length", token, logprobs, now, events, flush=True)
        delta_text = ""  # the text of a request that does not detokenize stays empty
        if detokenizer is not None:
            text = req.text
            visible = len(text) - (stop_strings.held_back(text) if stop_strings is not None else 0)
            delta_text = text[req.sent : visible]
            req.sent = max(req.sent, visible)
        events.append(
            StreamDelta(
                req.request_id, [token], delta_text, False, None, req.num_cached_tokens, now,
                req.index, None if logprobs is None else [logprobs],
            )
        )  # fmt: skip
        return False

    def _stop(
        self,
        req: Request,
        reason: str,
        token: int,
        logprobs: PositionLogprobs | None,
        now: float,
        events: list[EngineEvent],
        flush: bool = False,
    ) -> bool:
        self.scheduler.release(req)
        events.append(self.finish(req, reason, [token], now, flush, logprobs))
        return True

    def finish(
        self,
        req: Request,
        reason: str,
        token_ids: list[int],
        now: float | None = None,
        flush: bool = True,
        logprobs: PositionLogprobs | None = None,
    ) -> StreamDelta:
        """Retire a request whose blocks are released, and return its last delta: ``token_ids``
        and the text not streamed yet (with, when ``flush``, what its detokenizer still held; cut
        at a stop string it completes). The delta is ``finished`` when it is its group's last."""
        if flush and req.detokenizer is not None:
            tail = req.detokenizer.flush()
            if tail:
                req.text += tail
                found = req.stop_strings and req.stop_strings.find(req.text, len(tail))
                if found:
                    req.stop_reason, kept = found
                    req.text = req.text[:kept]
                    reason = "stop"
        text = req.text[req.sent :]
        req.sent = len(req.text)
        self.scheduler.retire(req, reason)
        return StreamDelta(
            req.request_id, token_ids, text, req.group_finished(), reason,
            req.num_cached_tokens or 0, time.perf_counter() if now is None else now,
            req.index, None if logprobs is None else [logprobs], req.stop_reason,
        )  # fmt: skip

    def token_text(self, token_id: int) -> str:
        """A token's own text (`Logprob.decoded_token`)."""
        return self.tokenizer.decode([token_id])


def request_output(first: Request, prompt: str | None) -> RequestOutput:
    """The `RequestOutput` of a finished request (its first sample, whose ``group`` holds every
    sample); ``prompt``: its text, when it was given as text."""
    outputs = [
        CompletionOutput(r.index, r.text, r.output_ids, r.logprobs, r.finish_reason, r.stop_reason)
        for r in first.group
    ]
    return RequestOutput(
        request_id=first.request_id,
        prompt=prompt,
        prompt_token_ids=first.prompt_ids.tolist(),
        outputs=outputs,
        finished=True,
        num_cached_tokens=first.num_cached_tokens or 0,
        prompt_logprobs=first.prompt_logprobs,
    )
