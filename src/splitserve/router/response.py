"""What one client request is sent: each sample's tokens turned into text as they arrive
(incremental detokenization), stop strings applied, each sample's token budget kept, the
usage counted, and the response that ends the stream.

A request has `sampling.n` samples, each its own text stream: its own detokenizer, stop
matcher, budget and finish. Their responses interleave on the one call, told apart by
`index`; each sample's last response has its finish_reason, and the response that finishes
the last sample ends the call and carries the usage (completion tokens of all samples).

`ResponseShaper` knows nothing of workers or attempts: the request's run
(router/request.py) hands it each batch of tokens, from whichever decode worker
produced them, and sends on what it returns. Because the shaper holds the
tokens already sent, a migrated request's streams go on where they stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from splitserve.engine.handoff import SampleState, TokenLogprob
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.metrics import RouterMetrics
from splitserve.router.stop import StopMatcher
from splitserve.router.tokenizer import Detokenizer, RouterTokenizer
from splitserve.router.validation import ValidRequest


@dataclass
class _Sample:
    """One sample's stream as the client has been sent it."""

    index: int
    detok: Detokenizer
    stopper: StopMatcher
    output: list[int] = field(default_factory=list)  # token ids sent (what a migration hands over)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per id sent, with sampling.logprobs
    reason: pb.FinishReason = pb.FINISH_REASON_UNSPECIFIED  # set once this sample's stream has ended
    last_token_at: float = 0.0
    stopped_here: bool = False  # ended by a stop string matched here: the worker does not know

    @property
    def finished(self) -> bool:
        return self.reason != pb.FINISH_REASON_UNSPECIFIED


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
        stops = req.sampling.stop
        self.samples = [
            _Sample(i, tokenizer.detokenizer(req.prompt_token_ids), StopMatcher(stops)) for i in range(req.sampling.n)
        ]
        self.cached_tokens: int | None = None  # prompt tokens the first attempt found cached
        # the prompt's log-probabilities (sampling.prompt_logprobs), from whoever prefilled; sent once
        self.prompt_logprobs: list[TokenLogprob] = []
        self.responded = False  # the first response has been made (it alone carries prompt_logprobs)
        self.finished = False  # every sample's stream has ended

    @property
    def completion_tokens(self) -> int:
        """Tokens sent to the client so far, all samples together."""
        return sum(len(s.output) for s in self.samples)

    def handoff_samples(self) -> list[SampleState]:
        """The samples a next attempt continues, as the Handoff carries them: none while nothing has
        been sent (a fresh start, all n), else every unfinished sample with what the client has of it."""
        if not any(s.output or s.finished for s in self.samples):
            return []
        return [SampleState(s.index, list(s.output), list(s.logprobs)) for s in self.samples if not s.finished]

    def sent(self, index: int) -> int:
        """Tokens of sample `index` sent so far."""
        return len(self.samples[index].output)

    def set_cached(self, n: int) -> None:
        if self.cached_tokens is None:  # the first attempt's count is the one the client paid for
            self.cached_tokens = min(n, len(self.req.prompt_token_ids))

    def set_prompt_logprobs(self, logprobs: Sequence[TokenLogprob]) -> None:
        """The prompt's log-probabilities as a worker reported them; the first report is kept (a later
        attempt's prefill computes the same ones)."""
        if logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = list(logprobs)

    def usage(self) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=len(self.req.prompt_token_ids),
            cached_tokens=self.cached_tokens or 0,
            completion_tokens=self.completion_tokens,
        )

    def emit(
        self, index: int, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]
    ) -> pb.GenerateResponse | None:
        """The response for sample `index`'s new tokens; None once that sample's stream has ended (a
        worker may send a few tokens past a stop string or the budget before its finish arrives)."""
        s = self.samples[index]
        room = self.req.sampling.max_tokens - len(s.output)
        if room <= 0 or s.finished:
            return None
        ids = list(token_ids[:room])
        lps = list(logprobs[: len(ids)]) if self.req.sampling.logprobs else []
        self._observe_latency(s, len(ids))
        s.output.extend(ids)
        s.logprobs.extend(lps)
        released = s.stopper.feed("".join([s.detok.feed(t) for t in ids]))
        resp = self._response(s, released.text, ids, lps)
        if released.stopped:
            s.stopped_here = True
            self._finish_sample(s, resp, pb.FINISH_REASON_STOP)
        elif len(s.output) >= self.req.sampling.max_tokens:
            tail, stopped = self._drain(s)
            resp.text += tail
            self._finish_sample(s, resp, pb.FINISH_REASON_STOP if stopped else pb.FINISH_REASON_LENGTH)
        self._add_usage(resp)
        return resp

    def stopped_here(self, index: int) -> bool:
        """Whether sample `index` ended on a stop string matched here (its worker decodes on)."""
        return self.samples[index].stopped_here

    def final(self, index: int, reason: pb.FinishReason) -> pb.GenerateResponse | None:
        """Sample `index`'s last response, when the worker finished it (`reason`, unless a stop string
        in the text still held back matches); None if its stream has already ended here."""
        s = self.samples[index]
        if s.finished:
            return None
        text, stopped = self._drain(s)
        resp = self._response(s, text, [], [])
        self._finish_sample(s, resp, pb.FINISH_REASON_STOP if stopped else reason)
        self._add_usage(resp)
        return resp

    def on_admitted(self) -> None:
        """A decode worker's first event for this request (reservation or local prefill): the end of
        its queue time, observed once (a later attempt after a migration is not queued again)."""
        if not self.admitted:
            self.admitted = True
            self.metrics.client.queue.observe(self.clock() - self.start)

    def _response(self, s: _Sample, text: str, ids: list[int], lps: list[TokenLogprob]) -> pb.GenerateResponse:
        sp = self.req.sampling
        resp = pb.GenerateResponse(request_id=self.req.request_id, index=s.index, text=text, token_ids=ids)
        if sp.logprobs:
            resp.logprobs.extend(lp.logprob for lp in lps)
            if sp.top_logprobs:
                resp.top_logprobs.extend(_top(lp) for lp in lps)
        if not self.responded:
            self.responded = True
            if sp.prompt_logprobs and self.prompt_logprobs:
                resp.prompt_logprobs.extend(_prompt_logprobs(self.req.prompt_token_ids, self.prompt_logprobs))
        return resp

    def _finish_sample(self, s: _Sample, resp: pb.GenerateResponse, reason: pb.FinishReason) -> None:
        s.reason = resp.finish_reason = reason
        if all(x.finished for x in self.samples):
            self._finish()

    def _add_usage(self, resp: pb.GenerateResponse) -> None:
        """Usage on the response that ends the call (or on every one, with continuous_usage)."""
        if self.finished or self.req.continuous_usage:
            resp.usage.CopyFrom(self.usage())

    def _finish(self) -> None:
        """Every sample's stream has ended: e2e latency and success observed, once per request
        ("length" when any sample was cut by its budget)."""
        if self.finished:
            return
        self.finished = True
        client = self.metrics.client
        client.e2e.observe(self.clock() - self.start)
        truncated = any(s.reason == pb.FINISH_REASON_LENGTH for s in self.samples)
        client.finished("length" if truncated else "stop")

    def _observe_latency(self, s: _Sample, n: int) -> None:
        """`n` tokens of sample `s` about to be sent: the request's first batch ends the TTFT (its
        other tokens have no gap to count); each later token of a sample counts an equal share of the
        gap since that sample's batch before (the gap its own stream shows); a sample's first batch
        after another sample's has no gap of its own."""
        if not n:
            return
        now = self.clock()
        client = self.metrics.client
        if not self.completion_tokens:
            self.metrics.ttft.observe(now - self.start)
            client.ttft.observe(now - self.start)
            client.prompt_tokens.inc(len(self.req.prompt_token_ids))
        elif s.output:
            gap = (now - s.last_token_at) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
                client.itl.observe(gap)
        client.generation_tokens.inc(n)
        s.last_token_at = now

    @staticmethod
    def _drain(s: _Sample) -> tuple[str, bool]:
        """The text still held by a sample's detokenizer and stop matcher, at the end of its stream."""
        released = s.stopper.feed(s.detok.flush())
        if released.stopped:
            return released.text, True
        return released.text + s.stopper.flush(), False


def _top(lp: TokenLogprob) -> pb.TopLogprobs:
    return pb.TopLogprobs(token_ids=[t for t, _ in lp.top], logprobs=[v for _, v in lp.top])


def _prompt_logprobs(prompt: Sequence[int], logprobs: Sequence[TokenLogprob]) -> list[pb.PromptLogprob]:
    """One per prompt token: the first has no logprob (nothing precedes it); token i's is the
    worker's logprobs[i - 1]."""
    out = [pb.PromptLogprob(token_id=prompt[0])]
    for token, lp in zip(prompt[1:], logprobs, strict=False):
        out.append(pb.PromptLogprob(token_id=token, logprob=lp.logprob, top=_top(lp) if lp.top else None))
    out.extend(pb.PromptLogprob(token_id=t) for t in prompt[len(out) :])  # a short report: the rest without
    return out
