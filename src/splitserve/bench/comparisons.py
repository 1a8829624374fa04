"""What BENCHMARKS.md's first page shows: each comparison of splitserve against its peer
(another system, the hardware's limit, or itself with one feature off), the results files
that measure it, and the figures quoted from the newest of them.

A figure is a pattern over the run's output and a template filled from its named
groups: every number on the page is a piece of a results file, as the run printed it.
A pattern that no longer matches fails the report, naming the file (bench/summary.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    pattern: str  # searched line by line (re.M); named groups fill the template ("" where an optional one is unmatched)
    template: str


@dataclass(frozen=True)
class Comparison:
    what: str
    against: str
    files: str  # a glob in bench/results/: the newest run, by its header's date, is quoted
    figures: tuple[Figure, ...]
    peer: bool = True  # against another system or the hardware; False: splitserve with a feature off


def peer_figure(load: str, metric: str, label: str, skip_columns: int = 0) -> Figure:
    """A row of `bench peer`'s table: the peer's column first, splitserve's last with its ratio
    to the peer's; `skip_columns` other systems between them."""
    skipped = r"\S+ \(\S+\)\s+" * skip_columns
    unit = metric.rsplit(" ", 1)[-1]  # the table's metrics end with theirs: "goodput req/s", "TTFT p50 ms"
    return Figure(
        rf"^{load}\s+rate inf\s+{re.escape(metric)}\s+(?P<peer>\S+)\s+{skipped}(?P<ours>\S+) \((?P<x>[\d.]+x)\)$",
        f"{label} {{x}} ({{ours}} against {{peer}} {unit})",
    )


def engine_figures(model: str, batch: int) -> tuple[Figure, Figure]:
    """`bench engine`'s lines at a batch size: decode tokens/s against transformers', and the
    share of the hardware's limit it reached (the memory roofline; at a batch, the matmul rate)."""
    prefix = rf"^\[{re.escape(model)}\] batch {batch}\s+"
    return (
        Figure(
            prefix + r"decode\s+ours (?P<ours>[\d.]+ tok/s).*\| HF (?P<peer>[\d.]+ tok/s).*\| ratio (?P<x>[\d.]+x)",
            f"batch {batch}: {{x}} ({{ours}} against {{peer}})",
        ),
        Figure(prefix + r"achieved\s+ours (?P<ours>.+?) = (?P<share>\d+% of the \S+ \S+)", f"batch {batch}: {{share}}"),
    )


def transfer_figure(transport: str) -> Figure:
    """`bench transfer`'s throughput line: kv_transfer's GB/s over the raw link's, as the median of pairs."""
    return Figure(
        rf"^\s+{transport}\s+raw\s+(?P<peer>[\d.]+ GB/s)\s+kv_transfer\s+(?P<ours>[\d.]+ GB/s)\s+ratio (?P<x>[\d.]+)",
        f"{transport}: {{x}} of raw ({{ours}} against {{peer}})",
    )


def tenants_figure(phase: str) -> Figure:
    """`bench tenants`' disaggregated table: the quiet tenants' TTFT p99 in a phase over their p99 alone."""
    return Figure(
        rf"^## disaggregated[\s\S]*?^{phase}\s+\|\s+\S+\s+\|\s+\S+\s+\|\s+(?P<x>[\d.]+)", f"{phase}: {{x}}x alone"
    )


_HF_1, _LIMIT_1 = engine_figures("smollm2 bf16", 1)
_HF_32, _LIMIT_32 = engine_figures("smollm2 bf16", 32)
_HF_1_8B, _LIMIT_1_8B = engine_figures("llama-3-8b bf16", 1)
_HF_32_8B, _LIMIT_32_8B = engine_figures("llama-3-8b bf16", 32)


