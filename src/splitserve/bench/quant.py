"""What computing a GGUF file's blocks in place buys (EngineConfig.quantization "auto",
engine/kernels/quant.cpp), against the same file dequantized, in one run.

    splitserve bench quant [--model smollm2-135m] [--tokens 96] [--rounds 5] [--batch 8]
                           [--ppl-tokens 384] [--budget-mib 1024] [--results bench/results/quant-cpu.txt]

Three engines on one file: "blocks" (the file's formats, the quantized kernel), "dense" (the
file dequantized into the machine's tuned dtype: splitserve's path before), and "fp32" (the
file dequantized to float32, the accuracy reference).

- weights: the file's tensor bytes; each engine's bytes read by a decode step; in a child process
  that loads the model and runs a step, the file's pages resident in it (smaps) and the weights'
  bytes outside them (copies, dequantized floats), their sum against the file's, and the process's
  growth; two such workers' proportional share of the file's pages (one copy: the page cache's).
- decode: ms a token at batch 1 (no speculation) and ms a step at --batch, the engines
  alternating round by round on the same prompt; the medians and their ratio; batch 1's bytes
  read a second against a STREAM-like memory read probe in the same run (the roofline).
- prefill: a prompt of 12, 48 and 400 tokens and its first token, alternating (what a decode
  worker's streams wait for while it prefills locally); every layer's matrices on the blocks
  against the dense engine's, at 1 to 256 rows (decode batches and prefill chunks), and on the AVX2
  paths with AVX-512 masked off (fp32 x, against the float32 engine's).
- accuracy: a text's perplexity by one decode step per token (the path a decode worker's steps
  take) against fp32's, and the teacher-forced top-1 agreement.
- capacity: the KV blocks left in --budget-mib once each engine's resident weights are in.
- determinism: one seeded request (temperature 0.8, seed 3) alone at one and at two threads
  and in a batch of eight: its tokens in all three, by default (every row on the kernel
  up to kernel.max_rows, past it a prefill chunk on the GEMM) and with --batch-invariant.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from splitserve.bench.results_file import with_results
from splitserve.bench.teacher_forcing import decode_logits, logprobs_of
from splitserve.engine import embedded
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.kernels import quant
from splitserve.engine.kv_cache import pool_blocks
from splitserve.engine.quant.weight import QuantizedWeight
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.tokenizer import Tokenizer
from splitserve.engine.tuned import detect_machine, tuned_defaults
from splitserve.measure import hw
from splitserve.measure.hw import machine_line

TEXT = Path(__file__).resolve().parent / "data" / "public_domain.txt"
PROMPT = "The history of the printing press begins in the fifteenth century, when"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="a GGUF file or an embedded model's name")
    p.add_argument(
        "--requantize",
        default="",
        metavar="FORMAT",
        help="first rewrite the model with llama.cpp's llama-quantize in this format (Q8_0, Q4_K_M, ...; "
        "built as the llama.cpp peer is) and measure that file",
    )
    p.add_argument("--tokens", type=int, default=96, help="tokens each timed generation decodes")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per engine, alternating")
    p.add_argument("--batch", type=int, default=8, help="the batched decode's sequences")
    p.add_argument("--ppl-tokens", type=int, default=384, help="tokens of the text for perplexity and top-1")
    p.add_argument("--budget-mib", type=float, default=1024.0, help="a worker's memory for weights and KV")
    p.add_argument("--results", default=None, help="also write the output here, under a header line")


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _modes() -> dict[str, tuple[str, str]]:
    """Each engine's (dtype, quantization)."""
    dtype = tuned_defaults(detect_machine("cpu")).dtype
    return {"blocks": (dtype, "auto"), "dense": (dtype, "none"), "fp32": ("float32", "none")}


def _run(args: argparse.Namespace) -> int:
    if not quant.available():
        print("the quantized kernel is not available on this machine; nothing to compare")
        return 1
    modes = _modes()
    again = f" --requantize {args.requantize}" if args.requantize else ""
    print(f"# splitserve bench quant --model {args.model}{again}")
    if args.requantize:
        args.model = str(_requantized(args.model, args.requantize))
        print(f"# the file: {args.model}")
    print(f"# {machine_line()}")
    print(f"# quantized kernel path: {quant.PATH_NAMES[quant.best_path()]}; engines: {modes}")
    engines: dict[str, Engine] = {}
    tok: Tokenizer | None = None
    for name, (dtype, q) in modes.items():
        cfg = EngineConfig(dtype=dtype, quantization=q, num_blocks=1024, max_num_seqs=args.batch)
        engines[name], tok = Engine.from_path(args.model, cfg, progress=False)
    assert tok is not None
    try:
        resident = _weights(args, engines)
        _decode(args, engines, tok)
        _prefill(args, engines, tok)
        _crossover(engines)
        _avx2_path(engines)
        _accuracy(args, engines, tok)
        _capacity(args, engines, resident)
        print("\n## determinism: a seeded request (temperature 0.8, seed 3, 48 tokens) on the blocks engine")
        _determinism(engines["blocks"], tok, "default")
        dtype, q = modes["blocks"]
        invariant, _ = Engine.from_path(
            args.model, EngineConfig(dtype=dtype, quantization=q, batch_invariant="strict"), progress=False
        )
        try:
            _determinism(invariant, tok, "--batch-invariant")
        finally:
            invariant.close()
    finally:
        for e in engines.values():
            e.close()
    return 0


