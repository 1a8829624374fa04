"""The transfer manifest (issue 30): the KV handshake carries, beside the shapes, each layer's
kind (its sliding window) and the model's fingerprint, and a receiver refuses KV that differs
in any of them, naming the field, before a byte of it is written. One mutation per field,
refused at both places it is checked (the sender against the reservation; the receiver
against the handshake a sender that lies in its reservation sends); the fingerprint that two
loads of one model share and other weights do not; and two engines of different weights,
whose request ends with the failure's code and no token."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.fingerprint import model_fingerprint
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams
from splitserve.kv_transfer import Failed, FailureCode, KVReceiver, KVSender, TransferError, frame
from splitserve.proto.convert import layout_from_proto, layout_to_proto
from tests.kv_transfer_helpers.common import assert_no_leak
from tests.kv_transfer_helpers.tp import TP_LAYOUT, assert_kv_zero, random_tp_cache
from tests.worker_helpers import EnginePair, assert_engine_empty

pytestmark = pytest.mark.timeout(120)

FP = bytes(range(16))
MANIFEST = dataclasses.replace(TP_LAYOUT, windows=(4, 0, 4), model_fingerprint=FP)
MUTATIONS: dict[str, dict[str, Any]] = {
    "num_layers": {"num_layers": 4, "windows": (4, 0, 4, 0)},
    "num_kv_heads": {"num_kv_heads": 2},
    "head_dim": {"head_dim": 16},
    "block_size": {"block_size": 8},
    "windows": {"windows": (4, 4, 4)},
    "windows_off": {"windows": ()},
    "model_fingerprint": {"model_fingerprint": bytes(15) + b"\x01"},
    "model_fingerprint_unknown": {"model_fingerprint": b""},
}


@pytest.mark.parametrize("field", list(MUTATIONS))
def test_a_manifest_that_differs_in_any_field_is_refused_by_name_and_nothing_is_written(field):
    sender_side = dataclasses.replace(MANIFEST, **MUTATIONS[field])
    src = random_tp_cache(1, seed=1, layout=sender_side)
    dst = KVCache(MANIFEST, 32)
    name = field.removesuffix("_off").removesuffix("_unknown")
    with KVReceiver(dst) as rx:
        r = rx.reserve("mutated", [1, 2, 3], lease_s=30)
        assert r.layout == MANIFEST  # the reservation states the receiver's manifest
        with pytest.raises(TransferError) as refused:
            KVSender(src).open(r)
        assert refused.value.code is FailureCode.LAYOUT_MISMATCH
        assert f"mismatch on {name}" in str(refused.value)
        with pytest.raises(TransferError, match=f"mismatch on {name}"):  # a sender that claims the receiver's
            KVSender(src).open(dataclasses.replace(r, layout=src.layout))
        outcome = rx.wait(r.ticket, 10)
        assert isinstance(outcome, Failed) and outcome.code is FailureCode.LAYOUT_MISMATCH
        assert f"mismatch on {name}" in outcome.reason
        assert_kv_zero(dst, range(32))
        assert_no_leak(rx, range(32))


def test_the_manifest_travels_whole_in_the_handshake_and_the_reservation():
    lay = MANIFEST
    body = frame.encode_layout(
        lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, lay.dtype, 1, 2, lay.windows, FP
    )
    assert frame.decode_layout(body) == (lay, 2)
    with pytest.raises(frame.FrameError, match="windows make it"):
        frame.decode_layout(body[:-4])  # a window cut off
    plain = dataclasses.replace(lay, windows=(), model_fingerprint=b"")
    assert frame.decode_layout(frame.encode_layout(3, 4, 8, 4, "bfloat16"))[0] == plain
    assert layout_from_proto(layout_to_proto(lay)) == lay


def test_one_model_loaded_twice_has_one_fingerprint_and_other_weights_another():
    cfg = tiny_model_config()
    weights = random_weights(cfg, seed=0)
    fp = model_fingerprint(cfg, weights)
    assert model_fingerprint(dataclasses.replace(cfg, name="renamed", eos_token_ids=(3,)), weights) == fp
    assert model_fingerprint(cfg, {k: v.to(torch.bfloat16) for k, v in weights.items()}) == model_fingerprint(
        cfg, {k: v.to(torch.bfloat16).float() for k, v in weights.items()}
    )
    assert model_fingerprint(cfg, random_weights(cfg, seed=1)) != fp
    nudged = dict(
        weights, **{"model.layers.1.mlp.down_proj.weight": weights["model.layers.1.mlp.down_proj.weight"] * 1.01}
    )
    assert model_fingerprint(cfg, nudged) != fp
    assert model_fingerprint(dataclasses.replace(cfg, sliding_window=8), weights) != fp


def test_engines_of_other_weights_never_exchange_kv():
    """What the prefill service meets (workers/prefill/service.py answers FAILED_PRECONDITION with
    the reason): the send is refused before the prefill engine admits the request, and the decode
    worker's reservation, aborted as the router aborts it, leaves nothing behind."""
    cfg = tiny_model_config()
    ecfg = EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    prefill, decode = Engine(cfg, random_weights(cfg, seed=0), ecfg), Engine(cfg, random_weights(cfg, seed=1), ecfg)
    assert prefill.layout.model_fingerprint != decode.layout.model_fingerprint
    pair = EnginePair.of(prefill, decode)
    try:
        params = SamplingParams(max_tokens=4, temperature=0)
        prompt = list(range(1, 14))
        remote = pair.reserve("r", prompt, params)
        with pytest.raises(TransferError, match="mismatch on model_fingerprint") as refused:
            pair.start_prefill("r", prompt, params, remote)
        assert refused.value.code is FailureCode.LAYOUT_MISMATCH
        assert not prefill.has_work
        assert decode.abort("r")
        assert_engine_empty(prefill)
        assert_engine_empty(decode)
    finally:
        pair.close()
