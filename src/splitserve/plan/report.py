"""A plan as readable text: one section per question, every number with its unit."""

from __future__ import annotations

from splitserve.plan import capacity
from splitserve.plan.decision import Plan


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.2f} s"


def format_plan(plan: Plan, concurrency: int = 0) -> str:
    """`concurrency`: the number of requests to report the longest context at (0: the decode batch)."""
    lines = [
        *_setting_lines(plan),
        "",
        *_memory_lines(plan, concurrency or plan.costs.decode_batch),
        "",
        *_transfer_lines(plan),
        "",
        *_roofline_lines(plan),
        "",
        *_check_lines(plan),
        "",
        *_recommendation_lines(plan),
    ]
    return "\n".join(lines)


def _mean_tokens(plan: Plan) -> tuple[int, int]:
    """The mean request's prompt and output tokens (at least one output token)."""
    wl = plan.workload
    return round(wl.prompt.mean), max(1, round(wl.output.mean))


def _setting_lines(plan: Plan) -> list[str]:
    """The model, the hardware and the workload the plan is for."""
    dep, wl = plan.deployment, plan.workload
    shape, gpu, net = dep.shape, dep.gpu, dep.network
    return [
        f"model     {shape.name}: {shape.layers} layers, {shape.kv_heads} KV heads x {shape.head_dim}, "
        f"{shape.total_params / 1e9:.1f}B parameters"
        + (f" ({shape.active_params / 1e9:.1f}B active, {shape.experts} experts)" if shape.is_moe else "")
        + (f", MLA latent {shape.kv_latent_dim}" if shape.kv_latent_dim else ""),
        f"hardware  {dep.gpus} x {gpu.name} ({gpu.memory_bytes / 1e9:.1f} GB, {gpu.hbm_bytes_per_s / 1e12:.2f} TB/s, "
        f"{gpu.bf16_flops / 1e12:.0f} TFLOP/s), TP {dep.tp} = {dep.replicas} replicas; network {net.gbps:g} Gb/s "
        f"{'RDMA' if net.rdma else 'TCP'}",
        f"workload  prompt {wl.prompt} tokens, output {wl.output} tokens, prefix reuse {wl.prefix_reuse:.0%}, "
        f"{wl.rate:g} requests/s, TTFT <= {wl.ttft_slo_s * 1e3:g} ms, TPOT <= {wl.tpot_slo_s * 1e3:g} ms",
    ]


def _memory_lines(plan: Plan, concurrency: int) -> list[str]:
    dep, c, gpu = plan.deployment, plan.costs, plan.deployment.gpu
    prompt, output = _mean_tokens(plan)
    kv_token = dep.shape.kv_bytes_per_token(dep.kv_dtype_bytes)
    longest = capacity.max_context_tokens(
        gpu.memory_bytes, dep.weight_bytes_per_gpu, dep.kv_bytes_per_token_per_gpu, concurrency, dep.reserve
    )
    return [
        "Memory",
        f"  KV per token              {kv_token:,.0f} B ({kv_token / 1024:.1f} KiB)"
        + (f"; {dep.kv_bytes_per_token_per_gpu:,.0f} B per GPU at TP {dep.tp}" if dep.tp > 1 else ""),
        f"  KV per request            {_bytes(kv_token * prompt)} for the prompt, "
        f"{_bytes(kv_token * (prompt + output))} with the output ({prompt + output:,} tokens)",
        f"  weights per GPU           {_bytes(dep.weight_bytes_per_gpu)} of {_bytes(gpu.memory_bytes)} "
        f"({dep.reserve:.0%} kept for activations)",
        f"  concurrent requests       {c.fits_memory:,} per replica fit at {prompt + output:,} tokens each",
        f"  longest context           {longest:,} tokens each at {concurrency:,} concurrent requests",
    ]


def _transfer_lines(plan: Plan) -> list[str]:
    c, net = plan.costs, plan.deployment.network
    return [
        "KV transfer (the mean prompt's uncached part)",
        f"  size                      {_bytes(c.kv_bytes)} ({plan.workload.uncached_prompt:,} tokens)",
        f"  whole                     {_ms(c.transfer_s)} at {net.gbps * net.efficiency:g} Gb/s "
        f"({net.efficiency:.0%} of line rate) per GPU",
        f"  left after prefill        {_ms(c.transfer_exposed_s)} with layer pipelining",
    ]


def _roofline_lines(plan: Plan) -> list[str]:
    dep, c = plan.deployment, plan.costs
    prompt, output = _mean_tokens(plan)
    return [
        f"Roofline (compute at {dep.eff.compute:.0%} of peak, bandwidth at {dep.eff.memory:.0%})",
        f"  prefill                   {_ms(c.prefill_s)} for {plan.workload.uncached_prompt:,} tokens",
        f"  decode step, batch 1      {_ms(dep.decode_step_s(1, prompt + output // 2))}",
        f"  decode step, batch {c.decode_batch:<6} {_ms(c.decode_step_s)} "
        f"({c.decode_batch / c.decode_step_s:,.0f} tokens/s per replica)",
    ]


def _check_lines(plan: Plan) -> list[str]:
    lines = ["Checks"]
    for i, ch in enumerate(plan.checks, 1):
        value = f"{ch.value:.0%}" if ch.unit == "share" else f"{ch.value:,.4g} {ch.unit}"
        lines.append(f"  {i}. {ch.name:<33} {value:<14} {ch.verdict.upper()}")
        lines.append(f"     {ch.reason}")
    return lines


def _recommendation_lines(plan: Plan) -> list[str]:
    dep, rec = plan.deployment, plan.recommendation
    lines = ["Recommendation"]
    if rec.disaggregate:
        threshold = rec.local_prefill_max_tokens
        lines.append(
            f"  DISAGGREGATE: {rec.prefill_replicas * dep.tp} prefill GPUs ({rec.prefill_replicas} x TP {dep.tp}), "
            f"{rec.decode_replicas * dep.tp} decode GPUs ({rec.decode_replicas} x TP {dep.tp}); "
            f"prefill locally up to {threshold:,} uncached tokens"
        )
    else:
        lines.append(f"  COLOCATE: all {dep.gpus} GPUs as {dep.replicas} replicas that prefill and decode")
    lines += [f"  - {r}" for r in rec.reasons]
    return lines