def _requantized(model: str, fmt: str) -> Path:
    from splitserve.bench.peer.llama_cpp import ensure_llama_server, requantize

    info = ensure_llama_server()
    print(f"# written by llama-quantize of {info.line()}")
    source = embedded.resolve(model)
    out = Path(embedded.cache_dir()) / "requantized" / f"{Path(source).stem}.{fmt}.gguf"
    return requantize(source, fmt, out, info)


# ---------------------------------------------------------------- weights


_CHILD = """
import json, os, sys, torch
from splitserve.engine.kernels import quant
quant.available()  # the kernel built and loaded before the baseline
from splitserve.engine import embedded
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.sampling import SamplingParams
from splitserve.bench.quant import file_mapping

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out

def tensors(model):
    from splitserve.engine.quant.weight import QuantizedWeight
    held = [model.embed, model.lm_head, model.norm] + [t for lw in model.layers for t in vars(lw).values()]
    seen = set()
    for t in held:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        if isinstance(t, QuantizedWeight):
            yield from (p.data for p in t.parts)
        else:
            yield t

torch.set_num_threads(1)
before = status()
engine, _ = Engine.from_path(sys.argv[1], EngineConfig(dtype=sys.argv[2], quantization=sys.argv[3], num_blocks=16),
                             progress=False)
engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
after = status()
ranges, file_rss, _ = file_mapping("self", os.path.realpath(sys.argv[1]))
# the weights' bytes outside the file's mapping: copies (q and k, reordered) and dequantized floats
copies = sum(t.numel() * t.element_size() for t in tensors(engine.model)
             if not any(lo <= t.data_ptr() < hi for lo, hi in ranges))
out = {k: after[k] - before[k] for k in after} | {"file_rss": file_rss, "copies": copies}
print(json.dumps(out), flush=True)
sys.stdin.readline()  # held until the parent has read its memory
"""


def file_mapping(pid: int | str, path: str) -> tuple[list[tuple[int, int]], int, int]:
    """Process `pid`'s ("self": this one's) mappings of `path`: their address ranges, and their
    resident and proportional bytes (smaps' Rss and Pss)."""
    ranges: list[tuple[int, int]] = []
    rss = pss = 0
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5] == path
                if inside:
                    lo, hi = fields[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
            elif inside and fields[0] == "Rss:":
                rss += int(fields[1]) * 1024
            elif inside and fields[0] == "Pss:":
                pss += int(fields[1]) * 1024
    return ranges, rss, pss


def _children(model: str, dtype: str, q: str, count: int) -> tuple[list[dict[str, int]], list[tuple[int, int]]]:
    """`count` worker-like processes holding the model at once: each one's memory growth, and each
    one's (Rss, Pss) of the model file's pages."""
    path = os.path.realpath(embedded.resolve(model))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, path, dtype, q], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(count)
    ]
    try:
        grown = [json.loads(p.stdout.readline()) for p in procs if p.stdout is not None]
        mapped = [file_mapping(p.pid, path)[1:] for p in procs]
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            p.wait(timeout=60)
    return grown, mapped


def _file_tensor_bytes(model: str) -> int:
    from splitserve.engine import embedded, gguf_loader

    reader = gguf_loader.open_gguf(embedded.resolve(model))
    return sum(int(t.n_bytes) for t in reader.tensors)


