"""In-process fake workers that speak the real internal gRPC services, so the
router is benchmarked (`splitserve bench router`) and tested over real gRPC on
loopback without a model. In bench/, the one folder of the package that runs
them: nothing of the product may import bench/ (import-linter), so no fake
worker stands in for a real one outside a benchmark or a test.

Both fakes produce the same canned tokens: the i-th output token of sample k
of any request is `sample_scripts[k][i]` (`script[i]` where no sample script is
given; then EOS), so a request migrated to another fake decode worker continues
exactly where it stopped. They speak the handoff protocol (worker.proto): the
request comes as a Handoff, each sample's tokens go out under its `index`, each
sample ends with its own Finish. The "KV plane" between them is an in-process
`FakeKVPlane`: the prefill fake hands its Handoff (each sample with its first
token) to the reservation's ticket, which is what the real prefill worker's Done
frame does. Knobs make a fake slow, refuse, hang, or die mid-stream.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from splitserve.engine.block_hash import block_hashes
from splitserve.engine.blocks import blocks_to_fill, cdiv
from splitserve.engine.handoff import Handoff, SampleState, TokenLogprob
from splitserve.engine.sampling import SamplingParams
from splitserve.proto import convert
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc

EOS = 257  # ByteTokenizer's
LAYOUT = wpb.KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, dtype="float32")
DECODE_LOGPROB = -0.5  # every token the decode fake samples has this logprob
PREFILL_LOGPROB = -0.25  # every first token the prefill fake samples
PROMPT_LOGPROB = -1.0  # every prompt token's
# A dying fake decode worker refuses new calls at once; its calls in flight that are not streaming
# tokens (each streaming one ends at its next token) are cancelled after this long at most
DEATH_GRACE_S = 1.0


def fake_logprob(token: int, value: float, top_logprobs: int) -> TokenLogprob:
    """A fake's logprob for `token`: the `top_logprobs` most likely are token, token + 1, ...,
    each 1 below the one before."""
    return TokenLogprob(value, tuple((token + j, value - j) for j in range(top_logprobs)))


def fake_prompt_logprobs(h: Handoff) -> list[TokenLogprob]:
    """With sampling.prompt_logprobs k: each prompt token after the first, with k - 1 others."""
    k = h.params.prompt_logprobs
    if not k:
        return []
    return [fake_logprob(t, PROMPT_LOGPROB, k - 1) for t in h.prompt_token_ids[1:]]


class FakeKVPlane:
    def __init__(self) -> None:
        self._waiting: dict[bytes, asyncio.Future[Handoff]] = {}

    def expect(self, ticket: bytes) -> asyncio.Future[Handoff]:
        fut: asyncio.Future[Handoff] = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = fut
        return fut

    def deliver(self, ticket: bytes, handoff: Handoff) -> bool:
        fut = self._waiting.pop(ticket, None)
        if fut is None or fut.done():
            return False
        fut.set_result(handoff)
        return True


async def parse_handoff(handoff: wpb.Handoff, context: grpc.aio.ServicerContext) -> Handoff:
    """The request's record, as a real worker reads it: INVALID_ARGUMENT naming the field if bad."""
    try:
        return convert.handoff_from_proto(handoff)
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        raise  # abort raises; for the type checker


class _FakeBase:
    def __init__(
        self,
        script: Sequence[int],
        block_size: int,
        total_blocks: int,
        worker_id: str,
        sample_scripts: Sequence[Sequence[int]] = (),
    ) -> None:
        self.script = list(script)
        self.sample_scripts = [list(s) for s in sample_scripts]
        self.block_size = block_size
        self.total_blocks = total_blocks
        self.worker_id = worker_id
        self.server: grpc.aio.Server | None = None
        self._stopping: asyncio.Task[None] | None = None
        self.address = ""
        self.cancel_calls: list[str] = []  # request ids passed to Cancel
        self.sample_cancels: list[tuple[str, int]] = []  # (request id, sample index) of one-sample cancels
        self.model_fingerprint = b""  # what its stats report (engine/fingerprint.py's 16 bytes)

    def token(self, index: int, i: int) -> int:
        """The i-th output token of sample `index` of every request."""
        script = self.sample_scripts[index] if index < len(self.sample_scripts) else self.script
        return script[i] if i < len(script) else EOS

    async def Cancel(self, request: wpb.CancelRequest, context: grpc.aio.ServicerContext) -> wpb.CancelResponse:  # noqa: N802
        self.cancel_calls.append(request.request_id)
        if request.HasField("index"):
            self.sample_cancels.append((request.request_id, request.index))
        return wpb.CancelResponse(found=False)

    async def BlockEvents(  # noqa: N802
        self, request: wpb.BlockEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.BlockEventBatch]:
        await asyncio.Event().wait()  # no prefix cache to report
        yield wpb.BlockEventBatch()

    async def start(self, host: str = "127.0.0.1") -> str:
        """Serve on a free loopback port; returns "host:port"."""
        self.server = grpc.aio.server()
        if isinstance(self, wgrpc.DecodeWorkerServicer):
            wgrpc.add_DecodeWorkerServicer_to_server(self, self.server)
        else:
            wgrpc.add_PrefillWorkerServicer_to_server(self, self.server)
        port = self.server.add_insecure_port(f"{host}:0")
        await self.server.start()
        self.address = f"{host}:{port}"
        return self.address

    def die(self, grace_s: float = 0.0) -> None:
        """Stop serving, from inside a handler too: new calls are refused at once, and calls in
        flight end with UNAVAILABLE when `grace_s` has passed (or when they end by themselves)."""
        if self.server is not None and self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self.server.stop(grace_s))

    async def stop(self) -> None:
        self.die()
        if self._stopping is not None:
            await asyncio.shield(self._stopping)


