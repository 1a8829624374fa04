"""A windowed layer's KV crosses the prefill/decode boundary only as far as its window still
reaches (issue 30): the prefill worker sends a sliding-window layer only the blocks from
engine/blocks.py's `window_start` on, the decode worker's reservation waits for no more, and
the tokens are the colocated engine's. Those blocks are no whole prefix: the decode worker's cache
of pages (engine/kv_groups.py) knows which lack their windowed layers' KV, and a prefix hit there
needs the next token's window whole (the prefill worker's, computed whole, holds them all)."""

from __future__ import annotations

import pytest

from splitserve.engine.block_hash import block_hashes
from splitserve.engine.blocks import window_start
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams
from tests.worker_helpers import EnginePair, assert_engine_empty

pytestmark = pytest.mark.timeout(120)

# two layers: a windowed one (8 tokens) and a global one; blocks of 4 tokens
CFG = tiny_model_config(num_layers=2, sliding_window=8, layer_types=("sliding_attention", "full_attention"))
PROMPT = list(range(3, 33))  # 30 tokens: 8 blocks, the last partial
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_window_start_is_where_the_next_tokens_window_begins():
    assert window_start(30, 0, 4) == 0  # a global layer reads everything
    assert window_start(30, 8, 4) == 5  # the token at position 30 sees 23..30: blocks 5 on
    assert window_start(5, 8, 4) == 0
    assert window_start(31, 8, 4) == 6


def _engine(chunk: int = 64) -> Engine:
    cfg = EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=chunk)
    return Engine(CFG, random_weights(CFG, seed=0), cfg)


def test_a_windowed_layer_sends_only_its_window_and_the_tokens_are_the_colocated_ones(monkeypatch):
    (want,) = _engine().generate([PROMPT], GREEDY)
    pair = EnginePair.of(_engine(chunk=8), _engine())
    assert pair.decode.layout.windows == (8, 0)
    sent: dict[int, int] = {}
    open_stream = pair.sender.open

    def counting_open(reservation):  # every layer frame the prefill worker queues, by layer
        stream = open_stream(reservation)
        send = stream.send_layer

        def send_layer(layer, block_ids, **kw):
            sent[layer] = sent.get(layer, 0) + len(block_ids)
            return send(layer, block_ids, **kw)

        monkeypatch.setattr(stream, "send_layer", send_layer)
        return stream

    monkeypatch.setattr(pair.sender, "open", counting_open)
    try:
        remote = pair.reserve("r", PROMPT, GREEDY)
        pair.start_prefill("r", PROMPT, GREEDY, remote)
        first = pair.prefill_until_done("r")
        pair.poll_prefill(timeout_s=10)
        pair.poll_decode(timeout_s=10)
        assert [first, *pair.decode_to_end("r")] == want
        # chunks of 8 tokens end on block boundaries: the global layer sends its 8 blocks once, the
        # windowed layer blocks 5, 6 and 7 (11 of 16 layer-blocks: 69% of the whole context's bytes)
        assert sent == {0: 3, 1: 8}, sent
        # the decode side caches the prompt's blocks, but blocks 0..4 never held the windowed layer's
        # KV, and the window passed 5..7 as the decode went on: no prefix of them is a hit
        decode_blocks = pair.decode.blocks
        assert len(pair.decode.scheduler.cached_block_hashes()) >= 7
        assert decode_blocks.cached_prefix(block_hashes(PROMPT, 4), len(PROMPT)) == []
        prefill_blocks = pair.prefill.blocks
        assert len(pair.prefill.scheduler.cached_block_hashes()) == 7  # the prefill side's is whole
        assert len(prefill_blocks.cached_prefix(block_hashes(PROMPT, 4), len(PROMPT))) == 7
        assert_engine_empty(pair.decode)
        assert_engine_empty(pair.prefill)
    finally:
        pair.close()
