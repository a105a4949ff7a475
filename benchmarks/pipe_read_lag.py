"""How late the front's reader gets the engine's frames while its event loop keeps the GIL busy:
``Connection.recv_bytes`` (two reads a frame, each giving up the GIL and waiting to take it back)
against the engine pipe's reader (`radixinfer.engine_process._PipeEnd`: everything the pipe holds
in one read).

    python3 benchmarks/pipe_read_lag.py --frames 460 --rate 230 --frame-bytes 8000

A spawned process writes ``--frames`` frames (``--frame-bytes`` each, about a 512-row decode
step's) at ``--rate`` a second, as the engine process's sender does; in this process a thread runs
Python without pause (an event loop streaming hundreds of requests) while the reader takes the
frames. Prints the lag from write to read, median and p99, for each reader.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixinfer.engine_process import _PipeEnd  # noqa: E402

_STAMP = struct.Struct("d")


def _write(conn: Connection, frames: int, rate: float, size: int) -> None:
    padding = b"x" * size
    for _ in range(frames):  # the engine's framing: a pickled list of messages
        conn.send_bytes(pickle.dumps([_STAMP.pack(time.perf_counter()) + padding]))
        time.sleep(1 / rate)
    conn.close()


def _spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def _lags(reader: str, args: argparse.Namespace) -> list[float]:
    context = multiprocessing.get_context("spawn")
    near, far = context.Pipe()
    writer = context.Process(target=_write, args=(near, args.frames, args.rate, args.frame_bytes))
    writer.start()
    near.close()
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop,))
    spinner.start()
    lags = []
    pipe = _PipeEnd(far, "reader") if reader == "pipe" else None
    try:
        while True:
            try:
                if pipe is None:
                    messages = pickle.loads(far.recv_bytes())
                else:
                    messages = pipe.recv()
            except EOFError:
                break
            now = time.perf_counter()
            lags += [now - _STAMP.unpack_from(m)[0] for m in messages]
    finally:
        stop.set()
        spinner.join()
        writer.join()
    return sorted(lags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=460)
    parser.add_argument("--rate", type=float, default=230.0, help="frames a second [230]")
    parser.add_argument("--frame-bytes", type=int, default=8000)
    args = parser.parse_args()
    for name, reader in (("Connection.recv_bytes", "plain"), ("engine pipe reader", "pipe")):
        lags = _lags(reader, args)
        p50, p99 = lags[len(lags) // 2], lags[int(0.99 * (len(lags) - 1))]
        print(f"{name:<22} {len(lags)} frames, lag p50 {1e3 * p50:.1f} ms, p99 {1e3 * p99:.1f} ms")


if __name__ == "__main__":
    main()
