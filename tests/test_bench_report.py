"""The benchmarks' report: BENCHMARKS.md, one page with the newest figure of each comparison
quoted from its run, and bench/results/HISTORY.md, every run's output verbatim in the issues'
order with its charts; both as the generator writes them from bench/results/."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.bench.comparisons import Comparison, Figure, peer_figure
from splitserve.bench.report import RESULTS, ROOT, history
from splitserve.bench.run_header import read_header
from splitserve.bench.summary import summary

NOW = (
    "$ splitserve bench peer --systems vllm,auto   # at c198dc1, 2026-11-26T14:05Z, 2 CPU cores "
    "(AMD EPYC; flags avx2 avx512f), load average 0.70 0.70 0.95 at start\n"
)
PEER_TABLE = (
    "load      run       metric            vllm           auto\n"
    "sharegpt  rate inf  goodput req/s     1.16   1.62 (1.40x)\n"
)
VLLM = Comparison("Serving", "vLLM", "peer-*.txt", (peer_figure("sharegpt", "goodput req/s", "goodput"),))


def test_the_committed_report_is_what_the_generator_writes():
    assert (ROOT / "BENCHMARKS.md").read_text() == summary(RESULTS), "run: python -m splitserve.bench.report"
    assert (RESULTS / "HISTORY.md").read_text() == history(RESULTS), "run: python -m splitserve.bench.report"


def test_history_sections_are_the_outputs_verbatim_in_order_with_their_charts(tmp_path: Path) -> None:
    (tmp_path / "peer-cpu.txt").write_text("$ splitserve bench peer\nratio 1.51x\n")
    (tmp_path / "engine-cpu.txt").write_text("$ splitserve bench engine\n46.5 tok/s\n")
    (tmp_path / "zzz-other.txt").write_text("$ other\n")
    charts = tmp_path / "peer-cpu"
    charts.mkdir()
    (charts / "sweep-goodput.png").write_bytes(b"\x89PNG")
    (charts / "notes.json").write_text("{}")  # only PNGs are charts

    text = history(tmp_path)

    engine, peer, other = (text.index(f"({n})") for n in ("engine-cpu.txt", "peer-cpu.txt", "zzz-other.txt"))
    assert engine < peer < other
    assert "```\n$ splitserve bench peer\nratio 1.51x\n```" in text
    assert "![sweep-goodput](peer-cpu/sweep-goodput.png)" in text  # relative to HISTORY.md, beside it
    assert "notes.json" not in text


def test_the_summary_quotes_the_newest_run_with_its_machine_flags_date_and_command(tmp_path: Path) -> None:
    (tmp_path / "peer-a.txt").write_text(NOW.replace("14:05Z", "15:00Z").replace("c198dc1", "aaaaaaa") + PEER_TABLE)
    older = PEER_TABLE.replace("1.62 (1.40x)", "1.20 (1.03x)")
    (tmp_path / "peer-b.txt").write_text(NOW.replace("2026-11-26", "2026-11-20") + older)

    text = summary(tmp_path, [VLLM])

    row = next(line for line in text.splitlines() if line.startswith("| 1 |"))
    assert "goodput 1.40x (1.62 against 1.16 req/s)" in row
    assert "2 CPU cores, AMD EPYC; avx2 avx512f" in row
    assert "2026-11-26 15:00 (aaaaaaa)" in row
    assert "[peer-a.txt](bench/results/peer-a.txt)" in row
    assert "1. `splitserve bench peer --systems vllm,auto` ([peer-a.txt]" in text
    assert "1.03x" not in text


def test_a_figure_its_run_no_longer_prints_fails_the_report_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "peer-a.txt").write_text(NOW + "no table\n")
    missing = Comparison("Serving", "vLLM", "peer-*.txt", (Figure(r"^goodput (?P<x>\S+)", "{x}"),))
    with pytest.raises(ValueError, match="bench/results/peer-a.txt"):
        summary(tmp_path, [missing])
    with pytest.raises(ValueError, match="no results file matches"):
        summary(tmp_path, [Comparison("x", "y", "none-*.txt", ())])


@pytest.mark.parametrize(
    ("first_lines", "command", "code", "date", "machine", "flags"),
    [
        (
            NOW,
            "splitserve bench peer --systems vllm,auto",
            "c198dc1",
            "2026-11-26 14:05",
            "2 CPU cores, AMD EPYC",
            "avx2 avx512f",
        ),
        (
            "# splitserve bench tiers --trials 3   [code 906ffa2; 2026-11-26 01:27 UTC; CPU flags: avx2 avx512f]\n"
            "machine: AMD EPYC, 2 CPUs; torch 2.13.0+cpu, 2 threads; load average 0.94 1.89 2.41\n",
            "splitserve bench tiers --trials 3",
            "906ffa2",
            "2026-11-26 01:27",
            "AMD EPYC, 2 CPUs",
            "avx2 avx512f",
        ),
        (
            "$ bash bench/device.sh   # python3 -m splitserve.cli bench engine --device cuda, at db86d67\n"
            "# splitserve bench engine --device cuda\nmachine: NVIDIA H100 80GB HBM3; torch 2.11.0+cu130\n",
            "bash bench/device.sh   # python3 -m splitserve.cli bench engine --device cuda",
            "db86d67",
            None,
            "NVIDIA H100 80GB HBM3",
            None,
        ),
        (
            "$ splitserve bench windows   # at 9bcf247 + uncommitted src/splitserve/ changes, 2026-11-28T16:42Z, "
            "2 CPU cores (Intel(R) Xeon(R) Processor; flags avx2 amx_tile), load average 1.9 at start\n",
            "splitserve bench windows",
            "9bcf247 + uncommitted src/splitserve/ changes",
            "2026-11-28 16:42",
            "2 CPU cores, Intel(R) Xeon(R) Processor",
            "avx2 amx_tile",
        ),
    ],
)
def test_a_run_header_in_each_format_the_results_files_hold(first_lines, command, code, date, machine, flags):
    h = read_header(first_lines + "figures\n")
    assert (h.command, h.code, h.date, h.machine, h.flags) == (command, code, date, machine, flags)
