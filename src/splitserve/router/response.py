"""What one client request is sent: its tokens turned into text as they arrive
(incremental detokenization), stop strings applied, the token budget kept, the
usage counted, and the last response that ends the stream.

`ResponseShaper` knows nothing of workers or attempts: the request's run
(router/request.py) hands it each batch of tokens, from whichever decode worker
produced them, and sends on what it returns. Because the shaper holds the
tokens already sent, a migrated request's stream goes on where it stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.metrics import RouterMetrics
from splitserve.router.stop import StopMatcher
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.router.validation import ValidRequest


class ResponseShaper:
    """The client's side of one request: tokens in, GenerateResponses out."""

    def __init__(
        self,
        req: ValidRequest,
        tokenizer: RouterTokenizer,
        metrics: RouterMetrics,
        start: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.req = req
        # observed as the client sees the request (tokens as they are sent, not as workers make them):
        # splitserve_router_ttft/itl and the workers' names in metrics.client, each once per request or token
        self.metrics = metrics
        self.start = start  # clock() at the request's arrival (for TTFT, queue time and e2e)
        self.clock = clock
        self.admitted = False  # a decode worker's first event has arrived (queue time observed)
        self.detok = tokenizer.detokenizer(req.prompt_token_ids)
        self.stopper = StopMatcher(req.sampling.stop)
        self.generated: list[int] = []  # tokens sent to the client so far (what a migration resumes from)
        self.cached_tokens: int | None = None  # prompt tokens the first attempt found cached
        self.finished = False
        self.last_token_at = 0.0

    @property
    def tokens_left(self) -> int:
        """The request's token budget still unspent."""
        return self.req.sampling.max_tokens - len(self.generated)

    def set_cached(self, n: int) -> None:
        if self.cached_tokens is None:  # the first attempt's count is the one the client paid for
            self.cached_tokens = min(n, len(self.req.prompt_token_ids))

    def usage(self) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=len(self.req.prompt_token_ids),
            cached_tokens=self.cached_tokens or 0,
            completion_tokens=len(self.generated),
        )

    def emit(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> pb.GenerateResponse | None:
        """The response for these new tokens; None once the stream has ended (a worker may send a
        few tokens past a stop string or the budget before its finish arrives)."""
        room = self.tokens_left
        if room <= 0 or self.finished:
            return None
        ids = list(token_ids[:room])
        self._observe_latency(len(ids))
        self.generated.extend(ids)
        released = self.stopper.feed("".join([self.detok.feed(t) for t in ids]))
        resp = pb.GenerateResponse(
            request_id=self.req.request_id,
            text=released.text,
            token_ids=ids,
            logprobs=list(logprobs[: len(ids)]) if self.req.sampling.logprobs else [],
        )
        if released.stopped:
            resp.finish_reason = pb.FINISH_REASON_STOP
        elif not self.tokens_left:
            tail, stopped = self._drain()
            resp.text += tail
            resp.finish_reason = pb.FINISH_REASON_STOP if stopped else pb.FINISH_REASON_LENGTH
        if resp.finish_reason:
            self._finish(resp.finish_reason)
        if resp.finish_reason or self.req.continuous_usage:
            resp.usage.CopyFrom(self.usage())
        return resp

    def final(self, reason: pb.FinishReason) -> pb.GenerateResponse:
        """The last response, when the worker finished the request (`reason`, unless a stop string
        in the text still held back matches)."""
        text, stopped = self._drain()
        resp = pb.GenerateResponse(
            request_id=self.req.request_id,
            text=text,
            finish_reason=pb.FINISH_REASON_STOP if stopped else reason,
            usage=self.usage(),
        )
        self._finish(resp.finish_reason)
        return resp

    def on_admitted(self) -> None:
        """A decode worker's first event for this request (reservation or local prefill): the end of
        its queue time, observed once (a later attempt after a migration is not queued again)."""
        if not self.admitted:
            self.admitted = True
            self.metrics.client.queue.observe(self.clock() - self.start)

    def _finish(self, reason: pb.FinishReason) -> None:
        """The stream ends with `reason`: e2e latency and success observed, once per request."""
        if self.finished:
            return
        self.finished = True
        client = self.metrics.client
        client.e2e.observe(self.clock() - self.start)
        client.finished("length" if reason == pb.FINISH_REASON_LENGTH else "stop")

    def _observe_latency(self, n: int) -> None:
        """`n` tokens about to be sent: the first batch ends the TTFT (its other tokens have no gap to
        count), each later token counts an equal share of the gap since the batch before."""
        if not n:
            return
        now = self.clock()
        client = self.metrics.client
        if not self.generated:
            self.metrics.ttft.observe(now - self.start)
            client.ttft.observe(now - self.start)
            client.prompt_tokens.inc(len(self.req.prompt_token_ids))
        else:
            gap = (now - self.last_token_at) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
                client.itl.observe(gap)
        client.generation_tokens.inc(n)
        self.last_token_at = now

    def _drain(self) -> tuple[str, bool]:
        """The text still held by the detokenizer and the stop matcher, at the end of the stream."""
        released = self.stopper.feed(self.detok.flush())
        if released.stopped:
            return released.text, True
        return released.text + self.stopper.flush(), False
