"""Conversions between the internal protobuf messages and the plain-data types
the engine and kv_transfer use. Workers validate here what the router sent:
a field out of range becomes a ValueError naming it (INVALID_ARGUMENT).

The router uses the sampling conversions and must not pay for torch at start:
the engine's and kv_transfer's types are imported only where they are built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.engine.handoff import Handoff, SampleState, TokenLogprob
from splitserve.engine.prefill_order import Share
from splitserve.engine.sampling import GrammarSpec, SamplingParams
from splitserve.engine.tier_cost import TierSpeed, TierSpeeds
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb

if TYPE_CHECKING:
    from splitserve.engine.block_manager import BlockEvent
    from splitserve.engine.kv_cache import KVLayout
    from splitserve.engine.loop import EngineLoop
    from splitserve.engine.scheduler import SchedulerStats
    from splitserve.kv_transfer import Reservation as KVReservation


def sampling_from_proto(sp: wpb.SamplingParams) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=int(sp.max_tokens),
            temperature=float(sp.temperature),
            top_p=float(sp.top_p),
            top_k=int(sp.top_k),
            min_p=float(sp.min_p),
            seed=int(sp.seed) if sp.HasField("seed") else None,
            repetition_penalty=float(sp.repetition_penalty),
            presence_penalty=float(sp.presence_penalty),
            frequency_penalty=float(sp.frequency_penalty),
            stop_token_ids=tuple(int(t) for t in sp.stop_token_ids),
            ignore_eos=bool(sp.ignore_eos),
            logprobs=bool(sp.logprobs),
            top_logprobs=int(sp.top_logprobs),
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in sp.logit_bias.items())),
            min_tokens=int(sp.min_tokens),
            grammar=_grammar_from_proto(sp.grammar) if sp.HasField("grammar") else None,
            n=int(sp.n) or 1,
            prompt_logprobs=int(sp.prompt_logprobs),
        )
    except ValueError as e:
        raise ValueError(f"sampling.{e}") from None


_GRAMMAR_KINDS = {
    wpb.GRAMMAR_KIND_JSON_SCHEMA: "json_schema",
    wpb.GRAMMAR_KIND_JSON_OBJECT: "json_object",
    wpb.GRAMMAR_KIND_REGEX: "regex",
    wpb.GRAMMAR_KIND_CHOICE: "choice",
    wpb.GRAMMAR_KIND_LARK: "lark",
}
_GRAMMAR_KIND_IDS = {name: kind for kind, name in _GRAMMAR_KINDS.items()}


def _grammar_from_proto(g: wpb.Grammar) -> GrammarSpec:
    if g.kind not in _GRAMMAR_KINDS:
        raise ValueError(f"grammar.kind {g.kind} is not a grammar kind")
    return GrammarSpec(_GRAMMAR_KINDS[g.kind], g.source)


def sampling_to_proto(p: SamplingParams) -> wpb.SamplingParams:
    msg = wpb.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        max_tokens=p.max_tokens,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        logit_bias=dict(p.logit_bias),
        min_tokens=p.min_tokens,
        n=p.n,
        prompt_logprobs=p.prompt_logprobs,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.grammar is not None:
        msg.grammar.CopyFrom(wpb.Grammar(kind=_GRAMMAR_KIND_IDS[p.grammar.kind], source=p.grammar.source))
    return msg


# ---- the handoff record (engine/handoff.py): the one place it becomes a message, and the one
# place a message becomes it again


def logprob_to_proto(lp: TokenLogprob) -> wpb.TokenLogprob:
    return wpb.TokenLogprob(
        logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top]
    )


def logprob_from_proto(m: wpb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(float(m.logprob), tuple(zip(m.top_token_ids, m.top_logprobs, strict=False)))


def handoff_to_proto(h: Handoff) -> wpb.Handoff:
    return wpb.Handoff(
        prompt_token_ids=h.prompt_token_ids,
        sampling=sampling_to_proto(h.params),
        samples=[
            wpb.SampleState(
                index=s.index,
                output_token_ids=s.output_token_ids,
                logprobs=[logprob_to_proto(lp) for lp in s.logprobs],
            )
            for s in h.samples
        ],
        prompt_logprobs=[logprob_to_proto(lp) for lp in h.prompt_logprobs],
        share=wpb.Share(tenant=h.share.tenant, weight=h.share.weight, band=h.share.band),
    )


def handoff_from_proto(m: wpb.Handoff) -> Handoff:
    """The record a worker continues from; ValueError naming the field for what cannot be continued."""
    params = sampling_from_proto(m.sampling)
    samples = [
        SampleState(int(s.index), list(s.output_token_ids), [logprob_from_proto(lp) for lp in s.logprobs])
        for s in m.samples
    ]
    indices = [s.index for s in samples]
    if len(set(indices)) != len(indices) or any(i >= params.n for i in indices):
        raise ValueError(f"handoff.samples: indices {indices} are not distinct sample indices below n={params.n}")
    share = Share()
    if m.HasField("share"):
        if m.share.band > 2 or not 0 <= m.share.weight <= 1000:
            raise ValueError(f"handoff.share: band {m.share.band} (0 to 2), weight {m.share.weight:g} (0 to 1000)")
        share = Share(m.share.tenant, m.share.weight or 1.0, m.share.band)
    prompt_logprobs = [logprob_from_proto(lp) for lp in m.prompt_logprobs]
    return Handoff(list(m.prompt_token_ids), params, samples, prompt_logprobs, share)


def layout_to_proto(layout: KVLayout) -> wpb.KVLayout:
    return wpb.KVLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=layout.dtype,
        tp_size=layout.tp_size,
        windows=layout.windows,
        model_fingerprint=layout.model_fingerprint,
    )


def layout_from_proto(m: wpb.KVLayout) -> KVLayout:
    from splitserve.engine.kv_cache import KVLayout

    try:
        return KVLayout(
            m.num_layers,
            m.num_kv_heads,
            m.head_dim,
            m.block_size,
            m.dtype,
            m.tp_size or 1,
            tuple(m.windows),
            m.model_fingerprint,
        )
    except ValueError as e:
        raise ValueError(f"reservation.layout: {e}") from None


def reservation_to_proto(r: KVReservation, num_cached_tokens: int) -> wpb.Reservation:
    return wpb.Reservation(
        kv_endpoint=r.endpoint,
        kv_tcp_endpoint=r.tcp_endpoint,
        transport=r.transport,
        ticket=r.ticket,
        request_id=r.request_id,
        block_ids=list(r.block_ids),
        num_cached_tokens=num_cached_tokens,
        layout=layout_to_proto(r.layout),
        lease_deadline_unix_ms=r.lease_deadline_unix_ms,
    )


def reservation_from_proto(m: wpb.Reservation) -> KVReservation:
    from splitserve.kv_transfer import Reservation as KVReservation
    from splitserve.kv_transfer.reservation import TRANSPORT_NAMES

    if len(m.ticket) != 16:
        raise ValueError(f"reservation.ticket must be 16 bytes, got {len(m.ticket)}")
    if not m.block_ids:
        raise ValueError("reservation.block_ids is empty")
    if not m.kv_endpoint:
        raise ValueError("reservation.kv_endpoint is empty")
    transport = m.transport or "tcp"
    if transport not in TRANSPORT_NAMES:
        raise ValueError(f"reservation.transport must be one of {TRANSPORT_NAMES}, got {transport!r}")
    return KVReservation(
        request_id=m.request_id,
        ticket=bytes(m.ticket),
        transport=transport,
        endpoint=m.kv_endpoint,
        tcp_endpoint=m.kv_tcp_endpoint or m.kv_endpoint,
        block_ids=tuple(int(b) for b in m.block_ids),
        layout=layout_from_proto(m.layout),
        lease_deadline_unix_ms=int(m.lease_deadline_unix_ms),
    )


def block_events_to_proto(events: list[BlockEvent]) -> wpb.BlockEventBatch:
    out = wpb.BlockEventBatch()
    for e in events:
        tier = "" if e.tier == "pool" else e.tier  # the pool: the field's default
        if e.kind == "stored":
            out.events.add(stored=wpb.BlocksStored(block_hashes=list(e.hashes)), tier=tier)
        elif e.kind == "removed":
            out.events.add(removed=wpb.BlocksRemoved(block_hashes=list(e.hashes)), tier=tier)
        else:
            out.events.add(cleared=wpb.AllBlocksCleared())
    return out


def tier_name(tier: str) -> str:
    """A BlockEvent's tier as engine/kv_tiers.py names it ("pool" where the field is empty)."""
    return tier or "pool"


