"""`splitserve bench serve`: load a running server and report what its users see.

    splitserve bench serve --backend openai-chat --base-url http://127.0.0.1:8000 \\
        --dataset sharegpt --num-prompts 200 --request-rate 1,2,4,inf --goodput ttft:500 tpot:100 \\
        --label splitserve --json out.json --plot charts/

Each request rate is one run (a sweep runs them in turn on the same prompts).
The figures are vLLM's (`vllm bench serve`): throughput, TTFT, TPOT, ITL,
E2EL and goodput; the burst dataset adds the steady streams' ITL in bursts
over the quiet spells.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

from splitserve.bench.serve import config as flags
from splitserve.bench.serve.arrivals import arrival_offsets
from splitserve.bench.serve.backends import open_backend
from splitserve.bench.serve.burst import run_bursts
from splitserve.bench.serve.config import BenchConfig, DatasetConfig
from splitserve.bench.serve.datasets import (
    BurstPlan,
    Session,
    TextTokenizer,
    burst_plan,
    conversation_sessions,
    prefix_sessions,
    random_sessions,
    sharegpt_sessions,
)
from splitserve.bench.serve.driver import Clock, run_load
from splitserve.bench.serve.progress import Progress
from splitserve.bench.serve.report import format_run
from splitserve.bench.serve.tokenizer import load_text_tokenizer
from splitserve.measure.metrics import burst_summary, summarize
from splitserve.measure.results import BenchResult, RunResult, json_safe, save_result

SECRET_ARGS = ("api_key",)  # never written into the result file


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_arguments(p)


def run(a: argparse.Namespace) -> int:
    try:
        cfg = flags.config_from_args(a)
    except ValueError as e:
        print(f"bench serve: {e}", file=sys.stderr)
        return 2
    tok = load_text_tokenizer(a.tokenizer)
    workload = build_workload(cfg.data, tok)
    clock = Clock(time.perf_counter, asyncio.sleep)
    runs = asyncio.run(run_all(cfg, workload, clock))
    for r in runs:
        print(format_run(r, cfg.label), flush=True)
    args = {k: json_safe(v) for k, v in vars(a).items() if not k.startswith("_") and k not in SECRET_ARGS}
    result = BenchResult(
        label=cfg.label,
        backend=cfg.backend.kind,
        base_url=cfg.backend.base_url,
        dataset=cfg.data.name,
        args=args,
        runs=runs,
    )
    if cfg.json_path:
        save_result(result, cfg.json_path)
        print(f"bench serve: results in {cfg.json_path}")
    if cfg.plot_dir:
        from splitserve.measure.plots import plot_run, plot_sweep

        d = result.to_dict()
        paths = [plot_run(run, cfg.plot_dir, cfg.label) for run in d["runs"]]
        if cfg.slos:
            paths.append(plot_sweep([d], cfg.plot_dir))
        print(f"bench serve: charts: {', '.join(paths)}")
    return 0 if all(r.completed for r in runs) else 1


def build_workload(d: DatasetConfig, tok: TextTokenizer) -> list[Session] | BurstPlan:
    rng = random.Random(d.seed)
    if d.name == "sharegpt":
        return sharegpt_sessions(tok, d.num_prompts, rng, d.sharegpt_output_len, d.sharegpt_max_input_len)
    if d.name == "random":
        return random_sessions(tok, d.num_prompts, d.random_input_len, d.random_output_len, d.random_range_ratio, rng)
    if d.name == "prefix":
        return prefix_sessions(
            tok, d.num_prompts, d.prefix_groups, d.prefix_len, d.suffix_len, d.random_output_len, rng
        )
    if d.name == "conversation":
        return conversation_sessions(
            tok,
            d.num_prompts,
            d.turns,
            d.conversation_output_len,
            rng,
            context_len=d.conversation_context_len,
            think_s=d.conversation_think_s,
        )
    return burst_plan(
        tok,
        d.burst_steady_streams,
        d.burst_steady_input_len,
        d.burst_steady_output_len,
        d.burst_count,
        d.burst_size,
        d.burst_input_len,
        d.burst_output_len,
        rng,
    )


async def run_all(cfg: BenchConfig, workload: list[Session] | BurstPlan, clock: Clock) -> list[RunResult]:
    backend = await open_backend(cfg.backend, clock.now)
    try:
        if isinstance(workload, BurstPlan):
            # the burst scenario has its own schedule: --request-rate and --max-concurrency do not apply
            progress = Progress(0, f"{cfg.label} burst", cfg.progress)
            got, windows = await run_bursts(backend, workload, cfg.data.burst_interval_s, clock, progress)
            progress.close()
            summary = burst_summary(got.records, windows)
            return [summarize(got.records, got.duration_s, float("inf"), 1.0, None, cfg.slos, summary)]
        rng = random.Random(cfg.data.seed + 1)  # arrivals: a stream of their own, apart from the prompts'
        runs = []
        for rate in cfg.rates:
            total = sum(len(s.turns) for s in workload)
            progress = Progress(total, f"{cfg.label} rate {rate:g}", cfg.progress)
            offsets = arrival_offsets(len(workload), rate, cfg.burstiness, rng)
            got = await run_load(backend, workload, offsets, cfg.max_concurrency, clock, progress)
            progress.close()
            runs.append(summarize(got.records, got.duration_s, rate, cfg.burstiness, cfg.max_concurrency, cfg.slos))
        return runs
    finally:
        await backend.close()
