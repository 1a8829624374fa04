"""The BlockEvents stream: a snapshot of the prefix cache, then every change."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc

from splitserve.engine.block_manager import BlockEvent
from splitserve.engine.loop import EngineLoop
from splitserve.proto import convert
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb


def stream_block_events(loop: EngineLoop, context: grpc.ServicerContext) -> Iterator[wpb.BlockEventBatch]:
    changes: queue.SimpleQueue[list[BlockEvent]] = queue.SimpleQueue()
    snapshot = loop.subscribe_blocks(changes.put).result(timeout=10.0)
    try:
        yield convert.block_events_to_proto(snapshot)
        while context.is_active():
            try:
                events = changes.get(timeout=1.0)
            except queue.Empty:
                continue
            yield convert.block_events_to_proto(events)
    finally:
        loop.unsubscribe_blocks(changes.put)
