"""`splitserve bench serving` end to end in quick mode: real worker processes,
real routers, both parts. Every figure it promises is printed, finite and
positive, and the worker processes are gone afterwards. Speed itself is the
benchmark's business, not the test's."""

from __future__ import annotations

import argparse
import math
import re

import pytest

from splitserve.bench import serving

pytestmark = pytest.mark.timeout(400)

NUM = r"([0-9.]+(?:e[-+]?[0-9]+)?)"
TIME = NUM + r" (?:ms|s)"


def _figures(text: str, pattern: str, count: int | None = None) -> list[tuple[float, ...]]:
    rows = [tuple(float(x) for x in (m if isinstance(m, tuple) else (m,))) for m in re.findall(pattern, text)]
    assert rows, f"no match for {pattern!r} in:\n{text}"
    if count is not None:
        assert len(rows) == count, (pattern, rows, text)
    assert all(math.isfinite(x) and x > 0 for row in rows for x in row), (pattern, rows)
    return rows


def _record_returns(monkeypatch, cls: type, name: str) -> list:
    """What every call of cls.name returns from now on (the processes the benchmark starts)."""
    returned: list = []
    real = getattr(cls, name)

    def recording(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        returned.append(out)
        return out

    monkeypatch.setattr(cls, name, recording)
    return returned


def test_quick_run_prints_every_figure(smollm2_path, capsys, monkeypatch):
    from splitserve.bench import cluster

    started: list[cluster.WorkerProcess] = _record_returns(monkeypatch, cluster.LocalCluster, "_start")
    loads: list[cluster.CoreLoad] = _record_returns(monkeypatch, cluster.LocalCluster, "core_load")
    p = argparse.ArgumentParser()
    serving.add_arguments(p)
    rc = serving.run(p.parse_args(["--quick", "--lengths", "32,48"]))
    out = capsys.readouterr().out
    assert rc == 0, out

    for n in (32, 48):
        _figures(
            out,
            rf"\[ttft\]\s+{n} tokens: disaggregated {TIME} \| colocated {TIME} \| ratio {NUM}x "
            rf"\| paired ratios median {NUM}x \[{NUM}\.\.{NUM}\]",
            count=1,
        )
        ((second_d, second_c, mb, _blocks, layers, block_bytes, rate),) = _figures(
            out,
            rf"\[ttft\]\s+{n} tokens: first -> second token: disaggregated {TIME} \| colocated {TIME} "
            rf"\| KV moved {NUM} MB/request \({NUM} blocks x {NUM} layers x {NUM} B\) = {NUM} MB/s",
            count=1,
        )
        assert layers == 30  # SmolLM2-135M
        _figures(
            out,
            rf"\[ttft\]\s+{n} tokens: worker CPU time per request: disaggregated {NUM} s \(prefill {NUM} "
            rf"\+ decode {NUM}\) \| colocated {NUM} s \(prefill [0-9.]+ \+ decode {NUM}\) \| ratio "
            rf"{NUM}x",
            count=1,
        )
    _figures(out, rf"\[ttft\] target: disaggregated / colocated at 48 tokens {NUM}x <= 1.10", count=1)
    assert "[ttft] prefix-cache hits on measured requests: 0 tokens" in out

    cpu = rf"decode worker {NUM} of a core, {TIME} CPU per steady token"
    _figures(out, rf"\[itl\] quiet\s+: p50 {TIME} p99 {TIME} \({NUM} samples\) \| {cpu}", count=1)
    for kind, span in (("disaggregated", "burst prefill"), ("colocated", "burst prefill"), ("busy neighbour", "busy")):
        _figures(
            out,
            rf"\[itl\] {kind}\s+: p50 {TIME} p99 {TIME} max {TIME} \({NUM} samples\) "
            rf"\| over quiet: p50 {NUM}x p99 {NUM}x \| {span} {TIME} median \| {cpu}",
            count=1,
        )
    _figures(out, rf"\[itl\] disaggregated over the busy-neighbour control: p50 {NUM}x p99 {NUM}x", count=1)
    _figures(
        out,
        rf"\[itl\] decode worker in disaggregated bursts over quiet: {NUM}x the CPU time per token "
        rf"\(busy neighbour {NUM}x\), on {NUM}x the share of its core \(busy neighbour {NUM}x\)",
        count=1,
    )
    _figures(
        out,
        rf"\[itl\] target: disaggregated p50 {NUM}x p99 {NUM}x <= 1.3: (?:met|NOT met); "
        rf"colocated p50 {NUM}x p99 {NUM}x",
        count=1,
    )
    assert "[itl] prefix-cache hits on measured requests: 0 tokens" in out
    for part in ("ttft", "itl"):
        assert f"[{part}] requests prefilled in the other mode (router fallbacks): 0" in out

    assert [w.role for w in started] == ["decode", "prefill"]
    assert all(w.proc.poll() is not None for w in started), "a worker process outlived the benchmark"
    assert loads and all(x.proc.poll() is not None for x in loads), "the busy-core process outlived the benchmark"


def test_a_worker_that_cannot_start_fails_fast_and_leaves_nothing(tmp_path):
    from splitserve.bench.cluster import ClusterError, LocalCluster, WorkerArgs

    with pytest.raises(ClusterError, match="exited with"):
        LocalCluster(WorkerArgs(model=str(tmp_path / "no-such-model.gguf")), cores=None, start_timeout_s=60)


def test_prompts_are_unique_and_exact():
    class Tok:
        vocab_size = 49152

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

    src = serving.PromptSource(Tok(), "random", seed=1, need_tokens=1000)
    prompts = [src.take(n) for n in (300, 300, 300, 300, 16)]  # the fourth wraps around
    assert [len(p) for p in prompts] == [300, 300, 300, 300, 16]
    firsts = {tuple(p[:16]) for p in prompts}
    assert len(firsts) == len(prompts)
