"""A prefill-side sender in its own process, for tests that kill it or need a second process.

Reads the reservation from argv, opens a stream, sends the given layers, prints
"sent" (the test's cue), then either finishes (--finish) or waits on stdin so
the test can SIGKILL it mid-stream.
"""

from __future__ import annotations

import argparse
import sys

import torch

from splitserve.engine.kv_cache import KVCache, KVLayout
from splitserve.kv_transfer import KVSender, Reservation
from splitserve.kv_transfer.reservation import TRANSPORT_NAMES


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ticket", required=True)
    p.add_argument("--request-id", required=True)
    p.add_argument("--transport", default="tcp", choices=TRANSPORT_NAMES)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--tcp-endpoint", required=True)
    p.add_argument("--dst", required=True, help="comma-separated receiver block ids")
    p.add_argument("--src", required=True, help="comma-separated sender block ids")
    p.add_argument("--layout", required=True, help="layers,heads,head_dim,block_size,dtype")
    p.add_argument("--layers", required=True, help="comma-separated layers to send")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--finish", type=int, default=None, help="first token to finish with")
    a = p.parse_args()
    layers, heads, head_dim, block_size, dtype = a.layout.split(",")
    layout = KVLayout(int(layers), int(heads), int(head_dim), int(block_size), dtype)
    cache = KVCache(layout, a.num_blocks, device=a.device)
    g = torch.Generator().manual_seed(a.seed)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=g).to(cache.tensor.dtype))
    r = Reservation(
        request_id=a.request_id,
        ticket=bytes.fromhex(a.ticket),
        transport=a.transport,
        endpoint=a.endpoint,
        tcp_endpoint=a.tcp_endpoint,
        block_ids=tuple(int(x) for x in a.dst.split(",")),
        layout=layout,
        lease_deadline_unix_ms=0,
    )
    src = [int(x) for x in a.src.split(",")]
    stream = KVSender(cache).open(r)
    for layer in (int(x) for x in a.layers.split(",")):
        stream.send_layer(layer, src)
    if a.finish is not None:
        stream.finish(a.finish, timeout=30)
        print("finished", stream.transport, flush=True)
        return 0
    print("sent", flush=True)
    sys.stdin.read()  # until the test kills us
    return 0


if __name__ == "__main__":
    sys.exit(main())
