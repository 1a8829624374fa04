"""The engine's one seam to the KV data plane (vLLM calls it a KV connector).

The engine imports nothing of kv_transfer: a worker hands it an object with
this interface, and the engine calls it at fixed points, always on the engine
thread:

- prefill role: `on_layer_done(layer, seqs, counts)` as each layer of a step
  lands in the cache (`wants_layers` says whether to call it at all: a hook
  keeps CUDA graphs off), and `on_prefill_done` once a prefill-only request's
  first token is sampled: the request is HELD (its blocks kept for the sender)
  until `poll` reports its transfer confirmed (the blocks are freed) or failed
  (the request is aborted);
- decode role: `reserve` when a request's KV is to be written by someone else,
  `cancel` when such a request is aborted (True once no write into its blocks
  can still land: only then are the blocks freed);
- both roles: `poll`, once per loop iteration, for the transfers that ended
  since the last poll (a decode worker's KV arrived; a prefill worker's send
  confirmed; either failed).

Outcomes are keyed by the transfer id the connector gave out, not by request
id: a late outcome of an old transfer can never touch a newer request that
reuses the id. `NullConnector` is the connector of a plain engine.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from splitserve.engine.handoff import Handoff
    from splitserve.engine.sequence import Sequence


class TransferOutcome(NamedTuple):
    """One transfer that ended: completed (received, or confirmed by the receiver) with the first
    token, or failed with a code."""

    request_id: str
    transfer_id: bytes
    first_token: int | None  # completed
    code: str | None  # failed: "lease_expired", "cancelled", "disconnected", ...
    # decode role, completed: the prefill worker's record of the request (engine/handoff.py): each
    # sample's first token (None: the first token alone, for sample 0)
    handoff: Handoff | None = None


class Transfer(Protocol):
    """What `reserve` hands back: the connector's own record, sent to whoever fills it."""

    @property
    def ticket(self) -> bytes: ...  # the transfer id


class KVConnector(Protocol):
    @property
    def wants_layers(self) -> bool: ...  # call on_layer_done (a hook keeps CUDA graphs off)

    def on_layer_done(self, layer: int, seqs: Seq[Sequence], counts: Seq[int]) -> None: ...
    def on_prefill_done(self, request_id: str, transfer_id: bytes, handoff: Handoff) -> None: ...
    def reserve(
        self, request_id: str, block_ids: list[int], lease_s: float, context_len: int = 0, first_index: int = 0
    ) -> Transfer: ...  # context_len, first_index: the windows' geometry (KVReceiver.reserve)
    def cancel(self, transfer_id: bytes) -> bool: ...
    def poll(self) -> list[TransferOutcome]: ...


class NullConnector:
    """No KV plane: nothing is reserved, nothing arrives, nothing is sent (a held request waits
    for `Engine.release`)."""

    wants_layers = False

    def on_layer_done(self, layer: int, seqs: Seq[Sequence], counts: Seq[int]) -> None:
        pass

    def on_prefill_done(self, request_id: str, transfer_id: bytes, handoff: Handoff) -> None:
        pass

    def reserve(
        self, request_id: str, block_ids: list[int], lease_s: float, context_len: int = 0, first_index: int = 0
    ) -> Any:
        raise RuntimeError("this engine has no KV connector: remote prefill is not available")

    def cancel(self, transfer_id: bytes) -> bool:
        return True

    def poll(self) -> list[TransferOutcome]:
        return []
