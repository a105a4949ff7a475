"""The benchmark's parts on plain data: metric definitions, arrivals, workloads (incl. the fixed prompts'
lengths with the GPT-2-small comparison tokenizer), variants, speedups, the run loop against a scripted backend
(multi-turn chaining, context caps, failures), and how variants run side by side (all open, paired rounds)."""

from __future__ import annotations

import argparse
import gc
import math
import queue
import time
from types import SimpleNamespace

import numpy as np
import pytest

from radixinfer.bench import backends, runner
from radixinfer.bench.args import default_warmup_runs
from radixinfer.bench.metrics import RequestRecord, cache_delta, latency_ms, summarize
from radixinfer.bench.report import comparisons, format_report, speedups
from radixinfer.bench.run_loop import run_workload
from radixinfer.bench.runner import Variant, open_backend, plan_variants, round_orders
from radixinfer.bench.workloads import (
    arrival_offsets,
    build_workload,
    fit_to_context,
    fixed_prompt_texts,
    parse_repeats,
)
from radixinfer.cli import parse_args
from radixinfer.core_messages import StreamFailure
from radixinfer.outputs import StreamDelta
from radixinfer.sampling_params import SamplingParams
from radixinfer.tokenizer import ByteTokenizer, HFTokenizer

SHARED_PROMPT = "You are a helpful assistant. Answer the question concisely and cite your sources."


def bench_args(*flags: str):
    return parse_args(["bench", *flags])


# ---------------------------------------------------------------------------------------------- metrics
def record(submit: float, times: list[float], prompt_len: int = 10) -> RequestRecord:
    r = RequestRecord(submit, prompt_len)
    for t in times:
        r.add(StreamDelta("r", [1], "", False, None, 0, t))
    return r


def test_metric_definitions():
    r = record(1.0, [1.5, 1.7, 2.0, 2.6])
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx((2.6 - 1.5) / 3)
    assert r.itls == pytest.approx([0.2, 0.3, 0.6])
    assert r.e2e == pytest.approx(1.6)
    assert record(0.0, [0.4]).tpot is None  # one token: no TPOT


def test_a_delta_with_several_tokens_counts_each_at_its_timestamp():
    r = RequestRecord(0.0, 3)
    r.add(StreamDelta("r", [1, 2], "", False, None, 0, 0.5))
    r.add(StreamDelta("r", [], "", True, "length", 0, 0.9))
    assert r.token_times == [0.5, 0.5] and r.finish_reason == "length"


def test_itl_is_per_arrival_and_tpot_per_token():
    """Tokens that arrive together (a served chunk of several) are one arrival: one gap each."""
    r = RequestRecord(0.0, 3)
    for ids, t in (([1], 0.5), ([2, 3, 4], 0.8), ([5], 0.9), ([6, 7], 1.5)):
        r.add(StreamDelta("r", ids, "", False, None, 0, t))
    assert r.itls == pytest.approx([0.3, 0.1, 0.6])
    assert r.tpot == pytest.approx((1.5 - 0.5) / 6)
    assert r.ttft == pytest.approx(0.5)


