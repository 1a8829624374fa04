"""Mocker workers (bench/mocker/): a step takes its modelled time, the tokens are the checkable
sequence, and a fleet behind the real router serves disaggregated requests with real KV
transfers, prefix hits and every block back."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from splitserve.bench.mocker.cluster import counter_total
from splitserve.bench.mocker.fleet import MockerSpec, start_fleet
from splitserve.bench.mocker.runner import ModelledRunner, step_seconds
from splitserve.bench.mocker.tokens import expected_tokens, mocker_token, prompt_key
from splitserve.engine.block_hash import block_hashes
from splitserve.plan.costs import mixed_step_s
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg
from splitserve.router.config import Listeners, RouterConfig, RoutingConfig
from splitserve.router.server import Router
from splitserve.router.tokenizer import ByteTokenizer
from tests.cli_helpers import splitserve
from tests.router_helpers import until_indexed


class LinearCosts:
    """1 ms a prefill token plus 1 us per cached token; a decode step 2 ms + 1 ms a row + 1 us a
    context token; no transfer tail."""

    def prefill_s(self, tokens: int, cached_tokens: int = 0) -> float:
        return 1e-3 * tokens + 1e-6 * cached_tokens

    def decode_step_s(self, batch: int, context_tokens_total: int) -> float:
        return 2e-3 + 1e-3 * batch + 1e-6 * context_tokens_total

    def transfer_s(self, tokens: int) -> float:
        return 0.0


class _Seq(SimpleNamespace):
    def __len__(self) -> int:
        return len(self.token_ids)


def seq(prompt: int, computed: int, length: int, sample: int = 0, forks: tuple[int, ...] = ()) -> Any:
    return _Seq(
        token_ids=list(range(1, length + 1)),
        num_prompt_tokens=prompt,
        num_computed_tokens=computed,
        num_output_tokens=length - prompt,
        sample_index=sample,
        fork_indices=list(forks),
    )


def batch(*rows: tuple[Any, int]) -> Any:
    return SimpleNamespace(seqs=[s for s, _ in rows], num_new_tokens=[n for _, n in rows], drafts=[])


def test_a_step_is_priced_as_its_prefill_chunks_and_decode_rows():
    costs = LinearCosts()
    # a 100-token chunk after 50 computed, a fresh 20-token prompt, two decode rows at contexts 31 and 61
    b = batch((seq(150, 50, 150), 100), (seq(20, 0, 20), 20), (seq(30, 30, 31), 1), (seq(60, 60, 61), 1))
    # the prefill's cached tokens are the token-weighted mean of what each chunk had computed
    assert step_seconds(costs, b) == pytest.approx(mixed_step_s(costs, 120, 100 * 50 // 120, 2, 31 + 61))
    assert step_seconds(costs, batch((seq(8, 8, 9), 1))) == pytest.approx(costs.decode_step_s(1, 9))
    # a one-token prompt is a prefill, not a decode row
    assert step_seconds(costs, batch((seq(1, 0, 1), 1))) == pytest.approx(costs.prefill_s(1))


def test_the_runner_waits_the_step_and_calls_each_layer_at_its_share():
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    runner = ModelledRunner(LinearCosts(), num_layers=4, clock=lambda: now[0], sleep=sleep)
    heard: list[tuple[int, float]] = []
    b = batch((seq(40, 0, 40), 40))  # 40 ms of prefill, ending at its last token
    out = runner.run(b, lambda layer, seqs, news: heard.append((layer, now[0])))
    assert [layer for layer, _ in heard] == [0, 1, 2, 3]
    assert [t for _, t in heard] == pytest.approx([0.010, 0.020, 0.030, 0.040])
    assert sum(slept) == pytest.approx(0.040) and runner.busy_s == pytest.approx(0.040)
    key = prompt_key(1, 40, 40)
    assert out.indices == [0] and out.token_ids == [mocker_token(key, 0)] and out.sample_indices == [0]


def test_tokens_are_drawn_only_where_a_step_ends_at_the_last_token_and_for_each_fork():
    runner = ModelledRunner(LinearCosts(), 1, clock=lambda: 0.0, sleep=lambda s: None)
    # a chunk that does not reach the end draws nothing; a fresh n=3 request draws for samples 0, 1, 2
    out = runner.run(batch((seq(64, 0, 64), 32), (seq(10, 0, 10, forks=(1, 2)), 10), (seq(5, 7, 8), 1)))
    k10, k5 = prompt_key(1, 10, 10), prompt_key(1, 5, 5)
    assert out.indices == [1, 1, 1, 2]
    assert out.token_ids == [mocker_token(k10, 0, 0), mocker_token(k10, 0, 1), mocker_token(k10, 0, 2)] + [
        mocker_token(k5, 3)
    ]
    assert out.sample_indices == [0, 1, 2, 0]


def test_the_token_sequence_depends_on_the_prompt_position_and_sample_only():
    prompt = [7, 3, 9, 200]
    a = expected_tokens(prompt, 300)
    assert a == expected_tokens(list(prompt), 300)  # a migrated request continues it exactly
    assert len(set(a[:256])) == 256 and all(0 <= t < 256 for t in a)  # every byte before a repeat
    assert a != expected_tokens([8, 3, 9, 200], 300) and a != expected_tokens(prompt, 300, sample=1)


def _spec() -> MockerSpec:
    return MockerSpec(LinearCosts(), "linear costs", kv_bytes_per_token=131072.0, num_blocks=256)


async def _generate(stub: pbg.GenerationStub, prompt: list[int], tokens: int) -> tuple[list[int], pb.Usage]:
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(temperature=0, max_tokens=tokens)
    )
    got: list[int] = []
    usage = pb.Usage()
    async for r in stub.Generate(req, timeout=60):
        got.extend(r.token_ids)
        if r.HasField("usage"):
            usage = r.usage
    return got, usage


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_fleet_behind_the_real_router_serves_checkable_tokens_and_gives_every_block_back():
    fleet = start_fleet(_spec(), prefill=2, decode=3)
    assert fleet.kv_scale == pytest.approx(131072 / 64)  # one layer, one head of 8 float32 dims: 64 B a token
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(40, 200))] for _ in range(12)]

    async def run() -> tuple[list[tuple[list[int], pb.Usage]], tuple[list[int], pb.Usage], float]:
        cfg = RouterConfig(routing=RoutingConfig(mode="disaggregated"), listeners=Listeners(grpc_port=0))
        prefill = [w.grpc_address for w in fleet.prefill]
        router = Router(cfg, ByteTokenizer(), [w.grpc_address for w in fleet.decode], prefill, random.Random(0))
        port = await router.start(0)
        try:
            await router.wait_for_workers(30)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pbg.GenerationStub(ch)
                results = await asyncio.gather(*(_generate(stub, p, 24) for p in prompts))
                # the decode mockers' KV events tell the router where each prompt's blocks are
                await until_indexed(router, block_hashes(prompts[0], 16), on={w.grpc_address for w in fleet.decode})
                hits = counter_total(router.metrics.prefix_hit_blocks)
                again = await _generate(stub, prompts[0], 8)  # its blocks are cached where it decoded
            return results, again, counter_total(router.metrics.prefix_hit_blocks) - hits
        finally:
            await router.stop()

    try:
        results, again, hit_blocks = asyncio.run(run())
        for prompt, (got, usage) in zip(prompts, results, strict=True):
            assert got == expected_tokens(prompt, 24)
            assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 24
        assert again[0] == expected_tokens(prompts[0], 8)
        # the prefix index sent it to the decode mocker holding its blocks (each whole one a hit)
        assert hit_blocks == len(prompts[0]) // 16
        remote = sum(w.loop.engine.runner.busy_s > 0 for w in fleet.prefill)  # type: ignore[attr-defined]
        assert remote >= 1  # prompts were prefilled on the prefill mockers, their KV sent to decode
        deadline = time.monotonic() + 10
        while not fleet.all_blocks_free() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fleet.all_blocks_free()
    finally:
        fleet.stop(0)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_the_command_serves_a_fleet_until_it_is_stopped(tmp_path: Any):
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "bench", "mocker", "--prefill", "1", "--decode", "2"]
        + ["--ready-file", str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        roles = [line.split()[0] for line in ready.read_text().splitlines()]
        assert roles == ["prefill", "decode", "decode"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert "splitserve router --prefill 127.0.0.1:" in out and "--decode 127.0.0.1:" in out


def test_a_fleet_without_decode_mockers_is_refused():
    out = splitserve("bench", "mocker", "--decode", "0", timeout=60)
    assert out.returncode == 2 and "--decode must be at least 1" in out.stderr
