"""Where each request's prefix came from: the pool, the host tier, the disk tier, or recomputed.

A splitserve worker with tiers logs one line per admitted prompt (engine/kv_tiers.py,
`TierStore.note_prefix`; a tier the worker has not is not named, and counts 0 here):

    2026-11-26 03:40:01,123 INFO splitserve.engine.kv_tiers: prefix: prompt 2113 tokens, pool 0,
        host 1536, disk 0, computed 577   (one line)

Workers never see the client's request id (the router gives each attempt its own), so a client
record is joined to the line with its prompt length whose time falls between the request's send
and its first token (the prompt is admitted in between), the clocks aligned on the run's first
request. A request with no such line (or two candidates in its window) is left unjoined and
counted. vLLM logs nothing of the kind: its requests are split by its usage's cached tokens
(pool or recompute), its KV living in its pool only.

A request's source is where most of its prompt's tokens came from; "recompute" when that is
computing them, and "first turn" when that is a session's first prompt (its context new to every
cache): a recompute that a tier could have saved is a returning turn's.
"""

from __future__ import annotations

import datetime
import re
import statistics
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

# the sources a report lists first, in this order; a tier of another name (a remote store) follows them
SOURCES = ("pool", "host", "disk", "recompute", "first turn")
_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO splitserve\.engine\.kv_tiers: prefix: prompt (\d+) tokens, "
    r"pool (\d+)((?:, \S+ \d+)*), computed (-?\d+)"  # each of the worker's tiers by name, in its order
)
_TIER = re.compile(r", (\S+) (\d+)")
SLACK_S = 0.25  # the two clocks' alignment error allowed at either end of a request's window


class PrefixNote(NamedTuple):
    """One admitted prompt, as a worker logged it; `t` in seconds since the epoch (the worker's local clock)."""

    t: float
    prompt: int
    pool: int
    tiers: tuple[tuple[str, int], ...]  # (tier name, tokens loaded from it), in the worker's order
    computed: int

    @property
    def source(self) -> str:
        shares = [("pool", self.pool), *self.tiers, ("recompute", self.computed)]
        return max(shares, key=lambda s: s[1])[0]  # ties: the pool, then the tiers in order, then recompute


def parse_notes(lines: Iterable[str], since: float = 0.0) -> list[PrefixNote]:
    """The prefix lines of a worker's log logged at or after `since` (seconds since the epoch)."""
    out = []
    for line in lines:
        m = _LINE.match(line)
        if m is None:
            continue
        t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if t >= since:
            tiers = tuple((name, int(n)) for name, n in _TIER.findall(m.group(4)))
            prompt, pool, computed = int(m.group(2)), int(m.group(3)), int(m.group(5))
            out.append(PrefixNote(t, prompt, pool, tiers, computed))
    return sorted(out)


class Joined(NamedTuple):
    sources: list[str | None]  # per record, in the records' order; None: not joined
    unjoined: int
    ambiguous: int  # records with more than one candidate line (left unjoined)


def join(records: Sequence[dict[str, Any]], notes: Sequence[PrefixNote]) -> Joined:
    """Each completed record (bench serve's JSON: prompt_len, start_s, ttft_s) joined to its note."""
    ok = [r for r in records if r.get("error") is None]
    if not ok or not notes:
        return Joined([None] * len(records), len(ok), 0)
    offset = notes[0].t - min(r["start_s"] for r in ok)  # the first request is the first admitted
    used: set[int] = set()
    sources: list[str | None] = []
    unjoined = ambiguous = 0
    for r in records:
        if r.get("error") is not None:
            sources.append(None)
            continue
        lo, hi = r["start_s"] - SLACK_S, r["start_s"] + r["ttft_s"] + SLACK_S
        found = [
            i for i, n in enumerate(notes) if i not in used and n.prompt == r["prompt_len"] and lo <= n.t - offset <= hi
        ]
        if len(found) == 1:
            used.add(found[0])
            sources.append(notes[found[0]].source)
            continue
        sources.append(None)
        unjoined += 1
        ambiguous += len(found) > 1
    return Joined(sources, unjoined, ambiguous)


def cached_sources(records: Sequence[dict[str, Any]]) -> list[str | None]:
    """A system without tiers: "pool" where the usage says most of the prompt was cached, else "recompute"
    (None where the request failed or the server did not say)."""
    out: list[str | None] = []
    for r in records:
        if r.get("error") is not None or r.get("cached_len", -1) < 0:
            out.append(None)
        else:
            out.append("pool" if 2 * r["cached_len"] >= r["prompt_len"] else "recompute")
    return out


def mark_first_turns(records: Sequence[dict[str, Any]], sources: Sequence[str | None]) -> list[str | None]:
    """A session's first turn (bench serve's tag "turn1") computed: "first turn", not "recompute"."""
    return [
        "first turn" if s == "recompute" and r.get("tag") == "turn1" else s
        for r, s in zip(records, sources, strict=True)
    ]


class SourceStats(NamedTuple):
    requests: int
    ttft_p50_ms: float
    ttft_mean_ms: float
    ttft_p90_ms: float
    prompt_mean: float  # tokens


def split(records: Sequence[dict[str, Any]], sources: Sequence[str | None]) -> dict[str, SourceStats]:
    """TTFT per source, over the records whose source is known: SOURCES' order, then any other tier's."""
    out = {}
    others = sorted({s for s in sources if s is not None and s not in SOURCES})
    for s in (*SOURCES, *others):
        rs = [r for r, src in zip(records, sources, strict=True) if src == s]
        if not rs:
            continue
        ttft = sorted(r["ttft_s"] * 1e3 for r in rs)
        p90 = ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))]
        out[s] = SourceStats(
            len(rs),
            statistics.median(ttft),
            statistics.fmean(ttft),
            p90,
            statistics.fmean(r["prompt_len"] for r in rs),
        )
    return out
