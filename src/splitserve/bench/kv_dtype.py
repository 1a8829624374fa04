"""What a quantized KV pool costs in quality and buys in capacity, against bfloat16 KV, in one run.

    splitserve bench kv-dtype [--dtype bfloat16] [--kv-dtypes int8,fp8] [--tokens 256]
                              [--pool-mib 32] [--batch 8] [--contexts 256,1024,2048] [--steps 24]
                              [--repeats 3] [--results bench/results/kv-dtype-cpu.txt]

On the default model (SmolLM2-135M) with the model in `--dtype`, each quantized KV dtype
against bfloat16 KV (the issue's targets in brackets):

- perplexity over the fixed text shipped in bench/data/public_domain.txt, teacher-forced
  through the engine's own prefill path and cache, in chunks of --chunk tokens (later chunks
  read the earlier ones back from the quantized pool) [within 1% of bfloat16 KV's];
- greedy agreement over --tokens tokens for a set of prompts, each dtype's engine decoding
  them in one batch: the fraction identical over every token, and the mean first divergence
  (a prompt that never diverges counts --tokens);
- the same tokens' log-probabilities computed teacher-forced by one prefill and step by step
  by decode (the fused CPU kernel): each decode step over the KV the prefill wrote (as a
  decode worker continues a prefill worker's), and every KV written by decode from scratch [each
  largest difference within 0.05 with the model in float32, where the compute is exact enough
  that the KV is what differs], with the model in float32 and in bfloat16, beside the noise
  floor: the same prefill against itself with its embedding weights moved by an ulp;
- capacity at a fixed pool of --pool-mib MiB (--kv-cache-bytes): the blocks that fit and the
  most sequences running at once when --requests prompts of --capacity-context tokens (each asking for
  --capacity-tokens more) arrive together [int8 at least 1.8x bfloat16];
- the decode step at batch --batch over each of --contexts tokens of context (KV is a small share
  of a step's bytes at 256 tokens, most of them at 2048), bfloat16 KV and each quantized dtype
  measured alternately in every repetition [not slower: ratio at most 1.0 at every context],
  beside a second bfloat16 engine's ratio (two identical engines' spread: the yardstick).
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from splitserve.bench.results_file import with_results
from splitserve.bench.step_timer import decode_step_ms
from splitserve.bench.teacher_forcing import step_by_step, teacher_forced
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.tokenizer import Tokenizer
from splitserve.measure.hw import CpuShare, machine_line

TEXT = Path(__file__).resolve().parent / "data" / "public_domain.txt"
BASELINE = "bfloat16"
CONTROL = "control"  # bench kv-dtype's second bfloat16 engine in the decode-step timing
PROMPTS = [
    "The history of the printing press begins",
    "Here is a recipe for a simple vegetable soup:",
    "Write a short story about a lighthouse keeper.",
    "The three laws of thermodynamics are",
    "Dear hiring manager, I am writing to apply for",
    "def fibonacci(n):\n    ",
    "The capital of France is Paris. The capital of Italy is",
    "Once upon a time, in a small village by the sea,",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bfloat16", help="the model's dtype (bfloat16, float32)")
    p.add_argument("--kv-dtypes", default="int8,fp8", help="quantized KV dtypes compared with bfloat16 KV")
    p.add_argument("--tokens", type=int, default=256, help="greedy tokens per prompt for the agreement")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk for the perplexity")
    p.add_argument("--logprob-tokens", type=int, default=160, help="tokens of the text for prefill against decode")
    p.add_argument(
        "--logprob-dtypes", default="float32,bfloat16", help="model dtypes of prefill against decode (float32: target)"
    )
    p.add_argument("--pool-mib", type=float, default=32.0, help="the fixed KV pool for the capacity, MiB")
    p.add_argument("--requests", type=int, default=64, help="prompts arriving together for the capacity")
    p.add_argument("--capacity-context", type=int, default=64, help="prompt tokens of each capacity request")
    p.add_argument("--capacity-tokens", type=int, default=8, help="tokens each capacity request asks for")
    p.add_argument("--batch", type=int, default=8, help="batch of the decode step timed")
    p.add_argument(
        "--contexts", default="256,1024,2048", help="prompt tokens (the context) of each sequence, one figure each"
    )
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per repetition")
    p.add_argument("--repeats", type=int, default=3, help="repetitions; each runs every dtype back to back")
    p.add_argument("--results", default=None, help="also write the output here, under a header line")


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    kvs = [k.strip() for k in args.kv_dtypes.split(",") if k.strip()]
    print(
        f"# splitserve bench kv-dtype --dtype {args.dtype} --kv-dtypes {','.join(kvs)} --tokens {args.tokens} "
        f"--chunk {args.chunk} --logprob-tokens {args.logprob_tokens} --logprob-dtypes {args.logprob_dtypes} "
        f"--pool-mib {args.pool_mib:g} --requests {args.requests} --capacity-context {args.capacity_context} "
        f"--capacity-tokens {args.capacity_tokens} --batch {args.batch} --contexts {args.contexts} "
        f"--steps {args.steps} --repeats {args.repeats}"
    )
    print(machine_line())
    verdicts: list[tuple[str, bool]] = []
    quality = {kv: _quality(args, kv) for kv in [BASELINE, *kvs]}
    verdicts += _print_quality(args, quality, kvs)
    verdicts += _logprobs(args, kvs)
    verdicts += _capacity(args, kvs)
    verdicts += _decode_speed(args, kvs)
    met = sum(ok for _, ok in verdicts)
    print(f"targets: {met} of {len(verdicts)} met" + "".join(f"; NOT met: {n}" for n, ok in verdicts if not ok))
    return 0


# ------------------------------------------------------------------ quality


def _engine(args: argparse.Namespace, kv: str, **cfg: object) -> tuple[Engine, Tokenizer]:
    fields: dict[str, object] = {"dtype": args.dtype, "kv_cache_dtype": kv, "num_blocks": 512, "max_num_seqs": 64}
    fields.update(cfg)
    return Engine.from_path(None, EngineConfig(**fields), progress=False)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Quality:
    tokens: int  # of the text
    ppl: float
    greedy: list[list[int]]  # each prompt's greedy tokens


def _quality(args: argparse.Namespace, kv: str) -> Quality:
    engine, tok = _engine(args, kv)
    try:
        text = tok.encode(TEXT.read_text())
        lp = teacher_forced(engine, text, args.chunk)
        nll = -float(lp.mean())
        greedy = engine.generate(
            [tok.encode(p) for p in PROMPTS], SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        )
        return Quality(len(text), math.exp(nll), greedy)
    finally:
        engine.close()


def _print_quality(args: argparse.Namespace, q: dict[str, Quality], kvs: list[str]) -> list[tuple[str, bool]]:
    base = q[BASELINE]
    print(f"\ntext: {TEXT.name}, {base.tokens} tokens; model dtype {args.dtype}")
    verdicts = []
    for kv in [BASELINE, *kvs]:
        r = q[kv]
        ratio = r.ppl / base.ppl
        line = f"perplexity {kv:<9} KV: {r.ppl:8.4f}  ratio {ratio:.4f}"
        if kv != BASELINE:
            ok = ratio <= 1.01
            verdicts.append((f"perplexity {kv} within 1%", ok))
            line += f"  [target <= 1.0100: {'met' if ok else 'NOT met'}]"
        print(line)
    print(f"greedy agreement with {BASELINE} KV over {args.tokens} tokens, {len(PROMPTS)} prompts:")
    for kv in kvs:
        same, firsts = _agreement(base.greedy, q[kv].greedy, args.tokens)
        print(
            f"  {kv:<9} identical {same}/{len(PROMPTS)} ({same / len(PROMPTS):.2f}); mean first divergence "
            f"{statistics.mean(firsts):.1f} tokens (per prompt: {' '.join(map(str, firsts))})"
        )
    return verdicts


def _logprobs(args: argparse.Namespace, kvs: list[str]) -> list[tuple[str, bool]]:
    """Prefill against decode, per model dtype and KV dtype: the largest and the mean difference,
    beside the same prefill against itself with its weights moved by one ulp (the noise floor)."""
    n = args.logprob_tokens
    print(
        f"log-probabilities of the same {n - 1} tokens of the text, teacher-forced by one prefill against "
        "decode one step per token (the fused CPU kernel), max |diff| (mean):"
    )
    print(
        "  'over prefill KV': each step reads the earlier tokens' KV as the prefill wrote it (a decode worker "
        "continuing a prefill worker); 'from scratch': every KV written by decode; 'noise floor': the same "
        "prefill against itself with the embedding weights moved by at most one ulp of the model's dtype (seeded), "
        "what the same function gives under rounding noise. Prefill attends over its own chunk's K/V read back "
        "from the pool (quantized, then dequantized: what decode reads), so the two paths compute one function; "
        "they differ in the order of their sums (GEMM against GEMV; with a bfloat16 model also where torch's SDPA "
        "rounds to bf16), and a quantized KV rounds such ulps into whole quantization steps that compound over "
        "layers and tokens, as the noise floor's do"
    )
    verdicts = []
    for dtype in args.logprob_dtypes.split(","):
        for kv in [BASELINE, *kvs]:
            over, scratch, floor = _prefill_against_decode(args, dtype, kv, n)
            line = (
                f"  model {dtype:<8} {kv:<9} KV: over prefill KV {_maxmean(over)}; from scratch {_maxmean(scratch)}; "
                f"noise floor {_maxmean(floor)}"
            )
            if dtype == "float32":  # the compute exact enough that the KV is what differs
                ok = float(over.max()) <= 0.05
                verdicts.append((f"prefill/decode logprobs {kv} KV over prefill KV", ok))
                fresh = float(scratch.max()) <= 0.05
                verdicts.append((f"prefill/decode logprobs {kv} KV from scratch", fresh))
                line += (
                    f"  [target <= 0.05 over prefill KV: {'met' if ok else 'NOT met'}, from scratch: "
                    f"{'met' if fresh else 'NOT met'}; from scratch within the noise floor: "
                    f"{'yes' if float(scratch.max()) <= float(floor.max()) else 'no'}]"
                )
            print(line)
    return verdicts


def _maxmean(d: torch.Tensor) -> str:
    return f"{float(d.max()):.4f} ({float(d.mean()):.4f})"


def _prefill_against_decode(
    args: argparse.Namespace, dtype: str, kv: str, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """|prefill - decode| over the prefill's KV, from scratch, and |prefill - prefill moved by an ulp|."""
    engine, tok = _engine(argparse.Namespace(**{**vars(args), "dtype": dtype}), kv)
    try:
        text = tok.encode(TEXT.read_text())[:n]
        forced = teacher_forced(engine, text, n)
        over = (forced - step_by_step(engine, text, over_prefill=True)).abs()
        scratch = (forced - step_by_step(engine, text)).abs()
        embed = engine.model.embed
        assert isinstance(embed, torch.Tensor), "the bench loads float weights"
        _move_by_an_ulp(embed, torch.Generator().manual_seed(0))  # last: the engine is spent after
        floor = (forced - teacher_forced(engine, text, n)).abs()
    finally:
        engine.close()
    return over, scratch, floor


