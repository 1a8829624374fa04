"""Prometheus metrics of the KV plane (one set per process, as Prometheus expects).

Every `reason` label of a failure (frames rejected, reservations failed, connections
dropped) is a `reservation.FailureCode`, the same value a `Failed` outcome carries.
A fallback's `reason` is what made the wanted transport unusable (an exception's
type name, or "cpu_cache"), not a failure.
"""

from __future__ import annotations

from prometheus_client import Counter

BYTES_RECEIVED = Counter("splitserve_kv_bytes_received", "KV payload bytes written into reserved blocks", ["transport"])
FRAMES_RECEIVED = Counter("splitserve_kv_frames_received", "KV layer frames accepted", ["transport"])
FRAMES_REJECTED = Counter("splitserve_kv_frames_rejected", "Frames or connections rejected, by reason", ["reason"])
RESERVATIONS_COMPLETED = Counter("splitserve_kv_reservations_completed", "Reservations whose KV arrived in full")
RESERVATIONS_FAILED = Counter("splitserve_kv_reservations_failed", "Reservations that failed, by reason", ["reason"])
TRANSPORT_CHOSEN = Counter(
    "splitserve_kv_transport_chosen", "KV streams opened, by the transport used", ["side", "transport"]
)
TRANSPORT_FALLBACKS = Counter(
    "splitserve_kv_transport_fallbacks", "Times a wanted transport was unusable and TCP was used", ["wanted", "reason"]
)
BYTES_SENT = Counter("splitserve_kv_bytes_sent", "KV payload bytes sent", ["transport"])
CONNECTIONS_DROPPED = Counter(
    "splitserve_kv_connections_dropped",
    "Connections the KV receiver closed on a slow or silent peer, or refused over its cap on unbound ones, by reason",
    ["reason"],
)
WIRE_BYTES = Counter(
    "splitserve_kv_wire_bytes",
    "KV layer payload bytes on the wire, by side and wire codec (raw: the cache's own bytes)",
    ["side", "codec"],
)
WIRE_KV_BYTES = Counter(
    "splitserve_kv_wire_cache_bytes",
    "Cache bytes (in the sender's dtype) the layer frames sent carried, by wire codec: over "
    "splitserve_kv_wire_bytes_total, what the codec saved",
    ["codec"],
)
CODEC_CHOSEN = Counter(
    "splitserve_kv_wire_codec_chosen", "KV streams opened, by the wire codec the handshake settled", ["codec"]
)
