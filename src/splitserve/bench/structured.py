"""What structured output costs: decode step time with and without a JSON schema, side by side.

    splitserve bench structured [--dtype float32] [--batches 1,8] [--steps 48] [--repeats 3]

On the default model: the grammar compiler's one-time setup (the tokenizer's trie), a schema's
compile time (fresh schemas, cold cache), then per batch size the decode step of requests
without a grammar against the same requests under a JSON schema, the two run back to back in
each repetition, and the grammar's share of the step (the mask fill on its own thread, whatever
of it the forward pass did not hide, and the masking itself). The issue's bound: the mask must
not double the step (ratio < 2).

Each step timed is a pure decode step of the whole batch (the prefill step and the steps after
the first request finished are left out). The schema (an array of records with free-text
fields) does not end within the steps measured, so both sides decode the same number of steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

from splitserve.bench.step_timer import decode_step_ms
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.grammar import GrammarCompiler
from splitserve.engine.sampling import GrammarSpec, SamplingParams
from splitserve.engine.tokenizer import Tokenizer
from splitserve.measure.hw import machine_line

# Records with free text: long enough that no request finishes its grammar within --steps.
RECORDS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "role": {"enum": ["engineer", "teacher", "doctor", "artist"]},
                    "bio": {"type": "string"},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "age", "role", "bio", "address"],
            },
        }
    },
    "required": ["people"],
}
PROMPT = "Write a long list of people with their biographies, as JSON."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", help="the engine's dtype (float32, bfloat16)")
    p.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--steps", type=int, default=48, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=3, help="repetitions; each runs both sides back to back")
    p.add_argument("--schemas", type=int, default=5, help="fresh schemas compiled for the compile time")


def run(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"# splitserve bench structured --dtype {args.dtype} --batches {args.batches} --steps {args.steps} "
        f"--repeats {args.repeats}"
    )
    print(machine_line())
    engine, tokenizer = Engine.from_path(None, EngineConfig(num_blocks=1024, dtype=args.dtype), progress=False)
    _compile_times(tokenizer, engine, args.schemas)
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    spec = GrammarSpec("json_schema", json.dumps(RECORDS))
    worst = 0.0
    for batch in batches:
        worst = max(worst, _compare(engine, prompt, spec, batch, args.steps, args.repeats))
    verdict = "met" if worst < 2.0 else "NOT met"
    print(f"bound: a schema's step at most 2x the plain step at every batch size: worst {worst:.2f}x, {verdict}")
    return 0


def _compile_times(tokenizer: Tokenizer, engine: Engine, count: int) -> None:
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, engine.model_cfg.vocab_size, engine.runner.eos_token_ids)
    setup = time.perf_counter() - t0
    times = []
    for i in range(count):  # a property renamed each time: nothing comes from the compile cache
        schema = json.loads(json.dumps(RECORDS).replace('"bio"', f'"bio{i}"'))
        t0 = time.perf_counter()
        compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
        times.append(time.perf_counter() - t0)
    print(
        f"grammar compiler setup (once per worker: the tokenizer's {engine.model_cfg.vocab_size}-token trie): "
        f"{setup * 1e3:.0f} ms"
    )
    print(
        f"compile of a nested JSON schema, cold: median {statistics.median(times) * 1e3:.1f} ms "
        f"(of {count}: {', '.join(f'{t * 1e3:.1f}' for t in times)} ms); a repeated schema is a cache hit"
    )


def _compare(engine: Engine, prompt: list[int], spec: GrammarSpec, batch: int, steps: int, repeats: int) -> float:
    """Median step (ms) without and with the schema at one batch size; prints both and the ratio."""
    plain_ms, schema_ms, ratios = [], [], []
    base = SamplingParams(max_tokens=steps + 2, temperature=0.8, seed=1, ignore_eos=True)
    for r in range(repeats):
        plain = decode_step_ms(engine, prompt, base, batch, steps, f"p{r}")
        constrained = decode_step_ms(engine, prompt, dataclasses.replace(base, grammar=spec), batch, steps, f"s{r}")
        plain_ms.append(plain)
        schema_ms.append(constrained)
        ratios.append(constrained / plain)
    ratio = statistics.median(ratios)
    print(
        f"batch {batch:<3} decode step: plain {statistics.median(plain_ms):.1f} ms | JSON schema "
        f"{statistics.median(schema_ms):.1f} ms | ratio {ratio:.2f}x (per repetition: "
        f"{' '.join(f'{x:.2f}' for x in ratios)})"
    )
    return ratio
