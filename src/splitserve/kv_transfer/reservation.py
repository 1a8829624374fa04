"""The values both ends of the KV plane share: a reservation, how it ended, and why.

A decode worker's receiver hands out a `Reservation`; the prefill worker's
sender writes into it; the receiver reports `Completed` or `Failed`. A failure
carries a `FailureCode`, the same value that labels the metrics, so nobody
has to tell failures apart by their text. Transport names are typed here too,
so configs, reservations and both ends agree on the three there are.

This module imports nothing else of kv_transfer, nor torch: a config can name
a transport without loading the data plane (or registering its metrics).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Literal, NamedTuple, get_args

if TYPE_CHECKING:  # an annotation only: this module stays free of torch
    from splitserve.engine.kv_cache import KVLayout

TransportName = Literal["tcp", "ucx", "cuda_ipc"]
TRANSPORT_NAMES: tuple[TransportName, ...] = get_args(TransportName)


class FailureCode(StrEnum):
    """Why a reservation, frame, connection or stream failed: the code and the metric label.

    A `StrEnum`: each member is its value (`FailureCode.LEASE_EXPIRED == "lease_expired"`,
    and `str()` gives the value), so the codes work as dict keys, labels and plain strings.
    """

    # how a reservation ends without its KV
    LEASE_EXPIRED = "lease_expired"
    CANCELLED = "cancelled"
    RECEIVER_CLOSED = "receiver_closed"
    DISCONNECTED = "disconnected"  # the sender's connection went away before done
    ABORTED_BY_SENDER = "aborted_by_sender"
    INTERNAL = "internal"  # a bug in the receiver
    # what the receiver refuses in a handshake
    UNKNOWN_TICKET = "unknown_ticket"
    TICKET_IN_USE = "ticket_in_use"  # another stream has it, or it is no longer live
    LAYOUT_MISMATCH = "layout_mismatch"  # also the sender's: the two caches cannot exchange KV
    # what the receiver refuses in a frame
    BAD_FRAME = "bad_frame"
    TICKET_MISMATCH = "ticket_mismatch"
    UNEXPECTED_FRAME = "unexpected_frame"
    LAYER_OUT_OF_RANGE = "layer_out_of_range"
    BLOCK_OUT_OF_RANGE = "block_out_of_range"
    DTYPE_MISMATCH = "dtype_mismatch"
    LENGTH_MISMATCH = "length_mismatch"
    HEAD_OUT_OF_RANGE = "head_out_of_range"  # a frame's KV heads are not one of the receiver's shards
    CHECKSUM_MISMATCH = "checksum_mismatch"
    INCOMPLETE = "incomplete"  # done before every layer of every block arrived
    NOT_LIVE = "not_live"  # a frame for a reservation that already ended
    # why the receiver dropped a slow or silent connection
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    FRAME_TIMEOUT = "frame_timeout"
    IDLE = "idle"  # a pooled connection with no stream under way
    TOO_MANY_UNBOUND = "too_many_unbound"
    # the sender's: any stream failure but a layout mismatch
    TRANSPORT = "transport"


@dataclass(frozen=True)
class Reservation:
    """Where and how a prefill worker must write one request's KV (mirrors the proto's Reservation)."""

    request_id: str
    ticket: bytes  # 16 random bytes; the only credential on the KV plane
    transport: TransportName  # data transport offered
    endpoint: str  # "host:port" of that transport's listener
    tcp_endpoint: str  # "host:port" of the TCP listener: fallback, and CUDA IPC's control channel
    block_ids: tuple[int, ...]  # the receiver's blocks, in the order the sender fills them
    layout: KVLayout
    lease_deadline_unix_ms: int  # the receiver fails the reservation if not complete by then


class Completed(NamedTuple):
    first_token: int
    handoff: bytes = b""  # the done frame's payload: the workers' handoff record, opaque here


class Failed(NamedTuple):
    reason: str  # for people
    code: FailureCode  # for code and metrics


Outcome = Completed | Failed
