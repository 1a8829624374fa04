"""A measured cost profile: what this project's engine took per step on one
machine, the models fitted to it, and the cost model the simulator reads it as.

The measurements (`plan/calibrate.py` takes them) stay in the profile beside
the fitted coefficients, so a reader can check the fit against its points:

    prefill      piecewise linear in the chunk's tokens, nothing cached; plus a linear attention
                 term, seconds per new token per cached token of context, fitted to chunks prefilled
                 after a cached prefix
    decode step  base + per_seq x batch + per_ctx x context tokens (least squares, no negative term)
    transfer     base + per_byte x bytes for the whole KV of a prompt, of which the layers sent while
                 the prefill still computes are hidden (costs.pipelined_tail_s)
    serving      what a served step costs beyond `Engine.step()`: per step + per_seq x batch (least
                 squares, no negative term), fitted to the gap between tokens a client saw through a
                 router and a real worker against the engine-alone decode step at the same batch and
                 context (`plan/calibrate.py`'s `serving_points`); 0 when not measured. Those gaps are
                 taken with every worker of the system decoding; on a machine this small the router
                 and the client take their cycles from the workers' cores, so a step costs less
                 overhead while fewer workers are busy: a request decoding alone, measured too, gives
                 what each idle worker takes off a step (`with_serving_alone`, `serving_by_busy`).
                 A system with prefill workers has one more: the same gaps measured while prompts
                 keep the prefill workers busy, whose excess over the overhead above (per step + per
                 seq x batch again) is what a decode step costs more beside busy prefill workers
                 (`with_serving_beside_prefill`, `serving_beside_prefill`): with every core computing,
                 the router's and the client's cycles, and the KV arriving, come out of the decode
                 step (disaggregated here: decode steps at batch 5 to 8 took 1.3 to 1.6x as long
                 while a prompt was prefilling as while none was)
    spread       how single decode steps spread around those figures, per batch, as quantiles of
                 measured / modelled (`costs.StepSpread`): the engine's timed steps against the decode
                 model (`decode_spread`), and a client's gaps against the served model at each gap's
                 context (`serve_spread`, the one the simulator draws from when it was measured)
    prefill under load
                 how much longer a served prefill takes than the model above while other requests
                 decode, per system: measured s = model s x (scale + scale_per x N) + (fixed +
                 fixed_per x N), N the decoding requests in the cluster (least squares on seconds, no
                 negative term), fitted to prompts sent one at a time beside 0, 2 and 6 decoding
                 streams (`plan/calibrate.py`'s `prefill_load_points`). On this machine the router and
                 the client share the workers' cores, and relaying every decoded token takes cycles a
                 prefill on those cores would have had. Fitted on seconds, not on ratios: the cost
                 per request (tens of ms: the router's and the client's handling of one prompt) looks
                 like a big ratio on a short prompt, and a ratio fitted to short prompts would stretch
                 a long one by it. Steps that carry a prefill chunk take the multiplier, and a step
                 that finishes a prompt the cost per request (`prefill_slowdown`); none when not
                 measured

Saved as JSON (`save_profile`, `load_profile`); `ProfileCosts` is the `CostModel`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from splitserve.plan.costs import SPREAD_LEVELS, StepSpread, pipelined_tail_s, spread_quantiles

# 2: the serving overhead; 3: the spread of decode steps; 4: prefill under load (a ratio fit);
# 5: prefill under load as a multiplier and a cost per request; 6: the serving overhead by workers busy;
# 7: the serving overhead beside busy prefill workers; 8: the speed probe
PROFILE_VERSION = 8
# a version 3 profile reads as one with prefill under load not measured; a version 4 one's ratio fit
# as the multiplier alone (no cost per request)
READS_VERSIONS = (3, 4, 5, 6, 7, 8)

# (system, scale, scale per decoding request, fixed s, fixed s per decoding request): see Profile
PrefillLoadFit = tuple[str, float, float, float, float]

# (batch, measured / modelled at each of Profile.spread_levels), by batch
SpreadTable = tuple[tuple[int, tuple[float, ...]], ...]


@dataclass(frozen=True)
class Profile:
    description: str  # model, dtype, threads, machine: what was measured
    max_num_batched_tokens: int  # the chunk the engine ran with
    num_layers: int
    kv_bytes_per_token: int  # all layers, K and V, in the engine's dtype
    prefill_points: tuple[tuple[int, float], ...]  # (tokens, seconds), nothing cached, by tokens
    prefill_cached_points: tuple[tuple[int, int, float], ...]  # (tokens, cached tokens, seconds)
    decode_points: tuple[tuple[int, int, float], ...]  # (batch, context tokens in all, seconds per step)
    transfer_points: tuple[tuple[int, float], ...]  # (bytes, seconds for the whole transfer)
    # fitted from the points (`fit_profile`)
    prefill_s_per_token_ctx: float
    decode_base_s: float
    decode_s_per_seq: float
    decode_s_per_ctx_token: float
    transfer_base_s: float
    transfer_s_per_byte: float
    # (batch per worker, context tokens per worker, engine-alone step s, served gap s), medians of
    # each batch's gaps; empty when the serving overhead was not measured
    serve_points: tuple[tuple[int, int, float, float], ...]
    serve_system: str  # what served them: "colocated, 2 workers" ("" when not measured)
    serve_step_s: float  # fitted: per step a served worker runs ...
    serve_s_per_seq: float  # ... and per token it delivers
    # the spread of single decode steps around the model, at these quantile levels
    spread_levels: tuple[float, ...]
    decode_spread: SpreadTable  # `Engine.step()` timed in calibration / the fitted decode model
    serve_spread: SpreadTable  # a client's gaps / (engine model + the batch's median overhead); () unmeasured
    # (system, decoding requests in the cluster, modelled s, measured TTFT s) of prompts sent one at a time
    prefill_load_points: tuple[tuple[str, int, float, float], ...] = ()
    # (system, scale, scale_per, fixed_s, fixed_s_per), fitted per system: a prefill beside N decoding
    # requests takes model s x (scale + scale_per x N) + fixed_s + fixed_s_per x N
    prefill_load_fits: tuple[PrefillLoadFit, ...] = ()
    # the serving overhead by how many of the system's workers step at once: serve_points were taken
    # with `serve_workers` busy; serve_alone_points (same fields) with one busy and the rest idle;
    # each worker idle takes `serve_s_per_busy` off a step's overhead (0 and () when not measured)
    serve_workers: int = 0
    serve_alone_points: tuple[tuple[int, int, float, float], ...] = ()
    serve_s_per_busy: float = 0.0
    # the serving overhead with every prefill worker busy: serve_prefill_points (as serve_points)
    # measured while prompts kept them computing; a decode step then costs serve_prefill_step_s +
    # serve_prefill_s_per_seq x batch more than the overhead above (0 and () when not measured)
    serve_prefill_points: tuple[tuple[int, int, float, float], ...] = ()
    serve_prefill_step_s: float = 0.0
    serve_prefill_s_per_seq: float = 0.0
    # seconds of plan/calibrate.py's speed probe (a fixed piece of engine work) while the engine
    # figures above were measured; 0: not measured (the machine taken as it was then, whenever)
    probe_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.prefill_points:
            raise ValueError("a profile needs at least one prefill point")
        if any(a[0] >= b[0] for a, b in zip(self.prefill_points, self.prefill_points[1:], strict=False)):
            raise ValueError("prefill points must be sorted by tokens, each length once")
        if self.num_layers < 1 or self.kv_bytes_per_token <= 0:
            raise ValueError("num_layers and kv_bytes_per_token must be positive")
        for table in (self.decode_spread, self.serve_spread):
            StepSpread(self.spread_levels, table)  # checks the table against the levels

    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **asdict(self)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Profile:
        if d.get("version") not in READS_VERSIONS:
            raise ValueError(f"profile version {d.get('version')!r}; this build reads {READS_VERSIONS}")
        return Profile(
            description=str(d["description"]),
            max_num_batched_tokens=int(d["max_num_batched_tokens"]),
            num_layers=int(d["num_layers"]),
            kv_bytes_per_token=int(d["kv_bytes_per_token"]),
            prefill_points=tuple((int(n), float(s)) for n, s in d["prefill_points"]),
            prefill_cached_points=tuple((int(n), int(c), float(s)) for n, c, s in d["prefill_cached_points"]),
            decode_points=tuple((int(b), int(c), float(s)) for b, c, s in d["decode_points"]),
            transfer_points=tuple((int(n), float(s)) for n, s in d["transfer_points"]),
            prefill_s_per_token_ctx=float(d["prefill_s_per_token_ctx"]),
            decode_base_s=float(d["decode_base_s"]),
            decode_s_per_seq=float(d["decode_s_per_seq"]),
            decode_s_per_ctx_token=float(d["decode_s_per_ctx_token"]),
            transfer_base_s=float(d["transfer_base_s"]),
            transfer_s_per_byte=float(d["transfer_s_per_byte"]),
            serve_points=tuple((int(b), int(c), float(e), float(s)) for b, c, e, s in d["serve_points"]),
            serve_system=str(d["serve_system"]),
            serve_step_s=float(d["serve_step_s"]),
            serve_s_per_seq=float(d["serve_s_per_seq"]),
            spread_levels=tuple(float(q) for q in d["spread_levels"]),
            decode_spread=_spread_table(d["decode_spread"]),
            serve_spread=_spread_table(d["serve_spread"]),
            prefill_load_points=tuple(
                (str(m), int(n), float(e), float(s)) for m, n, e, s in d.get("prefill_load_points", ())
            ),
            prefill_load_fits=tuple(_prefill_load_fit(f) for f in d.get("prefill_load_fits", ())),
            serve_workers=int(d.get("serve_workers", 0)),
            serve_alone_points=tuple(
                (int(b), int(c), float(e), float(s)) for b, c, e, s in d.get("serve_alone_points", ())
            ),
            serve_s_per_busy=float(d.get("serve_s_per_busy", 0.0)),
            serve_prefill_points=tuple(
                (int(b), int(c), float(e), float(s)) for b, c, e, s in d.get("serve_prefill_points", ())
            ),
            serve_prefill_step_s=float(d.get("serve_prefill_step_s", 0.0)),
            serve_prefill_s_per_seq=float(d.get("serve_prefill_s_per_seq", 0.0)),
            probe_s=float(d.get("probe_s", 0.0)),
        )

    def step_spread(self) -> StepSpread | None:
        """The spread the simulator draws decode steps from: the served gaps' when measured, else
        the engine's; None when neither was."""
        table = self.serve_spread or self.decode_spread
        return StepSpread(self.spread_levels, table) if table else None


