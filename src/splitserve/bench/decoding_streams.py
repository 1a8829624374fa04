"""Requests that keep decoding in the background while something else is measured.

`DecodingStreams(base_url, model, n)` opens n streaming chat completions with a
long output (EOS ignored), each read on its own thread. `wait_decoding()`
returns once every stream has its first token, so what is measured next runs
beside n decoding requests, not beside their prefills. Leaving the `with` block
closes the streams (the router cancels them: the workers free their seats).
"""

from __future__ import annotations

import json
import threading
import urllib.request

from splitserve.bench.background import Background


class DecodingStreams(Background):
    def __init__(
        self,
        base_url: str,
        model: str,
        n: int,
        prompt: str = "Count to ten thousand.",
        max_tokens: int = 4000,
        timeout_s: float = 120.0,
    ) -> None:
        self.base_url = base_url
        self.body = json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        super().__init__(timeout_s)
        self._first = [threading.Event() for _ in range(n)]
        self.tokens = [0] * n
        for i in range(n):
            self._start_later(self._read, (i,), f"stream-{i}")

    def wait_decoding(self) -> None:
        """Every stream has its first token; raises RuntimeError if one failed or none came in time."""
        for i, ev in enumerate(self._first):
            if not ev.wait(self.timeout_s) or self.errors:
                raise RuntimeError(f"background stream {i} is not decoding: {self.errors or 'no first token'}")

    def _read(self, i: int) -> None:
        req = urllib.request.Request(
            self.base_url + "/v1/chat/completions", self.body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                for line in r:  # one SSE event per token: the stop flag is seen within a step
                    if line.startswith(b"data:") and b"[DONE]" not in line:
                        self.tokens[i] += 1
                        self._first[i].set()
                    if self._stop.is_set():
                        return
            if not self._stop.is_set():
                self.errors.append(f"stream {i} ended after {self.tokens[i]} tokens, before it was stopped")
        except OSError as e:
            self.errors.append(f"stream {i}: {e}")
        finally:
            self._first[i].set()  # wait_decoding sees the error instead of waiting out its timeout
