"""bench conversation's pure parts: the workers' prefix lines parsed, joined to the client's records by
prompt length and time window, and the TTFT split by source (bench/peer/prefix_sources.py)."""

from __future__ import annotations

import datetime

import pytest

from splitserve.bench.peer import prefix_sources as ps
from splitserve.bench.peer.conversation_report import ratio_lines

T0 = datetime.datetime(2026, 11, 26, 3, 40, 0)


def line(seconds: float, prompt: int, pool: int, host: int, disk: int) -> str:
    t = T0 + datetime.timedelta(seconds=seconds)
    stamp = t.strftime("%Y-%m-%d %H:%M:%S,") + f"{t.microsecond // 1000:03d}"
    computed = prompt - pool - host - disk
    return (
        f"{stamp} INFO splitserve.engine.kv_tiers: prefix: prompt {prompt} tokens, pool {pool}, host {host}, "
        f"disk {disk}, computed {computed}"
    )


def record(start: float, ttft: float, prompt: int, error: str | None = None) -> dict[str, object]:
    return {"start_s": start, "ttft_s": ttft, "prompt_len": prompt, "error": error, "cached_len": -1}


def test_a_prefix_line_parses_and_names_where_most_tokens_came_from():
    lines = [
        line(0.0, 1600, 0, 0, 0),  # before `since`: the warm-up's
        "2026-11-26 03:40:01,000 INFO splitserve.workers.server: listening",
        line(2.0, 2000, 1024, 512, 0),
        line(3.0, 2000, 0, 0, 1536),
        line(4.0, 2000, 0, 1200, 0),
    ]
    notes = ps.parse_notes(lines, since=(T0 + datetime.timedelta(seconds=1)).timestamp())
    assert [n.source for n in notes] == ["pool", "disk", "host"]
    assert notes[0].computed == 464
    # the tiers are named as the worker has them: one without a host tier, one with a third tier
    disk_only = line(5.0, 2000, 0, 0, 1536).replace("host 0, ", "")
    third = (
        line(6.0, 2000, 0, 64, 0).replace("disk 0, ", "disk 0, remote 1536, ").replace("computed 1936", "computed 400")
    )
    (a, b) = ps.parse_notes([disk_only, third])
    assert (a.tiers, a.computed, a.source) == ((("disk", 1536),), 464, "disk")
    assert b.tiers == (("host", 64), ("disk", 0), ("remote", 1536)) and (b.computed, b.source) == (400, "remote")


def test_records_join_their_line_by_prompt_length_inside_their_window():
    base = (T0 + datetime.timedelta(seconds=100)).timestamp()
    notes = [
        ps.PrefixNote(base + 0.01, 1700, 0, (), 1700),  # the run's first request, admitted at once
        ps.PrefixNote(base + 2.5, 2100, 1600, (("host", 0),), 500),
        ps.PrefixNote(base + 2.6, 2300, 0, (("host", 1600),), 700),  # waited 1.6 s in the queue
        ps.PrefixNote(base + 9.0, 2400, 0, (("host", 0), ("disk", 2000)), 400),
    ]
    records = [
        record(0.0, 3.0, 1700),
        record(1.0, 2.0, 2300),
        record(2.4, 0.3, 2100),
        record(5.0, 1.0, 2400),  # its line comes 4 s after its first token: not this request's
        record(6.0, 0.0, 999, error="HTTP 500"),
    ]
    joined = ps.join(records, notes)
    assert joined.sources == ["recompute", "host", "pool", None, None]
    assert (joined.unjoined, joined.ambiguous) == (1, 0)


def test_two_lines_in_one_window_leave_the_record_unjoined_and_counted():
    notes = [ps.PrefixNote(10.0, 500, 0, (), 500), ps.PrefixNote(10.5, 500, 496, (), 4)]
    joined = ps.join([record(0.0, 1.0, 500)], notes)
    assert joined.sources == [None] and (joined.unjoined, joined.ambiguous) == (1, 1)


def test_a_third_tiers_hits_are_split_out_after_the_known_sources():
    records = [record(0, 0.1, 1000), record(1, 0.2, 1000), record(2, 3.0, 1000)]
    split = ps.split(records, ["remote", "pool", "recompute"])
    assert list(split) == ["pool", "recompute", "remote"]
    assert split["remote"].requests == 1 and split["remote"].ttft_p50_ms == pytest.approx(100.0)


def test_a_system_without_tiers_is_split_by_its_usages_cached_tokens():
    rs = [record(0, 1, 1000) | {"cached_len": 896}, record(1, 1, 1000) | {"cached_len": 0}, record(2, 1, 1000)]
    assert ps.cached_sources(rs) == ["pool", "recompute", None]


def test_the_ratios_compare_hits_with_recomputes_and_name_the_target():
    def result(goodput: float, ttfts: dict[str, list[float]]) -> dict[str, object]:
        requests, sources = [], []
        for source, values in ttfts.items():
            for v in values:
                requests.append(record(0, v, 2000))
                sources.append(source)
        run = {"goodput": goodput, "request_throughput": 2 * goodput, "requests": requests}
        return {"runs": [run], "sources": sources}

    results = {
        "tier-aware": result(1.2, {"host": [0.2, 0.3], "disk": [0.5], "recompute": [4.0]}),
        "tier-blind": result(0.6, {"recompute": [4.0, 5.0]}),
        "vllm": result(0.4, {}),
    }
    lines = ratio_lines(results)
    assert lines[0].startswith("goodput tier-aware / tier-blind: 2.00x") and "met" in lines[0]
    assert lines[1] == "goodput tier-aware / vLLM: 3.00x"
    assert lines[2] == "throughput tier-aware / tier-blind: 2.00x (2.400 against 1.200 req/s)"
    host = next(x for x in lines if x.startswith("host"))
    assert f"{0.25 / 4.0:.2f}x" in host and "NOT met" not in host
    disk = next(x for x in lines if x.startswith("disk"))
    assert f"{0.5 / 4.0:.2f}x" in disk


@pytest.mark.parametrize("bad", [{"error": "start: boom"}])
def test_a_system_that_failed_gives_no_ratio(bad):
    assert ratio_lines({"tier-aware": bad, "tier-blind": bad}) == [
        "host hit / recompute TTFT: no host requests to compare",
        "disk hit / recompute TTFT: no disk requests to compare",
    ]


def test_a_sessions_first_turn_computed_is_a_first_turn_not_a_recompute():
    rs = [record(0, 1, 1600) | {"tag": "turn1"}, record(5, 1, 2400) | {"tag": "turn2"}, record(9, 1, 2600)]
    assert ps.mark_first_turns(rs, ["recompute", "recompute", "host"]) == ["first turn", "recompute", "host"]
    # no returning turn was recomputed: the first turns stand in, and the line says so
    results = {
        "tier-aware": {
            "runs": [{"goodput": 1.0, "request_throughput": 1.0, "requests": rs}],
            "sources": ["first turn", "host", "host"],
        }
    }
    host = next(x for x in ratio_lines(results) if x.startswith("host"))
    assert host.startswith("host hit / first turn TTFT p50") and "1.00x" in host


def test_a_tier_blind_goodput_of_nothing_gives_the_figures_not_a_ratio():
    def result(goodput: float) -> dict[str, object]:
        return {"runs": [{"goodput": goodput, "request_throughput": 0.5, "requests": []}], "sources": []}

    lines = ratio_lines({"tier-aware": result(0.004), "tier-blind": result(0.0)})
    assert lines[0] == "goodput tier-aware 0.004 req/s against tier-blind 0: no ratio (target NOT met)"
