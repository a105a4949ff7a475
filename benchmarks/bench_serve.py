"""Served against in-process: the same ``radixinfer bench`` workload through ``radixinfer serve`` (the
bench's OpenAI client on loopback) and through the engine in this process, side by side, with the
ratio, and the CPU time the server's processes spent per request and per streamed token.

    python benchmarks/bench_serve.py --model qwen2.5-0.5b --dtype bfloat16 --max-batch-size 512 \
        --dataset shared-prefix --num-groups 16 --prompts-per-group 32 --system-prompt-len 1024 \
        --question-len 128 --output-len 128 --no-stop-on-eos --cold-cache --warmup-runs 1 \
        --repeat-runs 3 --api-server-count 4 --client-processes 4
    python benchmarks/bench_serve.py --stub-model --max-batch-size 512 --dataset shared-prefix \
        --num-groups 16 --prompts-per-group 32 --system-prompt-len 1024 --question-len 128 \
        --output-len 16 --no-stop-on-eos     # CPU: the server's own costs, the model's forward stubbed

Every flag is a ``radixinfer bench`` flag (``--backend`` and ``--base-url`` are set here); the model
and engine flags among them also start the server. Steps: start ``radixinfer serve`` as a subprocess
on a free loopback port, wait for ``/health``, run the bench's ``openai`` backend against it, stop it
(its GPU memory is released), run the ``radixinfer`` backend in this process, print both tables and
the in-process / served ratios (> 1: in-process is better). Both halves take the in-process
bench's ``--warmup-runs`` (1 on a GPU, 0 on a CPU, unless given). ``--api-server-count N`` starts
the server with N API server processes over its engine process (default 1); ``--client-processes K``
reads the served streams from K client processes (the bench's flag, given to the served half only;
default 1): one process of either kind streams ~70,000 one-token chunks a second at most, so a
faster engine needs several of both. ``--skip-in-process`` runs the served half only;
``--serve-flag=--stream-interval=4`` (repeatable) passes a flag to the server alone;
``--server-timeout S`` bounds its start-up (300 s); ``--json PATH`` writes both results and the CPU
counts; ``--profile-front PATH`` runs the server under cProfile (its event loop's thread, start-up
included, in CPU seconds of that thread; cProfile slows it, so its tables are not the ones to
compare; with ``--api-server-count 1`` only) and prints its top functions.

CPU counts (Linux ``/proc``): the server's HTTP processes (``front``: the command's own process and
its API server processes) and its engine process (``engine``), and this process with its client
processes (``client``: the bench's OpenAI clients and run loops), over the whole served bench
(warm-up runs included), per request and per streamed token.

``--step-trace DIR``: every engine core of both halves records its steps in DIR
(`radixinfer.engine_core.StepTrace`), and a table follows the reports with each burst of steps
(a run of the bench, warm-ups first, when all its requests come at once) on the engine's side:
requests taken, over how long they arrived, the burst's span from its first step to its last,
when its last prefill ended, a steady decode pass (median), and the steps in which requests
finished, with their time and the CPU time the engine's thread ran in them, the collector's pauses
and the times the kernel preempted the engine's thread; then, for a measured run, its time outside
the engine: from its first submit to the burst's first step (``lead``) and from the last step to
its last token (``tail``). The served half's span against the in-process half's says how much of
the served run's extra time is the engine's, and which part; ``lead`` and ``tail`` say the rest.

``--stub-model`` replaces the model's forward by its embedding lookup (no attention, no layers) in
every process of this script, the server's engine process included (the environment variable
``BENCH_SERVE_STUB`` is inherited, and multiprocessing's spawn re-imports this file there), so a CPU
measures the server's intake and streaming instead of the model. Llama-shaped models only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STUB_ENV = "BENCH_SERVE_STUB"
PROFILE_ENV = "BENCH_SERVE_PROFILE"  # where the server's process writes its event loop's profile
STUB_MODEL = "tiny"  # the preset --stub-model defaults --model to (its byte vocabulary)


def install_stub() -> None:
    """Make every Llama-shaped model's forward its embedding lookup: ``[T] -> [T, hidden]``."""
    from radixinfer.models.llama import LlamaModel

    LlamaModel.forward = lambda self, input_ids, positions, ctx: self.embed_tokens(input_ids)


if os.environ.get(STUB_ENV):  # here and in the server's processes, which inherit the variable
    install_stub()