@torch.inference_mode()
def _move_by_an_ulp(w: torch.Tensor, gen: torch.Generator) -> None:
    """Each nonzero weight one ulp of its own dtype away from zero, towards it, or left, at random."""
    bits = w.view(torch.int32 if w.element_size() == 4 else torch.int16)
    step = torch.randint(-1, 2, bits.shape, generator=gen).to(bits.dtype) * (bits != 0).to(bits.dtype)
    bits.add_(step)


def _agreement(base: list[list[int]], other: list[list[int]], tokens: int) -> tuple[int, list[int]]:
    firsts = []
    for a, b in zip(base, other, strict=True):
        firsts.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), tokens))
    return sum(f >= tokens for f in firsts), firsts


# ----------------------------------------------------------------- capacity


def _capacity(args: argparse.Namespace, kvs: list[str]) -> list[tuple[str, bool]]:
    pool = int(args.pool_mib * 2**20)
    print(
        f"\ncapacity at a fixed pool of {args.pool_mib:g} MiB (--kv-cache-bytes {pool}): {args.requests} prompts of "
        f"{args.capacity_context} tokens arriving together, each asking for {args.capacity_tokens} tokens"
    )
    peak: dict[str, int] = {}
    verdicts = []
    for kv in [BASELINE, *kvs]:
        # no prefix caching: the prompts' shared beginning would otherwise be held once for all
        engine, tok = _engine(
            args, kv, kv_cache_bytes=pool, num_blocks=1, max_num_seqs=256, enable_prefix_caching=False
        )
        try:
            prompt = tok.encode(TEXT.read_text())[: args.capacity_context - 1]
            params = SamplingParams(max_tokens=args.capacity_tokens, temperature=0, ignore_eos=True)
            for i in range(args.requests):
                engine.add_request(f"c{i}", [*prompt, 1 + i], params)
            most = 0
            while engine.has_work:
                engine.step()
                most = max(most, engine.stats().running_requests)
            peak[kv] = most
            print(
                f"  {kv:<9} KV: {engine.cfg.num_blocks} blocks of {engine.layout.bytes_per_block} B per layer; "
                f"most sequences running at once {most}; preemptions {engine.scheduler.num_preemptions}"
            )
        finally:
            engine.close()
    for kv in kvs:
        ratio = peak[kv] / max(1, peak[BASELINE])
        ok = ratio >= 1.8
        verdicts.append((f"capacity {kv} >= 1.8x", ok))
        print(f"  {kv} against {BASELINE}: {ratio:.2f}x the sequences  [target >= 1.80: {'met' if ok else 'NOT met'}]")
    return verdicts


