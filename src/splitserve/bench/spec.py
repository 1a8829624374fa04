"""`splitserve bench spec`: speculative decoding against plain decode, side by side in one run.

    splitserve bench spec [--dtype bfloat16] [--threads 1] [--batches 1,4] [--prompts 8]
                          [--max-tokens 128] [--repeats 3] [--modes auto,ngram]

Two loads on the default model, greedy: one that copies from its prompt (repeat a passage,
fix the typos of a passage, add a docstring to a function: the passages from the fixed text
shipped in bench/data/public_domain.txt, the functions from this package's own source), and
ShareGPT's first human turns. Each repetition decodes every load's prompts, a batch at a
time (each of `--batches` in turn), with speculation off and in each `--modes` back to back (the order rotating, so a
neighbour's load falls on every mode alike). A run's decode speed is its output tokens after
each request's first, over the time from the step that gave every request of the group its
first token to the group's last step; the ratio is the median of the repetitions' ratios to
plain decode. Every mode's tokens are compared with plain decode's of the same repetition,
request by request. (Across repetitions plain decode need not agree with itself in bfloat16:
a prompt found in the prefix cache prefills only its tail, in a matrix product of another
shape, whose bfloat16 sums may round a near tie the other way; that count is printed too.)

Targets (issue 22): on the copying load, decode tokens/s at least 1.5x plain decode's with
identical greedy output; on ShareGPT no slower (at least 0.98x: two per cent is about the
spread of plain decode's own repetitions on a shared machine, printed beside it).
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TextIO

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.tokenizer import Tokenizer
from splitserve.measure.hw import code_version, cpu_flags, load_average, machine

TEXT = os.path.join(os.path.dirname(__file__), "data", "public_domain.txt")
COPY_TARGET = 1.5
REPEAT = "Repeat the following text exactly, word for word:\n\n"
FIX = "Fix the typos in this text and return it in full:\n\n"
DOCSTRING = "Add a docstring to this Python function and return the whole function:\n\n"
SHAREGPT_TARGET = 0.98


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bfloat16", help="the engine's dtype (bfloat16, float32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: a decode worker's share of 2 cores)")
    p.add_argument("--batches", default="1,4", help="requests decoding together, comma-separated: each measured")
    p.add_argument("--prompts", type=int, default=8, help="prompts per load")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request at most (greedy, eos on)")
    p.add_argument("--repeats", type=int, default=3, help="repetitions, each running every mode back to back")
    p.add_argument("--modes", default="auto,ngram", help="speculative modes measured against off, comma-separated")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--out", default="bench/results/spec-cpu.txt", help="also write the output here ('': stdout only)")


@dataclass
class Run:
    """One mode's decode of one load in one repetition."""

    outputs: list[list[int]]
    tokens: int  # output tokens after each request's first
    seconds: float
    drafted: int
    accepted: int

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    out = _Tee(args.out)
    modes = ["off", *[m for m in args.modes.split(",") if m and m != "off"]]
    command = " ".join(["splitserve bench spec", *sys.argv[3:]]) if sys.argv[1:3] == ["bench", "spec"] else "spec"
    out.print(
        f"# {command}   [code {code_version()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"CPU flags: {cpu_flags()}; load average {load_average()}]"
    )
    engines = {m: _engine(args, m) for m in modes}
    tok = engines["off"].tokenizer
    assert tok is not None
    out.print(
        f"machine: {machine(torch.device('cpu'))}; torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
        f"model SmolLM2-135M-Instruct in {args.dtype}; greedy, up to {args.max_tokens} tokens; "
        f"--num-speculative-tokens {args.num_speculative_tokens}, --ngram-min 2 --ngram-max 4"
    )
    loads = {"copy": copy_prompts(tok, args.prompts), "sharegpt": sharegpt_prompts(tok, args.prompts)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    verdicts = []
    for batch in (int(b) for b in args.batches.split(",")):
        for name, prompts in loads.items():
            runs = _measure(engines, prompts, params, batch, args.repeats)
            verdicts.append(_report(out, f"{name}, batch {batch}", prompts, runs, modes))
    met = sum(ok for _, ok in verdicts)
    out.print(f"targets: {met} of {len(verdicts)} met" + "".join(f"; NOT met: {n}" for n, ok in verdicts if not ok))
    out.close()
    return 0


def _engine(args: argparse.Namespace, mode: str) -> Engine:
    cfg = EngineConfig(
        num_blocks=2048, dtype=args.dtype, speculative=mode, num_speculative_tokens=args.num_speculative_tokens
    )
    return Engine.from_path(None, cfg, progress=False)[0]


def _measure(
    engines: dict[str, Engine], prompts: list[list[int]], params: SamplingParams, batch: int, repeats: int
) -> dict[str, list[Run]]:
    """Each mode's runs, one per repetition; the modes' order rotates from one repetition to the next."""
    modes = list(engines)
    for m in modes:  # an untimed pass: the kernels built, the step costs of auto measured once
        _decode(engines[m], prompts[:batch], params, batch)
    runs: dict[str, list[Run]] = {m: [] for m in modes}
    for r in range(repeats):
        for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
            runs[m].append(_decode(engines[m], prompts, params, batch))
    return runs


def _decode(engine: Engine, prompts: list[list[int]], params: SamplingParams, batch: int) -> Run:
    """`prompts` decoded `batch` at a time; the decode steps timed (see the module's docstring)."""
    engine.drain_iteration_stats()
    outputs: list[list[int]] = []
    tokens, seconds = 0, 0.0
    for g in range(0, len(prompts), batch):
        ids = [f"{time.monotonic_ns()}-{g + i}" for i in range(len(prompts[g : g + batch]))]
        for rid, p in zip(ids, prompts[g : g + batch], strict=True):
            engine.add_request(rid, p, params)
        got: dict[str, list[int]] = {rid: [] for rid in ids}
        while engine.has_work and not all(got.values()):
            for o in engine.step():
                got[o.request_id].append(o.token_id)
        t0 = time.perf_counter()
        while engine.has_work:
            for o in engine.step():
                got[o.request_id].append(o.token_id)
        seconds += time.perf_counter() - t0
        tokens += sum(len(v) - 1 for v in got.values())
        outputs += [got[rid] for rid in ids]
    it = engine.drain_iteration_stats()
    return Run(outputs, tokens, seconds, it.draft_tokens, it.accepted_draft_tokens)


def _report(out: _Tee, name: str, prompts: list[list[int]], runs: dict[str, list[Run]], modes: list[str]) -> tuple:
    """Print one load's figures; (target name, met) for the first speculative mode (the default, auto)."""
    plain = runs["off"]
    spread = (max(r.tps for r in plain) - min(r.tps for r in plain)) / statistics.median(r.tps for r in plain)
    steady = sum(_same(r, plain[0]) for r in plain[1:])
    out.print(
        f"\n{name}: {len(prompts)} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
        f"{plain[0].tokens + len(prompts)} output tokens"
    )
    out.print(
        f"  off    {statistics.median(r.tps for r in plain):7.1f} tok/s decode (per repetition: "
        f"{' '.join(f'{r.tps:.1f}' for r in plain)}; spread {spread:.1%}); its later repetitions' outputs equal "
        f"its first's in {steady} of {len(prompts) * (len(plain) - 1)}"
    )
    verdict: tuple[str, bool] = (name, False)
    for m in modes[1:]:
        ratios = [s.tps / p.tps for s, p in zip(runs[m], plain, strict=True)]
        same = sum(_same(r, p) for r, p in zip(runs[m], plain, strict=True))
        total = len(prompts) * len(runs[m])
        drafted, accepted = sum(r.drafted for r in runs[m]), sum(r.accepted for r in runs[m])
        ratio = statistics.median(ratios)
        out.print(
            f"  {m:<6} {statistics.median(r.tps for r in runs[m]):7.1f} tok/s decode, {ratio:.2f}x off (per "
            f"repetition: {' '.join(f'{x:.2f}' for x in ratios)}); greedy output identical to off's in {same} of "
            f"{total}; {drafted} draft tokens verified, {accepted} accepted ({accepted / max(drafted, 1):.0%})"
        )
        if m == modes[1]:
            bound = COPY_TARGET if name.startswith("copy") else SHAREGPT_TARGET
            ok = ratio >= bound and same == total
            verdict = (f"{name} {m}", ok)
            out.print(f"  target: {m} >= {bound:.2f}x off with identical output: {'met' if ok else 'NOT met'}")
    return verdict


def _same(run: Run, plain: Run) -> int:
    """Requests of `run` whose tokens are `plain`'s (the same repetition's plain decode)."""
    return sum(o == e for o, e in zip(run.outputs, plain.outputs, strict=True))


def copy_prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    """Requests whose answer copies their prompt: a passage repeated, a passage's typos fixed, a
    docstring added to one of this package's functions; `n` of them, the kinds taken by turns."""
    with open(TEXT, encoding="utf-8") as f:
        passages = [p.strip() for p in f.read().split("\n\n") if len(p.strip()) > 300]
    from splitserve.engine import block_hash, blocks
    from splitserve.engine.spec import ngram, verify

    functions = [inspect.getsource(f) for f in (verify.accepted_tokens, ngram._continue, blocks.cdiv)]
    functions.append(inspect.getsource(block_hash.block_hashes))
    asks = []
    for i in range(n):
        kind, k = i % 3, i // 3
        if kind == 0:
            asks.append(REPEAT + passages[k % len(passages)])
        elif kind == 1:
            asks.append(FIX + _typos(passages[-1 - k % len(passages)]))
        else:
            asks.append(DOCSTRING + functions[k % len(functions)])
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": a}])) for a in asks]


def _typos(text: str) -> str:
    """Every seventh word of 5 letters or more with two letters swapped: a deterministic edit task."""
    words = text.split(" ")
    for i in range(3, len(words), 7):
        w = words[i]
        if len(w) >= 5 and w.isalpha():
            words[i] = w[0] + w[2] + w[1] + w[3:]
    return " ".join(words)


def sharegpt_prompts(tok: Tokenizer, n: int, max_len: int = 512) -> list[list[int]]:
    """ShareGPT's first human turns in the file's order, those of 4..`max_len` tokens, chat-templated."""
    from splitserve.bench.serve.datasets import sharegpt_pairs

    out = []
    for humans, _ in sharegpt_pairs():
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": humans[0]}]))
        if 4 <= len(ids) <= max_len:
            out.append(ids)
        if len(out) == n:
            return out
    raise ValueError(f"sharegpt: only {len(out)} of {n} prompts of at most {max_len} tokens")


class _Tee:
    """Lines to stdout and to the results file (written as they come: a cut run keeps its figures)."""

    def __init__(self, path: str) -> None:
        self.file: TextIO | None = open(path, "w", encoding="utf-8") if path else None

    def print(self, line: str) -> None:
        print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