def _weights(args: argparse.Namespace, engines: dict[str, Engine]) -> dict[str, int]:
    """Prints the weight figures; returns each engine's resident weight bytes (one worker)."""
    mib = 1 << 20
    file_bytes = _file_tensor_bytes(args.model)
    print(f"\n## weights: the file's tensors hold {file_bytes / mib:.1f} MiB")
    print("## a worker-like process loading the model and running a step: the file's pages resident in it (smaps),")
    print("## the weights' bytes outside them (copies, floats), their sum against the file's, and the process's growth")
    print(
        f"{'engine':8} {'formats':22} {'read/step':>9} {'file pages':>10} {'copies':>8} {'weights':>8} {'/file':>6} "
        f"{'process':>8} (MiB)"
    )
    resident: dict[str, int] = {}
    for name, (dtype, q) in _modes().items():
        grown, _ = _children(args.model, dtype, q, 1)
        g = grown[0]
        weights = g["file_rss"] + g["copies"]
        resident[name] = weights
        e = engines[name]
        print(
            f"{name:8} {'+'.join(e.model.weight_formats):22} {e.model.weight_bytes / mib:9.1f} "
            f"{g['file_rss'] / mib:10.1f} {g['copies'] / mib:8.1f} {weights / mib:8.1f} {weights / file_bytes:6.2f} "
            f"{g['VmRSS'] / mib:8.1f}"
        )
    dtype, q = _modes()["blocks"]
    _, mapped = _children(args.model, dtype, q, 2)
    (rss_a, pss_a), (rss_b, pss_b) = mapped
    print(
        f"two 'blocks' workers at once: the file's pages resident {rss_a / mib:.1f} and {rss_b / mib:.1f} MiB in "
        f"each, {pss_a / mib:.1f} and {pss_b / mib:.1f} MiB proportionally: one copy in the page cache, shared by "
        f"{rss_a / max(1, pss_a):.1f} processes (the two and this bench's own engine)"
    )
    return resident


# ----------------------------------------------------------------- decode


def _timed(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompts, params)
    return (time.perf_counter() - start) * 1e3 / tokens


def _decode(args: argparse.Namespace, engines: dict[str, Engine], tok: Tokenizer) -> None:
    prompt = tok.encode(PROMPT)
    print(f"\n## decode: {args.tokens} greedy tokens after a {len(prompt)}-token prompt, no speculation, ")
    print(f"## {args.rounds} rounds, engines alternating; median ms per token (batch 1) or per step (batch n)")
    for batch in (1, args.batch):
        prompts = [prompt] * batch
        times: dict[str, list[float]] = {n: [] for n in engines}
        for e in engines.values():
            _timed(e, prompts, 8)  # warm: kernels built, buffers sized
        for _ in range(args.rounds):
            for name, e in engines.items():
                times[name].append(_timed(e, prompts, args.tokens))
        med = {n: statistics.median(t) for n, t in times.items()}
        cells = "  ".join(f"{n} {m:.2f} ms" for n, m in med.items())
        print(f"batch {batch:2}: {cells}  ->  blocks is {med['dense'] / med['blocks']:.2f}x dense, "
              f"{med['fp32'] / med['blocks']:.2f}x fp32")  # fmt: skip
        if batch == 1:
            _bandwidth(engines, med)


def _bandwidth(engines: dict[str, Engine], ms_per_token: dict[str, float]) -> None:
    """Batch-1 decode against the memory: each engine's bytes read per token over its ms a token,
    against a STREAM-like read of 1 GiB (measure/hw.py: torch.sum over fp32, far past the
    last-level cache) on the same threads, measured here, right after the decode timings."""
    buf = hw.read_buffer(torch.device("cpu"), 1 << 30)
    hw.read_bandwidth(buf)  # first touch
    reads = [hw.read_bandwidth(buf) for _ in range(5)]
    del buf
    read = statistics.median(reads)
    print(f"memory read: {read:.1f} GB/s (torch.sum over 1024 MiB of fp32, {torch.get_num_threads()} threads, "
          f"median of 5: {min(reads):.1f}..{max(reads):.1f})")  # fmt: skip
    for name, e in engines.items():
        nbytes = e.model.weight_bytes
        rate = nbytes / (ms_per_token[name] / 1e3) / 1e9
        print(f"batch 1 {name:6}: {nbytes / 1e6:6.1f} MB a token (weights) / {ms_per_token[name]:.2f} ms = "
              f"{rate:5.1f} GB/s = {100 * rate / read:3.0f}% of the memory read")  # fmt: skip


