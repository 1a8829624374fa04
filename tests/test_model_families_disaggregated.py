"""The model families' conformance across the prefill/decode boundary (issue 30): for every
family in engine/models/, its tiny seeded model (tests/family_helpers) gives the same tokens
on one engine (colocated), through a TP 1 prefill engine feeding a TP 2 decode engine over
the KV plane (disaggregated: every layer's KV re-sharded by heads on the way), and on an
engine that resumes each sample from the tokens another produced (what a migration off a
killed decode worker hands over); for a greedy request, and for n=2 seeded samples under a
JSON schema (structured output, the grammar rebuilt on each side from the handoff)."""

from __future__ import annotations

import json

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.sampling import GrammarSpec, SamplingParams
from splitserve.engine.weights import load_model
from splitserve.kv_transfer import KVReceiver, KVSender
from splitserve.workers.decode.connector import ReceiverConnector
from splitserve.workers.prefill.connector import SenderConnector
from tests.family_helpers.build import FAMILY_NAMES, build, save_hf_dir
from tests.test_handoff import colocated, disaggregated, migrated, tokens
from tests.worker_helpers import EnginePair

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
REQUESTS = {
    "greedy": SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    "json_n2_seeded": SamplingParams(
        max_tokens=16, temperature=0.9, seed=5, n=2, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA))
    ),
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from splitserve.engine import gguf_loader
    from splitserve.engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(gguf_loader.read_metadata(gguf_loader.open_gguf(smollm2_path), smollm2_path))


def _engine(loaded, tp: int = 1, chunk: int = 64) -> Engine:
    cfg = EngineConfig(num_blocks=96, block_size=4, tensor_parallel_size=tp, max_num_batched_tokens=chunk)
    return Engine(loaded.config, loaded.weights, cfg, tokenizer=loaded.tokenizer)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_colocated_disaggregated_tp1_to_tp2_and_migrated_give_the_same_tokens(name, tmp_path, tokenizer):
    loaded = load_model(save_hf_dir(build(name, seed=3), str(tmp_path / name), tokenizer), torch.float32, False)
    prompt = torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(2)).tolist()  # past the window
    whole = {}
    for what, params in REQUESTS.items():
        engine = _engine(loaded)
        whole[what] = colocated(engine, prompt, params)
        assert len(whole[what]) == params.n
        assert tokens(migrated(_engine(loaded), prompt, params, whole[what], k=7)) == tokens(whole[what]), what
    # a TP 1 prefill engine (8-token chunks: the layers go out over several steps) feeding a TP 2 decode engine
    prefill, decode = _engine(loaded, chunk=8), _engine(loaded, tp=2)
    receiver = KVReceiver(decode.kv_cache)
    sender = KVSender(prefill.kv_cache)
    try:
        decode_connector = ReceiverConnector(receiver, cancel_timeout_s=5.0)
        decode.connect(decode_connector)
        prefill_connector = SenderConnector(sender, confirm_timeout_s=10.0)
        prefill.connect(prefill_connector)
        pair = EnginePair(prefill, decode, receiver, sender, decode_connector, prefill_connector)
        assert decode.kv_cache.layout.tp_size == 2
        for what, params in REQUESTS.items():
            remote, _ = disaggregated(pair, prompt, params)
            assert tokens(remote) == tokens(whole[what]), what
    finally:
        sender.close()
        receiver.close()
        prefill.close()
        decode.close()
