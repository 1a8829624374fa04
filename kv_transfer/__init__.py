"""The KV data plane: stream a request's KV cache, layer by layer, from a prefill
worker's cache into the blocks a decode worker reserved.

    receiver = KVReceiver(cache, transport="tcp")          # decode worker, once
    r = receiver.reserve(request_id, block_ids, lease_s)   # -> plain-data Reservation
    outcome = receiver.wait(r.ticket, timeout)             # Completed(first_token) | Failed(reason, code)

    sender = KVSender(cache)                               # prefill worker, once
    with sender.open(r) as stream:                         # handshake checks ticket and layout
        stream.send_layer(layer, src_block_ids)            # per layer, from the compute loop
        stream.finish(first_token, timeout)                # returns once every byte is confirmed

Frames: frame.py. Transports: transport.py (TCP), ucx.py, cuda_ipc.py, fake.py.
"""

from splitserve.kv_transfer.receiver import KVReceiver
from splitserve.kv_transfer.reservation import Completed, Failed, FailureCode, Outcome, Reservation
from splitserve.kv_transfer.sender import KVSender, KVStream, TransferError

__all__ = [
    "Completed", "Failed", "FailureCode", "KVReceiver", "KVSender", "KVStream", "Outcome", "Reservation", "TransferError",
]  # fmt: skip
