"""The background prompts bench plan-check measures decode steps beside (bench/prefilling_prompts.py),
against a real HTTP server: each prompt new and of the length asked, sent back to back from its
threads until the `with` block ends, and a failing server an error rather than a wait."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest

from splitserve.bench.prefilling_prompts import PrefillingPrompts
from tests.http_helpers import http_server

pytestmark = pytest.mark.timeout(60)


class _Chat(BaseHTTPRequestHandler):
    """Answers every chat completion at once and keeps its body; `fail` answers 500 instead."""

    fail = False
    bodies: list[dict] = []
    lock = threading.Lock()
    enough = threading.Event()  # set once `want` bodies came
    want = 6

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.fail:
            self.send_error(500)
            return
        with self.lock:
            self.bodies.append(body)
            if len(self.bodies) >= self.want:
                self.enough.set()
        out = b'{"choices": [{"message": {"content": "ok"}}]}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Chat.bodies, _Chat.enough, _Chat.fail = [], threading.Event(), False
    with http_server(_Chat) as url:
        yield url


def test_prompts_are_new_of_the_length_asked_and_stop_with_the_block(server):
    with PrefillingPrompts(server, "m", words=40, seed=3, timeout_s=10) as prompts:
        prompts.wait_prefilling()
        assert _Chat.enough.wait(10)
    sent = prompts.sent
    assert sent >= _Chat.want and prompts.errors == []
    assert len(_Chat.bodies) == sent  # nothing sent after the block ended: its threads were joined
    texts = [b["messages"][0]["content"] for b in _Chat.bodies]
    assert all(len(t.split()) == 40 for t in texts)
    assert len(set(texts)) == len(texts)  # each prompt new: none is a prefix-cache hit
    assert all(b["model"] == "m" and b["max_tokens"] == 2 and b["ignore_eos"] for b in _Chat.bodies)


def test_a_failing_server_is_an_error_not_a_wait(server):
    _Chat.fail = True
    with PrefillingPrompts(server, "m", timeout_s=10) as prompts, pytest.raises(RuntimeError, match="500"):
        prompts.wait_prefilling()
    assert prompts.sent == 0