def loop_stats(worker_id: str, loop: EngineLoop) -> wpb.WorkerStats:
    """A worker's stats as its engine loop sees them: load, block size, tiers' speeds, model."""
    engine = loop.engine
    return stats_to_proto(
        worker_id, loop.stats, engine.cfg.block_size, loop.tier_speeds(), engine.layout.model_fingerprint
    )


def stats_to_proto(
    worker_id: str,
    s: SchedulerStats,
    block_size: int,
    speeds: TierSpeeds | None = None,
    model_fingerprint: bytes = b"",
) -> wpb.WorkerStats:
    """`speeds`: the worker's measured prefill speed and tier bandwidths (engine/kv_tiers.py), if it has tiers."""
    out = wpb.WorkerStats(
        worker_id=worker_id,
        queued_tokens=s.queued_tokens,
        running_tokens=s.running_tokens,
        free_blocks=s.free_blocks,
        total_blocks=s.total_blocks,
        queue_length=s.queue_length,
        running_requests=s.running_requests + s.reserved_requests,
        block_size=block_size,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        model_fingerprint=model_fingerprint,
    )
    if speeds is not None:
        out.prefill_tokens_per_s = speeds.prefill_tokens_per_s
        out.kv_block_bytes = speeds.block_bytes
        out.tiers.extend(wpb.KVTierSpeed(name=t.name, bytes_per_s=t.bytes_per_s) for t in speeds.tiers)
    return out


def speeds_from_proto(m: wpb.WorkerStats) -> TierSpeeds:
    """What a worker measured (`stats_to_proto`'s `speeds`), its tiers in its order."""
    tiers = tuple(TierSpeed(t.name, t.bytes_per_s) for t in m.tiers)
    return TierSpeeds(m.prefill_tokens_per_s, m.kv_block_bytes, tiers)