def _prefill_load_fit(row: Any) -> PrefillLoadFit:
    """One saved fit; a version 4 row (system, scale, scale_per) has no cost per request."""
    m, a, b, c, d = (*row, 0.0, 0.0) if len(row) == 3 else row
    return (str(m), float(a), float(b), float(c), float(d))


def _spread_table(rows: Any) -> SpreadTable:
    return tuple((int(b), tuple(float(r) for r in ratios)) for b, ratios in rows)


def spread_table(ratios: Sequence[tuple[int, float]], levels: Sequence[float] = SPREAD_LEVELS) -> SpreadTable:
    """(batch, measured / modelled) samples as a spread table: their quantiles at `levels` per batch."""
    by_batch: dict[int, list[float]] = {}
    for b, r in ratios:
        by_batch.setdefault(b, []).append(r)
    return tuple((b, spread_quantiles(v, levels)) for b, v in sorted(by_batch.items()))


def save_profile(profile: Profile, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(profile.to_dict(), f, indent=1)
    os.replace(tmp, path)


def load_profile(path: str) -> Profile:
    with open(path, encoding="utf-8") as f:
        return Profile.from_dict(json.load(f))


# ---- fitting -----------------------------------------------------------------------------------


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float], nonnegative: bool = True) -> list[float]:
    """Coefficients c minimising sum((row . c - y)^2), by the normal equations (a handful of columns).
    With `nonnegative`, a column whose coefficient comes out negative is dropped (its coefficient 0)
    and the rest refitted: a step never gets cheaper with more work."""
    if not rows or len(rows) != len(ys):
        raise ValueError("least_squares needs as many rows as values, at least one")
    k = len(rows[0])
    active = list(range(k))
    while True:
        coef = _solve_normal(rows, ys, active)
        negative = [j for j in active if coef[j] < 0]
        if not nonnegative or not negative:
            return coef
        active.remove(min(negative, key=lambda j: coef[j]))


