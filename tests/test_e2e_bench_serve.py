"""`splitserve bench serve` against a real splitserve: worker processes, and
routers with their HTTP front door and gRPC API, one colocated and one
disaggregated. Short runs through the CLI: every request completes, the token
counts are the ones asked for (EOS ignored), and the charts are written."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from splitserve import cli
from splitserve.bench.serve.tokenizer import load_text_tokenizer
from splitserve.measure.results import load_result
from splitserve.router.config import Listeners, Mode, RouterConfig, RoutingConfig
from splitserve.router.engine_tokenizer import EngineTokenizer
from splitserve.router.server import Router
from splitserve.workers.launch import WorkerProcess, spawn_worker
from tests.e2e_helpers.cluster import FLAGS, wait_all_blocks_free

pytestmark = pytest.mark.e2e

OUTPUT_LEN = 8


@contextmanager
def routers(workers: dict[str, WorkerProcess], tokenizer, modes: list[Mode]) -> Iterator[list[Router]]:
    """Routers (one per mode) in a thread of their own, so that the benchmark's event loop runs in this one."""
    loop = asyncio.new_event_loop()
    started: list[Router] = []
    ready = threading.Event()
    failure: list[BaseException] = []

    async def start() -> None:
        for mode in modes:
            r = Router(
                RouterConfig(
                    routing=RoutingConfig(mode=mode), listeners=Listeners(grpc_port=0, http_port=0, metrics_port=0)
                ),
                EngineTokenizer(tokenizer),
                decode=[workers["decode"].grpc_address],
                prefill=[workers["prefill"].grpc_address],
            )
            await r.start(0)
            await r.wait_for_workers(30)
            started.append(r)

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(start())
        except BaseException as e:  # handed to the test thread, which raises it
            failure.append(e)
        ready.set()
        if not failure:
            loop.run_forever()
        for r in started:
            loop.run_until_complete(r.stop())
        loop.close()

    thread = threading.Thread(target=serve, name="routers", daemon=True)
    thread.start()
    assert ready.wait(60), "the routers did not start"
    try:
        if failure:
            raise failure[0]
        yield started
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


@pytest.fixture(scope="module")
def cluster(tok_dir):
    with ThreadPoolExecutor(2) as pool:  # the two start side by side (model load is most of the test's time)
        started = {role: pool.submit(spawn_worker, role, *FLAGS) for role in ("decode", "prefill")}
    workers = {role: f.result() for role, f in started.items()}
    try:
        with routers(workers, load_text_tokenizer(tok_dir), ["colocated", "disaggregated"]) as (colo, disagg):
            yield {"colocated": colo, "disaggregated": disagg, "workers": list(workers.values())}
    finally:
        for w in workers.values():
            w.stop()


def _check(path, num: int) -> dict:
    raw = load_result(path)
    (run,) = raw["runs"]
    assert (run["completed"], run["failed"]) == (num, 0), [r["error"] for r in run["requests"]]
    assert run["total_output_tokens"] == num * OUTPUT_LEN
    assert all(r["output_len"] == OUTPUT_LEN and r["ttft_s"] > 0 for r in run["requests"])
    assert all(r["prompt_len"] > 0 for r in run["requests"])
    assert run["ttft_ms"]["p50"] > 0 and run["itl_ms"]["p50"] > 0 and run["tpot_ms"]["mean"] > 0
    return run


@pytest.mark.timeout(180)
def test_openai_chat_on_sharegpt_through_the_http_front_door(cluster, tok_dir, tmp_path):
    router = cluster["colocated"]
    out, charts = tmp_path / "r.json", tmp_path / "charts"
    rc = cli.main(
        [
            "bench",
            "serve",
            "--backend",
            "openai-chat",
            "--base-url",
            f"http://127.0.0.1:{router.http_port}",
            "--tokenizer",
            tok_dir,
            "--dataset",
            "sharegpt",
            "--num-prompts",
            "6",
            "--sharegpt-output-len",
            str(OUTPUT_LEN),
            "--sharegpt-max-input-len",
            "128",
            "--ignore-eos",
            "--request-rate",
            "inf",
            "--max-concurrency",
            "3",
            "--goodput",
            "ttft:60000",
            "--label",
            "colocated",
            "--json",
            str(out),
            "--plot",
            str(charts),
            "--no-progress",
        ]
    )
    assert rc == 0
    run = _check(out, 6)
    assert run["slo_attainment"] == 1.0
    assert sorted(p.name for p in charts.iterdir()) == ["colocated-rate-inf-latency-cdf.png", "sweep-goodput.png"]
    assert all((charts / name).read_bytes()[:4] == b"\x89PNG" for name in ("sweep-goodput.png",))
    wait_all_blocks_free(cluster["workers"])


@pytest.mark.timeout(180)
def test_grpc_on_random_prompts_disaggregated(cluster, tok_dir, tmp_path):
    router = cluster["disaggregated"]
    out = tmp_path / "r.json"
    rc = cli.main(
        [
            "bench",
            "serve",
            "--backend",
            "grpc",
            "--grpc-address",
            f"127.0.0.1:{router.port}",
            "--tokenizer",
            tok_dir,
            "--dataset",
            "random",
            "--random-input-len",
            "48",
            "--random-output-len",
            str(OUTPUT_LEN),
            "--num-prompts",
            "6",
            "--ignore-eos",
            "--request-rate",
            "20",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    run = _check(out, 6)
    assert load_result(out)["base_url"] is None
    # the chat template wraps each random prompt, so the server counts more than the dataset did
    assert all(r["prompt_len"] > 40 for r in run["requests"])
    wait_all_blocks_free(cluster["workers"])
