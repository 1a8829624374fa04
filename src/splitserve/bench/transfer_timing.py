"""The one whole-cache timing both `splitserve bench transfer` figures use: the plain
throughput (bench/transfer.py) and the re-sharding cost between tensor-parallel sizes
(bench/transfer_tp.py), so the two are measured the same way and compare."""

from __future__ import annotations

import time

from splitserve.engine.kv_cache import KVCache
from splitserve.kv_transfer import Completed, KVReceiver, KVSender
from splitserve.kv_transfer.reservation import TransportName
from splitserve.kv_transfer.tcp import TCPTransport


def whole_cache_seconds(
    kind: TransportName, src: KVCache, dst: KVCache, checksum: str, tcp: tuple[TCPTransport, TCPTransport] | None = None
) -> float:
    """Every block of every layer of `src` through kv_transfer into `dst` (its shards at whatever
    TP sizes the two have); the seconds to the receiver's confirmation. `tcp`: the receiver's and
    the sender's TCP in place of plain TCP (the cluster's TLS: bench/internal_tls.py)."""
    ids = list(range(src.num_blocks))
    with KVReceiver(dst, transport=tcp[0] if tcp else kind) as rx:
        assert rx.transport == kind, f"receiver fell back to {rx.transport}"
        r = rx.reserve("bench", ids, lease_s=600)
        sender = KVSender(src, checksum=checksum, transport=tcp[1] if tcp else None)
        stream = sender.open(r)
        assert stream.transport == kind, f"sender fell back to {stream.transport}"
        t = time.perf_counter()
        for layer in range(src.layout.num_layers):
            stream.send_layer(layer, ids)
        stream.finish(1, timeout=600)
        dt = time.perf_counter() - t
        assert rx.wait(r.ticket, 10) == Completed(1)
        sender.close()
    return dt
