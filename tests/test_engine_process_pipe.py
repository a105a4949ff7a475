"""The engine process's pipe (`radixinfer.engine_process._PipeEnd`): what one end sends, the other
receives, every message once and in order, however the sender groups them into frames; an
`AddRequest` crosses it whole (its prompt as bytes), with params asked for ids only. An idle
engine whose last front goes away closes (`_CoreEnd.take`) instead of waiting on no pipe."""

from __future__ import annotations

import multiprocessing
import pickle
import threading

import numpy as np
import pytest

from radixinfer import engine_process
from radixinfer.core_messages import AddRequest, Close
from radixinfer.engine.prompts import PromptChecker
from radixinfer.engine_process import _CoreEnd, _PipeEnd
from radixinfer.sampling_params import SamplingParams


def test_messages_sent_from_several_bursts_arrive_once_each_and_in_order():
    near, far = multiprocessing.Pipe()
    sender, receiver = _PipeEnd(near, "test-sender"), _PipeEnd(far, "test-receiver")
    sent = [("request", i, np.arange(i % 7)) for i in range(2000)]
    release = threading.Event()

    def produce() -> None:
        for i, message in enumerate(sent):
            sender.send(message)
            if i == 1000:
                release.wait()  # a pause mid-way: the rest goes as a later burst
        sender.close()

    producer = threading.Thread(target=produce)
    producer.start()
    received = []
    while len(received) < len(sent):
        received += receiver.recv()
        if len(received) > 1000:
            release.set()
    producer.join()
    assert [(kind, i) for kind, i, _ in received] == [(kind, i) for kind, i, _ in sent]
    assert all(np.array_equal(a[2], b[2]) for a, b in zip(received, sent))
    receiver.close()


def test_a_reader_that_is_behind_never_blocks_the_sender_and_misses_nothing():
    """Frames the socket cannot take at once (~16 MB against a buffer of a few hundred KB, while
    nobody reads) wait for the writer thread: every send returns at once, and once the reader
    reads, every frame arrives whole and in order, later small ones after the big ones."""
    near, far = multiprocessing.Pipe()
    sender, receiver = _PipeEnd(near, "test-sender"), _PipeEnd(far, "test-receiver")
    sent = [(i, bytes([i]) * (256 << 10)) for i in range(64)] + [(64 + i, b"") for i in range(100)]
    sending = threading.Thread(target=lambda: [sender.send(message) for message in sent])
    sending.start()
    sending.join(timeout=10)
    blocked = sending.is_alive()
    received: list = []
    while len(received) < len(sent):  # (unblocks a sender that waits for the reader)
        received += receiver.recv()
    sending.join()
    assert not blocked, "a send waited for the reader"
    assert received == sent
    sender.send("after the queue drained")  # written directly again
    assert receiver.recv() == ["after the queue drained"]
    sender.close()
    receiver.close()


def test_a_send_after_the_other_end_has_gone_is_dropped_and_the_reader_sees_the_end():
    near, far = multiprocessing.Pipe()
    sender = _PipeEnd(near, "test-sender")
    far.close()
    sender.send("nobody reads this")
    sender.close()  # returns: the sender thread dropped what it could not write

    near2, far2 = multiprocessing.Pipe()
    reader = _PipeEnd(far2, "test-reader")
    writer = _PipeEnd(near2, "test-writer")
    writer.send("last")
    writer.close()
    assert reader.recv() == ["last"]
    try:
        reader.recv()
    except EOFError:
        pass
    else:
        raise AssertionError("a closed pipe must end the reader with EOFError")


def test_an_add_request_crosses_with_its_prompt_params_and_salt():
    prompt = np.arange(1152, dtype=np.int64) % 259
    params = SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop_token_ids=[4])
    message = pickle.loads(pickle.dumps(AddRequest("req-9", prompt, params, "tenant"), 5))
    assert message.request_id == "req-9" and message.cache_salt == "tenant"
    assert message.params == params and message.prompt.dtype == np.int64
    assert np.array_equal(message.prompt, prompt)


def test_a_crossed_prompt_is_kept_as_it_is_and_a_callers_array_is_copied():
    """The engine keeps a prompt that crossed the pipe without copying it: it lies over immutable
    bytes. A caller's own array is copied, so that changing it later changes no request."""
    checker = PromptChecker(tokenizer=None, vocab_size=259, max_context_len=128)
    prompt = np.arange(1, 65, dtype=np.int64)
    crossed = pickle.loads(pickle.dumps(AddRequest("r", prompt, SamplingParams(), None), 5))
    assert checker.token_ids(crossed.prompt) is crossed.prompt
    kept = checker.token_ids(prompt)
    assert kept is not prompt and np.array_equal(kept, prompt)
    prompt[0] = 2
    assert kept[0] == 1


