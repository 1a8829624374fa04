"""A CPU harness for the worker-side lifecycle, in the style of vLLM's
connector tests: a tiny model, a prefill engine and a decode engine joined by
the in-memory fake transport (no sockets, no gRPC, no engine loop: the test
steps the engines), and `assert_engine_empty`, the leak check every lifecycle
test ends with.

    pair = EnginePair.tiny()
    remote = pair.reserve("r1", prompt, params)      # decode side: blocks and a ticket
    pair.start_prefill("r1", prompt, params, remote)
    first = pair.prefill_until_done("r1")            # layer frames flow as layers land, then Done
    pair.poll_prefill()                              # the confirmed send frees the held blocks
    outs = pair.poll_decode()                        # the decode engine commits the KV

The polls wait for the connectors' news (their `wake`), each with a deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.context import Context

from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.connector import KVConnector
from splitserve.engine.engine import Engine, RemotePrefill, StepOutput
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.stats import Clock
from splitserve.kv_transfer import KVReceiver, KVSender
from splitserve.workers.decode.connector import ReceiverConnector
from splitserve.workers.prefill.connector import SenderConnector
from tests.kv_transfer_helpers.fake import FakeTransport


def tiny_engine(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    clock: Clock = time.monotonic,
    model_cfg: ModelConfig | None = None,
) -> Engine:
    """`model_cfg`: the tiny model's shape (default `tiny_model_config()`), its weights random with seed 0."""
    cfg = model_cfg or tiny_model_config()
    return Engine(
        cfg,
        random_weights(cfg),
        EngineConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        ),
        clock=clock,
    )


def assert_engine_empty(engine: Engine) -> None:
    """Every block free, every request state empty."""
    s = engine.scheduler
    held = {
        name: len(c)
        for name, c in (
            ("waiting", s.waiting),
            ("running", s.running),
            ("reserved", s.reserved),
            ("held", s.held),
            ("requests", s.requests),
            ("aborting", s.aborting),
        )
        if c
    }
    assert not held, f"engine still holds {held}"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, (
        f"{engine.blocks.num_blocks - engine.blocks.num_free_blocks} blocks not freed"
    )
    assert all(rc == 0 for rc in engine.blocks.ref_counts)


def poll_until(
    engine: Engine,
    connector: KVConnector,
    news: threading.Event,
    done: Callable[[list[StepOutput]], bool],
    timeout_s: float,
) -> list[StepOutput]:
    """An engine loop's poll, woken by the connector's news, until `done(outputs so far)`."""
    outs: list[StepOutput] = []
    deadline = time.monotonic() + timeout_s
    while True:
        news.clear()  # before the poll: news that comes after it wakes the wait below
        outs += engine.apply_transfers(connector.poll())
        if done(outs):
            return outs
        left = deadline - time.monotonic()
        assert left > 0, f"the connector's outcomes did not come in {timeout_s}s (got {outs})"
        news.wait(left)


@dataclass
class EnginePair:
    prefill: Engine
    decode: Engine
    receiver: KVReceiver
    sender: KVSender
    decode_connector: ReceiverConnector
    prefill_connector: SenderConnector
    decode_news: threading.Event = field(default_factory=threading.Event)  # the connectors' wake
    prefill_news: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.decode_connector.wake = self.decode_news.set
        self.prefill_connector.wake = self.prefill_news.set

    @staticmethod
    def tiny(
        decode_max_num_seqs: int = 8,
        num_blocks: int = 64,
        clock: Clock = time.monotonic,
        model_cfg: ModelConfig | None = None,
    ) -> EnginePair:
        """Both engines run the same tiny model (`model_cfg`, as `tiny_engine`'s)."""
        # the prefill engine takes 8 tokens a step, so a prompt's layers go out over several steps
        prefill = tiny_engine(num_blocks, max_num_batched_tokens=8, clock=clock, model_cfg=model_cfg)
        decode = tiny_engine(num_blocks, max_num_seqs=decode_max_num_seqs, clock=clock, model_cfg=model_cfg)
        return EnginePair.of(prefill, decode)

    @staticmethod
    def of(prefill: Engine, decode: Engine) -> EnginePair:
        """Two engines of one model (a real one, say), joined by the in-memory transport."""
        transport = FakeTransport()
        receiver = KVReceiver(decode.kv_cache, transport=transport)
        decode_connector = ReceiverConnector(receiver, cancel_timeout_s=5.0)
        decode.connect(decode_connector)
        sender = KVSender(prefill.kv_cache, transport=transport)
        prefill_connector = SenderConnector(sender, confirm_timeout_s=5.0)
        prefill.connect(prefill_connector)
        return EnginePair(prefill, decode, receiver, sender, decode_connector, prefill_connector)

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()

    def reserve(
        self, rid: str, prompt: list[int], params: SamplingParams, lease_s: float = 30.0, prior: list[int] | None = None
    ) -> RemotePrefill:
        remote = self.decode.reserve(rid, prompt, params, lease_s, prior)
        assert remote is not None, "no seat or blocks on the decode engine"
        return remote

    def start_prefill(
        self, rid: str, prompt: list[int], params: SamplingParams, remote: RemotePrefill, prior: list[int] | None = None
    ) -> bytes:
        """What the prefill service does: open the send, admit prefill-only on its ticket; the ticket.
        `prior`: the output a migrated request had (sample 0's)."""
        ticket: bytes = remote.transfer.ticket
        self.prefill_connector.open(
            rid, remote.transfer, remote.num_cached_tokens // self.prefill.cfg.block_size, Context()
        )
        seq = self.prefill.add_request(rid, prompt, params, prefill_only=True, output_token_ids=prior)
        seq.transfer_id = ticket
        return ticket

    def step_prefill(self) -> list[StepOutput]:
        """One prefill step, after the connector's poll (as the engine loop does)."""
        outs = self.prefill.apply_transfers(self.prefill_connector.poll())
        return outs + (self.prefill.step() if self.prefill.has_work else [])

    def prefill_until_done(self, rid: str) -> int:
        """Step the prefill engine until `rid` has its first token (and its send its Done)."""
        for _ in range(1000):
            for out in self.step_prefill():
                if out.request_id == rid:
                    assert out.finish_reason == "prefill_done", out
                    return out.token_id
        raise AssertionError("prefill never finished")

    def poll_prefill(self, timeout_s: float = 5.0) -> list[StepOutput]:
        """The prefill loop's poll until no request is held (every send confirmed or failed)."""
        return poll_until(
            self.prefill,
            self.prefill_connector,
            self.prefill_news,
            lambda _: not self.prefill.scheduler.held,
            timeout_s,
        )

    def poll_decode(self, timeout_s: float = 5.0, want: int = 1) -> list[StepOutput]:
        """The decode loop's poll, until `want` outputs have come out of it (the receiver's threads report)."""
        return poll_until(
            self.decode, self.decode_connector, self.decode_news, lambda outs: len(outs) >= want, timeout_s
        )

    def decode_to_end(self, rid: str) -> list[int]:
        tokens = []
        while self.decode.has_work:
            for out in self.decode.step():
                if out.request_id == rid and out.token_id >= 0:
                    tokens.append(out.token_id)
        return tokens
