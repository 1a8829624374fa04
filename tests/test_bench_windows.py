"""splitserve bench windows on a tiny Gemma 3 (5 windowed layers of 8 tokens, 1 global): at the
same pool in bytes, the cache of pages runs several times the sequences that one row per layer
does (a count, the same on every machine), and the transfer arithmetic is window_start's."""

from __future__ import annotations

import argparse
import re

import pytest

from splitserve.bench import windows
from tests.family_helpers.build import build, save_hf_dir

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, smollm2_path):
    from splitserve.engine import gguf_loader
    from splitserve.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(gguf_loader.read_metadata(gguf_loader.open_gguf(smollm2_path), smollm2_path))
    return save_hf_dir(build("gemma3", seed=1), str(tmp_path_factory.mktemp("gemma3")), tok)


def test_the_cache_of_pages_runs_more_sequences_at_the_same_pool(gemma_dir, capsys):
    parser = argparse.ArgumentParser()
    windows.add_arguments(parser)
    # 96-token prompts and 64 more tokens: 40 blocks of 4, 6 KiB each with every layer's KV in
    # bfloat16; 480 KiB hold two such sequences whole. Each runs far longer than its prefill, so
    # memory, not the prefill's pace, decides how many run at once.
    args = parser.parse_args(
        ["--model", gemma_dir, "--pool-mib", str(480 / 1024), "--requests", "8", "--context", "96", "--tokens", "64"]
        + ["--chunk", "16", "--block-size", "4"]
    )
    assert windows.run(args) == 0
    out = capsys.readouterr().out
    most = {m[0]: int(m[1]) for m in re.findall(r"  (plain|paged): .*most sequences running at once (\d+)", out)}
    assert most["paged"] >= 2 * most["plain"] >= 4, out
    assert "KV bytes a transfer sends" in out and " 32768 tokens: " in out