COMPARISONS = (
    Comparison(
        "Serving SmolLM2-135M, both in bfloat16, splitserve in its defaults",
        "vLLM's CPU build",
        "peer-cpu*-default.txt",
        (
            peer_figure("sharegpt", "goodput req/s", "ShareGPT at concurrency 4: goodput"),
            peer_figure("sharegpt", "TTFT p99 ms", "TTFT p99"),
            peer_figure("prefill1", "TTFT p50 ms", "a lone 1,000-token prompt's TTFT"),
        ),
    ),
    Comparison(
        "Serving SmolLM2-135M: splitserve on the Q4_1 GGUF (--quantization auto), vLLM on its bfloat16 export",
        "vLLM's CPU build",
        "peer-vllm-llamacpp-cpu.txt",
        (
            peer_figure("sharegpt", "goodput req/s", "ShareGPT at concurrency 4: goodput", skip_columns=1),
            peer_figure("sharegpt", "TPOT p50 ms", "TPOT p50", skip_columns=1),
        ),
    ),
    Comparison(
        "Serving SmolLM2-135M on the same Q4_1 GGUF, both in their defaults",
        "llama.cpp's llama-server",
        "peer-llamacpp-cpu.txt",
        (
            peer_figure("sharegpt", "goodput req/s", "ShareGPT at concurrency 4: goodput"),
            peer_figure("lone", "TTFT p50 ms", "a lone 1,000-token prompt's TTFT"),
            peer_figure("lone", "TPOT p50 ms", "its TPOT"),
        ),
    ),
    Comparison(
        "Serving SmolLM2-135M's Q4_1 GGUF with no flags on either side (splitserve keeps the blocks)",
        "llama.cpp's llama-server",
        "peer-llamacpp-default.txt",
        (
            peer_figure("sharegpt", "goodput req/s", "ShareGPT at concurrency 4: goodput"),
            peer_figure("sharegpt", "TPOT p50 ms", "TPOT p50"),
            peer_figure("burst", "goodput req/s", "steady streams with prompt bursts: goodput"),
            peer_figure("burst", "burst prompts TTFT p50 ms", "burst prompts' TTFT p50"),
            peer_figure("burst", "ITL p99 ms", "ITL p99"),
            peer_figure("prefill1", "TTFT p50 ms", "a lone ~1,000-token prompt's TTFT"),
        ),
    ),
    Comparison(
        "Serving SmolLM2-135M with no flags on either side (splitserve on the GGUF's blocks)",
        "vLLM's CPU build on its bfloat16 export",
        "peer-vllm-default.txt",
        (
            peer_figure("sharegpt", "goodput req/s", "ShareGPT at concurrency 4: goodput"),
            peer_figure("burst", "burst prompts TTFT p50 ms", "burst prompts' TTFT p50"),
            peer_figure("burst", "ITL p99 ms", "steady streams' ITL p99"),
            peer_figure("prefill1", "TTFT p50 ms", "a lone ~1,000-token prompt's TTFT"),
        ),
    ),
    Comparison(
        "Batch-1 decode of SmolLM2's Q4_1 GGUF with no flags on either side",
        "llama.cpp's llama-server",
        "peer-llamacpp-lone.txt",
        (
            peer_figure("lone", "TPOT p50 ms", "a lone ~1,000-token prompt's 32 tokens: TPOT"),
            peer_figure("lone", "TTFT p50 ms", "its TTFT"),
        ),
    ),
    Comparison(
        "A mixed step's decode rows as a decode step computes them, on by default (--batch-invariant on)",
        "the same cluster with --batch-invariant off, beside it in one run",
        "peer-invariance.txt",
        (
            peer_figure("sharegpt", "goodput req/s", "ShareGPT at concurrency 4: goodput"),
            peer_figure("sharegpt", "TPOT p50 ms", "TPOT p50"),
            peer_figure("burst", "goodput req/s", "steady streams with prompt bursts: goodput"),
        ),
        peer=False,
    ),
    Comparison(
        "The ITL budget: a step beside decode rows capped at two decode steps (--itl-target auto)",
        "the same cluster with --itl-target off, beside it in one run",
        "peer-itl-budget.txt",
        (
            peer_figure("sharegpt", "ITL p99 ms", "ShareGPT at concurrency 4: ITL p99"),
            peer_figure("sharegpt", "goodput req/s", "goodput"),
            peer_figure("sharegpt", "TTFT p50 ms", "TTFT p50"),
            peer_figure("burst", "ITL p99 ms", "steady streams with prompt bursts: ITL p99"),
        ),
        peer=False,
    ),
    Comparison(
        "Batch-1 decode of SmolLM2's Q4_1 file on its blocks",
        "the machine's memory read (torch.sum over 1 GiB, same threads, same run)",
        "quant-cpu.txt",
        (
            Figure(
                r"^batch 1 blocks:\s+(?P<mb>[\d.]+ MB) a token \(weights\) / (?P<ms>[\d.]+ ms) ="
                r"\s+(?P<gbs>[\d.]+ GB/s) =\s+(?P<p>\d+%) of the memory read",
                "{p} ({mb} a token in {ms}: {gbs})",
            ),
            Figure(r"^memory read: (?P<r>[\d.]+ GB/s)", "against {r}"),
            Figure(r"^batch 1 dense :.* =\s+(?P<p>\d+%) of the memory read", "the dense bfloat16 engine's {p} of it"),
        ),
    ),
    Comparison(
        "`splitserve serve --model FILE`, no other flag, 8B shapes (random blocks) on this 24 GB machine",
        "the machine's memory; a 70B shape refused",
        "start-8b-cpu.txt",
        (
            Figure(
                r"^## splitserve serve --model \S*q4_k_m\S*\s+\((?P<gb>[\d.]+ GB) file[\s\S]*?"
                r"^serving after (?P<s>[\d.]+ s)[\s\S]*?PSS peaked at (?P<pss>[\d.]+ GiB)",
                "Q4_K_M ({gb}): serving after {s}, {pss} resident",
            ),
            Figure(
                r"^## splitserve serve --model \S*q8_0\S*\s+\((?P<gb>[\d.]+ GB) file[\s\S]*?"
                r"^serving after (?P<s>[\d.]+ s)[\s\S]*?PSS peaked at (?P<pss>[\d.]+ GiB)",
                "Q8_0 ({gb}): {s}, {pss}",
            ),
            Figure(r"^exit code \d+ after (?P<s>[\d.]+ s)", "70B refused in {s} with the arithmetic"),
        ),
    ),
    Comparison(
        "Serving an 8B shape (random Q4_0 blocks) on a 24 GB machine",
        "llama.cpp's llama-server",
        "peer-llamacpp-8b.txt",
        (
            peer_figure("lone", "TTFT p50 ms", "a lone 1,000-token prompt's TTFT"),
            peer_figure("lone", "TPOT p50 ms", "TPOT"),
        ),
    ),
    Comparison(
        "Serving the 8B shape as Q8_0 blocks (8.5 GB)",
        "llama.cpp's llama-server",
        "peer-llamacpp-8b-q8_0.txt",
        (
            peer_figure("lone", "TTFT p50 ms", "a lone 1,000-token prompt's TTFT"),
            peer_figure("lone", "TPOT p50 ms", "TPOT"),
        ),
    ),
    Comparison(
        "Engine decode, SmolLM2-135M in bfloat16, one thread",
        "Hugging Face transformers",
        "engine-cpu-*.txt",
        (_HF_1, _HF_32),
    ),
    Comparison(
        "Engine decode, SmolLM2-135M in bfloat16, one thread",
        "the CPU's memory read and matmul rate (measured beside it)",
        "engine-cpu-*.txt",
        (_LIMIT_1, _LIMIT_32),
    ),
    Comparison(
        "Engine decode on an H100, the Llama-3-8B shape in bfloat16",
        "Hugging Face transformers",
        "engine-cuda.txt",
        (_HF_1_8B, _HF_32_8B),
    ),
    Comparison(
        "Engine decode and prefill on an H100, the Llama-3-8B shape in bfloat16",
        "the GPU's memory read and matmul rate (measured beside it)",
        "engine-cuda.txt",
        (
            _LIMIT_1_8B,
            _LIMIT_32_8B,
            Figure(
                r"^\[llama-3-8b bf16\] prefill\s+(?P<n>\d+) tokens: .* = (?P<share>\d+% of F\.linear)",
                "a {n}-token prefill: {share} at its shapes",
            ),
        ),
    ),
    Comparison(
        "KV transfer of a 1 GiB cache, per-layer frames, checksummed",
        "the raw link (bare sends between the same processes)",
        "transfer-cpu.txt",
        (transfer_figure("tcp"), transfer_figure("ucx")),
    ),
    Comparison(
        "KV transfer on the H100: TCP and CUDA IPC",
        "the raw copy (TCP sends; a device-to-device copy)",
        "transfer-cuda.txt",
        (transfer_figure("tcp"), transfer_figure("cuda_ipc")),
    ),
    Comparison(
        "The router's added latency, a request through it",
        "the same request sent straight to the workers",
        "router-cpu.txt",
        (
            Figure(
                r"^disaggregated\s+(?P<p50>[\d.]+)\s+(?P<p99>[\d.]+)\s+(?P<first>[\d.]+)",
                "disaggregated: +{p50} ms p50, +{p99} ms p99, +{first} ms to the first token",
            ),
            Figure(r"^bare\s+(?P<p50>[\d.]+)\s", "a bare gRPC proxy: +{p50} ms p50"),
        ),
    ),
    Comparison(
        "The router's CPU, loaded to saturation over mock workers (one router core)",
        "issue 44's targets: 15 us a streamed token, 300 us a request",
        "router-load-cpu.txt",
        (
            Figure(
                r"^router CPU per streamed token (?P<tok>[\d.]+) us \(target [\d.]+\), per request (?P<req>[\d.]+) us",
                "{tok} us a token, {req} us a request",
            ),
            Figure(
                r"^\s+16\s+16\s+(?P<rate>[\d.]+)\s+[\d.]+\s+(?P<p99>[\d.]+)\s",
                "16 tokens out at concurrency 16: {rate} req/s, p99 {p99} ms",
            ),
        ),
    ),
    *(
        Comparison(
            f"The router's CPU in front of {n} decode mocker workers (one router core; mode, prefill pool: header)",
            "issue 44's targets: 15 us a streamed token, 300 us a request",
            f"router-load-mockers-{n}.txt",
            (
                Figure(
                    r"^router CPU per streamed token (?P<tok>[\d.-]+) us \(target [\d.]+\), "
                    r"per request (?P<req>[\d.-]+) us",
                    "{tok} us a token, {req} us a request",
                ),
                Figure(
                    r"^router CPU with no request in flight .*: (?P<idle>[\d.]+ core)", "{idle} with none in flight"
                ),
                Figure(
                    r"^\s+16\s+16\s+(?P<rate>[\d.]+)\s+[\d.]+\s+(?P<p99>[\S]+)\s+.*ms\s+(?P<lost>\d+)\s+(?P<wrong>\d+)$",
                    "16 tokens out at concurrency 16: {rate} req/s, p99 {p99} ms, {lost} lost, {wrong} wrong",
                ),
            ),
        )
        for n in (16, 64, 256)
    ),
    Comparison(
        "The router's CPU in front of 16 decode mocker workers whose streams send tokens in groups of at least 8 "
        "(--stream-interval 8; run just after the 16-worker row that sends each step's tokens)",
        "issue 44's targets: 15 us a streamed token, 300 us a request",
        "router-load-mockers-16-interval8.txt",
        (
            Figure(
                r"^router CPU per streamed token (?P<tok>[\d.-]+) us \(target [\d.]+\), "
                r"per request (?P<req>[\d.-]+) us",
                "{tok} us a token, {req} us a request",
            ),
            Figure(
                r"^\s+64\s+16\s+(?P<rate>[\d.]+)\s+[\d.]+\s+(?P<p99>[\S]+)\s+(?P<cpu>[\d.]+ core)",
                "64 tokens out at concurrency 16: {rate} req/s, router {cpu}",
            ),
        ),
    ),
    *(
        Comparison(
            f"The open-loop rate one router sustains within +5 ms p99 in front of {n} decode mocker workers "
            "(prefill pool: header; one router core, the fleet and the client on the other)",
            "issue 44: the router adds at most 5 ms at p99, against the same load sent straight to the workers",
            f"router-rate-mockers-{n}.txt",
            (
                Figure(
                    r"^sustained within \+5 ms p99: (?P<what>.*?) with .*?, router (?P<r>[\d.]+ core), fleet "
                    r"(?P<f>[\d.]+ core); stopped by (?P<why>.*)$",
                    "{what} (router {r}, fleet {f}); stopped by {why}",
                ),
            ),
        )
        for n in (16, 64, 256)
    ),
    Comparison(
        "Mocker workers against real ones, 1 prefill + 1 decode, one open-loop load",
        "issue 44's target: TTFT and ITL p50 within 15% of the real cluster's",
        "mocker-fidelity-cpu.txt",
        (
            Figure(
                r"^TTFT\s+p50 real\s+(?P<r>[\d.]+ ms)\s+mocker\s+(?P<m>[\d.]+ ms)\s+ratio (?P<x>[\d.]+)",
                "TTFT {x} ({m} against {r})",
            ),
            Figure(
                r"^TPOT\s+p50 real\s+(?P<r>[\d.]+ ms)\s+mocker\s+(?P<m>[\d.]+ ms)\s+ratio (?P<x>[\d.]+)",
                "TPOT {x} ({m} against {r})",
            ),
        ),
    ),
    Comparison(
        "The plan simulator against 16 prefill + 48 decode mocker workers behind the real router, one load",
        "issue 44's target: the simulator's TTFT and ITL p50 within 10% of the mockers'",
        "mocker-sim-cpu.txt",
        (
            Figure(
                r"^TTFT\s+p50 mockers\s+(?P<m>[\d.]+ ms)\s+simulator\s+(?P<s>[\d.]+ ms)\s+ratio (?P<x>[\d.]+)",
                "TTFT {x} ({s} against {m})",
            ),
            Figure(
                r"^TPOT\s+p50 mockers\s+(?P<m>[\d.]+ ms)\s+simulator\s+(?P<s>[\d.]+ ms)\s+ratio (?P<x>[\d.]+)",
                "TPOT {x} ({s} against {m})",
            ),
        ),
    ),
    *(
        Comparison(
            f"{n} router replicas (--routers {n}) against one router, over 4 prefill + 16 decode mocker workers, "
            "one load of shared prefixes",
            "issue 44's targets: prefix-hit rate within 2 points of one router's, at least 0.8 of linear per core",
            "router-replicas-mockers.txt",
            (
                Figure(
                    rf"^{n} replicas: hit rate (?P<hit>[\d.]+%) against one router's (?P<one>[\d.]+%) "
                    r"\((?P<pts>[+-][\d.]+) points",
                    "hit rate {hit} against {one} ({pts} points)",
                ),
                Figure(
                    rf"^{n} replicas: .*on {n} cores (?P<x>[\d.]+)x one router's rate, (?P<lin>[\d.]+) of linear",
                    f"projected {{x}}x one router's rate on {n} cores, {{lin}} of linear (CPU measured on one shared "
                    "core)",
                ),
            ),
        )
        for n in (2, 4)
    ),
    Comparison(
        "A pool grown from a standby worker, by a cold start, and by an idle worker of the other pool switching "
        "role, the real model on local Ray",
        "issue 44's target: standby activation to first token under 1 s",
        "standby-cpu.txt",
        (
            Figure(
                r"^from standby (?P<warm>[\d.]+ s) to the first token .*, (?P<x>\d+)x sooner than a cold start's "
                r"(?P<cold>[\d.]+ s)",
                "{warm} from standby, {cold} cold ({x}x sooner)",
            ),
            Figure(r"^role switch (?P<switch>[\d.]+ s) to the first token", "{switch} by a role switch"),
        ),
    ),
    *(
        Comparison(
            f"Pools under a 1x-4x-1x burst ({what}), {fleet}: fixed pools, the queue policy, the joint controller "
            "with standby",
            "issue 44: SLO attainment against worker-seconds, and the time until the SLOs hold again",
            f"autoscale-{kind}-{name}.txt",
            tuple(
                Figure(
                    rf"^\s+{policy}\s+(?P<met>[\d.]+%)\s+(?P<ws>\d+)\s+(?P<peak>\d+:\d+)\s+(?P<back>never|[\d.]+ s)",
                    f"{policy}: {{met}} met, {{ws}} worker-s, peak {{peak}}, recovered {{back}}",
                )
                for policy in ("fixed", "queue", "joint")
            ),
        )
        for kind, fleet in (
            ("mockers", "the real Router and PoolManager over 128 mocker workers"),
            ("sim", "the pool manager's policies in the plan simulator, 1,056 workers at most"),
        )
        for name, what in (("step", "Poisson arrivals"), ("gamma", "Gamma arrivals, shape 0.5"))
    ),
    Comparison(
        "A tenth of a mocker fleet killed under load (the busiest decode workers)",
        "issue 44's targets: 0 requests lost, 0 wrong tokens, blocks back within 1 s",
        "fleet-loss-mockers.txt",
        (
            Figure(
                r"^requests finished (?P<n>\d+) .*lost (?P<lost>\d+) .*wrong tokens (?P<wrong>\d+) .*blocks back "
                r"(?P<back>[\d.]+ s|not within [\d.]+ s)",
                "{n} finished, {lost} lost, {wrong} wrong, blocks back {back}",
            ),
            Figure(r"^the router moved (?P<m>\d+) streams", "{m} streams migrated"),
        ),
    ),
    Comparison(
        "The pools on a 5-node Ray cluster of this machine, the prefill nodes in a network namespace behind a 1 Gb/s "
        "link: grown from 1+1 to 2+2 from standby under a 10x burst, then a prefill node killed whole under load",
        "issue 44's targets: 0 requests lost, 0 wrong tokens, blocks back within 1 s",
        "ray-nodes-netns.txt",
        (
            Figure(r"^prefill pool at 2 workers: (?P<p>[-\d.]+ s|never)", "prefill at 2 after {p}"),
            Figure(r"^decode pool at 2 workers: (?P<d>[-\d.]+ s|never)", "decode at 2 after {d} (from the burst)"),
            Figure(r"^prefill pool at 2 workers again after (?P<back>[\d.]+ s|never)", "replaced after {back}"),
            Figure(
                r"^lost (?P<lost>\d+) of (?P<n>\d+) requests, (?P<wrong>\d+) wrong .*blocks back (?P<blocks>[\d.]+ s)",
                "{lost} of {n} lost, {wrong} wrong, blocks back {blocks}",
            ),
            Figure(r"^KV across the link: (?P<mib>\d+ MiB)", "{mib} across the link"),
        ),
    ),
    Comparison(
        "The plan simulator's TTFT and ITL",
        "the same loads measured",
        "plan-check*.txt",
        # runs before --repeats print only the first count; the others then quote as ""
        (
            Figure(
                r"^(?P<n>\d+ of \d+) simulated figures within (?P<pct>\d+%)"
                r"(?: of the measured median(?P<rest>, \d+ more within noise, \d+ miss(?:es)?))?",
                "{n} within {pct}{rest}",
            ),
        ),
    ),
    Comparison(
        "Disaggregated serving: TTFT, and the steady streams' ITL while long prompts arrive",
        "colocated (one worker prefills and decodes)",
        "serving-cpu.txt",
        (
            Figure(
                r"^\[ttft\] target: disaggregated / colocated at (?P<n>\d+) tokens (?P<x>[\d.]+x)",
                "TTFT at {n} tokens {x}",
            ),
            Figure(
                r"^\[itl\] target: disaggregated p50 \S+ p99 (?P<d>[\d.]+x) .*; colocated p50 \S+ p99 (?P<c>[\d.]+x)",
                "ITL p99 in bursts over quiet: {d} disaggregated, {c} colocated",
            ),
        ),
        peer=False,
    ),
    Comparison(
        "Quiet tenants' TTFT p99 beside a noisy one, disaggregated",
        "the quiet tenants alone",
        "tenants-cpu.txt",
        (tenants_figure("noisy long"), tenants_figure("noisy many")),
        peer=False,
    ),
    Comparison(
        "The cluster's mutual TLS",
        "plaintext",
        "internal-tls-cpu.txt",
        (
            Figure(r"^plain (?P<p>\S+ GB/s), TLS (?P<t>\S+ GB/s): TLS / plain (?P<x>[\d.]+)", "KV on loopback {x}x"),
            Figure(r"^plain (?P<p>\S+ Gb/s), TLS .*: TLS / plain (?P<x>[\d.]+)", "KV over 1 Gb/s {x}x"),
            Figure(r"^plain (?P<p>\S+ ms), TLS (?P<t>\S+ ms): TLS / plain (?P<x>[\d.]+)", "TTFT {x}x"),
        ),
        peer=False,
    ),
    Comparison(
        "The KV wire codec (auto: int8 where the link is slow) through the serving path",
        "raw KV, on links throttled by tc",
        "transfer-codec-netns.txt",
        (
            Figure(r"^  (?P<link>1 Gb/s)\s+auto\s+int8\s+.*\s(?P<pct>[-+][\d.]+%)\s+\(", "TTFT at {link} {pct}"),
            Figure(r"^  (?P<link>0\.03 Gb/s)\s+auto\s+int8\s+.*\s(?P<pct>[-+][\d.]+%)\s+\(", "at {link} {pct}"),
        ),
        peer=False,
    ),
    Comparison(
        "KV tiers: a 1,536-token prefix loaded from the host or the disk tier",
        "recomputing the prefix",
        "tiers-cpu.txt",
        (Figure(r"^median TTFT over \d+ trials: (?P<all>.*)$", "TTFT {all}"),),
        peer=False,
    ),
    Comparison(
        "Tier-aware routing on a multi-turn load (10 s think time)",
        "tier-blind routing, the same tiers",
        "conversation-cpu-think.txt",
        (Figure(r"^goodput tier-aware / tier-blind: (?P<x>[\d.]+x)", "goodput {x}"),),
        peer=False,
    ),
    Comparison(
        "Speculative decoding by prompt lookup (auto), batch 1",
        "plain decode",
        "spec-cpu.txt",
        (
            Figure(r"^copy, batch 1:[\s\S]*?^\s+auto\s+[\d.]+ tok/s decode, (?P<x>[\d.]+x) off", "copying: {x}"),
            Figure(r"^sharegpt, batch 1:[\s\S]*?^\s+auto\s+[\d.]+ tok/s decode, (?P<x>[\d.]+x) off", "ShareGPT: {x}"),
        ),
        peer=False,
    ),
    Comparison(
        "A JSON schema's decode step",
        "the plain decode step",
        "structured-cpu.txt",
        (Figure(r"^batch (?P<b>8)\s+decode step: .*\| ratio (?P<x>[\d.]+x)", "batch {b}: {x} its time"),),
        peer=False,
    ),
    Comparison(
        "int8 KV cache",
        "bfloat16 KV",
        "kv-dtype-cpu.txt",
        (
            Figure(r"^  int8 against bfloat16: (?P<x>[\d.]+x) the sequences", "{x} the sequences in a pool"),
            Figure(r"^perplexity int8\s+KV:\s+\S+\s+ratio (?P<x>[\d.]+)", "perplexity {x}x"),
        ),
        peer=False,
    ),
    Comparison(
        "A GGUF's Q4_1 blocks computed in place",
        "the file dequantized to bfloat16",
        "quant-cpu.txt",
        (
            Figure(r"^batch  1: .*->  blocks is (?P<x>[\d.]+x) dense", "decode batch 1: {x} the speed"),
            Figure(r"^batch  8: .*->  blocks is (?P<x>[\d.]+x) dense", "batch 8: {x}"),
            Figure(r"^ 32 rows: .*->  blocks is (?P<x>[\d.]+x) dense$", "linear layers at 32 rows: {x}"),
            Figure(r"^ 64 rows: .*->  blocks is (?P<x>[\d.]+x) dense$", "64 rows: {x}"),
            Figure(r"^256 rows: .*->  blocks is (?P<x>[\d.]+x) dense$", "256 rows: {x}"),
            Figure(r"^  1 rows: .*->  blocks is (?P<x>[\d.]+x) dense \(AVX2\)$", "AVX2 path, fp32: 1 row {x}"),
            Figure(r"^ 32 rows: .*->  blocks is (?P<x>[\d.]+x) dense \(AVX2\)$", "32 rows {x}"),
            Figure(r"^blocks holds (?P<x>[\d.]+x) the dense engine's KV", "{x} the KV in 1 GiB"),
        ),
        peer=False,
    ),
    Comparison(
        "The linear kernel's AVX-512 BF16 path, batch 8",
        "its AVX2 path",
        "kernels-isa-cpu.txt",
        (Figure(r"^  batch  8: avx2 (?P<t>[\d.]+ ms) = \S+ GB/s \((?P<x>[\d.]+x)\)", "AVX2 takes {x} its time"),),
        peer=False,
    ),
    Comparison(
        "Prefill attention kernel, queries 512..999, 2 threads",
        "PyTorch's SDPA",
        "prefill-profile-cpu.txt",
        (
            Figure(
                r"^2 thread[\s\S]*?queries 512\.\.999: kernel (?P<k>[\d.]+ ms) .* SDPA (?P<s>[\d.]+ ms) .*: "
                r"(?P<x>[\d.]+x)",
                "{x} ({k} against {s})",
            ),
        ),
        peer=False,
    ),
    Comparison(
        "Sliding-window layers paged per layer (Gemma 3)",
        "every layer paged alike",
        "windows-cpu.txt",
        (Figure(r"^paged against plain: (?P<x>[\d.]+x) the sequences", "{x} the sequences at once"),),
        peer=False,
    ),
)
