"""Roofline estimates of a prefill and of a decode step.

A step takes the longer of its FLOPs at the compute peak and its bytes at the memory
bandwidth, each derated by an efficiency (`Efficiency`, stated, not measured),
plus, under tensor parallelism, two all-reduces of the activations per layer over
the interconnect. Prefill is FLOP-bound for all but short prompts; decode reads
every weight and every cached token's KV once per step, so it is bandwidth-bound
until the batch is large.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.plan.capacity import kv_bytes_per_token_per_gpu
from splitserve.plan.hardware import Accelerator
from splitserve.plan.shapes import ModelShape

ACTIVATION_BYTES = 2.0  # bf16 activations on the wire
ALLREDUCE_LATENCY_S = 10e-6  # per all-reduce: a kernel launch and a hop


@dataclass(frozen=True)
class Efficiency:
    """The share of the datasheet peak a real kernel reaches."""

    compute: float = 0.5  # model FLOPs utilisation of a prefill
    memory: float = 0.8  # share of HBM bandwidth a decode step's reads reach

    def __post_init__(self) -> None:
        if not (0 < self.compute <= 1 and 0 < self.memory <= 1):
            raise ValueError("efficiencies must be in (0, 1]")


def allreduce_seconds(shape: ModelShape, gpu: Accelerator, tokens: int, tp: int) -> float:
    """Two ring all-reduces per layer (after attention and after the MLP) of tokens x hidden:
    each GPU sends and receives 2 (tp - 1) / tp of the buffer."""
    if tp == 1:
        return 0.0
    nbytes = tokens * shape.hidden * ACTIVATION_BYTES
    one = 2 * (tp - 1) / tp * nbytes / gpu.interconnect_bytes_per_s + ALLREDUCE_LATENCY_S
    return 2 * shape.layers * one


def weight_bytes_read(shape: ModelShape, weight_dtype_bytes: float, batch: int) -> float:
    """Weights one forward pass reads. Dense: all of them. A mixture of experts reads its shared
    part and the routed experts its `batch` tokens touch: each expert is missed by one token with
    probability 1 - k/E, so a share 1 - (1 - k/E)^batch of them is touched (routing taken as uniform)."""
    if not shape.is_moe:
        return shape.weight_bytes(weight_dtype_bytes)
    share = shape.active_experts / shape.experts
    routed = (shape.total_params - shape.active_params) / (1 - share)  # every routed expert's parameters
    always = shape.active_params - routed * share
    touched = 1 - (1 - share) ** batch
    return (always + routed * touched) * weight_dtype_bytes


def prefill_seconds(
    shape: ModelShape,
    gpu: Accelerator,
    tokens: int,
    tp: int = 1,
    weight_dtype_bytes: float = 2.0,
    eff: Efficiency = Efficiency(),
    cached: int = 0,
) -> float:
    """One prompt's prefill of `tokens` uncached tokens after `cached` cached ones."""
    compute = shape.prefill_flops(tokens, cached) / (tp * gpu.bf16_flops * eff.compute)
    memory = weight_bytes_read(shape, weight_dtype_bytes, tokens) / (tp * gpu.hbm_bytes_per_s * eff.memory)
    return max(compute, memory) + allreduce_seconds(shape, gpu, tokens, tp)


def prefill_compute_seconds(
    shape: ModelShape, gpu: Accelerator, tokens: int, tp: int = 1, eff: Efficiency = Efficiency(), cached: int = 0
) -> float:
    """A prompt's FLOPs alone: what it adds to a decode step it rides along in (chunked prefill),
    whose weights the step reads anyway."""
    return shape.prefill_flops(tokens, cached) / (tp * gpu.bf16_flops * eff.compute)


def decode_step_seconds(
    shape: ModelShape,
    gpu: Accelerator,
    batch: int,
    context: int,
    tp: int = 1,
    weight_dtype_bytes: float = 2.0,
    kv_dtype_bytes: float = 2.0,
    eff: Efficiency = Efficiency(),
) -> float:
    """One decode step of `batch` requests each at `context` positions: weights plus every
    request's KV read once, against one token's FLOPs per request."""
    kv = batch * context * kv_bytes_per_token_per_gpu(shape, kv_dtype_bytes, tp)
    memory = (weight_bytes_read(shape, weight_dtype_bytes, batch) / tp + kv) / (gpu.hbm_bytes_per_s * eff.memory)
    compute = batch * shape.decode_flops(context) / (tp * gpu.bf16_flops * eff.compute)
    return max(memory, compute) + allreduce_seconds(shape, gpu, batch, tp)