class FakeDecodeWorker(_FakeBase, wgrpc.DecodeWorkerServicer):
    def __init__(
        self,
        kv: FakeKVPlane,
        script: Sequence[int] = (),
        block_size: int = 16,
        total_blocks: int = 1024,
        worker_id: str = "decode",
        token_delay_s: float = 0.0,
        admit_delay_s: float = 0.0,
        lease_s: float = 5.0,
        die_after_tokens: int | None = None,  # stop this worker's server after sending this many tokens
        refuse: bool = False,  # answer every Decode with RESOURCE_EXHAUSTED
        extra_queued_tokens: int = 0,  # reported in stats on top of the real load (to steer routing)
        fail: grpc.StatusCode
        | None = None,  # answer every Decode with this status, as a worker refusing the request would
        sample_scripts: Sequence[Sequence[int]] = (),  # sample k's tokens, where not `script`
    ) -> None:
        super().__init__(script, block_size, total_blocks, worker_id, sample_scripts)
        self.kv = kv
        self.token_delay_s = token_delay_s
        self.admit_delay_s = admit_delay_s
        self.lease_s = lease_s
        self.die_after_tokens = die_after_tokens
        self.refuse = refuse
        self.fail = fail
        self.extra_queued_tokens = extra_queued_tokens
        self.requests: list[wpb.DecodeRequest] = []
        self.callers: set[str] = set()  # the gRPC peers (router connections) that sent it Decode calls
        self.active: dict[str, int] = {}  # request id -> context tokens
        self.cancelled: list[str] = []  # request ids whose Decode call the router cancelled
        self.cache: set[bytes] = set()
        self.tokens_sent = 0
        self.stats_busy = False  # answer GetStats with RESOURCE_EXHAUSTED, as a worker at its call limit does
        self.stats_refused = 0  # GetStats calls answered so
        self.stats_delay_s = 0.0  # a GetStats call answers this long after it arrives
        self.stats_started = 0  # GetStats calls arrived
        self._subscribers: list[asyncio.Queue[wpb.BlockEventBatch]] = []

    def _store(self, hashes: list[bytes]) -> None:
        new = [h for h in hashes if h not in self.cache]
        if not new:
            return
        self.cache.update(new)
        batch = wpb.BlockEventBatch(events=[wpb.BlockEvent(stored=wpb.BlocksStored(block_hashes=new))])
        for q in self._subscribers:
            q.put_nowait(batch)

    def clear_cache(self) -> None:
        self.cache.clear()
        batch = wpb.BlockEventBatch(events=[wpb.BlockEvent(cleared=wpb.AllBlocksCleared())])
        for q in self._subscribers:
            q.put_nowait(batch)

    async def BlockEvents(  # noqa: N802
        self, request: wpb.BlockEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.BlockEventBatch]:
        q: asyncio.Queue[wpb.BlockEventBatch] = asyncio.Queue()
        self._subscribers.append(q)
        try:
            yield wpb.BlockEventBatch(
                events=[
                    wpb.BlockEvent(cleared=wpb.AllBlocksCleared()),
                    wpb.BlockEvent(stored=wpb.BlocksStored(block_hashes=sorted(self.cache))),
                ]
            )
            while True:
                yield await q.get()
        finally:
            self._subscribers.remove(q)

    async def GetStats(self, request: wpb.StatsRequest, context: grpc.aio.ServicerContext) -> wpb.WorkerStats:  # noqa: N802
        self.stats_started += 1
        if self.stats_delay_s:
            await asyncio.sleep(self.stats_delay_s)
        if self.stats_busy:
            self.stats_refused += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded")
        used = sum(cdiv(n, self.block_size) for n in self.active.values())
        return wpb.WorkerStats(
            worker_id=self.worker_id,
            queued_tokens=self.extra_queued_tokens,
            running_tokens=sum(self.active.values()),
            free_blocks=max(0, self.total_blocks - used),
            total_blocks=self.total_blocks,
            running_requests=len(self.active),
            block_size=self.block_size,
            model_fingerprint=self.model_fingerprint,
        )

    async def Decode(  # noqa: N802
        self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.DecodeEvent]:
        self.requests.append(request)
        self.callers.add(context.peer())
        h = await self._admit(request, context)
        samples = h.sample_states()
        ctx = [*h.prompt_token_ids, *(samples[0].output_token_ids if len(samples) == 1 else [])]
        hashes, cached = self._cached(ctx)
        rid = request.request_id
        self.active[rid] = len(ctx)
        done = False
        try:
            # as the real worker: samples that went different lengths are prefilled here, whatever was asked
            if request.prefill_mode == wpb.PREFILL_MODE_REMOTE and len(h.samples) <= 1:
                ticket = os.urandom(16)
                arrived = self.kv.expect(ticket)
                yield wpb.DecodeEvent(reservation=self._reservation(rid, ticket, len(ctx), cached))
                try:  # the prefill worker's record: each sample with its first token, never sent again
                    samples = (await asyncio.wait_for(arrived, self.lease_s)).sample_states()
                except TimeoutError:
                    done = True
                    yield wpb.DecodeEvent(finish=wpb.Finish(reason=wpb.FINISH_REASON_LEASE_EXPIRED, message="no KV"))
                    return
            else:
                local = wpb.LocalPrefill(num_cached_tokens=cached)
                local.prompt_logprobs.extend(convert.logprob_to_proto(lp) for lp in fake_prompt_logprobs(h))
                yield wpb.DecodeEvent(local_prefill=local)
            self._store(hashes)
            pending = list(samples)
            while pending:  # one step: a token for each unfinished sample, in index order
                for sample in list(pending):
                    reason = _finish_reason(sample.output_token_ids, h.params)
                    if reason is None:
                        yield wpb.DecodeEvent(tokens=await self._next_token(h.params, sample, rid, context))
                        reason = _finish_reason(sample.output_token_ids, h.params)
                    if reason is not None:
                        pending.remove(sample)
                        done = not pending
                        yield wpb.DecodeEvent(finish=wpb.Finish(reason=reason, index=sample.index))
        except asyncio.CancelledError:
            if not done:
                self.cancelled.append(rid)
            raise
        finally:
            if not done and rid not in self.cancelled:
                self.cancelled.append(rid)  # generator closed early: the router cancelled the call
            self.active.pop(rid, None)

    async def _admit(self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext) -> Handoff:
        """Refuse or fail the call as configured, or admit it (after `admit_delay_s`): its record."""
        if self.refuse:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free blocks")
        if self.fail is not None:
            await context.abort(self.fail, "fake decode failure")
        if request.prefill_mode not in (wpb.PREFILL_MODE_LOCAL, wpb.PREFILL_MODE_REMOTE):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prefill_mode must be LOCAL or REMOTE")
        h = await parse_handoff(request.handoff, context)
        if self.admit_delay_s:
            await asyncio.sleep(self.admit_delay_s)
        return h

    def _cached(self, ctx: list[int]) -> tuple[list[bytes], int]:
        """The context's block hashes, and its tokens this worker has cached (never the last one)."""
        bs = self.block_size
        hashes = block_hashes(ctx, bs)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.cache:
            hit += 1
        return hashes, min(hit * bs, (len(ctx) - 1) // bs * bs)

    def _reservation(self, rid: str, ticket: bytes, context_tokens: int, cached: int) -> wpb.Reservation:
        return wpb.Reservation(
            kv_endpoint=f"fake:{self.worker_id}",
            transport="fake",
            ticket=ticket,
            request_id=rid,
            block_ids=list(range(len(blocks_to_fill(context_tokens, cached, self.block_size)))),
            num_cached_tokens=cached,
            layout=LAYOUT,
            lease_deadline_unix_ms=int((time.time() + self.lease_s) * 1000),
        )

    async def _next_token(
        self, params: SamplingParams, sample: SampleState, rid: str, context: grpc.aio.ServicerContext
    ) -> wpb.Tokens:
        """The sample's next script token (after `token_delay_s`), or the worker's death at
        `die_after_tokens`: the whole worker goes away, mid-stream. This stream ends with
        UNAVAILABLE after every token it sent (gRPC puts the status behind the messages), so the
        router holds exactly `die_after_tokens` of them when it hands the request on; stopping the
        server at once instead cancelled the call with its last tokens still unsent, now and then
        (tests/test_router_samples.py saw 2 tokens of a sample where 3 had been sent)."""
        if self.token_delay_s:
            await asyncio.sleep(self.token_delay_s)
        if self.die_after_tokens is not None and self.tokens_sent >= self.die_after_tokens:
            self.die(grace_s=DEATH_GRACE_S)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake decode worker died")
        t = self.token(sample.index, len(sample.output_token_ids))
        sample.output_token_ids.append(t)
        self.tokens_sent += 1
        self.active[rid] += 1
        out = wpb.Tokens(index=sample.index, token_ids=[t])
        if params.logprobs:
            lp = fake_logprob(t, DECODE_LOGPROB, params.top_logprobs)
            sample.logprobs.append(lp)
            out.logprobs.append(convert.logprob_to_proto(lp))
        return out


def _finish_reason(out: list[int], sp: SamplingParams) -> wpb.FinishReason | None:
    """STOP after a stop token, LENGTH at max_tokens (a sample's output in all, handed-over tokens
    included); None while the sample goes on."""
    stops = {EOS, *sp.stop_token_ids} - ({EOS} if sp.ignore_eos else set())
    if out and out[-1] in stops:
        return wpb.FINISH_REASON_STOP
    if len(out) >= sp.max_tokens:
        return wpb.FINISH_REASON_LENGTH
    return None


class FakePrefillWorker(_FakeBase, wgrpc.PrefillWorkerServicer):
    def __init__(
        self,
        kv: FakeKVPlane,
        script: Sequence[int] = (),
        block_size: int = 16,
        total_blocks: int = 1024,
        worker_id: str = "prefill",
        delay_s: float = 0.0,
        fail: grpc.StatusCode | None = None,  # answer every Prefill with this status
        queued_tokens: int = 0,  # reported in stats
        sample_scripts: Sequence[Sequence[int]] = (),  # sample k's tokens, where not `script`
    ) -> None:
        super().__init__(script, block_size, total_blocks, worker_id, sample_scripts)
        self.kv = kv
        self.delay_s = delay_s
        self.fail = fail
        self.queued_tokens = queued_tokens
        self.requests: list[wpb.PrefillRequest] = []
        self.cancelled: list[str] = []
        self.stats_open = asyncio.Event()  # clear it to hold GetStats answers (a poll in flight)
        self.stats_open.set()
        self.stats_held = 0  # GetStats calls waiting on stats_open now
        self.stats_answered = 0

    async def GetStats(self, request: wpb.StatsRequest, context: grpc.aio.ServicerContext) -> wpb.WorkerStats:  # noqa: N802
        self.stats_held += 1
        try:
            await self.stats_open.wait()
        finally:
            self.stats_held -= 1
        self.stats_answered += 1
        return wpb.WorkerStats(
            worker_id=self.worker_id,
            queued_tokens=self.queued_tokens,
            free_blocks=self.total_blocks,
            total_blocks=self.total_blocks,
            block_size=self.block_size,
            model_fingerprint=self.model_fingerprint,
        )

    async def Prefill(self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext) -> wpb.PrefillResult:  # noqa: N802
        self.requests.append(request)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.fail is not None:
                await context.abort(self.fail, "fake prefill failure")
            h = await parse_handoff(request.handoff, context)
            if len(h.samples) > 1:  # as the real worker: one context to prefill
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "handoff.samples: a prefill continues one sample")
            out = Handoff(h.prompt_token_ids, h.params, h.sample_states(), fake_prompt_logprobs(h))
            for sample in out.samples:  # each sample's next token here, at its own position
                t = self.token(sample.index, len(sample.output_token_ids))
                sample.output_token_ids.append(t)
                # a worker reports the logprobs of the tokens it sampled (worker.proto's SampleState)
                sample.logprobs = [fake_logprob(t, PREFILL_LOGPROB, h.params.top_logprobs)] if h.params.logprobs else []
            result = wpb.PrefillResult(handoff=convert.handoff_to_proto(out))  # before D goes on with `out`
            if not self.kv.deliver(request.reservation.ticket, out):
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no such reservation")
            return result
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
