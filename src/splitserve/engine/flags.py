"""The engine's command-line flags and the EngineConfig built from them, beside the config
(engine/config.py), for every command that builds an engine: `splitserve serve` (its pools),
`splitserve worker` and `splitserve generate --local`. The router's flags sit beside its config
the same way (router/flags.py).
"""

from __future__ import annotations

import argparse
from typing import Any

from splitserve.engine.config import BATCH_INVARIANCE, KV_CACHE_DTYPES, QUANTIZATIONS, SPECULATIVE_MODES, EngineConfig
from splitserve.engine.itl_budget import ITL_TARGET_FLAG_DEFAULT
from splitserve.engine.prefill_order import AGING_TOKENS_PER_S, PREFILL_ORDERS
from splitserve.engine.tuned import chunk_tokens, fill_tuned, tuned_for


def add_engine_arguments(p: argparse._ActionsContainer) -> None:  # a parser or one of its groups
    """Model and engine flags shared by every command that builds an engine."""
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file, Hugging Face directory, or an embedded model: smollm2-135m (the default, "
        "SmolLM2-135M-Instruct) or gemma3-270m (Gemma 3 270M pretrained, Q4_K_M)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 | bfloat16 | float16 (default: tuned: bfloat16 on CUDA and on a CPU with bf16 arithmetic, "
        "avx512_bf16 or amx_bf16; else float32)",
    )
    add_weight_arguments(p)
    add_kv_cache_arguments(p)
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one step at most (the batch)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"tokens per step (the prefill chunk; default {chunk_tokens('prefill')} on a prefill worker, which has "
        f"no decodes to interleave, {chunk_tokens(None)} elsewhere)",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="a prompt with more tokens than this left to prefill lets a waiting prompt this short go first "
        "(0: arrival order; default: tuned, what the peer runs found best)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of each worker (0: torch's own count; default: tuned under serve, its share of the "
        "machine's cores; a worker or generate started alone: torch's own count)",
    )
    add_core_lease_arguments(p)
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="processes splitting each layer's heads and MLP (on CUDA one GPU each, from --device's on); "
        "must divide the model's heads, KV heads and intermediate size",
    )
    add_tier_arguments(p)
    add_speculation_arguments(p)


def add_kv_cache_arguments(p: argparse._ActionsContainer) -> None:
    """The paged KV pool: its size, its storage dtype, its block."""
    p.add_argument("--num-blocks", type=int, default=2048, help="KV cache blocks")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="the KV pool's storage dtype: auto (the model's), bfloat16, float32, int8 or fp8 (e4m3); int8 and fp8 "
        "keep a scale per token and KV head and hold about twice the tokens of bfloat16 in the same bytes",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=0,
        help="size the KV pool in bytes instead (all layers, every rank's shard): the blocks that fit "
        "in the chosen --kv-cache-dtype (0: --num-blocks decides)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")


def add_core_lease_arguments(p: argparse._ActionsContainer) -> None:
    """Core lending between the workers of one machine (engine/core_lease.py)."""
    p.add_argument(
        "--core-lease",
        default=None,
        help="a file in /dev/shm shared by the workers of this machine: a prefill step takes the cores no other "
        "worker's step claims, and gives them back at its next step when they do; --threads is each worker's "
        "own share ('off': off; default: tuned under serve, which makes one for its CPU workers; a worker "
        "started alone: off)",
    )
    p.add_argument(
        "--prefill-order",
        default=None,
        choices=PREFILL_ORDERS,
        help="which waiting prompt starts first: the shortest remaining, a second of waiting counting as "
        f"{AGING_TOKENS_PER_S:g} tokens fewer so that long ones are not starved, or in arrival order "
        "(default: tuned)",
    )
    p.add_argument(
        "--lease-cores",
        type=int,
        default=0,
        help="the cores the --core-lease shares (0: the cores this process may run on)",
    )
    p.add_argument(
        "--decode-borrows",
        default=None,
        choices=["on", "off"],
        help="decode steps borrow the cores no other worker claims too, and give them back at the next step "
        "when a prefill wants them (default: tuned)",
    )


