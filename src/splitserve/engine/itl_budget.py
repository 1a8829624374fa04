"""How many prompt tokens a step that carries decode rows may prefill: the ITL budget.

A decode worker prefills a short prompt (or, when the prefill pool is backed up, a long
one) itself, in steps shared with its running streams, and every one of those streams
waits for the whole step. A step's prefill tokens are what makes it longer than a decode
step, so they are capped at what fits in the ITL target (Sarathi-Serve's token budget,
derived from the target rather than chosen by hand): issue 45, the steady streams' ITL
p99 was 2.5 to 3.3 times their p50, set by the steps that prefilled a new stream's prompt.

The target is `EngineConfig.itl_target` (`--itl-target`): "auto", twice this worker's own
decode step (the steps of decode rows alone, as measured: a stream never waits behind more
than one decode step's worth of prefill); a number of milliseconds; or "off" (a step takes
its whole chunk). What a prefill token costs is measured too: a
mixed step's time past a decode step's, per prompt token, averaged. Both averages follow
the worker as its batch and contexts change, and until a mixed step is measured the cap
is the floor. A step without decode rows is not capped: nobody waits for it.

`ItlBudget` is the policy and holds the two averages; the engine feeds it each step's
measured time (`observe`) and asks it before scheduling (`prefill_tokens`).
"""

from __future__ import annotations

# What a worker's --itl-target is without the flag (EngineConfig's own default is "off": an engine
# built in code schedules by tokens alone, whatever the clock measured)
ITL_TARGET_FLAG_DEFAULT = "auto"
# "auto": a mixed step may last this many decode steps. Measured side by side against "off"
# (SmolLM2's Q4_1 file, bench peer --systems auto:off,auto, 2 cores): at 2.0 the ShareGPT ITL
# p99 0.68x, goodput 0.95x, TTFT p50 1.93x (143 -> 275 ms); at 1.5 the ITL p99 0.75x for
# goodput 0.94x and TTFT p50 2.15x: a prompt token costs ~2 ms on a decode worker's core, so
# 1.5 left room for the floor alone.
AUTO_HEADROOM = 2.0
# a capped step still prefills this many tokens: a prompt always progresses
FLOOR_TOKENS = 8
_ALPHA = 0.2  # the averages' weight of each new step


def parse_itl_target(value: str) -> float | None:
    """`--itl-target`'s value as seconds (None: "auto"); 0.0 for "off". ValueError naming it else."""
    if value == "auto":
        return None
    if value == "off":
        return 0.0
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not ms > 0:
        raise ValueError(f"itl_target must be auto, off or a positive number of milliseconds, got {value!r}")
    return ms / 1e3


class ItlBudget:
    """The prefill tokens of the next step with decode rows (see the module's note)."""

    def __init__(self, target: str, chunk_tokens: int) -> None:
        self.target_s = parse_itl_target(target)
        self.chunk_tokens = chunk_tokens
        self.decode_s: float | None = None  # a step of decode rows alone
        self.token_s: float | None = None  # a prompt token's time, past a decode step's

    @property
    def off(self) -> bool:
        return self.target_s == 0.0

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """A step's measured time, with its decode rows and prompt tokens."""
        if not decode_rows or self.off:
            return
        if not prefill_tokens:
            self.decode_s = _averaged(self.decode_s, seconds)
        elif self.decode_s is not None:
            self.token_s = _averaged(self.token_s, max(seconds - self.decode_s, 0.0) / prefill_tokens)

    def prefill_tokens(self) -> int:
        """The cap on the next step's prompt tokens when it carries decode rows."""
        if self.off:
            return self.chunk_tokens
        if self.decode_s is None or self.token_s is None:
            return FLOOR_TOKENS
        target = self.target_s if self.target_s is not None else AUTO_HEADROOM * self.decode_s
        room = target - self.decode_s
        fits = int(room / self.token_s + 1e-6) if self.token_s > 0 else self.chunk_tokens
        return max(FLOOR_TOKENS, min(self.chunk_tokens, fits))


def _averaged(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new