def _prefill(args: argparse.Namespace, engines: dict[str, Engine], tok: Tokenizer) -> None:
    """A prompt's prefill alone (max_tokens 1): what a decode worker's running streams wait for
    when it prefills locally, the blocks dequantized into the GEMM past kernel.MAX_ROWS rows."""
    text = tok.encode(TEXT.read_text())
    print(f"\n## prefill: a prompt of n tokens and its first token, {args.rounds} rounds, engines alternating")
    print("## (each round a prompt of its own: no prefix-cache hit); median ms")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for n in (12, 48, 400):
        times: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.rounds + 1):
            for name, e in engines.items():
                prompt = text[r * 7 + len(name) : r * 7 + len(name) + n]
                start = time.perf_counter()
                e.generate([prompt], params)
                if r:  # the first round warms
                    times[name].append((time.perf_counter() - start) * 1e3)
        med = {name: statistics.median(t) for name, t in times.items()}
        cells = "  ".join(f"{name} {m:.1f} ms" for name, m in med.items())
        print(f"{n:4} tokens: {cells}  ->  blocks takes {med['blocks'] / med['dense']:.2f}x dense's time")


def _crossover(engines: dict[str, Engine], rows_list: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256)) -> None:
    """Every layer's qkv, o, gate_up and down matrices: the blocks engine's (the kernel, or the GEMM
    past kernel.max_rows) against the dense engine's bf16 matrices, at each number of rows: a decode
    batch (1 to 64) and a prefill chunk (16 to 256). All the layers in turn, so the weights come from
    memory as in a step, not from cache."""
    from splitserve.engine.kernels.linear import linear

    slots = ("qkv", "o", "gate_up", "down")
    blocks = [getattr(layer, s) for layer in engines["blocks"].model.layers for s in slots]
    dense = [getattr(layer, s) for layer in engines["dense"].model.layers for s in slots]
    if not blocks or not all(isinstance(w, QuantizedWeight) for w in blocks):
        return
    dtype = engines["blocks"].model.dtype
    formats = "+".join(sorted({f for w in blocks for f in w.format_names}))
    print(f"\n## the linear layers: {len(blocks)} matrices ({formats}) against the dense engine's {dtype} ones,")
    print(f"## all layers in turn; {torch.get_num_threads()} threads, best of 3; ms for all of them")
    for rows in rows_list:
        xs = {w.k: torch.randn(rows, w.k).to(dtype) for w in blocks}
        best = {"blocks": math.inf, "dense": math.inf}
        for _ in range(3):
            start = time.perf_counter()
            for w in blocks:
                w.linear(xs[w.k])
            mid = time.perf_counter()
            for d in dense:
                linear(xs[d.shape[1]], d)
            end = time.perf_counter()
            best["blocks"] = min(best["blocks"], (mid - start) * 1e3)
            best["dense"] = min(best["dense"], (end - mid) * 1e3)
        path = "kernel" if rows <= quant.max_rows() else "dequantize + GEMM"
        print(f"{rows:3} rows: blocks {best['blocks']:7.2f} ms ({path:17})  dense {best['dense']:7.2f} ms  ->  "
              f"blocks is {best['dense'] / best['blocks']:.2f}x dense")  # fmt: skip


def _avx2_path(engines: dict[str, Engine], rows_list: tuple[int, ...] = (1, 4, 8, 16, 32, 64, 256)) -> None:
    """The same matrices on the AVX2 paths, the AVX-512 ones masked off: the blocks' (quant.cpp path 1,
    fp32 x, what an AVX2 machine runs: its tuned dtype is float32) against the fp32 engine's dense
    matrices on linear.cpp's AVX2 path; past linear.cpp's 32 rows the dense matrices take oneDNN's
    GEMM, which picks its own ISA (AVX-512 here: the dense side's figure is then not AVX2's)."""
    from splitserve.engine.kernels import linear as dense_kernel

    ext = dense_kernel._EXT.get()
    if quant.best_path() < 1 or ext is None:
        return
    slots = ("qkv", "o", "gate_up", "down")
    blocks = [getattr(layer, s) for layer in engines["blocks"].model.layers for s in slots]
    dense = [getattr(layer, s) for layer in engines["fp32"].model.layers for s in slots]
    if not all(isinstance(w, QuantizedWeight) for w in blocks):
        return
    print(f"\n## the AVX2 paths (AVX-512 masked off): the same {len(blocks)} matrices, fp32 x, the blocks")
    print("## against the float32 engine's; all layers in turn, best of 3, ms for all of them")
    for rows in rows_list:
        xs = {w.k: torch.randn(rows, w.k) for w in blocks}
        best = {"blocks": math.inf, "dense": math.inf}
        for _ in range(3):
            start = time.perf_counter()
            _avx2_blocks(ext, blocks, xs, rows)
            mid = time.perf_counter()
            _avx2_dense(ext, dense, xs, rows)
            end = time.perf_counter()
            best["blocks"] = min(best["blocks"], (mid - start) * 1e3)
            best["dense"] = min(best["dense"], (end - mid) * 1e3)
        print(f"{rows:3} rows: blocks {best['blocks']:7.2f} ms  dense fp32 {best['dense']:7.2f} ms  ->  "
              f"blocks is {best['dense'] / best['blocks']:.2f}x dense (AVX2)")  # fmt: skip


