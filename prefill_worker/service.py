"""The prefill worker's gRPC service: compute a context's KV, stream it layer by
layer into a decode worker's reservation, return the first token.

The engine runs the request in prefill-only mode (chunked, batched with other
prompts, reusing this worker's own prefix cache). A layer hook fires as each
layer's KV of each chunk lands in the cache and queues exactly the blocks the
decode worker lacks on the KV stream, so the transfer hides behind the
remaining layers' compute. The first token goes back to the router as soon as
it is sampled; the stream's confirmation and the release of this worker's
blocks finish in the background.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from splitserve.engine.engine import Engine, StepOutput
from splitserve.engine.loop import EngineLoop
from splitserve.engine.sequence import Sequence
from splitserve.kv_transfer import KVSender, KVStream, TransferError
from splitserve.proto import convert
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
from splitserve.worker.blocks import stream_block_events
from splitserve.worker.config import WorkerConfig

log = logging.getLogger(__name__)


@dataclass
class _Outbound:
    """One request's KV on its way to the decode worker."""

    stream: KVStream
    first_index: int  # index in this request's block table of the reservation's first block
    sent_hi: int  # blocks below this were sent in earlier chunks (the last may have been partial)
    chunk: tuple[int, int] = (0, 0)  # block range of the chunk in flight, fixed at its layer 0


class PrefillService(wgrpc.PrefillWorkerServicer):
    def __init__(self, cfg: WorkerConfig, sender: KVSender) -> None:
        self.cfg = cfg
        self.sender = sender
        self.outbound: dict[str, _Outbound] = {}  # touched on the engine thread only
        self.finisher = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kv-finish")
        self.loop: EngineLoop | None = None

    def attach(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.block_size = loop.engine.cfg.block_size
        self.cuda = loop.engine.kv_cache.tensor.is_cuda

    # ---- the layer hook, on the engine thread ----

    def on_layer_done(self, layer: int, seqs: list[Sequence], counts: list[int]) -> None:
        bs = self.block_size
        synced = False
        for seq, n in zip(seqs, counts):
            ob = self.outbound.get(seq.request_id)
            if ob is None:
                continue
            start = seq.num_computed_tokens  # not yet advanced past this step
            if layer == 0:
                # a partial block of the last chunk is sent again; blocks this worker had cached
                # (computed by nobody in this step) go with the first chunk
                lo = max(ob.first_index, min(ob.sent_hi, start // bs))
                ob.chunk = (lo, -(-(start + n) // bs))
            lo, hi = ob.chunk
            if hi <= lo:
                continue
            if self.cuda and not synced:
                torch.cuda.current_stream().synchronize()  # the layer's writes must land before the copy
                synced = True
            try:
                ob.stream.send_layer(layer, seq.block_table[lo:hi], first_index=lo - ob.first_index)
            except TransferError as e:
                log.warning("request %s: KV stream failed: %s", seq.request_id, e)
            if layer == len(self.loop.engine.model.layers) - 1:  # type: ignore[union-attr]
                ob.sent_hi = hi

    # ---- Prefill ----

    def Prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext) -> wpb.PrefillResult:  # noqa: N802
        assert self.loop is not None
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        prior = list(request.output_token_ids)
        try:
            if not rid:
                raise ValueError("request_id is empty")
            params = convert.sampling_from_proto(request.sampling)
            kv = convert.reservation_from_proto(request.reservation)
            first_index = self._check_reservation(request.reservation, len(prompt) + len(prior))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            stream = self.sender.open(kv)
        except TransferError as e:
            code = grpc.StatusCode.FAILED_PRECONDITION if "mismatch" in str(e) else grpc.StatusCode.UNAVAILABLE
            context.abort(code, f"KV stream to {kv.endpoint}: {e}")

        first: Future[StepOutput] = Future()

        def sink(out: StepOutput) -> None:
            if not first.done():
                first.set_result(out)

        def admit(engine: Engine) -> None:
            engine.add_request(rid, prompt, params, prefill_only=True, output_token_ids=prior)
            self.outbound[rid] = _Outbound(stream, first_index, sent_hi=first_index)

        self.loop.set_sink(rid, sink)
        try:
            self.loop.call(admit).result(timeout=self.cfg.admit_timeout_s)
        except ValueError as e:
            self.loop.drop_sink(rid)
            stream.abort(str(e))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        context.add_callback(lambda: first.done() or self._drop(rid, stream, "cancelled by the router"))
        try:
            out = first.result(timeout=self.cfg.prefill_timeout_s)
        except TimeoutError:
            self._drop(rid, stream, "prefill timed out")
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish in time")
        if out.finish_reason != "prefill_done":
            self._drop(rid, stream, f"prefill ended: {out.finish_reason}")
            context.abort(grpc.StatusCode.ABORTED, f"prefill ended: {out.finish_reason}")
        self.finisher.submit(self._finish, rid, stream, out.token_id)
        result = wpb.PrefillResult(first_token_id=out.token_id, num_cached_tokens=out.num_cached_tokens)
        if out.logprob is not None:
            result.first_token_logprob = out.logprob
        return result

    def _check_reservation(self, r: wpb.Reservation, context_len: int) -> int:
        bs = self.block_size
        if r.num_cached_tokens % bs or r.num_cached_tokens >= context_len:
            raise ValueError(
                f"reservation.num_cached_tokens ({r.num_cached_tokens}) must be a multiple of {bs} "
                f"below the context length ({context_len})"
            )
        first_index = r.num_cached_tokens // bs
        want = -(-context_len // bs) - first_index
        if len(r.block_ids) != want:
            raise ValueError(f"reservation.block_ids has {len(r.block_ids)} blocks; the context needs {want}")
        return first_index

    def _finish(self, rid: str, stream: KVStream, first_token: int) -> None:
        try:
            stream.finish(first_token, timeout=self.cfg.prefill_timeout_s)
        except TransferError as e:
            log.warning("request %s: KV not confirmed: %s", rid, e)
        finally:
            self._forget(rid)

    def _drop(self, rid: str, stream: KVStream, reason: str) -> None:
        stream.abort(reason)
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        def forget(engine: Engine) -> None:
            self.outbound.pop(rid, None)
            engine.abort(rid)  # running or held: either way its blocks go back

        assert self.loop is not None
        self.loop.drop_sink(rid)
        self.loop.call(forget)

    # ---- the rest ----

    def Cancel(self, request: wpb.CancelRequest, context: grpc.ServicerContext) -> wpb.CancelResponse:  # noqa: N802
        assert self.loop is not None
        rid = request.request_id

        def cancel(engine: Engine) -> bool:
            ob = self.outbound.pop(rid, None)
            if ob is not None:
                ob.stream.abort("cancelled")
            return engine.abort(rid)

        return wpb.CancelResponse(found=bool(self.loop.call(cancel).result(timeout=self.cfg.admit_timeout_s)))

    def GetStats(self, request: wpb.StatsRequest, context: grpc.ServicerContext) -> wpb.WorkerStats:  # noqa: N802
        assert self.loop is not None
        return convert.stats_to_proto(self.cfg.worker_id, self.loop.stats, self.block_size)

    def BlockEvents(self, request: wpb.BlockEventsRequest, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]  # noqa: N802
        assert self.loop is not None
        return stream_block_events(self.loop, context)
