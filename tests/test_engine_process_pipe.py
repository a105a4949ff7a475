"""The engine process's pipe (`radixinfer.engine_process._PipeEnd`): what one end sends, the other
receives, every message once and in order, however the sender groups them into frames."""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np

from radixinfer.engine_process import _PipeEnd


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
