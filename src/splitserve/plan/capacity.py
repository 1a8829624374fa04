"""Memory arithmetic: how much KV a request holds, how many requests fit beside the
weights, how long a context fits at a given concurrency, and how long the KV takes
to cross the network, whole and with layer pipelining.

Every function takes bytes and seconds and returns bytes, seconds or counts; the
reserve for activations and the runtime is a parameter (vLLM leaves 10% of the
device by default, `gpu_memory_utilization=0.9`).
"""

from __future__ import annotations

import math

from splitserve.plan.costs import pipelined_tail_s
from splitserve.plan.shapes import ModelShape

# The share of device memory kept for activations, CUDA graphs and the runtime.
ACTIVATION_RESERVE = 0.10


def kv_bytes_per_request(shape: ModelShape, tokens: int, kv_dtype_bytes: float) -> float:
    return shape.kv_bytes_per_token(kv_dtype_bytes) * tokens


def kv_bytes_per_token_per_gpu(shape: ModelShape, kv_dtype_bytes: float, tp: int) -> float:
    """Tensor parallelism splits the KV heads across GPUs, as far as there are heads to split;
    MLA's latent is one vector per token, so every GPU holds all of it."""
    shards = 1 if shape.kv_latent_dim else min(tp, shape.kv_heads)
    return shape.kv_bytes_per_token(kv_dtype_bytes) / shards


def weight_bytes_per_gpu(shape: ModelShape, weight_dtype_bytes: float, tp: int) -> float:
    """Tensor parallelism splits every matrix `tp` ways (norms and the like are too small to count)."""
    return shape.weight_bytes(weight_dtype_bytes) / tp


def kv_budget_bytes(memory_bytes: float, weight_bytes: float, reserve: float = ACTIVATION_RESERVE) -> float:
    """What is left for the KV cache on one device after the weights and the reserve (never negative)."""
    return max(0.0, memory_bytes * (1.0 - reserve) - weight_bytes)


def max_concurrent_requests(
    memory_bytes: float, weight_bytes: float, kv_bytes_per_request: float, reserve: float = ACTIVATION_RESERVE
) -> int:
    """Requests whose whole KV fits at once beside the weights."""
    return math.floor(kv_budget_bytes(memory_bytes, weight_bytes, reserve) / kv_bytes_per_request)


def max_context_tokens(
    memory_bytes: float,
    weight_bytes: float,
    kv_bytes_per_token: float,
    concurrency: int,
    reserve: float = ACTIVATION_RESERVE,
) -> int:
    """The longest context each of `concurrency` requests can hold at once."""
    return math.floor(kv_budget_bytes(memory_bytes, weight_bytes, reserve) / concurrency / kv_bytes_per_token)


def transfer_seconds(nbytes: float, bytes_per_s: float, latency_s: float = 0.0, messages: int = 1) -> float:
    """Bytes over a link, plus a latency per message."""
    return nbytes / bytes_per_s + latency_s * messages


def kv_transfer_seconds(nbytes: float, bytes_per_s: float, prefill_s: float, layers: int) -> tuple[float, float]:
    """A prompt's KV over a link: whole, and what is left after prefill ends when each layer is sent
    as soon as it is computed (the simulator's `pipelined_tail_s`: the last layer's share when the
    link keeps up, else the backlog)."""
    whole = transfer_seconds(nbytes, bytes_per_s)
    return whole, pipelined_tail_s(whole, prefill_s, layers)
