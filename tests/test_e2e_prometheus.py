"""A real Prometheus (Debian's package, installed by `make test-tools`) scraping a running
cluster: the router's /metrics on its HTTP port and a worker process's own endpoint. Through
Prometheus's HTTP API the test reads both targets' health and TTFT quantiles, as an operator's
dashboard would."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from splitserve.engine.weights import load_model
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import Listeners, RoutingConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.workers.launch import spawn_worker
from tests.e2e_helpers.cluster import FLAGS, free_port, with_router

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    assert found, "prometheus is not installed: `make test-tools` installs Debian's package"
    return found


async def query(s: aiohttp.ClientSession, base: str, promql: str) -> list[dict[str, Any]]:
    async with s.get(f"{base}/api/v1/query", params={"query": promql}) as r:
        body = await r.json()
    assert body["status"] == "success", body
    return list(body["data"]["result"])


async def until(fn: Any, what: str, timeout_s: float = 60.0) -> Any:
    end = time.monotonic() + timeout_s
    while True:
        got = await fn()
        if got:
            return got
        assert time.monotonic() < end, f"Prometheus never showed {what}"
        await asyncio.sleep(0.5)  # Prometheus scrapes every second: nothing to wait on but its next scrape


def test_prometheus_scrapes_router_and_worker_and_reads_ttft_quantiles(tmp_path: Path) -> None:
    binary = prometheus_binary()
    model = load_model(None, torch.float32, progress=False)
    d = spawn_worker("decode", *FLAGS)
    worker_metrics = re.search(r"metrics (\S+:\d+)", d.log())
    if worker_metrics is None:
        d.stop()
        pytest.fail(f"the worker's ready line names no metrics endpoint: {d.log()[-2000:]}")
    ids = EngineTokenizer(model.tokenizer).encode_chat([("user", "Say hello.")])
    prom_port = free_port()
    base = f"http://127.0.0.1:{prom_port}"

    async def body(stub: Any, router: Any) -> None:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - job_name: router\n    static_configs: [{{targets: ['127.0.0.1:{router.http_port}']}}]\n"
            f"  - job_name: workers\n    honor_labels: true\n"
            f"    static_configs: [{{targets: ['{worker_metrics.group(1)}']}}]\n"
        )
        prom = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "prometheus.log").open("w"),
        )
        try:
            for i in range(6):
                req = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=ids + [i]),
                    sampling=pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                )
                [r async for r in stub.Generate(req, timeout=60)]
            async with aiohttp.ClientSession() as s:

                async def targets_up() -> list[str] | None:
                    try:
                        async with s.get(f"{base}/api/v1/targets") as r:
                            active = (await r.json())["data"]["activeTargets"]
                    except aiohttp.ClientError:
                        return None  # not listening yet
                    ups = sorted(t["labels"]["job"] for t in active if t["health"] == "up")
                    return ups if ups == ["router", "workers"] else None

                assert await until(targets_up, "both targets up") == ["router", "workers"]

                async def quantile(metric: str, selector: str = "") -> float | None:
                    promql = f"histogram_quantile(0.9, sum by (le) ({metric}_bucket{selector}))"
                    result = await query(s, base, promql)
                    v = float(result[0]["value"][1]) if result else float("nan")
                    return v if v == v and v > 0 else None  # NaN until a scrape has the requests

                router_ttft = await until(lambda: quantile("splitserve_router_ttft_seconds"), "router TTFT")
                engine_ttft = await until(
                    lambda: quantile("splitserve:time_to_first_token_seconds", '{role="decode"}'), "the engine's TTFT"
                )
                # the router's series under the workers' names, as the client saw the requests
                client_ttft = await until(
                    lambda: quantile("splitserve:time_to_first_token_seconds", '{role="router"}'), "the client's TTFT"
                )
                client_count = await query(s, base, 'sum(splitserve:time_to_first_token_seconds_count{role="router"})')
                count = await query(s, base, 'sum(splitserve:generation_tokens_total{role!="router"})')
                print(f"Prometheus: TTFT p90 router {router_ttft:.3f} s, engine {engine_ttft:.3f} s")
                assert 0 < engine_ttft <= router_ttft + 0.5  # the engine's TTFT is inside the router's
                assert float(count[0]["value"][1]) >= 6 * 8
                assert float(client_count[0]["value"][1]) >= 1 and 0 < engine_ttft <= client_ttft + 0.5
        finally:
            prom.terminate()
            prom.wait(30)

    try:
        asyncio.run(
            with_router(
                [d],
                [],
                model.tokenizer,
                body,
                routing=RoutingConfig(mode="colocated"),
                listeners=Listeners(http_port=0),
            )
        )
    finally:
        d.stop()
