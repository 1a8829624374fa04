"""BENCHMARKS.md is the results files verbatim, in the issues' order, with each run's charts."""

from __future__ import annotations

from pathlib import Path

from splitserve.bench.report import build


def test_sections_are_the_outputs_verbatim_in_order_with_their_charts(tmp_path: Path) -> None:
    (tmp_path / "peer-cpu.txt").write_text("$ splitserve bench peer\nratio 1.51x\n")
    (tmp_path / "engine-cpu.txt").write_text("$ splitserve bench engine\n46.5 tok/s\n")
    (tmp_path / "zzz-other.txt").write_text("$ other\n")
    charts = tmp_path / "peer-cpu"
    charts.mkdir()
    (charts / "sweep-goodput.png").write_bytes(b"\x89PNG")
    (charts / "notes.json").write_text("{}")  # only PNGs are charts

    text = build(tmp_path)

    engine, peer, other = (
        text.index(f"`bench/results/{n}`") for n in ("engine-cpu.txt", "peer-cpu.txt", "zzz-other.txt")
    )
    assert engine < peer < other
    assert "```\n$ splitserve bench peer\nratio 1.51x\n```" in text
    assert "![sweep-goodput](bench/results/peer-cpu/sweep-goodput.png)" in text
    assert "notes.json" not in text
