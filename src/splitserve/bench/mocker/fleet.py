"""A fleet of mocker workers in one process, each with its own ports (see __init__.py).

Each mocker is a real `Engine` over a one-layer, one-head random model (the same
seeded weights for all, so every mocker's KV layout and fingerprint match and
any prefill mocker may fill any decode mocker's reservation), its runner swapped
for the `ModelledRunner`, started by the workers' own `start_worker`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitserve.bench.mocker.runner import ModelledRunner
from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.engine import Engine
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.plan.costs import CostModel
from splitserve.workers.common.config import WorkerConfig
from splitserve.workers.server import RunningWorker, start_worker

# An idle engine loop wakes this often to poll its KV connector, which also wakes it on news (a
# reservation's lease is checked at these wakes): hundreds of mockers at a real worker's 50 ms took
# 0.21 of a core doing nothing, 0.07 at this
IDLE_WAIT_S = 0.5
VOCAB = 512  # a byte tokenizer's ids and its specials; the tokens a mocker emits are bytes
HEAD_DIM = 8


def mocker_model_config(max_position: int) -> ModelConfig:
    """The model every mocker holds: what its KV cache is shaped by, never run."""
    return tiny_model_config(
        vocab_size=VOCAB,
        hidden_size=HEAD_DIM,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        intermediate_size=2 * HEAD_DIM,
        max_position=max_position,
        name="mocker",
    )


@dataclass(frozen=True)
class MockerSpec:
    """What every mocker of a fleet is: its costs, and the engine limits a real worker would have."""

    costs: CostModel
    costs_what: str  # where the costs come from, for a benchmark's header
    kv_bytes_per_token: float  # the modelled model's KV per token, which the mocker's stands for
    num_blocks: int = 4096  # of 16 tokens: the modelled worker's KV room
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_position: int = 32768
    cluster_token: str | None = None
    host: str = "127.0.0.1"
    stream_interval: int = 1  # a decode mocker's token groups (WorkerConfig.stream_interval)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            num_blocks=self.num_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            use_cuda_graphs=False,
            hybrid_kv_cache=False,
        )


@dataclass
class Fleet:
    spec: MockerSpec
    prefill: list[RunningWorker] = field(default_factory=list)
    decode: list[RunningWorker] = field(default_factory=list)
    kv_scale: float = 1.0  # the modelled KV's bytes over the bytes a mocker moves

    @property
    def workers(self) -> list[RunningWorker]:
        return [*self.prefill, *self.decode]

    def all_blocks_free(self) -> bool:
        """Every mocker's block pool whole (cached blocks count as free: they are evictable)."""
        return all(w.loop.engine.blocks.num_free_blocks == w.loop.engine.blocks.num_blocks for w in self.workers)

    def stop(self, grace_s: float = 0.5) -> None:
        for w in self.workers:
            w.stop(grace_s)


def start_fleet(spec: MockerSpec, prefill: int, decode: int, name: str = "mocker") -> Fleet:
    """`prefill` and `decode` mockers, listening once this returns; stopped as a whole on a failure.
    Sets this process's torch to one thread: a mocker's only tensor work is copying its tiny KV
    blocks, from hundreds of threads at once, and torch's thread pool given a core each would
    spin (OpenMP's waiting workers) against those threads on the cores the fleet has."""
    torch.set_num_threads(1)
    model_cfg = mocker_model_config(spec.max_position)
    weights = random_weights(model_cfg, seed=0)
    fleet = Fleet(spec)
    engine_cfg = spec.engine_config()
    try:
        for role, count, into in (("prefill", prefill, fleet.prefill), ("decode", decode, fleet.decode)):
            for i in range(count):
                engine = Engine(model_cfg, weights, engine_cfg)
                engine.runner = ModelledRunner(spec.costs, model_cfg.num_layers)  # type: ignore[assignment]
                cfg = WorkerConfig(
                    role=role,
                    worker_id=f"{name}-{role}-{i}",
                    engine=engine.cfg,
                    host=spec.host,
                    kv_wire_codec="raw",
                    cluster_token=spec.cluster_token,
                    warm_up=False,
                    stream_interval=spec.stream_interval,
                )
                worker = start_worker(cfg, engine)
                worker.loop.idle_wait_s = IDLE_WAIT_S
                into.append(worker)
    except BaseException:
        fleet.stop(0)
        raise
    if fleet.workers:  # every mocker's KV layout is the same model's
        layout = fleet.workers[0].loop.engine.layout
        fleet.kv_scale = spec.kv_bytes_per_token * engine_cfg.block_size / layout.bytes_per_block
    return fleet