def _solve_normal(rows: Sequence[Sequence[float]], ys: Sequence[float], cols: list[int]) -> list[float]:
    n = len(cols)
    # a pivot this small against its column's own size is a column the others already explain
    # (collinear: every point at one decoding count, or of one modelled time): coefficient 0
    tiny = [1e-12 * max(sum(r[i] * r[i] for r in rows), 1e-300) for i in cols]
    a = [
        [sum(r[i] * r[j] for r in rows) for j in cols] + [sum(r[i] * y for r, y in zip(rows, ys, strict=True))]
        for i in cols
    ]
    for c in range(n):  # Gauss-Jordan with partial pivoting
        p = max(range(c, n), key=lambda r: abs(a[r][c]))
        a[c], a[p] = a[p], a[c]
        if abs(a[c][c]) <= tiny[c]:
            continue  # a column with no information keeps coefficient 0
        for r in range(n):
            if r != c and a[r][c] != 0.0:
                f = a[r][c] / a[c][c]
                a[r] = [x - f * y for x, y in zip(a[r], a[c], strict=True)]
    coef = [0.0] * len(rows[0])
    for i, j in enumerate(cols):
        coef[j] = a[i][n] / a[i][i] if abs(a[i][i]) > tiny[i] else 0.0
    return coef


def interpolate(points: Sequence[tuple[int, float]], x: float) -> float:
    """Piecewise linear through `points` (sorted by x), extended along the end segments, never below 0.
    One point: proportional to x."""
    if len(points) == 1:
        x0, y0 = points[0]
        return max(0.0, y0 * x / x0) if x0 else y0
    i = 1
    while i < len(points) - 1 and points[i][0] < x:
        i += 1
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def fit_profile(
    description: str,
    max_num_batched_tokens: int,
    num_layers: int,
    kv_bytes_per_token: int,
    prefill_points: Sequence[tuple[int, float]],
    prefill_cached_points: Sequence[tuple[int, int, float]],
    decode_points: Sequence[tuple[int, int, float]],
    transfer_points: Sequence[tuple[int, float]],
) -> Profile:
    """A profile from measured points, the models fitted. Repeated prefill lengths are averaged.
    Each decode point is one timed step: their ratios to the fitted model make `decode_spread`."""
    by_len: dict[int, list[float]] = {}
    for n, s in prefill_points:
        by_len.setdefault(n, []).append(s)
    prefill = tuple(sorted((n, sum(v) / len(v)) for n, v in by_len.items()))
    # attention over the cached prefix: what a chunk took beyond the same chunk alone, per token x cached token
    extra = [(n * c, s - interpolate(prefill, n)) for n, c, s in prefill_cached_points if c > 0]
    per_token_ctx = least_squares([[x] for x, _ in extra], [y for _, y in extra])[0] if extra else 0.0
    base = per_seq = per_ctx = 0.0
    if decode_points:
        base, per_seq, per_ctx = least_squares(
            [[1.0, b, c] for b, c, _ in decode_points], [s for *_, s in decode_points]
        )
    decode_spread = spread_table(
        [(b, s / model) for b, c, s in decode_points if (model := base + per_seq * b + per_ctx * c) > 0]
    )
    t_base = t_byte = 0.0
    if transfer_points:
        t_base, t_byte = least_squares([[1.0, b] for b, _ in transfer_points], [s for _, s in transfer_points])
    return Profile(
        description=description,
        max_num_batched_tokens=max_num_batched_tokens,
        num_layers=num_layers,
        kv_bytes_per_token=kv_bytes_per_token,
        prefill_points=prefill,
        prefill_cached_points=tuple(prefill_cached_points),
        decode_points=tuple(decode_points),
        transfer_points=tuple(transfer_points),
        prefill_s_per_token_ctx=per_token_ctx,
        decode_base_s=base,
        decode_s_per_seq=per_seq,
        decode_s_per_ctx_token=per_ctx,
        transfer_base_s=t_base,
        transfer_s_per_byte=t_byte,
        serve_points=(),
        serve_system="",
        serve_step_s=0.0,
        serve_s_per_seq=0.0,
        spread_levels=SPREAD_LEVELS,
        decode_spread=decode_spread,
        serve_spread=(),
    )