def test_summary_percentiles_throughput_and_cache_counters():
    records = [record(0.0, [0.1 * (i + 1), 0.1 * (i + 1) + 0.05]) for i in range(10)]
    before = {
        "prompt_tokens": 5,
        "cached_tokens": 1,
        "computed_prompt_tokens": 4,
        "cow_copies": 0,
        "evicted_blocks": 0,
        "preemptions": 0,
        "host_hit_tokens": 0,
        "loaded_tokens": 0,
        "offloaded_tokens": 0,
        "written_through_tokens": 0,
        "loaded_bytes": 0,
        "load_seconds": 0.0,
        "decode_forwards": 3,
        "decode_read_bytes": 3 * 10**9,
        "free_blocks": 9,
    }
    after = {
        **before,
        "prompt_tokens": 105,
        "cached_tokens": 81,
        "computed_prompt_tokens": 24,
        "decode_forwards": 7,  # 4 decode steps in the run, 2 GB each at the least
        "decode_read_bytes": 11 * 10**9,
    }
    s = summarize(records, wall_s=2.0, cache=cache_delta(before, after), hbm_tbps=4.0)
    assert s["requests"] == 10 and s["prompt_tokens"] == 100 and s["completion_tokens"] == 20
    assert (
        s["cached_tokens"] == 80
        and s["computed_prompt_tokens"] == 20
        and s["hit_rate"] == pytest.approx(0.8)
    )
    assert s["ttft_ms"]["p50"] == pytest.approx(550.0) and s["ttft_ms"]["mean"] == pytest.approx(
        550.0
    )
    assert s["ttft_ms"]["p99"] == pytest.approx(
        np.percentile([100 * (i + 1) for i in range(10)], 99)
    )
    assert s["itl_ms"]["p95"] == pytest.approx(50.0) and s["tpot_ms"]["mean"] == pytest.approx(50.0)
    assert s["output_throughput"] == pytest.approx(10.0) and s["total_throughput"] == pytest.approx(
        60.0
    )
    # the mean decode step's floor: 2 GB at 4 TB/s, 0.5 ms of the 50 ms median gap between tokens
    assert s["decode_read_mb"] == pytest.approx(2000.0)
    assert s["decode_floor_ms"] == pytest.approx(0.5)
    assert s["decode_floor_of_itl"] == pytest.approx(0.01)
    no_bandwidth = summarize(records, 2.0, cache=cache_delta(before, after))
    assert no_bandwidth["decode_read_mb"] == pytest.approx(2000.0)
    assert no_bandwidth["decode_floor_ms"] is None and no_bandwidth["decode_floor_of_itl"] is None
    no_counters = summarize(records, 2.0, cache=None, hbm_tbps=4.0)
    assert no_counters["hit_rate"] is None and no_counters["decode_floor_ms"] is None
    assert latency_ms([]) == {"mean": None, "p50": None, "p95": None, "p99": None}


def test_without_engine_counters_the_hit_rate_comes_from_what_each_request_reported():
    """A server's requests report their cached prompt tokens on their last delta (the usage's
    ``cached_tokens``): the run's hit rate adds them up, and is None when any request did not."""

    def served(prompt_len: int, cached: int | None) -> RequestRecord:
        r = RequestRecord(0.0, prompt_len)
        r.add(StreamDelta("r", [1], "", False, None, None, 0.5))
        r.add(StreamDelta("r", [2], "", True, "length", cached, 0.6))
        return r

    s = summarize([served(100, 60), served(50, 0)], 1.0, cache=None)
    assert (s["cached_tokens"], s["computed_prompt_tokens"]) == (60, 90)
    assert s["hit_rate"] == pytest.approx(0.4)
    assert s["preemptions"] is None and s["load_gb_per_s"] is None
    unreported = summarize([served(100, 60), served(50, None)], 1.0, cache=None)
    assert unreported["cached_tokens"] is None and unreported["hit_rate"] is None


