"""`splitserve bench transfer --codec --netns`: the KV wire codec through the real serving path, over a
real link throttled with `tc` (bench/transfer_link.py), raw against auto against int8 side by side.

Processes, as a deployment has them: prefill workers (`python -m splitserve.workers --role prefill`,
one per codec mode, since `--kv-wire-codec` is a process's flag) inside a network namespace whose
veth link is shaped to `--netns-gbps`; one decode worker outside it, listening on the link's
address; and, for the loopback figures, prefill workers outside the namespace (raw and auto), whose
KV reaches the same decode worker over loopback. A router per prefill worker in this process
(`mode="disaggregated"`: every prompt prefilled remotely), the client this process too, over real
gRPC; the KV over the workers' own kv_transfer TCP. The prefill workers share one core, the decode
worker has the other; each prompt is unique (random token ids: no prefix-cache hit anywhere).

Per link (loopback first, then each rate, the same namespace reshaped) and codec: `--warm-up`
untimed prompts (auto measures the link on them: its first stream goes raw), then `--prompts`
rounds, each one prompt per codec in rotating order, so that the machine's load drifts over all
codecs alike. Figures, medians: TTFT (the client's send to its first token: the prefill, and
whatever of the transfer it could not hide), the first to second token gap (the KV's tail, Done,
the decode worker's first step), the wire bytes per prompt and the codec used (the prefill
worker's own counters). Before each link's rows, its raw TCP throughput measured through the
link (one stream from inside the namespace), so the shaping is checked, not assumed.

A CPU prefill of 2K tokens takes seconds, and the transfer runs while it computes (layer by
layer, chunk by chunk): the link only shows in TTFT where moving the KV takes longer than
computing it: 45 MiB of bfloat16 KV for 2K tokens is 0.39 s at 1 Gb/s against a prefill of
about 6 s on one shared core. The default rates, 1, 0.1 and 0.03 Gb/s, put the link on both sides
of that line (0.03 Gb/s: 13 s raw, 7 s as int8).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from splitserve.bench.transfer_link import LinkError, ThrottledLink, net_admin_refusal
from splitserve.workers.launch import WorkerProcess

TOKEN_ENV = "SPLITSERVE_CLUSTER_TOKEN"
THROTTLED_MODES = ("raw", "auto", "int8")
LOOPBACK_MODES = ("raw", "auto")
TARGET_CUT = 0.30  # issue 21: TTFT at 1 Gb/s at least 30% lower with the codec on


# ---- worker processes, inside or outside the namespace ----------------------------------


@dataclass
class Starting:
    """A worker process on its way up: `wait_ready` turns it into a WorkerProcess."""

    role: str
    proc: subprocess.Popen[bytes]
    ready_file: str
    log_path: str


def spawn(
    role: str, flags: list[str], workdir: str, name: str, prefix: list[str], core: int | None, token: str
) -> Starting:
    """Start one worker (`prefix`: e.g. `ip netns exec NS`), in its own process group, with the
    cluster token in its environment (a worker on an address other than loopback requires one)."""
    ready = os.path.join(workdir, f"{name}.ready")
    log_path = os.path.join(workdir, f"{name}.log")
    cmd = [sys.executable, "-m", "splitserve.workers", "--role", role, "--ready-file", ready, *flags]
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*prefix, *cmd],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, TOKEN_ENV: token},
        )
    return Starting(role, proc, ready, log_path)


def wait_ready(starting: list[Starting], timeout_s: float) -> list[WorkerProcess]:
    """Until every worker wrote its ready file; raises if one died or the time ran out (the caller
    stops them all)."""
    deadline = time.monotonic() + timeout_s
    ready: dict[int, WorkerProcess] = {}
    while len(ready) < len(starting):
        for i, s in enumerate(starting):
            if i in ready:
                continue
            if os.path.exists(s.ready_file):
                with open(s.ready_file) as f:
                    grpc_address, kv = f.read().split()
                ready[i] = WorkerProcess(s.role, s.proc, grpc_address, None if kv == "-" else kv, s.log_path)
            elif s.proc.poll() is not None or time.monotonic() > deadline:
                with open(s.log_path, errors="replace") as f:
                    raise RuntimeError(f"{s.role} worker did not start ({s.log_path}):\n{f.read()[-3000:]}")
        time.sleep(0.1)
    return [ready[i] for i in range(len(starting))]


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """TERM each process group, then KILL what is left (they run in their own sessions)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def metrics_address(w: WorkerProcess) -> str:
    """The worker's Prometheus endpoint, from the ready line in its log."""
    found = re.search(r"worker ready: .* metrics (\S+)", w.log())
    if found is None or found.group(1) == "-":
        raise RuntimeError(f"{w.role} worker has no metrics endpoint in its log ({w.log_path})")
    return found.group(1)


