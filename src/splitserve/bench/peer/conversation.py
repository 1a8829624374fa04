"""`splitserve bench conversation`: the multi-turn load that KV tiers are for (issue 21), in one run.

    splitserve bench conversation [--sessions 20 --turns 8 --context-len 1536 --session-rate 0.33 --think-s 10]

Three systems on this machine, one after another, each loaded with the same `bench serve`
conversation sessions (each opens with a document of --context-len tokens of its own, then
--turns user turns; every answer goes back into the next turn's prompt, after --think-s seconds of
the user's pause, during which the session holds only its parked context: without a pause every
session runs at once, the running requests alone outgrow pools a quarter of the working set, and
every system waits for blocks, tiers or not):

- `tier-aware`: two colocated splitserve workers (one per core, as `bench peer` runs them) with a
  host and a disk tier behind each pool, the router pricing a worker by the seconds until the
  context is in its pool;
- `tier-blind`: the same workers and tiers, the router with --tier-blind-routing;
- `vllm`: vLLM's CPU build on both cores, prefix caching on, its KV in its pool only.

The pools are sized to --pool-fraction of the working set (the tokens of every session's last
prompt and answer): the two workers' pools together, and vLLM's one, hold that much; each host
tier a --host-fraction of it, each disk tier all of it. Printed: goodput at the stated objective,
the ratios the issue asks for (tier-aware over tier-blind goodput; host-tier and disk-tier hits'
TTFT over recomputing's), and each request's TTFT by where its prefix came from
(bench/peer/prefix_sources.py).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any, NamedTuple

from splitserve.bench.peer import prefix_sources as ps
from splitserve.bench.peer.main import DEFAULT_CACHE, SERVED_MODEL_NAME, Load, parse_cores, run_load, warmup
from splitserve.bench.peer.servers import LaunchContext, ServerError, SystemSpec, describe_cores, start_system

VLLM_BLOCK = 128  # vLLM's CPU block size (its default there)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=20)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--context-len", type=int, default=1536, help="tokens of each session's opening document")
    p.add_argument("--output-len", type=int, default=64, help="tokens of each answer")
    p.add_argument("--session-rate", type=float, default=0.33, help="sessions started per second (Poisson)")
    p.add_argument(
        "--think-s",
        type=float,
        default=10.0,
        help="the user's pause after each answer: sessions park their context between turns",
    )
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:100"], metavar="NAME:MS")
    p.add_argument("--pool-fraction", type=float, default=0.25, help="the pools' share of the working set")
    p.add_argument("--host-fraction", type=float, default=0.125, help="each host tier's share of it")
    p.add_argument("--dtype", default="bfloat16", help="model and KV dtype of both systems")
    p.add_argument("--block-size", type=int, default=16, help="splitserve's KV block")
    p.add_argument("--systems", default="tier-aware,tier-blind,vllm", help="comma list, run in this order")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--out", default=os.path.join(os.path.dirname(DEFAULT_CACHE), "conversation"), help="JSON, logs")
    p.add_argument("--result", default=os.path.join("bench", "results", "conversation-cpu.txt"))
    p.add_argument("--vllm-venv", default=None, help="default: ~/.cache/splitserve/peer/vllm-venv")
    p.add_argument("--load-timeout", type=float, default=3600.0)


class Sizing(NamedTuple):
    working_set_tokens: int
    pool_tokens: int  # the system's pool: both splitserve workers' together, vLLM's one
    worker_blocks: int  # one splitserve worker's pool
    host_mib: int  # one worker's host tier
    disk_mib: int
    vllm_blocks: int
    longest_prompt: int


def kv_bytes_per_token(dtype: str) -> int:
    from splitserve.engine.weights import load_model

    m = load_model(None, progress=False).config
    return m.num_layers * 2 * m.num_kv_heads * m.head_dim * (4 if dtype == "float32" else 2)


def size(a: argparse.Namespace, per_token: int) -> Sizing:
    """The working set from the sessions bench serve will send (its tokenizer, its seed): each
    session's last prompt and answer; a few tokens a message for the chat template."""
    from splitserve.bench.serve.datasets import conversation_sessions
    from splitserve.bench.serve.tokenizer import load_text_tokenizer

    tok = load_text_tokenizer(None)
    sessions = conversation_sessions(
        tok, a.sessions, a.turns, a.output_len, random.Random(a.seed), context_len=a.context_len
    )
    template = 8  # tokens a message: role markers and newlines
    last = [sum(t.prompt_len + template for t in s.turns) + a.turns * (a.output_len + template) for s in sessions]
    ws = sum(last) + a.sessions * a.context_len
    pool = int(a.pool_fraction * ws)
    longest = max(last) + a.context_len
    worker_blocks = max(math.ceil(pool / 2 / a.block_size), 2 * math.ceil(longest / a.block_size))
    mib = 1 << 20
    return Sizing(
        ws,
        pool,
        worker_blocks,
        max(1, int(a.host_fraction * ws * per_token / mib)),
        max(1, math.ceil(ws * per_token / mib)),
        max(math.ceil(pool / VLLM_BLOCK), 2 * math.ceil(longest / VLLM_BLOCK)),
        longest,
    )


