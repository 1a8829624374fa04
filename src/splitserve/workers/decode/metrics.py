"""The decode worker's own Prometheus counters (default registry, beside kv_transfer's)."""

from __future__ import annotations

from prometheus_client import Counter

BLOCKS_FREED_WHILE_RESERVED = Counter(
    "splitserve_decode_blocks_freed_while_reserved",
    "KV blocks the engine was about to free while a live KV reservation could still write them "
    "(kept instead; must stay 0)",
)
