"""The KV tiers on CUDA (engine/kv_tiers.py, `CudaLoads`): the host tier's blocks in pinned memory, a
load queued on a stream of its own, and the tokens of a run whose prefix stayed in the pool. Skipped
where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.block_hash import block_hashes
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.kv_tier_blocks import HostTier
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BS = 4
MODEL = tiny_model_config(tie_embeddings=False)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
CONTEXT = [(i * 37) % 500 + 1 for i in range(41)]  # ten full blocks and a token
OTHER = [(i * 53) % 500 + 1 for i in range(84)]  # fills the pool: CONTEXT's blocks are evicted
TURN2 = CONTEXT + [5, 9, 17, 33, 65, 129, 257]


def engine(num_blocks: int, **tiers: object) -> Engine:
    cfg = EngineConfig(device="cuda", num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=64, **tiers)  # type: ignore[arg-type]
    return Engine(MODEL, random_weights(MODEL), cfg)


def run(e: Engine, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    e.add_request(rid, prompt, GREEDY)
    tokens: list[int] = []
    cached = -1
    while e.has_work:
        for out in e.step():
            tokens.append(out.token_id)
            cached = out.num_cached_tokens
    return tokens, cached


def test_a_host_tier_hit_on_cuda_loads_pinned_blocks_on_its_own_stream_with_the_same_tokens():
    big = engine(64)
    run(big, "turn1", CONTEXT)
    want, cached = run(big, "turn2", TURN2)
    assert cached == 40

    e = engine(24, kv_host_tier_bytes=1 << 20)
    tiers = e.tiers
    assert tiers is not None and tiers.cuda is not None
    host_tier = tiers.tier("host")
    assert isinstance(host_tier, HostTier)
    run(e, "turn1", CONTEXT)
    run(e, "other", OTHER)
    assert not e.blocks.cached_prefix(block_hashes(TURN2, BS), len(TURN2))
    assert host_tier.blocks and all(held.data.is_pinned() for held in host_tier.blocks.values())
    tiers.prefill_tokens_per_s = None  # every hit loads
    tokens, cached = run(e, "turn2", TURN2)
    assert tokens == want and cached == 40
    torch.cuda.synchronize()
    tiers.speeds()  # takes in the loads' CUDA timings
    host = tiers.stats["host"]
    assert host.hits == 10 and host.load_seconds > 0 and not tiers.cuda.timing