def specs(a: argparse.Namespace, s: Sizing, disk_root: str) -> dict[str, SystemSpec]:
    def workers(label: str) -> tuple[str, ...]:
        return (
            *("--dtype", a.dtype, "--block-size", str(a.block_size), "--num-blocks", str(s.worker_blocks)),
            *("--kv-host-tier-mib", str(s.host_mib), "--kv-disk-tier-mib", str(s.disk_mib)),
            *("--kv-disk-tier-dir", os.path.join(disk_root, label)),
        )

    vllm: tuple[str, ...] = ("--dtype", a.dtype, "--enable-prefix-caching", "--enable-prompt-tokens-details")
    vllm += ("--num-gpu-blocks-override", str(s.vllm_blocks), "--block-size", str(VLLM_BLOCK))
    return {
        "tier-aware": SystemSpec("colocated", workers("tier-aware")),
        "tier-blind": SystemSpec("colocated", workers("tier-blind"), ("--tier-blind-routing",)),
        "vllm": SystemSpec("vllm", vllm),
    }


def load_for(a: argparse.Namespace, label: str) -> Load:
    flags = (
        *("--dataset", "conversation", "--num-prompts", str(a.sessions), "--turns", str(a.turns)),
        *("--conversation-context-len", str(a.context_len), "--conversation-output-len", str(a.output_len)),
        *("--conversation-think-s", f"{a.think_s:g}"),
        *("--request-rate", f"{a.session_rate:g}", "--ignore-eos", "--seed", str(a.seed), "--goodput", *a.goodput),
    )
    return Load(f"conversation-{label}", flags, a.load_timeout)


def run_one(label: str, spec: SystemSpec, ctx: LaunchContext, a: argparse.Namespace, out: str) -> dict[str, Any]:
    """Start the system, warm it up, run the load, stop it; the records' prefix sources joined in."""
    ctx = replace(ctx, workdir=os.path.join(out, "logs", label))
    os.makedirs(ctx.workdir, exist_ok=True)
    print(f"[{label}] starting: {spec.name} {' '.join(spec.flags)} {' '.join(spec.router_flags)}", flush=True)
    try:
        system = start_system(spec, ctx)
    except ServerError as e:
        return {"error": f"start: {e}"}
    with system:
        print(f"[{label}] serving after {system.start_s:.0f}s; {describe_cores(spec.name, system.cores)}", flush=True)
        warmup(system.base_url, ctx.served_model_name)
        since = time.time()
        res = run_load(system, load_for(a, label), ctx, out, "openai-chat")
    if "error" in res:
        return res
    records = res["runs"][0]["requests"]
    if spec.is_vllm:
        res["sources"], res["unjoined"], res["ambiguous"] = (
            ps.mark_first_turns(records, ps.cached_sources(records)),
            0,
            0,
        )
        return res
    notes: list[ps.PrefixNote] = []
    for name in os.listdir(ctx.workdir):
        if name.endswith(".log") and "decode" in name:
            with open(os.path.join(ctx.workdir, name), encoding="utf-8", errors="replace") as f:
                notes += ps.parse_notes(f, since)
    joined = ps.join(records, sorted(notes))
    res["sources"] = ps.mark_first_turns(records, joined.sources)
    res["unjoined"], res["ambiguous"] = joined.unjoined, joined.ambiguous
    return res


