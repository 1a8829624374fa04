"""When requests are sent: pure functions of the rate and a random generator.

Gaps between arrivals are gamma distributed with shape `burstiness` and mean
1 / rate, as in vLLM: burstiness 1 is a Poisson process, below 1 burstier,
above 1 more even. A rate of infinity sends everything at once.
"""

from __future__ import annotations

import math
import random


def arrival_offsets(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send times in seconds from the start, non-decreasing, the first at 0 (the clock starts with a request)."""
    if n < 0 or rate <= 0 or burstiness <= 0:
        raise ValueError("arrivals: n must be >= 0, rate and burstiness > 0")
    if math.isinf(rate):
        return [0.0] * n
    scale = 1.0 / (rate * burstiness)  # gamma's mean is shape * scale = 1 / rate
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, scale)
        out.append(t)
    return out


def parse_rates(text: str) -> list[float]:
    """`--request-rate 0.2,0.4,inf` -> [0.2, 0.4, inf]: a sweep runs each in turn."""
    rates = []
    for word in text.split(","):
        word = word.strip().lower()
        if not word:
            continue
        rate = math.inf if word in ("inf", "infinity") else float(word)
        if not rate > 0:
            raise ValueError(f"request rate {word!r}: must be > 0 (or inf)")
        rates.append(rate)
    if not rates:
        raise ValueError("request rate: give at least one")
    return rates
