"""A deployment (model, GPU, budget, tensor parallelism, network) and what the
workload's mean request costs on it, in replica-seconds.

A replica is `tp` GPUs serving one copy of the model. `request_costs` puts the
roofline and the capacity arithmetic together: the mean request's prefill time,
the decode batch that fits in memory and meets the TPOT objective, the decode
time the request takes from that batch, and its KV transfer, whole and pipelined.
The checks and the recommendation read these numbers and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from splitserve.plan import capacity, roofline
from splitserve.plan.costs import pipelined_tail_s
from splitserve.plan.hardware import Accelerator, Network
from splitserve.plan.roofline import Efficiency
from splitserve.plan.shapes import ModelShape
from splitserve.plan.sim.workload import Workload


@dataclass(frozen=True)
class Deployment:
    shape: ModelShape
    gpu: Accelerator
    gpus: int  # the whole budget
    tp: int  # tensor-parallel size of one replica
    network: Network
    weight_dtype_bytes: float = 2.0
    kv_dtype_bytes: float = 2.0
    eff: Efficiency = Efficiency()
    reserve: float = capacity.ACTIVATION_RESERVE
    max_num_seqs: int = 256  # the engine's cap on a running batch (vLLM's default too)

    def __post_init__(self) -> None:
        if self.tp <= 0 or self.gpus <= 0:
            raise ValueError("gpus and tp must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.gpus < self.tp:
            raise ValueError(f"{self.gpus} GPUs cannot hold one replica of tensor-parallel size {self.tp}")

    @property
    def replicas(self) -> int:
        return self.gpus // self.tp

    @property
    def weight_bytes_per_gpu(self) -> float:
        return capacity.weight_bytes_per_gpu(self.shape, self.weight_dtype_bytes, self.tp)

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        return capacity.kv_bytes_per_token_per_gpu(self.shape, self.kv_dtype_bytes, self.tp)

    def prefill_s(self, tokens: int, cached: int = 0) -> float:
        return roofline.prefill_seconds(
            self.shape, self.gpu, tokens, self.tp, self.weight_dtype_bytes, self.eff, cached
        )

    def prefill_compute_s(self, tokens: int, cached: int = 0) -> float:
        return roofline.prefill_compute_seconds(self.shape, self.gpu, tokens, self.tp, self.eff, cached)

    def decode_step_s(self, batch: int, context: int) -> float:
        return roofline.decode_step_seconds(
            self.shape, self.gpu, batch, context, self.tp, self.weight_dtype_bytes, self.kv_dtype_bytes, self.eff
        )

    def transfer_s(self, tokens: int) -> float:
        """The KV of `tokens` tokens over the network, one message per layer. Each GPU of a
        replica sends its own KV shard over its own NIC (one NIC per GPU, as in DGX-class nodes)."""
        net = self.network
        nbytes = tokens * self.kv_bytes_per_token_per_gpu
        return capacity.transfer_seconds(nbytes, net.bytes_per_s, net.latency_s, self.shape.layers)

    def does_not_fit(self, context: int) -> str | None:
        """Why not one request of `context` tokens fits beside the weights, or None when one does."""
        short = self.shortfall(context)
        return None if short is None else f"{short}: raise --tp or lower --weight-dtype"

    def shortfall(self, context: int) -> str | None:
        """What does not fit in what (no advice), or None when one request of `context` tokens fits."""
        if self.max_batch(context) > 0:
            return None
        room = self.gpu.memory_bytes * (1 - self.reserve)
        return (
            f"{self.weight_bytes_per_gpu / 1e9:.1f} GB of weights per GPU (TP {self.tp}) and one request's KV "
            f"({context * self.kv_bytes_per_token_per_gpu / 1e9:.2f} GB) do not fit in {room / 1e9:.1f} GB of "
            f"{self.gpu.name}"
        )

    def exposed_transfer_s(self, tokens: int, cached: int = 0) -> float:
        """What is left of the transfer after the prefill of `tokens` ends, layers sent as they finish."""
        return pipelined_tail_s(self.transfer_s(tokens), self.prefill_s(tokens, cached), self.shape.layers)

    def max_batch(self, context: int) -> int:
        """Requests of `context` tokens whose KV fits on a replica at once."""
        return capacity.max_concurrent_requests(
            self.gpu.memory_bytes, self.weight_bytes_per_gpu, context * self.kv_bytes_per_token_per_gpu, self.reserve
        )


def tp_sizes(shape: ModelShape, gpus: int) -> list[int]:
    """The tensor-parallel sizes a replica may take: powers of two up to the GPU budget that split the
    attention heads evenly (a size past the KV heads replicates them, as the engine does)."""
    sizes, tp = [], 1
    while tp <= gpus:
        if shape.heads % tp == 0:
            sizes.append(tp)
        tp *= 2
    return sizes


def smallest_fitting_tp(dep: Deployment, context: int) -> Deployment | None:
    """`dep` at the smallest tensor-parallel size (`tp_sizes`) where one request of `context`
    tokens fits beside the weights, or None when none up to the budget does."""
    for tp in tp_sizes(dep.shape, dep.gpus):
        candidate = replace(dep, tp=tp)
        if candidate.does_not_fit(context) is None:
            return candidate
    return None


class DeploymentCosts:
    """The simulator's `CostModel` (plan/costs.py) of a Deployment: its roofline step times for one
    replica, and of its KV transfer what the layers sent during the prefill leave after it."""

    def __init__(self, dep: Deployment) -> None:
        self.dep = dep

    def prefill_s(self, tokens: int, cached_tokens: int = 0) -> float:
        return float(self.dep.prefill_s(tokens, cached_tokens)) if tokens > 0 else 0.0

    def decode_step_s(self, batch: int, context_tokens_total: int) -> float:
        per_request = round(context_tokens_total / batch) if batch else 0  # the deployment's is per request
        return float(self.dep.decode_step_s(batch, per_request))

    def transfer_s(self, tokens: int) -> float:
        return float(self.dep.exposed_transfer_s(tokens)) if tokens > 0 else 0.0


class RequestCosts(NamedTuple):
    prefill_s: float  # the mean prompt's uncached part, on one replica
    decode_batch: int  # requests decoded together: fits in memory, max_num_seqs and the TPOT objective
    decode_step_s: float  # one step at that batch, at the mean context
    decode_s: float  # replica-seconds of decode one request takes: output * step / batch
    fits_memory: int  # the batch memory alone allows
    kv_bytes: float  # the KV a prefill worker sends for the mean prompt (all GPUs of a replica)
    transfer_s: float  # whole, at the network's effective rate
    transfer_exposed_s: float  # what is left after prefill ends, with layer pipelining

    @property
    def decode_share(self) -> float:
        return self.decode_s / (self.prefill_s + self.decode_s)


def largest_batch_within(dep: Deployment, context: int, most: int, step_limit_s: float) -> int:
    """The largest batch <= `most` whose decode step takes at most `step_limit_s` (at least 1):
    a step only grows with the batch, so a bisection finds it."""
    lo, hi = 1, max(1, most)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if dep.decode_step_s(mid, context) <= step_limit_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def request_costs(dep: Deployment, wl: Workload) -> RequestCosts:
    prompt, output = round(wl.prompt.mean), max(1, round(wl.output.mean))
    prefill = dep.prefill_s(wl.uncached_prompt, wl.cached_prompt)
    fits = dep.max_batch(prompt + output)
    mean_context = prompt + output // 2
    batch = largest_batch_within(dep, mean_context, min(fits, dep.max_num_seqs), wl.tpot_slo_s)
    step = dep.decode_step_s(batch, mean_context)
    whole = dep.transfer_s(wl.uncached_prompt)
    return RequestCosts(
        prefill_s=prefill,
        decode_batch=batch,
        decode_step_s=step,
        decode_s=output * step / batch,
        fits_memory=fits,
        kv_bytes=wl.uncached_prompt * dep.shape.kv_bytes_per_token(dep.kv_dtype_bytes),
        transfer_s=whole,
        transfer_exposed_s=dep.exposed_transfer_s(wl.uncached_prompt, wl.cached_prompt),
    )