def wire_bytes(address: str) -> dict[str, float]:
    """The sender's KV payload bytes so far, by wire codec (splitserve_kv_wire_bytes_total)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^splitserve_kv_wire_bytes_total\{([^}]*)\} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("side") == "sender":
            out[labels["codec"]] = out.get(labels["codec"], 0.0) + float(m.group(2))
    return out


# ---- the link's own throughput ------------------------------------------------------------

_PROBE_SENDER = (
    "import socket,sys\n"
    "s=socket.create_connection((sys.argv[1],int(sys.argv[2])))\n"
    "b=bytes(1<<20)\n"
    "for _ in range(int(sys.argv[3])): s.sendall(b)\n"
    "s.shutdown(socket.SHUT_WR); s.recv(1)\n"
)


def probe_gbps(link: ThrottledLink, mib: int) -> float:
    """Raw TCP throughput from inside the namespace to this side, one stream of `mib` MiB, Gb/s
    (from the first byte received to the last: the connection's set-up excluded)."""
    with socket.create_server((link.outer_host, 0)) as srv:
        port = srv.getsockname()[1]
        cmd = [*link.exec_prefix, sys.executable, "-c", _PROBE_SENDER, link.outer_host, str(port), str(mib)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        srv.settimeout(30)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(120)
            buf = bytearray(1 << 20)
            got, t0 = conn.recv_into(buf), time.perf_counter()
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                got += n
            elapsed = time.perf_counter() - t0
            conn.sendall(b"x")
        proc.wait(30)
    return got * 8 / 1e9 / max(elapsed, 1e-9)


# ---- the run ---------------------------------------------------------------------------------


@dataclass
class Path:
    """One prefill worker's way to the decode worker: a codec mode over the namespace's link or
    loopback, with its own router."""

    mode: str  # its --kv-wire-codec
    worker: WorkerProcess
    metrics: str = ""  # its Prometheus endpoint
    stub: Any = None  # its router's GenerationStub


@dataclass
class Figures:
    """One link and codec mode's timed prompts."""

    ttft: list[float] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)  # first -> second token
    wire: dict[str, float] = field(default_factory=dict)  # wire bytes by codec over the timed prompts
    cached_tokens: int = 0  # prefix-cache hits (must stay 0: every prompt is unique)


def _flags(a: argparse.Namespace, host: str, mode: str) -> list[str]:
    model = ["--model", a.model] if a.model else []
    return [
        *model,
        *("--host", host, "--dtype", a.dtype, "--threads", "1", "--num-blocks", str(a.netns_blocks)),
        *("--max-num-batched-tokens", str(a.netns_chunk), "--kv-wire-codec", mode),
    ]


def run(a: argparse.Namespace) -> int:
    refusal = net_admin_refusal()
    if refusal is not None:
        print(f"splitserve bench transfer --netns: {refusal}", file=sys.stderr)
        return 2
    try:
        rates = [float(x) for x in a.netns_gbps.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or min(rates) <= 0:
        print(
            f"splitserve bench transfer --netns: --netns-gbps wants positive rates, got {a.netns_gbps!r}",
            file=sys.stderr,
        )
        return 2
    from splitserve.bench.results_file import with_results

    return with_results(a.out, lambda: _run(a, rates), header=False)  # _header prints its command line


def _run(a: argparse.Namespace, rates: list[float]) -> int:
    from splitserve.bench.cluster import usable_cores
    from splitserve.bench.serving import _kv_layout

    lay = _kv_layout(a.model, a.dtype)
    raw = lay.num_layers * (a.prompt_tokens // lay.block_size) * lay.bytes_per_block
    cores = usable_cores()
    prefill_core, decode_core = (cores[0], cores[1]) if len(cores) >= 2 else (None, None)
    _header(a, rates, lay, raw, prefill_core, decode_core)
    token = secrets.token_hex(16)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with ThrottledLink(rates[0]) as link, tempfile.TemporaryDirectory(prefix="splitserve-netns-") as tmp:
            try:
                starting = _start(a, link, tmp, token, prefill_core, decode_core)
                procs = [s.proc for s in starting]
                t0 = time.monotonic()
                decode, *prefill = wait_ready(starting, 600)
                print(f"{len(starting)} worker processes ready in {time.monotonic() - t0:.0f}s")
                modes = LOOPBACK_MODES + THROTTLED_MODES
                paths = [Path(m, w, metrics_address(w)) for m, w in zip(modes, prefill, strict=True)]
                loop_paths, ns_paths = paths[: len(LOOPBACK_MODES)], paths[len(LOOPBACK_MODES) :]
                results = asyncio.run(_measure(a, link, rates, decode, loop_paths, ns_paths, token))
            finally:
                stop_all(procs)
    except LinkError as e:
        print(f"splitserve bench transfer --netns: {e}", file=sys.stderr)
        return 2
    return _report(a, rates, results, raw)


def _start(
    a: argparse.Namespace, link: ThrottledLink, tmp: str, token: str, pcore: int | None, dcore: int | None
) -> list[Starting]:
    """The decode worker on the link's outer address, the loopback prefill workers beside it, the
    throttled ones inside the namespace; in that order."""
    starting = [spawn("decode", _flags(a, link.outer_host, "raw"), tmp, "decode", [], dcore, token)]
    for m in LOOPBACK_MODES:
        starting.append(spawn("prefill", _flags(a, "127.0.0.1", m), tmp, f"lo-{m}", [], pcore, token))
    for m in THROTTLED_MODES:
        starting.append(spawn("prefill", _flags(a, link.inner_host, m), tmp, f"ns-{m}", link.exec_prefix, pcore, token))
    return starting


Results = dict[tuple[str, str], Figures]  # (link, mode) -> figures
Phase = tuple[str, float | None, list[Path]]  # link label, rate (None: loopback), its paths


async def _measure(
    a: argparse.Namespace,
    link: ThrottledLink,
    rates: list[float],
    decode: WorkerProcess,
    loop_paths: list[Path],
    ns_paths: list[Path],
    token: str,
) -> tuple[Results, dict[str, float]]:
    """Every phase's figures, and each throttled link's probed throughput (Gb/s)."""
    import grpc

    from splitserve.engine.weights import load_tokenizer
    from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg
    from splitserve.router.config import Listeners, RouterConfig, RoutingConfig
    from splitserve.router.engine_tokenizer import EngineTokenizer
    from splitserve.router.server import Router

    tok = EngineTokenizer(load_tokenizer(a.model))
    routers, channels = [], []
    try:
        for p in loop_paths + ns_paths:
            cfg = RouterConfig(
                routing=RoutingConfig(mode="disaggregated"),
                listeners=Listeners(host="127.0.0.1", grpc_port=0, cluster_token=token),
            )
            r = Router(cfg, tok, decode=[decode.grpc_address], prefill=[p.worker.grpc_address])
            routers.append(r)
            port = await r.start(0)
            await r.wait_for_workers(60)
            channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
            p.stub = pbg.GenerationStub(channels[-1])
        phases: list[Phase] = [("loopback", None, loop_paths)]
        phases += [(f"{g:g} Gb/s", g, ns_paths) for g in rates]
        results: Results = {}
        probed: dict[str, float] = {}
        prompts = _Prompts(a.prompt_tokens)
        async with asyncio.timeout(a.netns_timeout_s):
            for label, rate, paths in phases:
                if rate is not None:
                    if rate != link.gbps:
                        link.set_rate(rate)
                    probed[label] = await asyncio.to_thread(probe_gbps, link, a.netns_probe_mib)
                    print(f"{label}: the link's raw TCP throughput, one stream: {probed[label]:.3f} Gb/s", flush=True)
                for mode, fig in (await _phase(a, paths, prompts)).items():
                    results[(label, mode)] = fig
        return results, probed
    finally:
        for ch in channels:
            await ch.close()
        for r in routers:
            await r.stop(0.5)


class _Prompts:
    """Unique prompts of random token ids (no prefix-cache hit on any worker)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rng = random.Random(0)
        self.count = 0

    def take(self) -> tuple[str, list[int]]:
        self.count += 1
        return f"netns-{self.count}", [self.rng.randrange(100, 30000) for _ in range(self.n)]


async def _phase(a: argparse.Namespace, paths: list[Path], prompts: _Prompts) -> dict[str, Figures]:
    """One link's warm-up, then its timed rounds, the codecs in rotating order."""
    from splitserve.bench.serving import _generate

    figs = {p.mode: Figures() for p in paths}
    for p in paths:
        for _ in range(a.warm_up):
            rid, ids = prompts.take()
            await _generate(p.stub, ids, 2, rid, a.netns_timeout_s)
    before = {p.mode: await asyncio.to_thread(wire_bytes, p.metrics) for p in paths}
    for i in range(a.prompts):
        for p in paths[i % len(paths) :] + paths[: i % len(paths)]:
            rid, ids = prompts.take()
            tr = await _generate(p.stub, ids, 2, rid, a.netns_timeout_s)
            times = tr.token_times()
            f = figs[p.mode]
            f.ttft.append(tr.ttft)
            f.gap.append(times[1] - times[0])
            f.cached_tokens += tr.cached_tokens
    for p in paths:
        after = await asyncio.to_thread(wire_bytes, p.metrics)
        figs[p.mode].wire = {c: (v - before[p.mode].get(c, 0.0)) / a.prompts for c, v in after.items()}
    return figs


def _header(
    a: argparse.Namespace, rates: list[float], lay: Any, raw: int, pcore: int | None, dcore: int | None
) -> None:
    import datetime

    from splitserve.measure.hw import code_version, cpu_flags, load_average

    now = datetime.datetime.now(datetime.UTC)
    model = f" --model {a.model}" if a.model else ""
    print(
        f"$ splitserve bench transfer --codec --netns --netns-gbps {a.netns_gbps} --prompt-tokens {a.prompt_tokens} "
        f"--prompts {a.prompts} --warm-up {a.warm_up} --dtype {a.dtype} --netns-chunk {a.netns_chunk}{model}"
        f"   # at {code_version()}, {now:%Y-%m-%dT%H:%MZ}, {os.cpu_count()} CPU cores (flags {cpu_flags()}), "
        f"load average {load_average()} at start"
    )
    cores = f"prefill workers on core {pcore}, decode worker on core {dcore}" if pcore is not None else "unpinned"
    print(
        f"{lay.name}: {lay.num_layers} layers, {raw / 2**20:.1f} MiB of {a.dtype} KV per {a.prompt_tokens}-token "
        f"prompt; worker processes with one torch thread each, {cores}, prefill chunk {a.netns_chunk} tokens; "
        f"the link a veth pair into a network namespace, shaped by tc tbf on both ends"
    )


def _report(a: argparse.Namespace, rates: list[float], got: tuple[Results, dict[str, float]], raw: int) -> int:
    from splitserve.measure.hw import load_average

    results, probed = got
    print(
        f"\nmedians over {a.prompts} prompts per codec after {a.warm_up} warm-up ones, the codecs taking turns; "
        "TTFT: client send -> first token through the router; 1st->2nd: the KV's tail, Done, the first decode step"
    )
    print(
        f"  {'link':10s} {'codec':6s} {'sent as':8s} {'MiB/prompt':>10s} {'x raw':>6s} {'TTFT ms':>8s} "
        f"{'1st->2nd ms':>11s}  TTFT vs raw  (TTFT min..max ms)"
    )
    for (link, mode), f in results.items():
        base = statistics.median(results[(link, "raw")].ttft)
        sent = sum(f.wire.values())
        codecs = "/".join(sorted(c for c, v in f.wire.items() if v > 0)) or "-"
        ttft = statistics.median(f.ttft)
        print(
            f"  {link:10s} {mode:6s} {codecs:8s} {sent / 2**20:10.2f} {sent / raw:6.3f} {ttft * 1e3:8.0f} "
            f"{statistics.median(f.gap) * 1e3:11.0f}  {(ttft / base - 1) * 100:+10.1f}%  "
            f"({min(f.ttft) * 1e3:.0f}..{max(f.ttft) * 1e3:.0f})"
        )
    cached = sum(f.cached_tokens for f in results.values())
    print(f"  (prefix-cache hits in timed prompts: {cached} tokens; every prompt unique)")
    print()
    prefill = statistics.median(results[("loopback", "raw")].ttft)  # the prefill, the link out of the way
    print(f"the prefill itself (loopback, raw): TTFT {prefill * 1e3:.0f} ms; the KV streams out while it computes")
    for label, gbps in probed.items():
        alone = raw * 8 / (gbps * 1e9)
        auto = 1 - statistics.median(results[(label, "auto")].ttft) / statistics.median(results[(label, "raw")].ttft)
        int8 = sum(results[(label, "int8")].wire.values()) / raw
        neck = "link" if alone > prefill else "prefill"
        print(
            f"{label} (probed {gbps:.3f} Gb/s): a prompt's raw KV alone over the link {alone * 1e3:.0f} ms, as int8 "
            f"{alone * int8 * 1e3:.0f} ms, against the prefill's {prefill * 1e3:.0f} ms: the {neck} is the "
            f"bottleneck; auto's TTFT {auto * 100:.1f}% lower than raw"
        )
    return _verdicts(results, rates, raw, load_average)


def _verdicts(results: Results, rates: list[float], raw: int, load: Any) -> int:
    """The issue's three targets, reached or not, with the figure reached."""
    one = next((f"{g:g} Gb/s" for g in rates if g == 1.0), f"{rates[0]:g} Gb/s")
    int8 = sum(results[(one, "int8")].wire.values()) / raw
    cut = 1 - statistics.median(results[(one, "auto")].ttft) / statistics.median(results[(one, "raw")].ttft)
    lo = results[("loopback", "auto")]
    lo_change = statistics.median(lo.ttft) / statistics.median(results[("loopback", "raw")].ttft) - 1
    lo_codecs = {c for c, v in lo.wire.items() if v > 0}
    print(
        f"\nint8 bytes per prompt {int8:.3f}x raw (target <= 0.55: {'ok' if int8 <= 0.55 else 'MISSED'}); "
        f"TTFT at {one} with auto {cut * 100:.1f}% lower than raw (target >= {TARGET_CUT * 100:.0f}%: "
        f"{'ok' if cut >= TARGET_CUT else 'MISSED'}); loopback auto sent {'/'.join(sorted(lo_codecs))} "
        f"({'ok' if lo_codecs == {'raw'} else 'MISSED'}), TTFT {lo_change * 100:+.1f}% against raw"
    )
    print(
        "(a prefill at a GPU's speed, about 2 ms a layer for 2K tokens, hides nothing of a 1 Gb/s link: that model, a "
        "stand-in compute over a paced proxy, is bench/results/transfer-codec.txt)"
    )
    print(f"load average {load()} at the end")
    return 0