# ------------------------------------------------------------- decode speed


def _decode_speed(args: argparse.Namespace, kvs: list[str]) -> list[tuple[str, bool]]:
    """The batch's decode step at each context, every dtype back to back in each repetition."""
    contexts = _contexts(args.contexts)
    bs = EngineConfig().block_size
    # room for every sequence of the longest context and its steps, plus a spare block
    blocks = args.batch * -(-(max(contexts) + args.steps + 3) // bs) + 1
    engines = {kv: _engine(args, kv, num_blocks=max(512, blocks)) for kv in [BASELINE, *kvs]}
    # a second engine of the baseline's dtype: what two identical engines differ by (their own
    # copies of the weights and pool in other pages), the yardstick for the dtypes' ratios
    engines[CONTROL] = _engine(args, BASELINE, num_blocks=max(512, blocks))
    verdicts = []
    try:
        prompt = engines[BASELINE][1].encode(TEXT.read_text())
        print(
            f"\ndecode step at batch {args.batch}, median of {args.steps} steps, {args.repeats} repetitions "
            "alternating the dtypes, at each context:"
        )
        for ctx in contexts:
            share = CpuShare()
            times = _step_times(engines, _prompt_of(prompt, ctx), args, f"c{ctx}")
            verdicts += _print_speed(times, kvs, args.batch, ctx)
            # a busy neighbour on a small shared machine slows one repetition several-fold: say how busy
            print(f"  context {ctx:>5}: other processes kept {share.others():.2f} cores busy meanwhile")
    finally:
        for engine, _ in engines.values():
            engine.close()
    return verdicts


def _contexts(text: str) -> list[int]:
    try:
        contexts = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise SystemExit(f"bench kv-dtype: --contexts takes comma-separated token counts, not {text!r}") from None
    if not contexts or min(contexts) < 2:
        raise SystemExit(f"bench kv-dtype: --contexts needs token counts of at least 2, got {text!r}")
    return contexts


def _prompt_of(text: list[int], n: int) -> list[int]:
    """n - 1 tokens of the text, repeated as often as it takes (the timer appends one of its own)."""
    return (text * (n // len(text) + 1))[: n - 1]


def _step_times(
    engines: dict[str, tuple[Engine, Tokenizer]], prompt: list[int], args: argparse.Namespace, tag: str
) -> dict[str, list[float]]:
    params = SamplingParams(max_tokens=args.steps + 2, temperature=0, ignore_eos=True)
    times: dict[str, list[float]] = {kv: [] for kv in engines}
    for r in range(args.repeats):
        for kv, (engine, _) in engines.items():
            times[kv].append(decode_step_ms(engine, prompt, params, args.batch, args.steps, f"{tag}{kv}{r}"))
    return times


def _print_speed(times: dict[str, list[float]], kvs: list[str], batch: int, ctx: int) -> list[tuple[str, bool]]:
    base = statistics.median(times[BASELINE])
    print(
        f"  context {ctx:>5}: {BASELINE:<9} KV {base:.2f} ms "
        f"(per repetition: {' '.join(f'{t:.2f}' for t in times[BASELINE])})"
    )
    verdicts = []
    if CONTROL in times:
        ratios = [a / b for a, b in zip(times[CONTROL], times[BASELINE], strict=True)]
        print(
            f"  context {ctx:>5}: {CONTROL:<9} a second {BASELINE} KV engine: ratio {statistics.median(ratios):.3f} "
            f"(per repetition: {' '.join(f'{x:.3f}' for x in ratios)}): two identical engines' spread"
        )
    for kv in kvs:
        ratios = [a / b for a, b in zip(times[kv], times[BASELINE], strict=True)]
        ratio = statistics.median(ratios)
        ok = ratio <= 1.0
        verdicts.append((f"decode batch {batch} context {ctx} {kv} not slower", ok))
        print(
            f"  context {ctx:>5}: {kv:<9} KV {statistics.median(times[kv]):.2f} ms, ratio {ratio:.3f} (per "
            f"repetition: {' '.join(f'{x:.3f}' for x in ratios)})  [target <= 1.000: {'met' if ok else 'NOT met'}]"
        )
    return verdicts
