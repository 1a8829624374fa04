"""`splitserve bench serve` without a real server: the datasets (the real
ShareGPT file), the arrival process, the metrics on hand-computed records, the
result file's round trip, and whole runs through the CLI against a fake
OpenAI-compatible server with known timings."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time

import pytest

from splitserve import cli
from splitserve.bench.serve import arrivals, datasets
from splitserve.bench.serve.backends import Outcome, Prompt
from splitserve.bench.serve.driver import Clock, run_load
from splitserve.bench.serve.progress import Progress
from splitserve.bench.serve.tokenizer import load_text_tokenizer
from splitserve.measure import metrics
from splitserve.measure.plots import plot_burst, plot_compare, plot_sweep
from splitserve.measure.results import BenchResult, RequestRecord, RunResult, load_result, save_result
from tests.fake_openai import MODEL, FakeScript, running_fake


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_text_tokenizer(tok_dir)


def rec(
    tag="plain",
    prompt_len=10,
    output_len=5,
    start=0.0,
    ttft=0.1,
    itl=(0.02, 0.02, 0.02, 0.02),
    latency=None,
    error=None,
) -> RequestRecord:
    latency = ttft + sum(itl) if latency is None else latency
    return RequestRecord(tag, prompt_len, output_len, start, ttft, list(itl), latency, error)


# ---- datasets ------------------------------------------------------------------------------------


def test_the_real_sharegpt_file_is_cut_and_only_complete_conversations_are_read():
    path = datasets.sharegpt_path()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert not text.rstrip().endswith("]")  # the packaged file ends mid-record
    records = list(datasets.iter_json_array(path))
    assert len(records) > 10_000
    assert all(isinstance(r, dict) and set(r) == {"id", "conversations"} for r in records)
    # the last record read is the last complete one: the next thing in the file cannot be decoded
    last = records[-1]
    assert isinstance(last, dict)
    tail = text[text.rfind('"id": "' + last["id"] + '"') :]
    after = tail[tail.find("\n  }") + 4 :].lstrip(" \n,")
    with pytest.raises(json.JSONDecodeError):
        json.JSONDecoder().raw_decode(after)


def test_a_json_array_cut_mid_record_yields_whole_records_across_chunk_boundaries(tmp_path):
    p = tmp_path / "cut.json"
    p.write_text('[\n {"a": 1, "s": "x,}{"},\n {"a": 2},\n {"a": 3, "b": [1, 2')
    assert list(datasets.iter_json_array(str(p), chunk_chars=5)) == [{"a": 1, "s": "x,}{"}, {"a": 2}]
    p.write_text('[{"a": 1}, {"a": 2}]')
    assert list(datasets.iter_json_array(str(p), chunk_chars=3)) == [{"a": 1}, {"a": 2}]


def test_sharegpt_filter_is_vllms():
    assert datasets.keep_sharegpt(4, 4, fixed_output=False)
    assert not datasets.keep_sharegpt(3, 100, fixed_output=False)  # prompt too short
    assert not datasets.keep_sharegpt(1025, 10, fixed_output=False)  # prompt too long
    assert not datasets.keep_sharegpt(1024, 1025, fixed_output=False)  # together too long
    assert datasets.keep_sharegpt(1024, 1024, fixed_output=False)
    assert not datasets.keep_sharegpt(100, 3, fixed_output=False)  # a reply too short to time
    assert datasets.keep_sharegpt(100, 1, fixed_output=True)  # unless the output length is fixed


def test_sharegpt_sessions_are_first_human_turns_filtered_and_seeded(tok):
    sessions = datasets.sharegpt_sessions(tok, 20, random.Random(3), output_len=None, pool=300)
    firsts = {h[0] for h, _ in datasets._take(datasets.sharegpt_pairs(), 300)}
    assert len(sessions) == 20
    for s in sessions:
        (t,) = s.turns
        assert t.user in firsts and t.tag == "plain"
        assert t.prompt_len == len(tok.encode(t.user))
        assert 4 <= t.prompt_len <= 1024 and t.prompt_len + t.output_len <= 2048
    again = datasets.sharegpt_sessions(tok, 20, random.Random(3), output_len=None, pool=300)
    assert again == sessions
    fixed = datasets.sharegpt_sessions(tok, 5, random.Random(3), output_len=8, max_prompt_len=64, pool=300)
    assert all(s.turns[0].output_len == 8 and s.turns[0].prompt_len <= 64 for s in fixed)


def test_random_prompts_have_the_lengths_asked_for(tok):
    sessions = datasets.random_sessions(tok, 30, 64, 16, 0.25, random.Random(1))
    assert sessions == datasets.random_sessions(tok, 30, 64, 16, 0.25, random.Random(1))
    for s in sessions:
        t = s.turns[0]
        assert 40 <= t.prompt_len <= 80 and 12 <= t.output_len <= 20
        assert t.prompt_len == len(tok.encode(t.user))
    assert len({s.turns[0].user for s in sessions}) == 30


def test_prefix_groups_share_a_system_prompt(tok):
    sessions = datasets.prefix_sessions(tok, 8, 2, 100, 10, 4, random.Random(0))
    assert [s.turns[0].tag for s in sessions] == ["group0", "group1"] * 4
    assert len({s.system for s in sessions}) == 2
    assert all(s.system == sessions[i % 2].system for i, s in enumerate(sessions))
    assert all(95 <= s.turns[0].prompt_len <= 115 for s in sessions)


def test_burst_plan_and_conversations(tok):
    plan = datasets.burst_plan(tok, 3, 16, 32, 2, 4, 200, 2, random.Random(0))
    assert [s.turns[0].tag for s in plan.steady] == ["steady"] * 3
    assert [len(b) for b in plan.bursts] == [4, 4]
    assert all(s.turns[0].tag == "burst" and s.turns[0].prompt_len > 150 for b in plan.bursts for s in b)
    conv = datasets.conversation_sessions(tok, 3, 3, 16, random.Random(0), pool=500)
    assert [[t.tag for t in s.turns] for s in conv] == [["turn1", "turn2", "turn3"]] * 3
    assert all(s.system is None for s in conv)
    docs = datasets.conversation_sessions(tok, 3, 3, 16, random.Random(0), pool=500, context_len=300)
    contexts = [s.system for s in docs]
    assert all(c is not None and 270 <= len(tok.encode(c)) <= 300 for c in contexts)
    assert len(set(contexts)) == 3  # each session's own


# ---- arrivals and the driver ------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_have_the_mean_rate_and_are_seeded(burstiness):
    t = arrivals.arrival_offsets(20_000, 5.0, burstiness, random.Random(7))
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:], strict=False))
    assert (len(t) - 1) / t[-1] == pytest.approx(5.0, rel=0.03)
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    # gamma(shape k): coefficient of variation 1/sqrt(k); Poisson's is 1
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert t == arrivals.arrival_offsets(20_000, 5.0, burstiness, random.Random(7))


def test_an_infinite_rate_sends_all_at_once_and_rates_parse():
    assert arrivals.arrival_offsets(4, math.inf, 1.0, random.Random(0)) == [0.0] * 4
    assert arrivals.parse_rates("0.2, 0.4,inf") == [0.2, 0.4, math.inf]
    with pytest.raises(ValueError):
        arrivals.parse_rates("0,1")


class CountingBackend:
    """Answers after a few event-loop turns, counting requests in flight; echoes the messages it got."""

    def __init__(self) -> None:
        self.in_flight = self.max_in_flight = 0
        self.prompts: list[Prompt] = []

    async def send(self, p: Prompt, t0: float) -> Outcome:
        self.prompts.append(p)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        for _ in range(5):
            await asyncio.sleep(0)
        self.in_flight -= 1
        return Outcome(rec(tag=p.tag), f"answer to {p.messages[-1]['content']}")

    async def close(self) -> None:
        pass


def test_max_concurrency_bounds_requests_in_flight():
    backend = CountingBackend()
    sessions = [datasets.Session((datasets.Turn(f"q{i}", 2, 4, "plain"),)) for i in range(12)]
    clock = Clock(time.perf_counter, asyncio.sleep)
    got = asyncio.run(run_load(backend, sessions, [0.0] * 12, 3, clock, Progress(12, "t", enabled=False)))
    assert len(got.records) == 12 and backend.max_in_flight == 3
    unbounded = CountingBackend()
    asyncio.run(run_load(unbounded, sessions, [0.0] * 12, None, clock, Progress(12, "t", enabled=False)))
    assert unbounded.max_in_flight == 12


def test_a_conversation_turn_carries_the_previous_answer():
    backend = CountingBackend()
    turns = tuple(datasets.Turn(f"q{i}", 2, 4, f"turn{i + 1}") for i in range(3))
    session = datasets.Session(turns, system="be brief")
    clock = Clock(time.perf_counter, asyncio.sleep)
    asyncio.run(run_load(backend, [session], [0.0], None, clock, Progress(3, "t", enabled=False)))
    assert [m["content"] for m in backend.prompts[2].messages] == [
        "be brief",
        "q0",
        "answer to q0",
        "q1",
        "answer to q1",
        "q2",
    ]
    assert [m["role"] for m in backend.prompts[2].messages] == ["system", *["user", "assistant"] * 2, "user"]
    assert backend.prompts[1].text == "be brief\nq0\nanswer to q0\nq1"


def test_a_conversation_pauses_its_think_time_between_turns_not_before_the_first():
    backend = CountingBackend()
    turns = tuple(datasets.Turn(f"q{i}", 2, 4, f"turn{i + 1}") for i in range(3))
    slept: list[float] = []

    async def sleep(s: float) -> None:  # the clock's sleep, recorded: the driver's only wait
        slept.append(s)

    clock = Clock(time.perf_counter, sleep)
    session = datasets.Session(turns, think_s=7.5)
    got = asyncio.run(run_load(backend, [session], [0.0], None, clock, Progress(3, "t", enabled=False)))
    assert len(got.records) == 3 and slept == [7.5, 7.5]
    slept.clear()
    asyncio.run(run_load(backend, [datasets.Session(turns)], [0.0], None, clock, Progress(3, "t", enabled=False)))
    assert slept == []


# ---- metrics -------------------------------------------------------------------------------------


def test_figures_by_hand():
    a = rec(prompt_len=10, output_len=5, ttft=0.1, itl=(0.02, 0.02, 0.04, 0.02))  # latency 0.2
    b = rec(prompt_len=20, output_len=3, ttft=0.3, itl=(0.1, 0.1))  # latency 0.5
    one = rec(prompt_len=30, output_len=1, ttft=0.2, itl=())  # one token: no TPOT
    bad = rec(prompt_len=99, output_len=0, ttft=0.0, itl=(), latency=0.05, error="HTTP 500")
    r = metrics.summarize([a, b, one, bad], duration_s=2.0, rate=4.0, burstiness=1.0, max_concurrency=None, slos={})
    assert (r.completed, r.failed, r.num_prompts) == (3, 1, 4)
    assert r.total_input_tokens == 60 and r.total_output_tokens == 9  # the failed request counts nowhere
    assert r.request_throughput == pytest.approx(1.5)
    assert r.output_throughput == pytest.approx(4.5)
    assert r.total_token_throughput == pytest.approx(34.5)
    assert r.ttft_ms.mean == pytest.approx(200.0) and r.ttft_ms.p50 == pytest.approx(200.0)
    assert r.tpot_ms.mean == pytest.approx((25.0 + 100.0) / 2)  # (0.2-0.1)/4 and (0.5-0.3)/2
    # gaps 20 20 40 20 100 100 ms: the median between 20 and 40
    assert r.itl_ms.p50 == pytest.approx(30.0) and r.itl_ms.mean == pytest.approx(50.0)
    assert r.e2el_ms.p99 == pytest.approx(200 + 0.98 * 300, rel=1e-6)  # interpolated between 200 and 500
    assert r.goodput is None and r.slo_attainment is None


def test_percentiles_interpolate_like_numpy():
    assert metrics.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert metrics.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert metrics.percentile([7.0], 99) == 7.0
    assert metrics.percentile([], 50) == 0.0


def test_goodput_counts_requests_meeting_every_slo_and_never_failures():
    fast = rec(ttft=0.1, itl=(0.02, 0.02, 0.02, 0.02))
    slow_start = rec(ttft=0.6, itl=(0.02, 0.02, 0.02, 0.02))
    one_long_pause = rec(ttft=0.1, itl=(0.01, 0.01, 0.01, 0.2))  # tpot 57.5 ms is fine, the 200 ms gap is not
    failed = rec(ttft=0.0, itl=(), error="boom")
    records = [fast, slow_start, one_long_pause, failed]
    slos = metrics.parse_goodput(["ttft:500", "tpot:100"])
    r = metrics.summarize(records, duration_s=2.0, rate=1.0, burstiness=1.0, max_concurrency=2, slos=slos)
    assert r.goodput == pytest.approx(1.0) and r.slo_attainment == pytest.approx(0.5)  # fast and one_long_pause
    slos = metrics.parse_goodput(["ttft:500", "itl:100"])
    r = metrics.summarize(records, duration_s=2.0, rate=1.0, burstiness=1.0, max_concurrency=2, slos=slos)
    assert r.goodput == pytest.approx(0.5) and r.slo_attainment == pytest.approx(0.25)
    assert r.slos == {"ttft": 500.0, "itl": 100.0}
    with pytest.raises(ValueError):
        metrics.parse_goodput(["latency:5"])


def test_burst_windows_file_steady_gaps_by_arrival():
    # steady tokens arrive at 1.0 (first), 1.1, 1.2, 2.5, 2.6; the burst window is [2.0, 2.55]
    steady = rec(tag="steady", start=0.5, ttft=0.5, itl=(0.1, 0.1, 1.3, 0.1))
    burst = rec(tag="burst", start=2.0, ttft=0.55, itl=())
    s = metrics.burst_summary([steady, burst], [(2.0, 2.55)])
    assert s.burst_itl_ms.p50 == pytest.approx(1300.0)
    assert s.quiet_itl_ms.p50 == pytest.approx(100.0)
    assert s.ratio_p50 == pytest.approx(13.0)
    assert s.burst_ttft_ms.p50 == pytest.approx(550.0)


# ---- the result file ----------------------------------------------------------------------------


def _result(label: str, rates: list[float]) -> BenchResult:
    runs = []
    for i, rate in enumerate(rates):
        records = [rec(), rec(ttft=0.3 + i), rec(error="HTTP 500", itl=())]
        slos = {"ttft": 500.0}
        runs.append(metrics.summarize(records, 2.0, rate, 1.0, None, slos, metrics.burst_summary(records, [])))
    return BenchResult(label, "openai-chat", "http://x", "random", {"request_rate": "1,inf"}, runs)


def test_the_json_shape_round_trips(tmp_path):
    res = _result("sys-a", [1.0, math.inf])
    path = tmp_path / "r.json"
    save_result(res, path)
    raw = load_result(path)
    assert BenchResult.from_dict(raw) == res
    assert set(raw) == {"label", "backend", "base_url", "dataset", "args", "runs"}
    run = raw["runs"][1]
    assert run["request_rate"] == "inf"
    assert set(run) == {
        "request_rate",
        "burstiness",
        "max_concurrency",
        "num_prompts",
        "duration_s",
        "completed",
        "failed",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "total_input_tokens",
        "total_output_tokens",
        "ttft_ms",
        "tpot_ms",
        "itl_ms",
        "e2el_ms",
        "goodput",
        "slo_attainment",
        "slos",
        "burst",
        "requests",
    }
    assert set(run["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    assert {"quiet_itl_ms", "burst_itl_ms", "ratio_p50", "ratio_p99", "burst_ttft_ms"} <= set(run["burst"])
    assert set(run["requests"][0]) == {
        "tag",
        "prompt_len",
        "output_len",
        "start_s",
        "ttft_s",
        "itl_s",
        "latency_s",
        "error",
        "cached_len",
    }
    assert isinstance(RunResult.from_dict(run), RunResult)


def test_plot_sweep_draws_one_line_per_system(tmp_path):
    results = [_result("sys-a", [1.0, 2.0, math.inf]).to_dict(), _result("sys-b", [1.0, math.inf]).to_dict()]
    path = plot_sweep(results, tmp_path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_compare_and_burst_charts_draw_several_systems(tmp_path):
    results = [_result("sys-a", [math.inf]).to_dict(), _result("sys-b", [math.inf]).to_dict()]
    results[0]["runs"][0]["requests"][0]["tag"] = "steady"
    results[0]["runs"][0]["burst"] = {"windows_s": [[0.1, 0.4]]}
    for path, name in (
        (plot_compare(results, tmp_path, "sharegpt"), "sharegpt-latency-cdf.png"),
        (plot_burst(results, tmp_path), "burst-itl-timeline.png"),
    ):
        assert path == str(tmp_path / name)
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ---- whole runs against the fake server ----------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["openai-chat", "openai-completions"])
def test_cli_against_the_fake_server(backend, tok_dir, tmp_path):
    script = FakeScript(ttft_s=0.05, gap_s=0.02, chunk_tokens=(1, 3), prompt_tokens=7, fail_index=2)
    out, charts = tmp_path / "r.json", tmp_path / "charts"
    with running_fake(script) as (url, fake):
        rc = cli.main(
            [
                "bench",
                "serve",
                "--backend",
                backend,
                "--base-url",
                url,
                "--tokenizer",
                tok_dir,
                "--dataset",
                "random",
                "--random-input-len",
                "16",
                "--random-output-len",
                "6",
                "--num-prompts",
                "6",
                "--request-rate",
                "50,inf",
                "--max-concurrency",
                "4",
                "--ignore-eos",
                "--goodput",
                "ttft:2000",
                "itl:2000",
                "--label",
                "fake",
                "--json",
                str(out),
                "--plot",
                str(charts),
                "--no-progress",
            ]
        )
        bodies = list(fake.bodies)
    assert rc == 0
    assert all(b["model"] == MODEL and b["ignore_eos"] is True and b["max_tokens"] == 6 for b in bodies)
    assert all(("messages" in b) == (backend == "openai-chat") for b in bodies)
    raw = load_result(out)
    assert (raw["label"], raw["backend"], raw["base_url"], raw["dataset"]) == ("fake", backend, url, "random")
    assert raw["args"]["num_prompts"] == 6 and "api_key" not in raw["args"]
    first, second = raw["runs"]
    assert (first["request_rate"], second["request_rate"]) == (50.0, "inf")
    assert (first["completed"], first["failed"]) == (5, 1)  # the fake fails its third request, once
    assert (second["completed"], second["failed"]) == (6, 0)
    assert first["slo_attainment"] == pytest.approx(5 / 6) and second["slo_attainment"] == 1.0
    for run in raw["runs"]:
        assert run["total_output_tokens"] == 6 * run["completed"]  # from usage: chunks of 1, 3 and 2 tokens
        assert run["total_input_tokens"] == 7 * run["completed"]
        ok = [r for r in run["requests"] if r["error"] is None]
        assert all(len(r["itl_s"]) == 2 for r in ok)  # three chunks: one gap per chunk, however many tokens
        assert all(r["cached_len"] == 4 for r in ok)  # the usage's prompt_tokens_details, as vLLM sends it
        # the fake's script, with loose bounds: a shared 2-core machine is slow, never fast
        assert 0.045 <= run["ttft_ms"]["p50"] / 1000 < 1.0
        assert 0.018 <= run["itl_ms"]["p50"] / 1000 < 0.5
        assert run["tpot_ms"]["mean"] == pytest.approx(
            statistics.mean((r["latency_s"] - r["ttft_s"]) / 5 * 1000 for r in ok)
        )
        assert 0.085 <= run["e2el_ms"]["p50"] / 1000 < 2.0
    failed = next(r for r in first["requests"] if r["error"] is not None)
    assert failed["error"].startswith("HTTP 500")
    pngs = sorted(p.name for p in charts.iterdir())
    assert pngs == ["fake-rate-50-latency-cdf.png", "fake-rate-inf-latency-cdf.png", "sweep-goodput.png"]


def test_bad_flags_are_refused_before_anything_runs(capsys):
    assert cli.main(["bench", "serve", "--backend", "openai-completions", "--dataset", "conversation"]) == 2
    assert "chat backend" in capsys.readouterr().err
    assert cli.main(["bench", "serve", "--goodput", "ttft"]) == 2