def test_an_engine_of_a_device_runs_torchs_cpu_work_inline_unless_told(monkeypatch):
    """`inline_host_ops`: one CPU thread for torch in a process that drives a GPU, unless
    ``OMP_NUM_THREADS`` is set; a CPU engine keeps its threads (its forward runs on them)."""
    import torch

    from radixinfer.engine.runner_setup import inline_host_ops

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        inline_host_ops(torch.device("cpu"))
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        inline_host_ops(torch.device("cuda", 0))
        assert torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        inline_host_ops(torch.device("cuda", 0))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_ids_only_params_keep_every_other_field_and_refuse_stop_strings():
    params = SamplingParams(max_tokens=5, top_p=0.9, presence_penalty=0.5, logit_bias={3: 1.0})
    ids_only = params.ids_only()
    assert not ids_only.detokenize and params.detokenize
    assert ids_only == SamplingParams(
        max_tokens=5, top_p=0.9, presence_penalty=0.5, logit_bias={3: 1.0}, detokenize=False
    )
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="x").ids_only()


def test_frames_read_together_or_split_over_reads_arrive_whole_and_in_order():
    """The reader reads what the pipe holds at once and splits it into frames itself: several small
    frames in one read, a frame larger than one read (3 MiB) over several, each whole, in order;
    ``has_frame`` says whether one has arrived; a closed end reads as ``EOFError``."""
    near, far = multiprocessing.Pipe()
    receiver = _PipeEnd(far, "test-receiver")
    assert not receiver.has_frame()
    messages = [b"a", list(range(10)), b"x" * (3 << 20), "", b"z" * 70_000, ("last", 1)]
    writer = threading.Thread(
        target=lambda: [  # the framing the engine's sender uses, one message a frame
            near.send_bytes(pickle.dumps([m])) for m in messages
        ]
    )
    writer.start()
    received: list = []
    while len(received) < len(messages):
        received += receiver.recv()
    writer.join()
    assert received == messages
    assert not receiver.has_frame()
    near.close()
    with pytest.raises(EOFError):
        receiver.recv()
    receiver.close()


def test_one_take_reads_everything_the_pipe_holds_however_many_reads_that_takes(monkeypatch):
    """The engine's take reads until the pipe is empty, not one read's worth: a burst of requests
    many times a read's size (here reads of 64 bytes) reaches the engine in one take."""
    monkeypatch.setattr(engine_process, "_READ_BYTES", 64)
    near, far = multiprocessing.Pipe()
    core = _CoreEnd([_PipeEnd(far, "test-core")])
    assert core.take(block=False) == []  # nothing there: returns at once
    sent = [("message", i, b"x" * 40) for i in range(50)]  # ~3 KB: the socket holds it all
    for message in sent:
        near.send_bytes(pickle.dumps([message]))
    assert core.take(block=False) == sent
    near.close()
    assert core.take(block=True) == [Close()]
    core.close()


def test_what_a_front_sent_before_going_away_is_taken():
    """A front's last frames and the end of its pipe may come in one read: the frames are taken
    before the front is dropped."""
    near, far = multiprocessing.Pipe()
    core = _CoreEnd([_PipeEnd(far, "test-core")])
    near.send_bytes(pickle.dumps([("last words", 1)]))
    near.close()
    taken: list = []
    while Close() not in taken:
        taken += core.take(block=True)
    assert taken == [("last words", 1), Close()]
    core.close()


@pytest.mark.parametrize("num_fronts", [1, 2])
def test_an_idle_engine_whose_last_front_goes_away_closes(num_fronts):
    pipes = [multiprocessing.Pipe() for _ in range(num_fronts)]
    core = _CoreEnd([_PipeEnd(far, f"test-core-{i}") for i, (_, far) in enumerate(pipes)])
    taken: list = []
    taker = threading.Thread(target=lambda: taken.extend(core.take(block=True)), daemon=True)
    taker.start()  # waits: nothing was sent
    for near, _ in pipes:
        near.close()  # the front's process has gone
    taker.join(timeout=10)
    assert not taker.is_alive(), "the engine went on waiting with no front left"
    assert taken == [Close()]
    core.close()