def add_weight_arguments(p: argparse._ActionsContainer) -> None:
    """How the engine holds and multiplies the weights (engine/quant/)."""
    p.add_argument(
        "--quantization",
        default=None,
        choices=list(QUANTIZATIONS),
        help="the weights' format: auto computes a GGUF file's block-format matrices (Q4_0, Q4_1, Q5_0, Q5_1, "
        "Q8_0, Q4_K, Q5_K, Q6_K) on their blocks with the CPU kernels, none dequantizes them into --dtype; "
        "q8_0 and q4_k also quantize a float checkpoint's matrices at load (default: tuned, auto)",
    )
    p.add_argument(
        "--batch-invariant",
        nargs="?",
        const="strict",
        default="on",
        choices=list(BATCH_INVARIANCE),
        help="on: a step's decode rows run as a pure decode step even beside a prefill, and a seeded request "
        "recomputes its outputs one a step after a migration, so that a seed gives one text in every mode; "
        "strict (the flag alone): also every prefill row of a quantized matrix on the decode kernel (prefill runs "
        "slower); off: neither",
    )
    p.add_argument(
        "--itl-target",
        default=ITL_TARGET_FLAG_DEFAULT,
        metavar="auto|off|MS",
        help="what a step beside running streams may last, its prompt tokens capped to fit: auto, twice the "
        "worker's own decode step; a number of milliseconds; off: the whole --max-num-batched-tokens chunk",
    )


def add_tier_arguments(p: argparse._ActionsContainer) -> None:  # a parser or one of its groups
    """The tiers behind a worker's prefix cache (engine/kv_tiers.py)."""
    p.add_argument(
        "--kv-host-tier-mib",
        type=int,
        default=0,
        help="RAM (MiB) for cached KV blocks evicted from the pool; a later prompt with that prefix loads them "
        "back instead of recomputing when that is faster (0: off)",
    )
    p.add_argument(
        "--kv-disk-tier-mib",
        type=int,
        default=0,
        help="disk (MiB) for cached KV blocks evicted from the host tier (or from the pool without one), one "
        "checksummed file per block under --kv-disk-tier-dir (0: off)",
    )
    p.add_argument(
        "--kv-disk-tier-dir",
        default="",
        help="the disk tier's directory; each worker keeps its files in a folder of its own there (workers of a "
        "host may share it), and deletes the folders of workers that are gone (default: a temporary directory)",
    )


def tier_fields(a: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's tier fields from `add_tier_arguments`' flags."""
    return {
        "kv_host_tier_bytes": a.kv_host_tier_mib << 20,
        "kv_disk_tier_bytes": a.kv_disk_tier_mib << 20,
        "kv_disk_tier_dir": a.kv_disk_tier_dir,
    }


# The default on a CPU (bench/results/spec-cpu.txt): on a load that copies its prompt auto
# decodes about as fast as always drafting, and on ShareGPT, where drafts rarely pay, it measures
# that and keeps to plain decode. On CUDA speculation is off unless asked for: a draft's rows
# leave the CUDA graphs, and the GPU's matrix products change kernels with the row count
# (engine/kernels/triton_decode_ops.py), so its tokens are not bit for bit plain decode's there;
# neither has been measured.
SPECULATIVE_ON_CPU = "auto"


def add_speculation_arguments(p: argparse._ActionsContainer) -> None:  # a parser or one of its groups
    """Speculative decoding on the decode worker (engine/spec/)."""
    p.add_argument(
        "--speculative",
        default=None,
        choices=list(SPECULATIVE_MODES),
        help="speculative decoding by prompt lookup (n-gram drafts from the request's own tokens, verified in the "
        "decode step, the output token for token what decoding without it gives): auto drafts where each "
        "sequence's measured acceptance pays for the draft's rows at the measured step cost, ngram always drafts, "
        f"off never (default: {SPECULATIVE_ON_CPU} on a CPU, off on CUDA)",
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
        "speculative": a.speculative or (SPECULATIVE_ON_CPU if a.device == "cpu" else "off"),
        "num_speculative_tokens": a.num_speculative_tokens,
        "ngram_min": a.ngram_min,
        "ngram_max": a.ngram_max,
    }


def engine_config_from_args(a: argparse.Namespace, role: str | None = None) -> EngineConfig:
    """The engine the flags describe for a worker of `role` (None: any); a tuned flag not given takes
    the machine's tuned choice (engine/tuned.py), as `serve` filled it already."""
    a = fill_tuned(a, tuned_for(a.device))
    return EngineConfig(
        device=a.device,
        dtype=a.dtype,
        block_size=a.block_size,
        num_blocks=a.num_blocks,
        kv_cache_dtype=a.kv_cache_dtype,
        kv_cache_bytes=a.kv_cache_bytes,
        quantization=a.quantization,
        batch_invariant=a.batch_invariant,
        itl_target=a.itl_target,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens or chunk_tokens(role),
        long_prefill_token_threshold=a.long_prefill_token_threshold,
        prefill_order=a.prefill_order,
        tensor_parallel_size=a.tensor_parallel_size,
        **tier_fields(a),
        **speculation_fields(a),
    )
