"""The benchmarks' report from bench/results/*.txt: `python -m splitserve.bench.report`.

Each results file is a benchmark's own output, its first line the exact command
that produced it. The report has two halves: BENCHMARKS.md, one page with the newest
figure of each comparison (bench/summary.py), and bench/results/HISTORY.md, every
run's output verbatim under its heading, in the issues' order. Nothing here computes
or rewrites a figure, so no number in either is typed by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

from splitserve.bench.summary import summary

# the repository root: src/splitserve/bench/report.py is three folders below it
ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "bench" / "results"
ORDER = ["engine", "cuda", "transfer", "router", "serving", "peer"]  # the issues' order; others follow by name
TITLES = {
    "engine": "Engine decode against Hugging Face transformers and the hardware limits (issue 2)",
    "transfer": "KV transfer per transport against the raw link, latency, pipelining (issue 3)",
    "router": "Router overhead against mock workers (issue 4)",
    "router-load-cpu": "The router loaded to saturation over mock workers: its CPU per request and per streamed token, "
    "the rate it carries and its latency (issue 44)",
    **{
        f"router-load-mockers-{n}": f"The router over {n} decode mocker workers (the real worker services, steps "
        "timed by the planner's model): its CPU per request and per streamed token, idle and loaded (issue 44)"
        for n in (16, 64, 256)
    },
    "router-load-mockers-16-interval8": "The router over 16 decode mocker workers whose streams send their tokens "
    "in groups of at least 8 (--stream-interval 8) (issue 44)",
    **{
        f"router-rate-mockers-{n}": f"The open-loop rate one router sustains within +5 ms p99 over {n} decode mocker "
        "workers, against the same arrivals sent straight to them (issue 44)"
        for n in (16, 64, 256)
    },
    "mocker-fidelity-cpu": "Mocker workers against real ones on the same load: TTFT and TPOT (issue 44)",
    "mocker-sim-cpu": "The plan simulator against a fleet of 64 mocker workers behind the real router (issue 44)",
    "fleet-loss-mockers": "A tenth of a mocker fleet killed under load: requests lost, tokens wrong, blocks back "
    "(issue 44)",
    "router-replicas-mockers": "Router replicas (--routers N, SO_REUSEPORT) against one router over a mocker fleet: "
    "CPU per request, the spread of connections, prefix-hit rate (issue 44)",
    "standby-cpu": "A pool grown from a warm standby worker against a cold start: from the grow to the first token "
    "(issue 44)",
    "ray-nodes-netns": "The pools on a multi-node Ray cluster, the KV across a shaped link between network namespaces: "
    "grown from standby under a burst, then a node killed under load (issue 44)",
    **{
        f"autoscale-mockers-{name}": "Pools under a 4x burst: fixed, the queue policy and the joint controller "
        f"with standby, over a fleet of mocker workers ({what}) (issue 44)"
        for name, what in (("step", "Poisson arrivals"), ("gamma", "Gamma arrivals"))
    },
    **{
        f"autoscale-sim-{name}": "Pools under a 4x burst in the plan simulator, 1,056 workers at most: fixed, the "
        f"queue policy and the joint controller with standby ({what}) (issue 44)"
        for name, what in (("step", "Poisson arrivals"), ("gamma", "Gamma arrivals"))
    },
    "serving": "TTFT and ITL, disaggregated against colocated (issue 4)",
    "peer": "Goodput, TTFT, TPOT and ITL against vLLM's CPU build: same model, same load (issue 10)",
    # a kind's further runs, by file name
    "engine-cuda": "Engine decode and prefill on an H100 against transformers and the GPU's limits (issue 2)",
    "cuda-tests": "The CUDA tests on the H100: graphs, CUDA against the CPU, Triton kernels, CUDA IPC (issue 2)",
    "transfer-cuda": "KV transfer over CUDA IPC and TCP on the H100 (issue 3)",
    "transfer-codec": "The KV wire codec: int8 against raw, bytes per prompt and TTFT on loopback and on a link "
    "paced to 1 Gb/s (issue 21)",
    "transfer-codec-netns": "The KV wire codec through the real serving path over a link throttled by tc in a network "
    "namespace: raw against auto against int8, TTFT of 2K-token prompts at 1, 0.1 and 0.03 Gb/s and on loopback "
    "(issue 21)",
    "transfer-lossless": "Lossless compression of real bfloat16 KV frames (zlib, zstd, lz4; plain, byte-shuffled, "
    "after int8): ratio and MB/s on one core against link rates (issue 21)",
    "transfer-tp": "KV transfer between tensor-parallel sizes: re-sharding per layer against the plain transfer "
    "(issue 13)",
    "peer-cpu2-sweep": "Goodput against vLLM past its capacity: the Poisson rate sweep from 1 to 3 req/s (issue 10)",
    "peer-cpu3-burst-auto": "Mode auto on the burst load with long prompts always remote (issue 10)",
    "plan-check": "The plan simulator against measured runs: TTFT and ITL, simulated and measured (issue 12)",
    "plan-check-loaded": "The plan simulator against measured runs with the serving overhead by workers busy, on the "
    "shared machine while other runs loaded it (issue 22)",
    "tiers-cpu": "KV tiers behind the prefix cache: TTFT of a host-tier and a disk-tier hit against recomputing "
    "the prefix, in one run (issue 21)",
    "conversation-cpu": "KV tiers on the conversation load without think time: 20 sessions of 8 turns at once, the "
    "pools a quarter of the working set; tier-aware against tier-blind routing and vLLM's CPU build, TTFT by where "
    "the prefix came from (issue 21)",
    "conversation-cpu-think": "KV tiers on the conversation load with 10 s of think time between turns: 20 sessions "
    "of 8 turns, the pools a quarter of the working set; goodput with tier-aware against tier-blind routing (the "
    "same tiers), TTFT by where the prefix came from (issue 21)",
    "structured-cpu": "Structured output's cost: the decode step with and without a JSON schema, and the grammar "
    "compile time (issue 20)",
    "prefill-profile-cpu": "Where a lone ~1,000-token prompt's prefill time goes, on 1 and 2 threads: TTFT, per-op "
    "time, FLOP rate (issue 22)",
    "peer-cpu4-default": "Against vLLM's CPU build in the same dtype, both on the whole machine, splitserve in its "
    "default (tuned) configuration with core lending: a lone prompt, ShareGPT at concurrency 4, the burst load "
    "(issue 22)",
    "peer-cpu4-nolend": "The lone prompt with each worker pinned to its own core (no core lending): the lever's "
    "share of the default run's figure (issue 22)",
    "spec-cpu": "Speculative decoding by prompt lookup against plain decode: decode tokens/s and identical greedy "
    "output on a load that copies its prompt and on ShareGPT, in one run (issue 22)",
    "peer-cpu5-default": "The default configuration against vLLM again, with the router charging a remote prompt "
    "to the prefill pool when it is routed (issue 22)",
    "peer-cpu6-default": "The default configuration against vLLM on a quiet machine, with the prefill attention "
    "kernel, the prefill's fused norms, decode steps borrowing idle cores and 2,048-token prefill-worker steps: five "
    "lone prompts and ten in pairs, ShareGPT at concurrency 4, the burst load (issue 22)",
    "peer-cpu7-default": "The default configuration against vLLM on a quiet machine once more, with the sampler "
    "drawing from one uniform number (torch.multinomial had drawn one per vocabulary entry) (issue 22)",
    "peer-cpu8-default": "The default configuration against vLLM, with the temperature-only rows of a step sampled "
    "together and the CDF searched in two levels (issue 22)",
    "peer-cpu9-default": "The default configuration against vLLM once more, with the CPU kernel drawing the "
    "temperature-only rows (issue 22)",
    "peer-cpu10-default": "The default configuration against vLLM once more, with the engine loop's stats never "
    "older than what the router sent (issue 22)",
    "peer-cpu4-stall0": "Mode auto with --decode-stall-weight 0 (a backed-up prompt prefills on the busy decode "
    "worker regardless of its streams): the other side of the decode-stall weighing (issue 22)",
    "kv-dtype-cpu": "KV cache dtypes: int8 and fp8 KV against bfloat16 KV, perplexity, greedy agreement, prefill "
    "against decode log-probabilities beside their noise floor, sequences at a fixed pool and the batch-8 decode "
    "step at 256 to 2048 tokens of context (issue 21)",
    "quant-cpu": "A GGUF file's blocks computed in place against the file dequantized (bfloat16, float32): bytes "
    "read, resident memory and shared pages, decode at batch 1 and 8, every layer's matrices at 1 to 256 rows "
    "against the dense bf16 ones (issue 45), perplexity and top-1 agreement, KV capacity, a seeded request's tokens "
    "(issue 31)",
    "internal-tls-cpu": "The cluster's mutual TLS against plaintext on loopback: the KV plane's GB/s (the mutual-"
    "TLS handshake, then AES-GCM records) and a disaggregated request's TTFT (issue 32)",
    "tenants-cpu": "Three quiet tenants and a noisy one at ten times their tokens on one cluster, disaggregated and "
    "colocated, on the router's seats and without: the quiet tenants' TTFT against their run alone, Jain's index "
    "of served tokens (issue 32)",
    "quant-cpu-q8_0": "The same on the embedded model rewritten as Q8_0 by llama.cpp's llama-quantize (issue 31)",
    "quant-cpu-q4_k_m": "The same on the embedded model rewritten as Q4_K_M by llama.cpp's llama-quantize: its "
    "Q4_K, Q6_K, Q5_0 and Q8_0 tensors, as llama.cpp writes them for rows of 576 columns (issue 31)",
    "peer-llamacpp-cpu": "Against llama.cpp's llama-server on the same Q4_1 GGUF, both in their defaults on the "
    "whole machine, splitserve with --quantization auto: ShareGPT at concurrency 4, a lone ~1,000-token prompt "
    "(issue 31)",
    "peer-vllm-llamacpp-cpu": "Against vLLM's CPU build (its defaults, on the HF export of the same weights in "
    "bfloat16) and llama-server (the same Q4_1 GGUF), splitserve with --quantization auto on the GGUF: ShareGPT at "
    "concurrency 4, in one run (issue 31)",
    "peer-llamacpp-default": "Against llama-server on the embedded Q4_1 GGUF, neither given a flag: splitserve's "
    "default now computes the file's blocks (issue 45): ShareGPT at concurrency 4, steady streams with prompt bursts, "
    "lone ~1,000-token prompts",
    "peer-vllm-default": "Against vLLM's CPU build on the bfloat16 export of the same weights, neither given a flag "
    "(splitserve on the GGUF's blocks, issue 45): ShareGPT at concurrency 4, steady streams with prompt bursts, lone "
    "~1,000-token prompts",
    "peer-llamacpp-lone": "Against llama-server on the embedded Q4_1 GGUF, neither given a flag: a lone "
    "~1,000-token prompt and its 32 tokens, one at a time (batch-1 decode, issue 45)",
    "peer-invariance": "splitserve with no flag on the embedded GGUF beside itself with --batch-invariant off "
    "(mixed steps whole, resumed outputs in chunks), in one run (bench peer's KIND:LABEL variants): ShareGPT at "
    "concurrency 4, steady streams with prompt bursts (issue 45)",
    "peer-itl-budget": "splitserve with no flag beside itself with --itl-target off (a step beside decode rows "
    "takes its whole chunk), in one run: ShareGPT at concurrency 4, steady streams with prompt bursts (issue 45)",
    "start-8b-cpu": "splitserve serve --model FILE with no other flag on 8B-shape files of random Q4_K_M and Q8_0 "
    "blocks (the embedded tokenizer): the serving processes' PSS, MemAvailable, one request; a sparse 70B-shape "
    "file's start refused (issue 45)",
    "peer-llamacpp-8b": "An 8B-shape model (random Q4_0 blocks, the embedded tokenizer) served by a prefill and a "
    "decode worker on this 24 GB machine against llama-server on the same file: a lone ~1,000-token prompt's TTFT "
    "and batch-1 decode (issue 31)",
    "peer-llamacpp-8b-q8_0": "The same 8B shape written as Q8_0 blocks (8.5 GB), against llama-server on the same "
    "file (issue 31)",
    "kernels-isa-cpu": "The CPU kernels' paths side by side: linear's AVX2, AVX-512 and AVX-512 BF16 (vdpbf16ps), "
    "decode attention's x86-64, AVX2 and AVX-512 over bfloat16, int8 and fp8 KV (issue 22)",
}

# What a section's output does not say itself (earlier runs that predate the line that now prints it).
NOTES = {
    "peer-cpu4-default": "Against the issue's targets: the lone ~1,000-token prompt 0.84x vLLM's TTFT (target "
    "0.8x; 1,552 against 1,855 ms): the prefill itself takes 1,155 ms on the two lent threads "
    "(prefill-profile-cpu), the rest is the serving path (HTTP, template, router, the KV handed to the decode "
    "worker, the first token back). ShareGPT at concurrency 4: goodput 1.81x (target 1.6x, met) but TTFT p99 "
    "1.69x (target 0.8x): with four streams decoding, the decode worker claims its core and a long prompt "
    "prefills on one thread. The burst load: the steady streams' ITL p99 during bursts 1.57x quiet (target 1.3x) "
    "and the burst prompts' TTFT p50 10.3 s against vLLM's 3.6 s: two 1,566-token prompts at once on the prefill "
    "worker's one thread (a 1,000-token prompt alone takes 2.1 s on one thread, prefill-profile-cpu; the first of "
    "each burst here 6.2 to 9.6 s, beside the streams, the router and the client), while vLLM puts both cores on "
    "them and stalls its streams (ITL 17.7x quiet; 13 steady requests done against 48). On two cores the two "
    "burst targets pull against each other. In peer-cpu4-stall0 (no stall weighing) the second prompt of a burst "
    "still went remote: the router had charged the first to the decode worker's queue and not yet to the prefill "
    "pool's, fixed after this run (router/request.py, `_charge`). The machine was shared (load average 3 to 5 "
    "from other engineers' tests) for both systems.",
    "peer-cpu5-default": "A quiet machine (load 0.6) and no change to splitserve's prefill yet: vLLM's lone prompt "
    "took 977 ms here against 1,855 under load in peer-cpu4-default, so the earlier ratios (0.84x, goodput 1.81x) "
    "owed much to vLLM's two threads suffering more from the shared machine than splitserve's one each. The prefill "
    "probes were one request each here; from peer-cpu6-default on, five rounds.",
    "peer-cpu6-default": "Against the issue's targets: the lone prompt 1.10x vLLM's TTFT (target 0.8x), ShareGPT "
    "goodput 1.23x (target 1.6x) and TTFT p99 1.18x (target 0.8x), the burst prompts' TTFT p50 1.77x vLLM's "
    "(target 1x) with the steady streams' ITL p99 2.12x their quiet value (target 1.3x; 1.72x before decode steps "
    "borrowed idle cores, which made the quiet spells faster, not the bursts slower: ITL p99 68 ms against vLLM's "
    "93). vLLM's CPU prefill runs at 1,148 tok/s here (about 290 GFLOP/s, two-thirds of the two cores' bf16 peak); "
    "splitserve's engine alone does a 1,000-token prompt in 782 ms (prefill-profile-cpu), and its served prefill "
    "computes 5 to 16% slower than the engine alone: the KV stream, gRPC, the router and the client share the two "
    "cores with its two threads.",
    "peer-cpu8-default": "Against the issue's targets: ShareGPT goodput 1.44x (target 1.6x) and TPOT p50 0.65x: "
    "decode is at the memory roofline (py-spy over a batch-4 SmolLM2 engine step: 70% of it in the linear "
    "kernel, reading the 269 MB of bf16 weights at about the 27 GB/s this machine reads), so goodput at "
    "concurrency 4 is bounded by that read plus what the prefill worker, the router and the client take from the "
    "two cores. TTFT p99 1.34x (target 0.8x), the lone prompt 1.14x (target 0.8x), the burst prompts' TTFT p50 "
    "1.64x (target 1x) with the streams' burst/quiet ITL p99 2.09 (target 1.3): the prefill-side figures as in "
    "peer-cpu6-default's note. Runs of splitserve alone earlier the same hour (at 4e9b6d7, before this sampler) "
    "reached 1.58 to 1.70 req/s on ShareGPT and a side-by-side one 1.34: this machine's speed moves by that much "
    "between runs, which is why only side-by-side ratios count.",
    "peer-cpu9-default": "The same command as peer-cpu8-default 70 minutes later, with the draw kernel: ShareGPT "
    "goodput 1.18x (1.25 / 1.06 req/s) against 1.44x there, the lone prompt 0.97x against 1.14x, the burst "
    "prompts' TTFT p50 2.18x against 1.64x. The kernel saves about 0.5 ms of a 13 ms engine step (sample() 310 "
    "against 800 us inside the engine), less than these runs move: three pairs of ShareGPT runs of splitserve "
    "alone right after this one, the kernel against the torch path (de0c231), gave 1.43/1.55, 1.39/1.33 and "
    "1.47/1.26 req/s. Read the two runs together as the spread of this measurement on this machine.",
    "peer-cpu10-default": "The same command at c198dc1, the engine loop's stats now never older than what the "
    "router sent (its local-or-remote decision reads the prefill worker's queue from them): ShareGPT goodput "
    "1.40x vLLM's (1.62 / 1.16 req/s) with TTFT p99 1.30x, the lone prompt 1.00x (832 / 834 ms), the burst "
    "prompts' TTFT p50 1.88x with the streams' burst/quiet ITL p99 2.34. Against peer-cpu8 and peer-cpu9 "
    "(1.44x and 1.18x goodput, 1.14x and 0.97x the lone prompt) this is the same system on the same machine: "
    "the spread of these runs is the machine's. What bounds the misses: the lone prompt's prefill runs at 311 "
    "GFLOP/s on the two cores in the engine alone (prefill-profile-cpu: 77% of it oneDNN GEMM at about 200 "
    "GFLOP/s a core, near this CPU's bf16 rate), so 0.8x vLLM's 834 ms would need the whole prefill faster than "
    "its matrix products run; decode is at the memory roofline (peer-cpu8-default's note); the burst's long "
    "prompts get one core while the steady streams keep the other (vLLM gives them both and stalls its "
    "streams: its burst/quiet ITL p50 47.6), and the ratio of ITL p99 during bursts to quiet spells is high "
    "because quiet decode borrows the idle core: during bursts splitserve's ITL p99 is 0.94x vLLM's.",
    "conversation-cpu": "Without think time every session is running at once: the running requests alone (about 7 "
    "sessions of ~2K tokens) outgrow pools a quarter of the working set, every system waits for free blocks, and "
    "TTFT is that wait (14 to 90 s), tiers or not: no request meets a 2 s TTFT anywhere. Its returning turns did "
    "come from the tiers (the disk, mostly: pool and host churn faster than a turn comes back), and splitserve "
    "served 3.7x vLLM's requests per second. The figures the issue asks for are conversation-cpu-think's.",
    "conversation-cpu-think": "Every TTFT here includes the wait for a seat and free blocks: with 10 s of think time "
    "about a third of the sessions are still in service at once, near what pools a quarter of the working set hold, "
    "so a returning turn's TTFT is mostly that wait (disk hits that did not wait came back in 0.2 to 0.7 s against "
    "5 to 15 s for a first turn). Host-tier hits are few: each worker's 130 MiB host tier turns over faster than a "
    "session thinks, so its blocks are on disk when it returns. Tier-blind routing loses less than it would on more "
    "workers: turns it sends to the other worker leave the session's document in both workers' tiers, and a later "
    "turn there loads it too. Both goodputs are small (SLO attainment 0.22 and 0.05): the ratio is of small "
    "numbers.",
    "engine-cuda": "From `bash bench/device.sh` on a lent H100 (no Ray there, weights drawn at random: a step's "
    "time does not depend on their values). Batch 1..4 matrix products run on the Triton GEMV of "
    "engine/kernels/triton_decode_ops.py, past that on cuBLAS; decode steps replay CUDA graphs. The small "
    "models' 4K prefill misses 60% of the matmul rate because their layer GEMMs are too narrow to fill the GPU "
    "and attention is 40% (SmolLM2) of the FLOPs; the Llama-3-8B shape meets it. Greedy agreement with HF at "
    "batch 32 on the Llama-3-8B shape is low from the first steps: random weights leave near-tied logits that "
    "bf16 rounding in another order flips (Llama-3.2-1B agrees 32 of 32).",
    "tiers-cpu": "Each ratio is within one trial, its three second turns run back to back. The disk tier's files are "
    "read off the device: the page cache is dropped for them before each disk hit.",
    "plan-check": "The profile times `Engine.step()` alone, on one core, between two runs of a speed probe (a "
    "fixed piece of engine work: a 128-token prefill and six batch-4 decode steps), taken again while the two "
    "differ by more than 10%; the probe runs again before every later measurement, and each load is compared "
    "with a simulation of the machine at the probed speed (the [... speed probe] lines: 1.00 to 1.19x here). "
    "This VM's speed moved by 30 to 40% within minutes: before the probe, two checks 16 minutes apart gave 23 "
    "and 10 of 32. In the measured runs the router and the load generator run unpinned on the workers' two "
    "cores and every token is streamed over gRPC; what that costs is measured on each running system before "
    "its loads: the served gap over the engine step with every worker busy and with one alone, the same gap "
    "while background prompts keep the prefill worker computing (disaggregated: the router's and the client's "
    "cycles then come out of the decode core), and a prefill beside 0, 2, 6 and 12 decoding streams, fitted on "
    "seconds. The simulator routes with the router's own chooser over a prefix index fed by its simulated "
    "workers, starts each worker's waiting prompts shortest first, aged, and lets a prompt of 256 tokens or "
    "fewer go before a long prefill in progress, as the workers do. This session's runs gave 23, 10, 13, 28 "
    "(at 1b0d380) and this 25 of 32; here the misses are disaggregated TTFTs the simulator puts too low, with "
    "the prefill under load fitted at 0.81x the calibrated prefill (the same fit gave 1.02x in the run at "
    "1b0d380): single runs of 32 requests on a machine whose speed the probe follows only between loads.",
    "transfer-codec": "The 1 Gb/s link is a TCP proxy inside the benchmark that paces the sender's bytes (a "
    "token bucket, 64 KiB chunks, a 256 KiB socket buffer): no root or tc needed, the same on CI. The prefill "
    "is a stand-in (a sleep per layer, as a GPU's): this CPU's real prefill of a 2K-token prompt takes seconds "
    "and would hide the link. TTFT ends when the last layer is handed to the stream, as a prefill worker then "
    "samples and returns the first token; the bounded send queue is what lets a slow link hold it back.",
    "transfer-tp": "The TP 1 -> TP 1 rows send the same transfer twice: their spread is the noise floor. "
    "Equal sizes above 1 send one zero-copy frame per shard; other pairs pack each receiver shard's heads in "
    "the sender's stream thread, in line with its sends. The copy figures repeat one 8 MiB layer, which stays "
    "in the CPU's cache: they compare packing with scattering, not what either costs on KV fresh from memory.",
    "peer-cpu": "Each row group is one `splitserve bench serve` load from `bench/peer/main.py` (`loads_for`), "
    "the same for every system: `sharegpt` 40 ShareGPT prompts at concurrency 4, 128 output tokens (EOS "
    "ignored); `sweep` 20 ShareGPT prompts per Poisson rate; `burst` 4 steady streams (32-token prompts, "
    "128 tokens) with 3 bursts of two 1,536-token prompts, 8 s apart; `prefill1`/`prefill2` one, then two "
    "1,000-token prompts at once, 1 output token. Goodput counts requests with TTFT <= 3 s and TPOT <= 100 ms. "
    "Newer runs print these lines themselves (`load NAME: bench serve ...`).",
}

HEADER = """# Every benchmark run

