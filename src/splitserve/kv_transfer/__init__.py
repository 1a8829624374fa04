"""The KV data plane: stream a request's KV cache, layer by layer, from a prefill
worker's cache into the blocks a decode worker reserved.

    receiver = KVReceiver(cache, transport="tcp")          # decode worker, once
    r = receiver.reserve(request_id, block_ids, lease_s)   # -> plain-data Reservation
    outcome = receiver.wait(r.ticket, timeout)             # Completed(first_token) | Failed(reason, code)

    sender = KVSender(cache)                               # prefill worker, once
    with sender.open(r) as stream:                         # handshake checks ticket and layout
        stream.send_layer(layer, src_block_ids)            # per layer, from the compute loop
        stream.finish(first_token, timeout)                # returns once every byte is confirmed

Values: reservation.py. Decode side: receiver.py (connections) over
reservations.py (bookkeeping); prefill side: sender.py. Frames: frame.py.
Transports: transport.py (TCP), ucx.py (tests/kv_transfer_helpers/fake.py: the tests'); which one a stream uses, and
how its payloads move (bytes on the connection, or CUDA IPC device copies:
cuda_ipc.py), links.py.

The names below load their modules on first use, so that importing one light
module (workers/common/config.py takes the transport names from reservation.py, and
the Ray pool manager imports that config) does not load the data plane or register its metrics.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # `X as X`: a re-export, as PEP 484 spells it for ruff and mypy
    from splitserve.kv_transfer.receiver import KVReceiver as KVReceiver
    from splitserve.kv_transfer.reservation import Completed as Completed
    from splitserve.kv_transfer.reservation import Failed as Failed
    from splitserve.kv_transfer.reservation import FailureCode as FailureCode
    from splitserve.kv_transfer.reservation import Outcome as Outcome
    from splitserve.kv_transfer.reservation import Reservation as Reservation
    from splitserve.kv_transfer.sender import KVSender as KVSender
    from splitserve.kv_transfer.sender import KVStream as KVStream
    from splitserve.kv_transfer.sender import TransferError as TransferError

_HOMES = {
    "Completed": "reservation",
    "Failed": "reservation",
    "FailureCode": "reservation",
    "Outcome": "reservation",
    "Reservation": "reservation",
    "KVReceiver": "receiver",
    "KVSender": "sender",
    "KVStream": "sender",
    "TransferError": "sender",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
