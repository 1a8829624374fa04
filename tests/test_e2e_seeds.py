"""One text whatever ran it (issue 45): six seeded prompts sent together through the router, to
workers on the default engine (the tuned dtype and the embedded GGUF's blocks computed in place, no
engine flag), give the same tokens colocated, disaggregated, under the auto mode and with their
decode worker killed mid-stream, and each the same as the prompt run alone in one process. The
blocks' kernel gives a row its bits whatever shares the call (tests/test_quant_kernels.py) and a
decode row runs the fused decode kernels even in a step that also prefills (model_runner.py's
`_forward_apart`), so neither the batch nor the moment a prompt arrives changes a text."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest
import torch

from splitserve.cli import build_parser
from splitserve.engine.engine import Engine
from splitserve.engine.flags import engine_config_from_args
from splitserve.engine.kernels import quant
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.weights import load_model
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import RoutingConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.workers.launch import WorkerProcess, spawn_worker
from tests.e2e_helpers.cluster import stats, wait_all_blocks_free, with_router
from tests.test_seeds_batch_invariant import QUESTIONS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# the engine's own defaults but for the pool's size and one thread a worker (two cores here)
FLAGS = ("--num-blocks", "512", "--threads", "1", "--insecure-no-cluster-token")
SEED, TOKENS = 7, 48
Mode = Literal["colocated", "disaggregated", "auto", "migrated"]


@pytest.fixture(scope="module")
def alone() -> tuple[list[list[int]], list[list[int]], Any]:
    """The prompts, each one's text alone in one process on the workers' engine, and the tokenizer."""
    argv = ["worker", "--role", "decode", *FLAGS]
    cfg = engine_config_from_args(build_parser(argv).parse_args(argv), "decode")
    if cfg.torch_dtype is not torch.bfloat16 or not (quant.available() and quant._ext().bf16()):
        pytest.skip("the default here is not bf16 activations on the AVX-512 BF16 block kernel")
    loaded = load_model(None, cfg.torch_dtype, progress=False, quantization=cfg.quantization)
    tok = EngineTokenizer(loaded.tokenizer)
    prompts = [tok.encode_chat([("user", q)]) for q in QUESTIONS]
    engine = Engine(loaded.config, loaded.weights, cfg, tokenizer=loaded.tokenizer)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.8, seed=SEED, ignore_eos=True)
    try:
        return prompts, [engine.generate([p], params)[0] for p in prompts], loaded.tokenizer
    finally:
        engine.close()


def _together(prompts: list[list[int]], mode: Mode, tokenizer: Any) -> tuple[list[list[int]], int]:
    decode = [spawn_worker("decode", *FLAGS) for _ in range(2 if mode == "migrated" else 1)]
    prefill = [] if mode == "colocated" else [spawn_worker("prefill", *FLAGS)]
    routing = RoutingConfig(mode="disaggregated" if mode == "migrated" else mode)
    sampling = pb.SamplingParams(temperature=0.8, seed=SEED, max_tokens=TOKENS, ignore_eos=True)
    try:

        async def body(stub: Any, router: Any) -> tuple[list[list[int]], int]:
            got: list[list[int]] = [[] for _ in prompts]
            killed: list[WorkerProcess] = []

            async def one(i: int) -> None:
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[i]), sampling=sampling)
                async for r in stub.Generate(req, timeout=300):
                    got[i] += list(r.token_ids)
                    if mode == "migrated" and not killed and sum(map(len, got)) >= 6 * len(prompts):
                        killed.append(next(w for w in decode if stats(w).running_requests > 0))
                        killed[0].kill()  # SIGKILL, mid-stream

            await asyncio.gather(*(one(i) for i in range(len(prompts))))
            return got, int(router.metrics.migrations._value.get())

        got, migrations = asyncio.run(with_router(decode, prefill, tokenizer, body, routing=routing))
        wait_all_blocks_free([w for w in [*decode, *prefill] if w.proc.poll() is None])
        return got, migrations
    finally:
        for w in [*decode, *prefill]:
            w.stop()


@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "auto", "migrated"])
def test_six_seeded_prompts_sent_together_give_each_prompts_text_alone(alone, mode):
    prompts, want, tokenizer = alone
    got, migrations = _together(prompts, mode, tokenizer)
    same = [g == w for g, w in zip(got, want, strict=True)]
    assert all(same), f"{sum(same)} of {len(same)} prompts gave their text alone"
    if mode == "migrated":
        assert migrations >= 1