Generated by `python -m splitserve.bench.report` from the results files beside it
(`bench/results/*.txt`). Every section is one benchmark's output as it printed it,
the command that produced it on the first line; nothing here is edited by hand.
Re-run a command and then the report to update a section. The newest figure of each
comparison, on one page: [BENCHMARKS.md](../../BENCHMARKS.md).

"""


def history(results: Path = RESULTS) -> str:
    """Every run in full; its links are relative to the results folder, where it is written."""
    files = sorted(
        results.glob("*.txt"),
        key=lambda p: (ORDER.index(p.stem.split("-")[0]) if p.stem.split("-")[0] in ORDER else len(ORDER), p.name),
    )
    parts = [HEADER]
    for f in files:
        kind = f.stem.split("-")[0]
        note = f"{NOTES[f.stem]}\n\n" if f.stem in NOTES else ""
        title = TITLES.get(f.stem) or TITLES.get(kind, f.stem)
        output = f.read_text().rstrip()
        parts.append(f"## {title}\n\n[`bench/results/{f.name}`]({f.name})\n\n{note}```\n{output}\n```\n\n")
        # the run's charts, where it drew any into bench/results/<its name>/
        for png in sorted((results / f.stem).glob("*.png")):
            parts.append(f"![{png.stem}]({f.stem}/{png.name})\n\n")
    return "".join(parts)


def main() -> int:
    for out, text in ((ROOT / "BENCHMARKS.md", summary(RESULTS)), (RESULTS / "HISTORY.md", history(RESULTS))):
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