def _avx2_blocks(ext: Any, blocks: list[QuantizedWeight], xs: dict[int, torch.Tensor], rows: int) -> None:
    """As the engine runs them on fp32 x: the kernel up to quant.TILE_MAX_ROWS (in registers up to
    quant.MAX_ROWS, then through scratch), else the matrix dequantized into linear.py's `linear`."""
    for w in blocks:
        if rows > quant.TILE_MAX_ROWS:
            _avx2_dense(ext, [w.dequantize(torch.float32)], xs, rows)
            continue
        for p in w.parts:
            quant.on_path(xs[w.k], p.fmt, p.data, w.k, 1, exact=True)


def _avx2_dense(ext: Any, dense: list[torch.Tensor], xs: dict[int, torch.Tensor], rows: int) -> None:
    """linear.py's `linear` on fp32 weights, its kernel held to the AVX2 path."""
    from splitserve.engine.kernels import linear as dense_kernel

    for d in dense:
        x = xs[d.shape[1]]
        if rows <= dense_kernel.MAX_ROWS_F32:
            dense_kernel._run(ext, x, d, None, 1)
        else:
            F.linear(x, d)


# --------------------------------------------------------------- accuracy


def _accuracy(args: argparse.Namespace, engines: dict[str, Engine], tok: Tokenizer) -> None:
    text = tok.encode(TEXT.read_text())[: args.ppl_tokens]
    print(f"\n## accuracy: {len(text)} tokens of {TEXT.name}, one decode step per token, against fp32")
    ref = decode_logits(engines["fp32"], text)
    ref_ppl = math.exp(-float(logprobs_of(ref, text).mean()))
    # the blocks in a float32 engine too: x in fp32 against the blocks dequantized in registers
    blocks_fp32, _ = Engine.from_path(args.model, EngineConfig(dtype="float32", quantization="auto"), progress=False)
    try:
        variants = {**{n: engines[n] for n in ("blocks", "dense")}, "blocks in float32": blocks_fp32}
        _print_accuracy(variants, text, ref, ref_ppl)
    finally:
        blocks_fp32.close()


def _print_accuracy(variants: dict[str, Engine], text: list[int], ref: torch.Tensor, ref_ppl: float) -> None:
    for name, engine in variants.items():
        logits = decode_logits(engine, text)
        ppl = math.exp(-float(logprobs_of(logits, text).mean()))
        top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        print(
            f"{name:17} perplexity {ppl:.4f} against fp32's {ref_ppl:.4f} ({(ppl / ref_ppl - 1) * 100:+.2f}%), "
            f"top-1 agreement {top1 * 100:.2f}%"
        )


# --------------------------------------------------------------- capacity


def _capacity(args: argparse.Namespace, engines: dict[str, Engine], resident: dict[str, int]) -> None:
    budget = int(args.budget_mib * (1 << 20))
    print(f"\n## capacity: KV blocks in a {args.budget_mib:g} MiB worker once its resident weights are in")
    blocks = {}
    for name in ("blocks", "dense"):
        left = budget - resident[name]
        layout = engines[name].layout
        blocks[name] = pool_blocks(layout, left) if left > 0 else 0
        tokens = blocks[name] * layout.block_size
        print(
            f"{name:7} {left / (1 << 20):8.1f} MiB left: {blocks[name]} blocks ({tokens} tokens of {layout.dtype} KV)"
        )
    print(f"blocks holds {blocks['blocks'] / max(1, blocks['dense']):.2f}x the dense engine's KV")


# ------------------------------------------------------------ determinism


def _determinism(engine: Engine, tok: Tokenizer, label: str) -> None:
    prompt = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=3)
    others = [tok.encode(f"Question {i}: what is {i} times {i + 3}?") for i in range(7)]
    before = torch.get_num_threads()
    runs = {}
    try:
        torch.set_num_threads(1)
        runs["alone, 1 thread"] = engine.generate([prompt], params)[0]
        torch.set_num_threads(2)
        runs["alone, 2 threads"] = engine.generate([prompt], params)[0]
        batch = [prompt, *others]
        runs["in a batch of 8, 2 threads"] = engine.generate(batch, [params] + [SamplingParams(max_tokens=48)] * 7)[0]
    finally:
        torch.set_num_threads(before)
    first = next(iter(runs.values()))
    for how, toks in runs.items():
        print(f"{label:18} {how:28} {len(toks)} tokens, {'identical' if toks == first else 'DIFFERENT'}")
