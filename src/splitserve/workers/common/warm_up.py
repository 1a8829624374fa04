"""A worker's warm-up step, run before it listens: one short request through the engine.

The first step of a fresh process pays for everything built lazily: the CPU
kernels (loaded here by name, engine/kernels/prebuild.py, and so said in the
log; compiled only where no preflight built them first, as on a fresh node of a
Ray cluster, about ten seconds), oneDNN's
and the allocator's first calls, on CUDA the Triton kernels' compilation and
the first CUDA graph's capture. Run here, before the worker answers a stats poll
and so before the router counts it ready (router/readiness.py), none of it
lands on a client's first token.

The prompt is shorter than one KV block, so nothing enters the prefix cache,
and every block goes back to the free list when it finishes.

The grammar compiler is built here too: llguidance reads the vocabulary holding
the GIL (half a second for SmolLM2's 49k tokens), which, left to the first
request with a grammar, stalled every stream of the batch for that long.
"""

from __future__ import annotations

import logging
import time

from splitserve.engine.engine import Engine
from splitserve.engine.kernels.prebuild import prepare, summary
from splitserve.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

WARM_UP_NEW_TOKENS = 2  # one prefill step, one decode step


def warm_up(engine: Engine) -> float:
    """Run one prefill and one decode step; the seconds it took."""
    t = time.monotonic()
    prompt_len = max(1, min(8, engine.cfg.block_size - WARM_UP_NEW_TOKENS))
    params = SamplingParams(max_tokens=WARM_UP_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    free = engine.blocks.num_free_blocks
    if not engine.cfg.device.startswith("cuda"):
        log.info("%s", summary(prepare()))
    engine.generate([[0] * prompt_len], params)
    engine.forget_prefill_speed()  # the first real prompts measure it
    if engine.tokenizer is not None:
        engine.grammars()
    if engine.blocks.num_free_blocks != free:  # a warm-up that kept a block would cost a client one
        raise RuntimeError(f"warm-up left {free - engine.blocks.num_free_blocks} KV block(s) allocated")
    took = time.monotonic() - t
    log.info("warm-up step done in %.2f s", took)
    return took