def engine_decode_step_s(p: Profile, batch: int, context_tokens_total: int) -> float:
    """`Engine.step()` alone for one decode step (the fitted model, no serving overhead)."""
    return p.decode_base_s + p.decode_s_per_seq * batch + p.decode_s_per_ctx_token * context_tokens_total


def with_serving(
    profile: Profile,
    points: Sequence[tuple[int, int, float, float]],
    system: str,
    gap_ratios: Sequence[tuple[int, float]] = (),
) -> Profile:
    """The profile with the serving overhead fitted to `points` (see `Profile.serve_points`):
    served gap - engine step = per step + per_seq x batch; and the served gaps' spread from
    `gap_ratios`, (batch, one gap / the served model at its context) each."""
    if not points:
        raise ValueError("no serving points to fit")
    step, per_seq = least_squares([[1.0, b] for b, *_ in points], [s - e for _, _, e, s in points])
    return replace(
        profile,
        serve_points=tuple(points),
        serve_system=system,
        serve_step_s=step,
        serve_s_per_seq=per_seq,
        serve_spread=spread_table(gap_ratios, profile.spread_levels),
    )


def with_serving_alone(profile: Profile, points: Sequence[tuple[int, int, float, float]], workers: int) -> Profile:
    """The profile with the serving overhead as a function of the workers busy: `points` (as
    `Profile.serve_points`) measured with one of the system's `workers` busy, the profile's
    serve_points with all of them. Each idle worker takes the same share off a step's overhead:
    (the fitted overhead at the alone points' batch - their median measured one) / (workers - 1),
    never negative and never more than takes the overhead below the alone figure."""
    if not points:
        raise ValueError("no serving points with one worker busy")
    if workers < 2:
        raise ValueError("the serving overhead by workers busy needs a system of two workers or more")
    batch = sorted(b for b, *_ in points)[len(points) // 2]
    alone = sorted(s - e for _, _, e, s in points)[len(points) // 2]
    all_busy = profile.serve_step_s + profile.serve_s_per_seq * batch
    per_busy = min(max(0.0, (all_busy - alone) / (workers - 1)), all_busy / (workers - 1))
    return replace(profile, serve_workers=workers, serve_alone_points=tuple(points), serve_s_per_busy=per_busy)


def serving_by_busy(profile: Profile) -> Callable[[int], float] | None:
    """What a step's modelled time changes by with `busy` of the system's workers stepping (itself
    included): the profile's overhead was fitted with all of them busy, and each idle one takes
    `serve_s_per_busy` off it. None when not measured (the overhead then as fitted, whatever the load)."""
    if profile.serve_s_per_busy <= 0 or profile.serve_workers < 2:
        return None
    per_busy, workers = profile.serve_s_per_busy, profile.serve_workers

    def at(busy: int) -> float:
        return -per_busy * (workers - min(max(busy, 1), workers))

    return at


def with_serving_beside_prefill(profile: Profile, points: Sequence[tuple[int, int, float, float]]) -> Profile:
    """The profile with the serving overhead beside busy prefill workers: `points` (as
    `Profile.serve_points`) measured while prompts kept every prefill worker computing. Their excess
    over the profile's overhead at the same batch is fitted as per step + per seq x batch (least
    squares, no negative term: a decode step is not cheaper for a prefill beside it)."""
    if not points:
        raise ValueError("no serving points beside busy prefill workers")
    excess = [s - e - (profile.serve_step_s + profile.serve_s_per_seq * b) for b, _, e, s in points]
    step, per_seq = least_squares([[1.0, float(b)] for b, *_ in points], excess)
    return replace(
        profile, serve_prefill_points=tuple(points), serve_prefill_step_s=step, serve_prefill_s_per_seq=per_seq
    )


def serving_beside_prefill(profile: Profile) -> Callable[[int], float] | None:
    """What a decode step of `batch` costs more with every prefill worker busy (see
    `with_serving_beside_prefill`); None when not measured or nothing."""
    step, per_seq = profile.serve_prefill_step_s, profile.serve_prefill_s_per_seq
    if not profile.serve_prefill_points or (step <= 0 and per_seq <= 0):
        return None

    def at(batch: int) -> float:
        return step + per_seq * batch

    return at


def with_prefill_load(profile: Profile, system: str, points: Sequence[tuple[int, float, float]]) -> Profile:
    """The profile with `system`'s prefill slowdown fitted to `points`, (decoding requests in the
    cluster, modelled s, measured s) each: measured = modelled x (scale + scale_per x N) + fixed +
    fixed_per x N, least squares on seconds, so a long prompt weighs by its time rather than a short
    one's fixed cost counting as a ratio. No term comes out negative (a prefill is never cheaper for
    more decoding, nor a request's handling free of cost below zero). Replaces what the profile held
    for that system."""
    if not points:
        raise ValueError("no prefill-under-load points to fit")
    scale, scale_per, fixed, fixed_per = least_squares(
        [[e, e * n, 1.0, float(n)] for n, e, _ in points], [s for *_, s in points]
    )
    kept = tuple(p for p in profile.prefill_load_points if p[0] != system)
    fits = tuple(f for f in profile.prefill_load_fits if f[0] != system)
    return replace(
        profile,
        prefill_load_points=kept + tuple((system, n, e, s) for n, e, s in points),
        prefill_load_fits=fits + ((system, scale, scale_per, fixed, fixed_per),),
    )


def prefill_slowdown(profile: Profile, system: str) -> Callable[[int], tuple[float, float]] | None:
    """`system`'s measured prefill slowdown for the simulator: at N requests decoding in the cluster,
    (the multiplier on the model's prefill time, the seconds added per request prefilled); None when
    the profile has none for it."""
    measured = [n for name, n, _, _ in profile.prefill_load_points if name == system]
    fit = next((f for f in profile.prefill_load_fits if f[0] == system), None)
    if fit is None:
        return None
    _, scale, scale_per, fixed, fixed_per = fit
    most = max(measured, default=0)  # not extrapolated past the most streams measured beside

    def at(decoding: int) -> tuple[float, float]:
        n = min(decoding, most)
        return scale + scale_per * n, fixed + fixed_per * n

    return at


class ProfileCosts:
    """The `CostModel` of a measured profile: a served worker's steps, each the engine's step plus
    the measured serving overhead (per step, and per token delivered: the decodes of a decode
    step; a prefill step's first token rides on its per-step part)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile

    def _engine_prefill_s(self, tokens: int, cached_tokens: int) -> float:
        p = self.profile
        return interpolate(p.prefill_points, tokens) + p.prefill_s_per_token_ctx * tokens * cached_tokens

    def prefill_s(self, tokens: int, cached_tokens: int = 0) -> float:
        if tokens <= 0:
            return 0.0
        return self._engine_prefill_s(tokens, cached_tokens) + self.profile.serve_step_s

    def decode_step_s(self, batch: int, context_tokens_total: int) -> float:
        p = self.profile
        overhead = p.serve_step_s + p.serve_s_per_seq * batch
        return engine_decode_step_s(p, batch, context_tokens_total) + overhead

    def whole_transfer_s(self, tokens: int) -> float:
        """The whole KV of `tokens` over the measured path, nothing hidden."""
        p = self.profile
        return p.transfer_base_s + p.transfer_s_per_byte * tokens * p.kv_bytes_per_token

    def transfer_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        p = self.profile
        wire = p.transfer_s_per_byte * tokens * p.kv_bytes_per_token
        return p.transfer_base_s + pipelined_tail_s(wire, self._engine_prefill_s(tokens, 0), p.num_layers)