class Report:
    """Lines printed as they come and kept for the result file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def header(argv: list[str], out: Report) -> None:
    from splitserve.measure.hw import code_version, cpu_flags, load_average

    now = datetime.datetime.now(datetime.UTC)
    command = "splitserve bench conversation " + " ".join(shlex.quote(x) for x in argv)
    out(f"# {command.strip()}   [code {code_version()}; {now:%Y-%m-%d %H:%M} UTC; CPU flags: {cpu_flags()}]")
    out(f"machine: {os.cpu_count()} CPUs; load average at the start {load_average()}")


def run(a: argparse.Namespace) -> int:
    if a.sessions < 1 or a.turns < 1 or not 0 < a.pool_fraction <= 1 or not 0 < a.host_fraction <= 1:
        print("bench conversation: --sessions, --turns >= 1; fractions in (0, 1]", file=sys.stderr)
        return 2
    labels = [x.strip() for x in a.systems.split(",") if x.strip()]
    report = Report()
    header(sys.argv[3:] if sys.argv[1:3] == ["bench", "conversation"] else sys.argv[1:], report)
    per_token = kv_bytes_per_token(a.dtype)
    s = size(a, per_token)
    describe_sizing(a, s, per_token, report)
    ctx = launch_context(a, labels)
    out = os.path.abspath(a.out)
    disk_root = tempfile.mkdtemp(prefix="splitserve-conversation-")
    systems = specs(a, s, disk_root)
    unknown = [x for x in labels if x not in systems]
    if unknown:
        print(f"bench conversation: unknown system(s) {unknown}; expected {list(systems)}", file=sys.stderr)
        return 2
    try:
        results = {label: run_one(label, systems[label], ctx, a, out) for label in labels}
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)
    from splitserve.bench.peer.conversation_report import summarize

    summarize(results, a, report)
    os.makedirs(os.path.dirname(os.path.abspath(a.result)), exist_ok=True)
    with open(a.result, "w", encoding="utf-8") as f:
        f.write("\n".join(report.lines) + "\n")
    print(f"wrote {a.result}")
    return 0 if all("error" not in r for r in results.values()) else 1


def describe_sizing(a: argparse.Namespace, s: Sizing, per_token: int, out: Report) -> None:
    mib = per_token * s.working_set_tokens / 2**20
    out(
        f"load: {a.sessions} sessions of {a.turns} turns, each opening with a {a.context_len}-token document of its "
        f"own, {a.output_len}-token answers, {a.think_s:g} s of user think time after each answer, sessions started "
        f"at {a.session_rate:g}/s (Poisson), seed {a.seed}; "
        f"goodput objective {' '.join(a.goodput)} (ms)"
    )
    out(
        f"working set {s.working_set_tokens} tokens ({mib:.0f} MiB of {a.dtype} KV); pools {a.pool_fraction:g} of "
        f"it: splitserve 2 workers x {s.worker_blocks} blocks of {a.block_size}, vLLM {s.vllm_blocks} blocks of "
        f"{VLLM_BLOCK} (KV in its pool only); per splitserve worker a host tier of {s.host_mib} MiB and a disk tier "
        f"of {s.disk_mib} MiB; longest prompt + answer {s.longest_prompt} tokens"
    )


def launch_context(a: argparse.Namespace, labels: list[str]) -> LaunchContext:
    from splitserve.bench.peer.hf_export import export_hf_dir
    from splitserve.bench.peer.vllm_env import DEFAULT_VENV, VllmEnvSpec, ensure_vllm_env

    model_dir = os.path.join(DEFAULT_CACHE, "model")
    export_hf_dir(None, model_dir)
    python = ""
    if "vllm" in labels:
        python = ensure_vllm_env(VllmEnvSpec(venv=a.vllm_venv or DEFAULT_VENV), True)
    return LaunchContext(
        model_dir=model_dir,
        served_model_name=SERVED_MODEL_NAME,
        workdir=os.path.abspath(a.out),
        vllm_python=python,
        cores=parse_cores(None),
    )