def test_speedups_are_above_one_when_the_first_run_is_better():
    first = {
        "output_throughput": 200.0,
        "total_throughput": 400.0,
        "wall_s": 1.0,
        **{k: {"p50": 10.0, "p99": 20.0} for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")},
    }
    other = {
        "output_throughput": 100.0,
        "total_throughput": 200.0,
        "wall_s": 2.0,
        **{k: {"p50": 30.0, "p99": 60.0} for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")},
    }
    s = speedups(first, other)
    assert s["output_throughput"] == 2.0 and s["ttft_ms.p50"] == 3.0 and s["wall_s"] == 2.0


# ---------------------------------------------------------------------------------------------- workloads
def test_arrivals():
    rng = np.random.default_rng(0)
    assert arrival_offsets(3, math.inf, None, rng) == [0.0, 0.0, 0.0]
    assert arrival_offsets(3, math.inf, 250.0, rng) == [0.0, 0.25, 0.5]
    poisson = arrival_offsets(4000, 100.0, None, rng)
    assert poisson[0] == 0.0 and poisson == sorted(poisson)
    assert np.mean(np.diff(poisson)) == pytest.approx(0.01, rel=0.1)


def test_fixed_prompts_cycle_repeats_and_append_a_unique_suffix():
    assert parse_repeats("512,1,1,1") == [512, 1, 1, 1]
    with pytest.raises(ValueError):
        parse_repeats("3,0")
    texts = fixed_prompt_texts("Hi", [3, 1], unique=True, num_requests=3)
    assert texts == ["Hi Hi Hi [0]", "Hi [1]", "Hi Hi Hi [2]"]
    assert fixed_prompt_texts("Hi", [2], unique=False, num_requests=2) == ["Hi Hi", "Hi Hi"]


def test_fixed_prompt_lengths_with_the_comparison_tokenizer(gpt2_checkpoint_dir):
    """The prompt lengths benchmarks/RESULTS.md gives for the fixed-prompt workloads with the tokenizer of
    the GPT-2-small comparison checkpoint (benchmarks/make_gpt2_checkpoint.py): repeats joined by a space,
    unique suffix " [i]", and the head-of-line mix counted after --truncate-prompts cuts its long prompts
    to GPT-2's 1,024-token context."""
    tokenizer = HFTokenizer.from_pretrained(gpt2_checkpoint_dir)

    def lengths(prompt, repeats, unique, n, context=None):
        ids = [
            tokenizer.encode(t)
            for t in fixed_prompt_texts(prompt, parse_repeats(repeats), unique, n)
        ]
        return [len(fit_to_context(p, context, truncate=True)) if context else len(p) for p in ids]

    assert set(lengths("Hello", "65", False, 4)) == {195}
    assert sum(lengths(SHARED_PROMPT, "20", True, 256)) == 148_992
    untruncated = lengths("Hello", "512,1,1,1", True, 128)
    assert untruncated[:4] == [1539, 6, 6, 6]
    assert sum(lengths("Hello", "512,1,1,1", True, 128, context=1024)) == 33_344


def test_fit_to_context():
    assert fit_to_context([1, 2, 3], 3, truncate=False) == [1, 2, 3]
    assert fit_to_context([1, 2, 3, 4], 3, truncate=True) == [2, 3, 4]
    with pytest.raises(ValueError, match="--truncate-prompts"):
        fit_to_context([1, 2, 3, 4], 3, truncate=False)


def test_workloads_shapes():
    tok = ByteTokenizer()

    def random_workload():
        args = "--dataset random --num-requests 50 --input-len 40 --output-len 8 --range-ratio 0.5"
        return build_workload(bench_args(*args.split()), tok, 300)

    random_ = random_workload()
    assert len(random_) == 50 and all(
        20 <= len(s.prompt) <= 40 and 4 <= s.max_tokens <= 8 for s in random_
    )
    assert all(0 <= t < 300 for s in random_ for t in s.prompt)
    shared = build_workload(
        bench_args(
            "--dataset",
            "shared-prefix",
            "--num-groups",
            "3",
            "--prompts-per-group",
            "4",
            "--system-prompt-len",
            "20",
            "--question-len",
            "5",
        ),
        tok,
        300,
    )
    assert len(shared) == 12 and len({tuple(s.prompt[:20]) for s in shared}) == 3
    assert all(len(s.prompt) == 25 for s in shared)
    chats = build_workload(
        bench_args("--dataset", "multi-turn", "--num-conversations", "2", "--turns", "3"), tok, 300
    )
    assert [s.num_turns for s in chats] == [3, 3]
    again = random_workload()
    assert [s.prompt for s in again] == [s.prompt for s in random_]  # seeded


def test_variants_are_the_product_of_the_comparisons():
    args = bench_args("--compare-backends", "--compare-no-cache", "--compare-policies", "fifo,lpm")
    assert plan_variants(args) == [
        Variant("radixinfer", True, "fifo"),
        Variant("radixinfer", True, "lpm"),
        Variant("radixinfer", False, "fifo"),
        Variant("radixinfer", False, "lpm"),
        Variant("hf", True, None),
        Variant("hf", False, None),
    ]
    assert plan_variants(bench_args("--no-prefix-cache")) == [Variant("radixinfer", False, "fifo")]


@pytest.mark.parametrize(
    "flags",
    [
        ["--request-rate", "5", "--submit-interval-ms", "10"],
        ["--repeat-runs", "0"],
        ["--compare-policies", "fifo,best"],
        ["--dataset", "nope"],
        ["--num-requests", "0"],
        ["--range-ratio", "2"],
        ["--n", "0"],
        ["--n", "2", "--compare-backends"],
        ["--compare-separate-samples"],
        ["--top-p", "0"],
        ["--min-p", "1.5"],
        ["--presence-penalty", "3"],
        ["--temperature", "0.8", "--compare-backends"],
        ["--temperature", "0.8", "--backend", "hf"],
        ["--hbm-tbps", "0"],
    ],
)
def test_bad_flag_combinations_exit_with_usage(flags):
    with pytest.raises(SystemExit):
        bench_args(*flags)


def test_warmup_runs_default_to_one_but_for_an_engine_on_the_cpu():
    """A GPU engine's first run compiles kernels, which would fall on a comparison's first variant."""
    assert bench_args("--device", "cpu").warmup_runs == 0
    assert bench_args("--device", "cpu", "--warmup-runs", "2").warmup_runs == 2
    served = bench_args("--device", "cpu", "--backend", "openai", "--base-url", "http://x/v1")
    assert served.warmup_runs == 1  # the server's device is its own
    for device in ("cuda", "cuda:1"):  # (parsing checks that CUDA is there)
        assert default_warmup_runs(argparse.Namespace(backend="radixinfer", device=device)) == 1


def test_a_bad_sampling_flag_is_named(capsys):
    with pytest.raises(SystemExit):
        bench_args("--top-p", "0")
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err


def test_sampling_flags_reach_every_request():
    flags = ["--temperature", "0.8", "--top-p", "0.95", "--top-k", "50", "--min-p", "0.05"]
    flags += ["--presence-penalty", "0.5", "--frequency-penalty", "0.25"]
    args = bench_args("--num-requests", "2", "--prompt-repeats", "2", *flags)
    backend = ScriptedBackend()
    sessions = build_workload(args, backend.tokenizer, backend.vocab_size)
    run_workload(backend, sessions, [0.0, 0.0], args, "test")
    for _, params in backend.requests:
        assert (params.temperature, params.top_p, params.top_k) == (0.8, 0.95, 50)
        assert params.min_p == 0.05
        assert (params.presence_penalty, params.frequency_penalty) == (0.5, 0.25)


def test_old_flag_names_parse(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # --model must name a checkpoint directory
    args = bench_args(
        "--model",
        str(tmp_path),
        "--prompt",
        "Hello",
        "--prompt-repeats",
        "512,1,1,1",
        "--unique-prompts",
        "--num-requests",
        "128",
        "--max-new-tokens",
        "32",
        "--submit-interval-ms",
        "5",
        "--max-batch-size",
        "8",
        "--prefill-max-batch-size",
        "128",
        "--prefill-max-tokens",
        "256",
        "--prefill-admission-policy",
        "pack",
        "--prefill-admission-lookahead",
        "32",
        "--prefill-force-fifo-every",
        "8",
        "--no-stop-on-eos",
        "--no-prefix-cache",
        "--warmup-runs",
        "1",
        "--repeat-runs",
        "2",
    )
    assert (
        args.ignore_eos
        and args.no_prefix_cache
        and args.max_new_tokens == 32
        and args.repeat_runs == 2
    )


# ---------------------------------------------------------------------------------------------- run loop
class ScriptedBackend:
    """Answers every request at once with tokens 1..max_tokens, one delta each (or fails, when told)."""

    tokenizer = ByteTokenizer()
    vocab_size = 257
    max_context_len = 64
    info: dict = {}

    def __init__(self, fail: bool = False) -> None:
        self.requests: list[tuple[list[int], SamplingParams]] = []
        self.fail = fail

    def submit(self, prompt, params, sink: queue.SimpleQueue) -> str:
        request_id = str(len(self.requests))
        self.requests.append((prompt, params))
        if self.fail:
            sink.put([StreamFailure(request_id, ValueError("no"))])
        for i in range(params.max_tokens):
            last = i == params.max_tokens - 1
            sink.put(
                [
                    StreamDelta(
                        request_id,
                        [i + 1],
                        "",
                        last,
                        "length" if last else None,
                        0,
                        time.perf_counter(),
                    )
                ]
            )
        return request_id

    def native_prompt(self, prompt):
        return prompt

    def cache_stats(self):
        return None

    def reset_cache(self) -> None:
        pass

    def close(self) -> None:
        pass


def short_chats(turns: int):
    """Flags of a multi-turn workload of two conversations with 4-token first prompts, 2-token
    follow-ups and 3-token answers."""
    flags = "--dataset multi-turn --num-conversations 2 --input-len 4 --turn-len 2 --output-len 3"
    return bench_args(*flags.split(), "--turns", str(turns))


def test_multi_turn_prompts_extend_the_previous_prompt_and_answer():
    args = short_chats(turns=3)
    backend = ScriptedBackend()
    sessions = build_workload(args, backend.tokenizer, backend.vocab_size)
    records, wall = run_workload(backend, sessions, [0.0, 0.0], args, "test")
    assert len(records) == 6 and wall >= 0
    prompts = [p for p, _ in backend.requests]
    for session in sessions:
        turns = [p for p in prompts if p[:4] == session.prompt]
        assert turns[0] == session.prompt
        assert turns[1] == session.prompt + [1, 2, 3] + session.follow_ups[0]
        assert turns[2] == turns[1] + [1, 2, 3] + session.follow_ups[1]


def test_later_turns_wait_their_think_time_after_the_answer():
    flags = "--dataset multi-turn --num-conversations 1 --input-len 4 --turn-len 2 --output-len 3"
    args = bench_args(*flags.split(), "--turns", "3", "--think-time", "0.05")
    backend = ScriptedBackend()
    (session,) = build_workload(args, backend.tokenizer, backend.vocab_size)
    # Drawn after the tokens: the conversation is the one without think times.
    (plain,) = build_workload(
        bench_args(*flags.split(), "--turns", "3"), backend.tokenizer, backend.vocab_size
    )
    assert (session.prompt, session.follow_ups) == (plain.prompt, plain.follow_ups)
    assert len(session.think_times) == 2 and min(session.think_times) > 0 and not plain.think_times
    records, _ = run_workload(backend, [session], [0.0], args, "test")
    turns = sorted(records, key=lambda r: r.submit_time)
    for k, think in enumerate(session.think_times):
        waited = turns[k + 1].submit_time - turns[k].token_times[-1]
        # Never early; late by at most a scheduling hiccup (as for first turns' offsets).
        assert think - 1e-3 <= waited < think + 0.2


def test_first_turns_go_in_the_backends_form_and_later_turns_as_built():
    """First turns are converted before the clock starts (`Backend.native_prompt`); later turns are built from
    answers at run time and submitted as lists."""

    class TupleBackend(ScriptedBackend):
        def native_prompt(self, prompt):
            return tuple(prompt)

    args = short_chats(turns=2)
    backend = TupleBackend()
    sessions = build_workload(args, backend.tokenizer, backend.vocab_size)
    run_workload(backend, sessions, [0.0, 0.0], args, "test")
    prompts = [p for p, _ in backend.requests]
    assert sorted(p for p in prompts if type(p) is tuple) == sorted(
        tuple(s.prompt) for s in sessions
    )
    assert sum(type(p) is list for p in prompts) == 2


def test_prompts_are_truncated_and_outputs_capped_to_the_context():
    args = bench_args(
        "--dataset",
        "random",
        "--num-requests",
        "1",
        "--input-len",
        "100",
        "--output-len",
        "16",
        "--truncate-prompts",
    )
    backend = ScriptedBackend()
    sessions = build_workload(args, backend.tokenizer, backend.vocab_size)
    records, _ = run_workload(backend, sessions, [0.0], args, "test")
    ((prompt, params),) = backend.requests
    assert (
        prompt == sessions[0].prompt[-64:]
        and params.max_tokens == 1
        and records[0].prompt_len == 64
    )


def test_a_failed_request_stops_the_run():
    args = bench_args("--num-requests", "2", "--prompt-repeats", "2")
    backend = ScriptedBackend(fail=True)
    with pytest.raises(RuntimeError, match="failed"):
        run_workload(
            backend,
            build_workload(args, backend.tokenizer, backend.vocab_size),
            [0.0, 0.0],
            args,
            "t",
        )


def test_report_has_a_column_per_run_and_speedups():
    metrics = summarize([record(0.0, [0.1, 0.2])], 1.0, None)
    runs = [{"label": "one", "metrics": metrics}, {"label": "two", "metrics": metrics}]
    text = format_report({"runs": runs, "comparisons": comparisons(runs)})
    assert "one" in text and "two" in text and "speedup of one" in text and "1.00x" in text


def test_first_turns_are_submitted_at_their_arrival_offsets():
    args = bench_args("--num-requests", "3", "--prompt-repeats", "2", "--max-new-tokens", "1")
    backend = ScriptedBackend()
    sessions = build_workload(args, backend.tokenizer, backend.vocab_size)
    offsets = [0.0, 0.1, 0.05]
    records, _ = run_workload(backend, sessions, offsets, args, "t")
    submits = sorted(r.submit_time for r in records)
    gaps = [b - submits[0] for b in submits]
    # Never early; late by at most a scheduling hiccup (a loaded 2-core CI machine has shown 30 ms).
    assert 0.05 - 1e-3 <= gaps[1] < 0.05 + 0.2 and 0.1 - 1e-3 <= gaps[2] < 0.1 + 0.2


# ---------------------------------------------------------------------------------------------- variants side by side
SMALL = (
    "--num-requests",
    "2",
    "--prompt-repeats",
    "2",
    "--max-new-tokens",
    "2",
)  # fits ScriptedBackend's context
ON, OFF = "radixinfer cache=on fifo", "radixinfer cache=off fifo"


class VariantBackend(ScriptedBackend):
    """A ScriptedBackend that logs its prefix-cache resets and knows whether it is closed."""

    def __init__(self, label: str, events: list) -> None:
        super().__init__()
        self.label, self.events, self.closed = label, events, False
        self.info = {"kv_blocks": 123}  # the pool size a real backend reports

    def reset_cache(self) -> None:
        self.events.append((self.label, "reset"))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def bench_log(monkeypatch):
    """`run_bench` with VariantBackends: logs the KV fraction each backend opens with, and each workload run
    as (label, "run", backends open at that moment); ``fail_open`` / ``fail_run`` make the n-th open / run
    (counted from 0) raise."""
    log = SimpleNamespace(
        opened=[], fractions=[], blocks=[], events=[], fail_open=None, fail_run=None
    )

    def fake_open(variant, model, args, gpu_memory_utilization, num_blocks):
        if len(log.opened) == log.fail_open:
            raise RuntimeError("open failed")
        log.fractions.append(gpu_memory_utilization)
        log.blocks.append(num_blocks)
        log.opened.append(VariantBackend(variant.label, log.events))
        return log.opened[-1]

    def logged_run(backend, *rest):
        runs = sum(kind == "run" for _, kind, *_ in log.events)
        log.events.append((backend.label, "run", sum(not b.closed for b in log.opened)))
        if runs == log.fail_run:
            raise RuntimeError("run failed")
        return real_run(backend, *rest)

    real_run = runner.run_workload
    monkeypatch.setattr(runner, "open_backend", fake_open)
    monkeypatch.setattr(runner, "run_workload", logged_run)
    return log


def test_round_orders_alternate():
    assert round_orders(2, 3) == [[0, 1], [1, 0], [0, 1]]
    assert round_orders(3, 2) == [[0, 1, 2], [2, 1, 0]]
    assert round_orders(1, 2) == [[0], [0]]


def test_warmups_come_first_then_abba_rounds_with_every_backend_open(bench_log):
    result = runner.run_bench(
        bench_args(
            *SMALL, "--compare-no-cache", "--warmup-runs", "1", "--repeat-runs", "3", "--cold-cache"
        )
    )
    measured = [[(label, "reset"), (label, "run", 2)] for label in (ON, OFF, OFF, ON, ON, OFF)]
    assert bench_log.events == [
        (ON, "run", 2),
        (OFF, "run", 2),
        *(e for pair in measured for e in pair),
    ]
    assert all(b.closed for b in bench_log.opened)
    # each engine its share of the GPU; the first sizes the common pool with a little headroom
    assert bench_log.fractions == [
        pytest.approx(0.9 / 2 * (1 - runner.FIRST_POOL_HEADROOM)),
        pytest.approx(0.9 / 2),
    ]
    on, off = result["runs"]
    assert on["label"] == ON and len(on["repeats"]) == len(off["repeats"]) == 3
    assert on["metrics"]["requests"] == 3 * 2 and on["repeats"][0]["requests"] == 2
    paired = result["comparisons"][0]["paired_output_throughput"]
    assert len(paired["ratios"]) == 3 and paired["min"] <= paired["median"] <= paired["max"]
    assert set(result["comparisons"][0]["speedup"]) == set(speedups(on["metrics"], off["metrics"]))


def test_gpu_share_is_split_between_variants_and_every_pool_has_the_first_ones_size(bench_log):
    runner.run_bench(
        bench_args(*SMALL, "--gpu-memory-utilization", "0.6", "--compare-policies", "fifo,pack,lpm")
    )
    runner.run_bench(bench_args(*SMALL, "--gpu-memory-utilization", "0.6"))
    runner.run_bench(bench_args(*SMALL, "--num-blocks", "64", "--compare-no-cache"))
    # every engine is open at once: each may use its share; the first sizes the pool, the others get
    # its size
    kept = 1 - runner.FIRST_POOL_HEADROOM  # the first of several variants keeps a little headroom
    assert bench_log.fractions == pytest.approx([0.2 * kept, 0.2, 0.2, 0.6, 0.45, 0.45])
    first = bench_log.opened[0].info["kv_blocks"]
    assert bench_log.blocks == [None, first, first, None, 64, 64]


def test_transformers_given_the_pool_size_gets_the_whole_fraction_as_its_ceiling(bench_log):
    runner.run_bench(bench_args(*SMALL, "--compare-backends"))
    # radixinfer its share; transformers checks its given pool against the whole fraction
    assert bench_log.fractions == pytest.approx([0.45 * (1 - runner.FIRST_POOL_HEADROOM), 0.9])


@pytest.mark.parametrize(
    ("flag", "young"),
    [((), 50_000), (("--gc-threshold", "1234"), 1234), (("--gc-threshold", "0"), None)],
)
def test_runs_see_the_gc_threshold_asked_for(bench_log, monkeypatch, flag, young):
    seen = []
    logged_run = runner.run_workload
    monkeypatch.setattr(
        runner, "run_workload", lambda *a: seen.append(gc.get_threshold()) or logged_run(*a)
    )
    before = gc.get_threshold()
    runner.run_bench(bench_args(*SMALL, "--warmup-runs", "1", *flag))
    assert seen == [(young or before[0], *before[1:])] * 2  # the warm-up and the measured run
    assert gc.get_threshold() == before


def test_the_gc_threshold_is_restored_when_a_run_fails(bench_log):
    before = gc.get_threshold()
    bench_log.fail_run = 0
    with pytest.raises(RuntimeError, match="failed"):
        runner.run_bench(bench_args(*SMALL, "--gc-threshold", "1234"))
    assert gc.get_threshold() == before


@pytest.mark.parametrize("failure", [{"fail_open": 1}, {"fail_run": 0}, {"fail_run": 3}])
def test_every_opened_backend_is_closed_when_something_fails(bench_log, failure):
    vars(bench_log).update(failure)
    with pytest.raises(RuntimeError, match="failed"):
        runner.run_bench(
            bench_args(*SMALL, "--compare-no-cache", "--warmup-runs", "1", "--repeat-runs", "2")
        )
    assert bench_log.opened and all(b.closed for b in bench_log.opened)


@pytest.mark.parametrize("kind", ["radixinfer", "hf"])
def test_open_backend_hands_the_given_gpu_share_to_the_backend(monkeypatch, kind):
    seen = {}

    def capture(*args, **kwargs):
        seen.update(kwargs)
        raise StopIteration

    monkeypatch.setattr(backends, "LLM", capture)
    monkeypatch.setattr(runner, "HFBackend", capture)
    with pytest.raises(StopIteration):
        open_backend(
            Variant(kind, True, "fifo" if kind == "radixinfer" else None),
            "tiny",
            bench_args(),
            0.25,
        )
    assert seen["gpu_memory_utilization" if kind == "radixinfer" else "kv_memory_fraction"] == 0.25
    with pytest.raises(StopIteration):
        open_backend(
            Variant(kind, True, "fifo" if kind == "radixinfer" else None),
            "tiny",
            bench_args(),
            0.25,
            10,
        )
    assert (
        seen["num_blocks"] if kind == "radixinfer" else seen["kv_tokens"] // 16
    ) == 10  # --block-size 16


def test_paired_rounds_give_one_ratio_per_round_and_show_their_spread():
    metrics = summarize([record(0.0, [0.1, 0.2])], 1.0, None)

    def run(label, throughputs):
        rounds = [{**metrics, "output_throughput": t} for t in throughputs]
        return {
            "label": label,
            "metrics": {**metrics, "output_throughput": sum(throughputs)},
            "repeats": rounds,
        }

    runs = [run("a", [100.0, 110.0, 90.0]), run("b", [50.0, 100.0, 100.0])]
    (comparison,) = comparisons(runs)
    paired = comparison["paired_output_throughput"]
    assert paired["ratios"] == pytest.approx([2.0, 1.1, 0.9])
    assert (paired["min"], paired["median"], paired["max"]) == pytest.approx((0.9, 1.1, 2.0))
    assert comparison["speedup"]["output_throughput"] == pytest.approx(300 / 250)
    assert "1.20x (0.90–2.00)" in format_report({"runs": runs, "comparisons": [comparison]})
    single = [{**r, "repeats": []} for r in runs]  # one round: the pooled metrics are that round's
    assert comparisons(single)[0]["paired_output_throughput"]["ratios"] == pytest.approx([1.2])
    assert (
        "("
        not in format_report({"runs": single, "comparisons": comparisons(single)}).split(
            "speedup of"
        )[1]
    )


def test_gc_pauses_counts_each_collection_while_open_and_none_after():
    """`GCPauses`: a pause per collection between `start` and `stop`, summed in ``total_s``; none
    once stopped (the callback is gone)."""
    from radixinfer.gc_pauses import GCPauses

    pauses = GCPauses().start()
    gc.collect()
    gc.collect()
    pauses.stop()
    gc.collect()
    assert len(pauses.pauses_ms) == 2 and all(p >= 0 for p in pauses.pauses_ms)
    assert pauses.total_s * 1e3 == pytest.approx(sum(pauses.pauses_ms))