def _split_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` split into (the model and engine flags, which ``radixinfer serve`` takes too, the
    rest), each flag with its values."""
    from radixinfer.engine_args import add_engine_arguments

    engine = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(engine)
    known = {flag: action for action in engine._actions for flag in action.option_strings}
    ours: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        action = known.get(flag)
        takes = 0 if "=" in argv[i] or action is None or action.nargs == 0 else 1
        (ours if action is not None else rest).extend(argv[i : i + 1 + takes])
        i += 1 + takes
    return ours, rest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (0.0 where ``/proc`` cannot tell)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    """``radixinfer serve`` with ``engine_flags`` and ``api_server_count`` API server processes on a
    free loopback port, as a subprocess."""

    def __init__(
        self,
        engine_flags: list[str],
        serve_flags: list[str],
        api_server_count: int,
        timeout: float,
        profile: str | None = None,
    ) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, str(Path(__file__).resolve()), "--serve"]
        command += [*engine_flags, *serve_flags, "--api-server-count", str(api_server_count)]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        if profile:
            env[PROFILE_ENV] = str(Path(profile).resolve())
        self.process = subprocess.Popen(command, env=env)
        self.engine_pid: int | None = None
        self.api_server_pids: list[int] = []  # beside this process's, with --api-server-count > 1
        self._wait_ready(timeout, api_server_count)

    def _wait_ready(self, timeout: float, api_server_count: int) -> None:
        """Wait until ``/health`` answers and every process of the server has named itself."""
        import httpx

        from radixinfer.engine_process import ENGINE_PROCESS_NAME, named_children
        from radixinfer.server.api_servers import API_SERVER_PROCESS_NAME

        api_servers = [f"{API_SERVER_PROCESS_NAME}{i}" for i in range(api_server_count)]
        names = [ENGINE_PROCESS_NAME, *(api_servers if api_server_count > 1 else [])]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.process.returncode}")
            children = named_children(self.process.pid)
            try:
                healthy = httpx.get(f"{self.url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                healthy = False
            if healthy and all(name in children for name in names):
                self.engine_pid = children[ENGINE_PROCESS_NAME]
                self.api_server_pids = [children[name] for name in names[1:]]
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server was not ready within {timeout:g} s")

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of the HTTP side (this process and the API server processes) and of
        the engine process."""
        front = sum(map(_cpu_seconds, [self.process.pid, *self.api_server_pids]))
        engine = _cpu_seconds(self.engine_pid) if self.engine_pid else 0.0
        return {"front": front, "engine": engine}

    def stop(self) -> None:
        """Stop the server and wait until its engine process has exited too: the in-process half
        that follows needs the GPU memory the engine held (killed after 30 s)."""
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.engine_pid is None:
            return
        deadline = time.monotonic() + 30
        while _alive(self.engine_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(self.engine_pid):
            os.kill(self.engine_pid, signal.SIGKILL)


def _client_cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that have ended (the bench's
    client processes, which end with the served bench; the server is stopped after the count)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (not a zombie waiting for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def _bench(argv: list[str]) -> dict:
    from radixinfer.bench.args import parse_bench_args
    from radixinfer.bench.runner import run_bench

    return run_bench(parse_bench_args(argv))


def _server_stack() -> str:
    """What uvicorn runs on in this environment (the server's, a subprocess of the same Python):
    httptools and uvloop when installed, else h11 and asyncio's loop, both pure Python."""
    import importlib.util

    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return f"server HTTP: {http}, event loop: {loop}"


def _cpu_table(cpu: dict[str, float], requests: int, tokens: int) -> str:
    lines = [_server_stack()]
    lines.append(f"{'CPU (served bench)':<12} {'seconds':>9} {'ms/request':>11} {'us/token':>9}")
    for name, seconds in cpu.items():
        per_request = 1e3 * seconds / max(requests, 1)
        per_token = 1e6 * seconds / max(tokens, 1)
        lines.append(f"{name:<18} {seconds:>9.2f} {per_request:>11.3f} {per_token:>9.1f}")
    return "\n".join(lines)


def _served_counts(result: dict, args: argparse.Namespace) -> tuple[int, int]:
    """Requests and completion tokens of every run of the served bench, warm-up included."""
    metrics = result["runs"][0]["metrics"]
    runs = args.warmup_runs + args.repeat_runs
    per_run = (
        metrics["requests"] / args.repeat_runs,
        metrics["completion_tokens"] / args.repeat_runs,
    )
    return round(per_run[0] * runs), round(per_run[1] * runs)


def trace_bursts(path: Path) -> list[list[dict[str, float]]]:
    """The steps of a `StepTrace` file split into bursts: a burst begins at a step whose take
    waited for work."""
    from radixinfer.engine_core import StepTrace

    bursts: list[list[dict[str, float]]] = []
    for step in StepTrace.read(path):
        if step["idle"] or not bursts:
            bursts.append([])
        bursts[-1].append(step)
    return bursts


def burst_summary(steps: list[dict[str, float]]) -> dict[str, float]:
    """One burst on the engine's side, in ms from its first step's start: the requests taken, the
    start of the last step that took some (``arrivals``), the end of the last step (``span``) and of
    the last that computed prompt tokens (``prefill``), the median pass (start to next start) of
    the steady decode steps (no prompt computed, no request finished), the steps in which
    requests finished (``active`` fell) and their time, start to end, and the CPU time the core's
    thread ran in them; then, over the whole burst, the collector's pauses and the times the kernel
    took the core's CPU for another thread (`radixinfer.engine_core.StepTrace`)."""
    t0 = steps[0]["start"]
    ms = lambda t: 1e3 * (t - t0)  # noqa: E731
    adding = [s for s in steps if s["added"]]
    prefill = [s for s in steps if s["computed"]]
    passes, ending = [], []
    for prev, step, nxt in zip(steps, steps[1:], [*steps[2:], None]):
        if step["active"] < prev["active"]:
            ending.append(step)
        elif not step["computed"] and nxt is not None:
            passes.append(nxt["start"] - step["start"])
    return {
        "requests": int(sum(s["added"] for s in steps)),
        "arrivals ms": ms(adding[-1]["start"]) if adding else 0.0,
        "span ms": ms(steps[-1]["end"]),
        "prefill ms": ms(prefill[-1]["end"]) if prefill else 0.0,
        "decode pass ms": 1e3 * statistics.median(passes) if passes else 0.0,
        "ending steps": len(ending),
        "ending ms": 1e3 * sum(s["end"] - s["start"] for s in ending),
        "ending cpu ms": 1e3 * sum(s["cpu"] for s in ending),
        "gc ms": 1e3 * sum(s["gc"] for s in steps),
        "preempted": int(sum(s["preempted"] for s in steps)),
    }


def outside_engine(
    steps: list[dict[str, float]], clocks: list[list[float]]
) -> dict[str, float | None]:
    """How much of the measured run that a burst served lies outside the engine's steps, in ms:
    ``lead`` from the run's first submit to the burst's first step, ``tail`` from its last step's
    end to the run's last token (where the client read it; in process, when the engine read it
    back, inside the last step). ``clocks``: each measured run's first submit and last token (the
    bench's ``clock_s``); a burst no run spans (a warm-up) has None."""
    first, last = steps[0]["start"], steps[-1]["end"]
    for submitted, done in clocks:
        if submitted <= first <= done:
            return {"lead ms": 1e3 * (first - submitted), "tail ms": 1e3 * (done - last)}
    return {"lead ms": None, "tail ms": None}


def _step_trace_table(
    folder: Path, in_process_pid: int, runs: list[dict]
) -> tuple[str, list[dict]]:
    """Every burst of both halves' traces in ``folder`` (`burst_summary`, `outside_engine` against
    the measured ``runs`` of the bench's result), as a table and as rows."""
    from radixinfer.bench.report import format_value, text_table

    clocks = {"served": [], "in-process": []}
    for run in runs:
        half = "served" if run["backend"] == "openai" else "in-process"
        clocks[half] += [r["clock_s"] for r in run["repeats"]] or [run["metrics"]["clock_s"]]
    halves = [("served", path) for path in sorted(folder.glob("engine-process-*.steps"))]
    halves += [("in-process", p) for p in sorted(folder.glob(f"engine-thread-{in_process_pid}-*"))]
    rows = [
        {
            "half": half,
            "burst": i + 1,
            **burst_summary(steps),
            **outside_engine(steps, clocks[half]),
        }
        for half, path in halves
        for i, steps in enumerate(trace_bursts(path))
    ]
    if not rows:
        return "no engine steps were traced", rows
    cells = [
        [str(v) if isinstance(v, str) else format_value(v, 1) for v in r.values()] for r in rows
    ]
    title = "engine steps by burst (ms from a burst's first step; a burst: a run, warm-ups first)"
    return title + "\n" + text_table(list(rows[0]), cells), rows


def main(argv: list[str]) -> int:
    from radixinfer.bench.args import parse_bench_args
    from radixinfer.bench.report import comparisons, format_report
    from radixinfer.engine_core import STEP_TRACE_ENV

    own = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    own.add_argument("--stub-model", action="store_true")
    own.add_argument("--skip-in-process", action="store_true")
    own.add_argument("--server-timeout", type=float, default=300.0)
    own.add_argument("--json", default=None)
    own.add_argument("--serve-flag", action="append", default=[], metavar="FLAG")
    own.add_argument("--profile-front", default=None, metavar="PATH")
    own.add_argument("--api-server-count", type=int, default=1, metavar="N")
    own.add_argument("--client-processes", type=int, default=1, metavar="K")
    own.add_argument("--step-trace", default=None, metavar="DIR")
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    args, bench_argv = own.parse_known_args(argv)
    if min(args.api_server_count, args.client_processes) < 1:
        own.error("--api-server-count and --client-processes must be >= 1")
    if args.profile_front and args.api_server_count > 1:
        own.error("--profile-front profiles the one HTTP process of --api-server-count 1")
    if args.stub_model:
        os.environ[STUB_ENV] = "1"
        install_stub()
        if not any(a.split("=")[0] == "--model" for a in bench_argv):
            bench_argv = ["--model", STUB_MODEL, *bench_argv]
    parsed = parse_bench_args(bench_argv)  # bad flags stop here, before a server starts
    # Both halves warm up alike: the served bench's own default would follow its client's backend.
    bench_argv = [*bench_argv, "--warmup-runs", str(parsed.warmup_runs)]
    if args.step_trace:  # read by this process's engine core and the server's, which inherit it
        Path(args.step_trace).mkdir(parents=True, exist_ok=True)
        os.environ[STEP_TRACE_ENV] = str(Path(args.step_trace).resolve())
    engine_flags, _ = _split_flags(bench_argv)
    server = Server(
        engine_flags,
        args.serve_flag,
        args.api_server_count,
        args.server_timeout,
        args.profile_front,
    )
    served_argv = [*bench_argv, "--backend", "openai", "--base-url", server.url]
    served_argv += ["--client-processes", str(args.client_processes)]
    try:
        before, client_before = server.cpu(), _client_cpu_seconds()
        served = _bench(served_argv)
        after, client_after = server.cpu(), _client_cpu_seconds()
    finally:
        server.stop()
    cpu = {name: after[name] - before[name] for name in after}
    cpu["client"] = client_after - client_before
    requests, tokens = _served_counts(served, parsed)
    runs = list(served["runs"])
    processes = {"api_servers": args.api_server_count, "client_processes": args.client_processes}
    print(format_report(served))  # before the in-process half, which may fail on its own
    print(
        f"API server processes: {args.api_server_count}, client processes: {args.client_processes}"
    )
    print(_cpu_table(cpu, requests, tokens), flush=True)
    if not args.skip_in_process:
        runs = _bench([*bench_argv, "--backend", "radixinfer"])["runs"] + runs
    result = {"config": served["config"], "runs": runs, "comparisons": comparisons(runs)}
    if not args.skip_in_process:
        print(format_report(result), flush=True)
    if args.profile_front:
        _print_profile(args.profile_front)
    if args.step_trace:
        text, result["step_trace"] = _step_trace_table(Path(args.step_trace), os.getpid(), runs)
        print(text)
    if args.json:
        result["served_cpu"] = {"seconds": cpu, "requests": requests, "tokens": tokens}
        result["served_processes"] = processes
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


def _print_profile(path: str, top: int = 30) -> None:
    import pstats

    print(f"\nthe server's event loop thread (cProfile, {path}), by own time:")
    pstats.Stats(path).sort_stats("tottime").print_stats(top)


def _serve(argv: list[str]) -> int:
    """``radixinfer serve``; under cProfile (its main thread: the event loop) when `PROFILE_ENV`
    names a file, written when the server stops."""
    from radixinfer.cli import main as cli_main

    if not (path := os.environ.get(PROFILE_ENV)):
        return cli_main(["serve", *argv])
    import cProfile

    # uvicorn re-raises the SIGTERM that stopped it once it has shut down: exit through `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    profiler = cProfile.Profile(time.thread_time)  # CPU time: not the waits for the GIL
    profiler.enable()
    try:
        return cli_main(["serve", *argv])
    finally:
        profiler.disable()
        profiler.dump_stats(path)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(_serve(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
