"""The output processor: reads launches back and turns their tokens into what the engine streams
(docs/request-lifecycle.md, Finish and Token pipelining): appends each token to its request,
detokenizes, checks stop ids and lengths, finishes requests, and emits `StreamDelta`s, or one
`TokenBatch` for the rows of a steady decode step that go on."""

from __future__ import annotations

import time

import numpy as np

from radixinfer.engine.pipeline import Launch
from radixinfer.engine.request import Request, Status
from radixinfer.engine.scheduler import Scheduler
from radixinfer.outputs import EngineEvent, StreamDelta, TokenBatch


class OutputProcessor:
    """Read-back, stop checks, detokenization and deltas for the requests of ``scheduler``."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def read_back(self, launches: list[Launch], events: list[EngineEvent]) -> None:
        """Read back the tokens of ``launches``, oldest first: append each to its request, stream
        it, and finish requests that stop or reach their limit. Requests that finished or were
        aborted meanwhile are skipped (their later tokens were sampled for nothing).

        A decode launch of requests that do not detokenize, all still running, needs a decision only
        for its rows that end (`Launch.last_rows`, stop tokens): the other rows are appended and go
        out as one `TokenBatch`."""
        finished = False
        scheduler, take_token = self.scheduler, self._take_token
        for launch in launches:
            tokens = launch.read()
            now = time.perf_counter()
            batch = launch.batch
            if batch is None or not batch.ids_only or launch.departures != scheduler.departures:
                for req, token in zip(launch.reqs, tokens):
                    finished |= take_token(req, token, now, events)
                continue
            ending = launch.last_rows
            if batch.stop_ids.size:
                stops = np.flatnonzero(np.isin(launch.host.numpy(), batch.stop_ids))
                if stops.size:
                    ending = np.union1d(ending, stops)
            reqs = launch.reqs
            steady = TokenBatch(batch.request_ids, tokens, batch.num_cached_tokens, now)
            if ending.size:
                for i in ending.tolist():
                    finished |= take_token(reqs[i], tokens[i], now, events)
                going_on = np.ones(len(reqs), dtype=bool)
                going_on[ending] = False
                rows = np.flatnonzero(going_on).tolist()
                reqs, steady = [reqs[i] for i in rows], steady.rows(rows)
            for req, token in zip(reqs, steady.token_ids):
                req.output_ids.append(token)
            if reqs:
                events.append(steady)
        if finished:
            scheduler.drop_finished()

    def _take_token(self, req: Request, token: int, now: float, events: list[EngineEvent]) -> bool:
        """Append ``token`` to a request, stream it as a delta, and finish the request if it stops
        or reaches its limit (returns whether it finished). A request no longer running skips it."""
        if req.status is not Status.RUNNING:
            return False
        out = req.output_ids
        out.append(token)
        detokenizer = req.detokenizer
        text = detokenizer.add(token) if detokenizer is not None else ""
        if token in req.stop_ids or len(out) >= req.max_output_len:
            self.scheduler.release(req)
            reason = "stop" if token in req.stop_ids else "length"
            events.append(self.finish(req, reason, [token], text, now))
            return True
        if text:
            req.text += text
        events.append(
            StreamDelta(req.request_id, [token], text, False, None, req.num_cached_tokens, now)
        )
        return False

    def finish(
        self,
        req: Request,
        reason: str,
        token_ids: list[int],
        text: str = "",
        now: float | None = None,
    ) -> StreamDelta:
        """Retire a request whose blocks are released, and return its last delta: ``token_ids``,
        ``text`` and what its detokenizer still held."""
        if req.detokenizer is not None:
            text += req.detokenizer.flush()
        req.text += text
        self.scheduler.retire(req, reason)
        return StreamDelta(
            req.request_id, token_ids, text, True, reason, req.num_cached_tokens or 0,
            time.perf_counter() if now is None else now,
        )  # fmt: skip
