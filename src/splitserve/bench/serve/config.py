"""The flags of `splitserve bench serve` and the frozen config built from them."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field

from splitserve.bench.serve.arrivals import parse_rates
from splitserve.bench.serve.backends import BACKENDS, BackendConfig
from splitserve.measure.metrics import parse_goodput

DATASETS = ("sharegpt", "random", "prefix", "burst", "conversation")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--backend", choices=BACKENDS, default="openai-chat")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="OpenAI backends: the server, without /v1")
    g.add_argument("--grpc-address", default="127.0.0.1:50051", help="grpc backend: splitserve's router")
    g.add_argument("--model", default=None, help="model name sent to OpenAI servers (default: the first of /v1/models)")
    g.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)"
    )
    g.add_argument("--tokenizer", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2)")
    g.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens tokens (vLLM's extension)")
    g.add_argument("--timeout-s", type=float, default=600.0, help="per request, the whole answer")

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=DATASETS, default="sharegpt")
    g.add_argument("--num-prompts", type=int, default=100, help="requests per run (conversation: sessions)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output tokens (default: the reply's)")
    g.add_argument("--sharegpt-max-input-len", type=int, default=1024, help="longest prompt kept (vLLM's filter: 1024)")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128, help="random and prefix: output tokens")
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in mean*(1 -/+ ratio)")
    g.add_argument("--prefix-groups", type=int, default=4, help="prefix: distinct shared system prompts")
    g.add_argument("--prefix-len", type=int, default=512, help="prefix: tokens of each shared system prompt")
    g.add_argument("--suffix-len", type=int, default=64, help="prefix: tokens of each request's own part")
    g.add_argument("--turns", type=int, default=3, help="conversation: user turns per session")
    g.add_argument("--conversation-output-len", type=int, default=64, help="conversation: output tokens per turn")
    g.add_argument(
        "--conversation-context-len",
        type=int,
        default=0,
        help="conversation: tokens of a document each session opens with, its own (0: none)",
    )
    g.add_argument(
        "--conversation-think-s",
        type=float,
        default=0.0,
        help="conversation: seconds the user pauses after each answer before the next turn",
    )
    g.add_argument("--burst-steady-streams", type=int, default=4, help="burst: steady streams running throughout")
    g.add_argument("--burst-steady-input-len", type=int, default=32)
    g.add_argument("--burst-steady-output-len", type=int, default=128)
    g.add_argument("--burst-interval-s", type=float, default=8.0, help="burst: quiet spell before each burst")
    g.add_argument("--burst-size", type=int, default=2, help="burst: long prompts sent at once")
    g.add_argument("--burst-input-len", type=int, default=1536)
    g.add_argument("--burst-output-len", type=int, default=4)
    g.add_argument("--burst-count", type=int, default=3, help="burst: bursts in the run")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", default="inf", help="req/s, or a sweep: 0.2,0.4,inf (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    g.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs: ttft, tpot, itl, e2el in ms")

    g = p.add_argument_group("output")
    g.add_argument("--label", default=None, help="the system's name in the results (default: the backend)")
    g.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    g.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


@dataclass(frozen=True)
class DatasetConfig:
    """What to send; lengths in tokens of the tokenizer given."""

    name: str = "sharegpt"
    num_prompts: int = 100  # requests per run (conversation: sessions)
    seed: int = 0
    sharegpt_output_len: int | None = None  # None: the reply's own length
    sharegpt_max_input_len: int = 1024  # vLLM's bound; lower it for a slow server
    random_input_len: int = 1024
    random_output_len: int = 128  # random and prefix
    random_range_ratio: float = 0.0
    prefix_groups: int = 4
    prefix_len: int = 512
    suffix_len: int = 64
    turns: int = 3
    conversation_output_len: int = 64
    conversation_context_len: int = 0  # a document of its own each session opens with (0: none)
    conversation_think_s: float = 0.0  # the user's pause after each answer
    burst_steady_streams: int = 4
    burst_steady_input_len: int = 32
    burst_steady_output_len: int = 128
    burst_interval_s: float = 8.0
    burst_size: int = 2
    burst_input_len: int = 1536
    burst_output_len: int = 4
    burst_count: int = 3

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset {self.name!r}: one of {', '.join(DATASETS)}")
        if self.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError("--random-range-ratio must be in [0, 1)")
        counts = (self.prefix_groups, self.turns, self.burst_steady_streams, self.burst_size, self.burst_count)
        if min(counts) < 1:
            raise ValueError("--prefix-groups, --turns and the burst counts must be >= 1")
        lengths = (
            self.random_input_len,
            self.random_output_len,
            self.prefix_len,
            self.suffix_len,
            self.conversation_output_len,
            self.burst_steady_input_len,
            self.burst_steady_output_len,
            self.burst_input_len,
            self.burst_output_len,
        )
        if (
            min(lengths) < 1
            or self.sharegpt_max_input_len < 4
            or (self.sharegpt_output_len is not None and self.sharegpt_output_len < 1)
        ):
            raise ValueError("token lengths must be >= 1")
        if self.conversation_context_len < 0:
            raise ValueError("--conversation-context-len must be >= 0")
        if not 0 <= self.conversation_think_s < float("inf"):
            raise ValueError("--conversation-think-s must be a number >= 0")
        if not self.burst_interval_s >= 0:
            raise ValueError("--burst-interval-s must be >= 0")


@dataclass(frozen=True)
class BenchConfig:
    backend: BackendConfig
    data: DatasetConfig
    rates: tuple[float, ...]
    burstiness: float
    max_concurrency: int | None
    slos: dict[str, float] = field(default_factory=dict)
    label: str = ""
    json_path: str | None = None
    plot_dir: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.burstiness > 0 or math.isinf(self.burstiness):
            raise ValueError("--burstiness must be a positive number")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if self.data.name == "conversation" and not self.backend.chat:
            raise ValueError("the conversation dataset needs a chat backend (openai-chat or grpc)")


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    grpc = a.backend == "grpc"
    backend = BackendConfig(
        kind=a.backend,
        base_url=None if grpc else a.base_url,
        model=a.model,
        api_key=a.api_key,
        grpc_address=a.grpc_address if grpc else None,
        ignore_eos=a.ignore_eos,
        timeout_s=a.timeout_s,
    )
    return BenchConfig(
        backend=backend,
        data=DatasetConfig(
            name=a.dataset,
            num_prompts=a.num_prompts,
            seed=a.seed,
            sharegpt_output_len=a.sharegpt_output_len,
            sharegpt_max_input_len=a.sharegpt_max_input_len,
            random_input_len=a.random_input_len,
            random_output_len=a.random_output_len,
            random_range_ratio=a.random_range_ratio,
            prefix_groups=a.prefix_groups,
            prefix_len=a.prefix_len,
            suffix_len=a.suffix_len,
            turns=a.turns,
            conversation_output_len=a.conversation_output_len,
            conversation_context_len=a.conversation_context_len,
            conversation_think_s=a.conversation_think_s,
            burst_steady_streams=a.burst_steady_streams,
            burst_steady_input_len=a.burst_steady_input_len,
            burst_steady_output_len=a.burst_steady_output_len,
            burst_interval_s=a.burst_interval_s,
            burst_size=a.burst_size,
            burst_input_len=a.burst_input_len,
            burst_output_len=a.burst_output_len,
            burst_count=a.burst_count,
        ),
        rates=tuple(parse_rates(str(a.request_rate))),
        burstiness=a.burstiness,
        max_concurrency=a.max_concurrency,
        slos=parse_goodput(a.goodput),
        label=a.label or a.backend,
        json_path=a.json,
        plot_dir=a.plot,
        progress=not a.no_progress,
    )
