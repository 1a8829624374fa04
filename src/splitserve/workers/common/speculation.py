"""The speculative-decoding flags of every command that builds an engine (engine/spec/)."""

from __future__ import annotations

import argparse
from typing import Any

from splitserve.engine.config import SPECULATIVE_MODES

# The default on a CPU (bench/results/spec-cpu.txt): on a load that copies its prompt auto
# decodes about as fast as always drafting, and on ShareGPT, where drafts rarely pay, it measures
# that and keeps to plain decode. On CUDA speculation is off unless asked for: a draft's rows
# leave the CUDA graphs, and the GPU's matrix products change kernels with the row count
# (engine/kernels/triton_decode_ops.py), so its tokens are not bit for bit plain decode's there;
# neither has been measured.
DEFAULT_CPU = "auto"


def add_speculation_arguments(p: argparse._ActionsContainer) -> None:  # a parser or one of its groups
    p.add_argument(
        "--speculative",
        default=None,
        choices=list(SPECULATIVE_MODES),
        help="speculative decoding by prompt lookup (n-gram drafts from the request's own tokens, verified in the "
        "decode step, the output token for token what decoding without it gives): auto drafts where each "
        "sequence's measured acceptance pays for the draft's rows at the measured step cost, ngram always drafts, "
        f"off never (default: {DEFAULT_CPU} on a CPU, off on CUDA)",
    )
    p.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="draft tokens a sequence verifies in a step at most"
    )
    p.add_argument("--ngram-min", type=int, default=2, help="the shortest suffix a draft is looked up by (tokens)")
    p.add_argument(
        "--ngram-max", type=int, default=4, help="the longest suffix a draft is looked up by (tokens; longest first)"
    )


def speculation_fields(a: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's speculation fields from `add_speculation_arguments`' flags."""
    return {
        "speculative": a.speculative or (DEFAULT_CPU if a.device == "cpu" else "off"),
        "num_speculative_tokens": a.num_speculative_tokens,
        "ngram_min": a.ngram_min,
        "ngram_max": a.ngram_max,
    }
