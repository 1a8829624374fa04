"""bench internal-tls's KV figure on a small cache: both planes carry it and the ratio is printed
(the figures themselves are the benchmark's, in bench/results/internal-tls-cpu.txt)."""

from __future__ import annotations

import re

import pytest

from splitserve.bench.internal_tls import _kv_plane
from splitserve.runtime.tls import make_cluster_tls


@pytest.mark.timeout(120)
def test_the_kv_figure_moves_the_cache_both_ways_and_prints_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    _kv_plane(make_cluster_tls(), size=8 << 20, rounds=1)
    out = capsys.readouterr().out
    m = re.search(r"plain ([\d.]+) GB/s, TLS ([\d.]+) GB/s: TLS / plain ([\d.]+)", out)
    assert m is not None, out
    plain, tls, ratio = (float(x) for x in m.groups())
    assert plain > 0 and tls > 0 and ratio == pytest.approx(tls / plain, rel=0.05)  # each printed to 2 places
