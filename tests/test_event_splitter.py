"""`EventSplitter`: a step's events as one list per owner; a decode batch that repeats (its ids
equal, whether the same list or a copy that crossed a pipe) splits as a fresh splitter would split
it, with the new step's tokens, and a batch of other ids is split anew."""

from __future__ import annotations

import pickle

from radixinfer.core_messages import EventSplitter
from radixinfer.outputs import StreamDelta, TokenBatch


def rows_of(events: list) -> list[tuple]:
    return [(e.request_ids, e.token_ids, e.num_cached_tokens, e.timestamp) for e in events]


def fresh_split(events: list, owners: dict[str, str]) -> dict[str, list[tuple]]:
    split = EventSplitter().split(events, dict(owners))
    return {owner: rows_of(owner_events) for owner, owner_events in split.items()}


def test_a_repeating_batch_splits_as_a_fresh_one_with_each_steps_tokens():
    ids = [f"r{i}" for i in range(9)]
    owners = {request_id: "abc"[i % 3] for i, request_id in enumerate(ids[:-1])}  # r8's has gone
    cached = [10 * i for i in range(9)]
    splitter = EventSplitter()
    for step in range(4):
        tokens = [100 * step + i for i in range(9)]
        batch = TokenBatch(ids, tokens, cached, float(step))
        if step % 2:  # as a front reads it: a copy of the ids, equal, not the same list
            batch = pickle.loads(pickle.dumps(batch))
        split = splitter.split([batch], owners)
        assert {o: rows_of(e) for o, e in split.items()} == fresh_split([batch], owners)
        b_tokens = [tokens[1], tokens[4], tokens[7]]
        assert split["b"] == [TokenBatch(["r1", "r4", "r7"], b_tokens, [10, 40, 70], float(step))]


def test_a_batch_of_other_ids_is_split_anew():
    owners = {"r0": "a", "r1": "b", "r2": "a"}
    splitter = EventSplitter()
    splitter.split([TokenBatch(["r0", "r1", "r2"], [1, 2, 3], [0, 0, 0], 0.0)], owners)
    last = StreamDelta("r1", [4], "", True, "length", 0, 1.0)  # r1 finishes: it leaves owners
    after = TokenBatch(["r0", "r2"], [5, 6], [0, 0], 1.0)
    split = splitter.split([last, after], owners)
    assert split == {"b": [last], "a": [after]}  # all rows one owner's: the batch goes whole
    assert split["a"][0] is after and "r1" not in owners
