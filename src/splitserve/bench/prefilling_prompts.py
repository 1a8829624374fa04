"""Prompts that keep a system's prefill workers busy while something else is measured.

`PrefillingPrompts(base_url, model, words)` sends chat completions of `words`
random words and two output tokens, one after another on each of two threads
(so one prompt waits while the other prefills, and the prefill workers never
idle between them), each prompt new (a prompt seen before would be a
prefix-cache hit, and no prefill). `wait_prefilling()` returns once the first
has answered, so what is measured next runs beside prompts that prefill back to
back. Leaving the `with` block lets those in flight finish and stops.
"""

from __future__ import annotations

import json
import random
import threading
import urllib.request

from splitserve.bench.background import Background

# Words the SmolLM2 tokenizer keeps whole, so `words` of them are about that many tokens.
_WORDS = (
    "river stone cloud paper window garden silver market candle forest engine yellow bridge "
    "winter orange pocket signal harbor meadow copper".split()
)


class PrefillingPrompts(Background):
    def __init__(
        self, base_url: str, model: str, words: int = 500, seed: int = 0, threads: int = 2, timeout_s: float = 120.0
    ) -> None:
        super().__init__(timeout_s)
        self.base_url = base_url
        self.model = model
        self.words = words
        self.sent = 0
        self._lock = threading.Lock()
        self._first = threading.Event()
        for i in range(threads):
            self._start_later(self._run, (random.Random(seed + i),), f"prompts-{i}")

    def wait_prefilling(self) -> None:
        """The first prompt was answered; raises RuntimeError if it failed or did not come in time."""
        if not self._first.wait(self.timeout_s) or self.errors:
            raise RuntimeError(f"background prompts are not being served: {self.errors or 'no answer'}")

    def _body(self, rng: random.Random) -> bytes:
        text = " ".join(rng.choice(_WORDS) for _ in range(self.words))
        return json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 2,
                "temperature": 0,
                "ignore_eos": True,
            }
        ).encode()

    def _run(self, rng: random.Random) -> None:
        url = self.base_url + "/v1/chat/completions"
        while not self._stop.is_set():
            req = urllib.request.Request(url, self._body(rng), {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    r.read()
            except OSError as e:
                self.errors.append(f"a background prompt failed: {e}")
                self._first.set()
                return
            with self._lock:
                self.sent += 1
            self._first.set()
