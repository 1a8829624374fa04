"""How one request is sent and timed: OpenAI chat, OpenAI completions, or
splitserve's gRPC Generate stream. Each backend turns a `Prompt` into an
`Outcome`: the request's record (times from the client's clock) and the text
that came back (a conversation's next turn carries it).

Timing rule, the same for every backend: TTFT ends at the first chunk that
carries output, and every later chunk with output adds one ITL sample, the gap
since the previous one. A chunk carrying k tokens is one gap, not k (vLLM
records it the same way); TPOT, computed from the token count, spreads it.
Token counts come from the server's usage when it sends one, else the client
counts (chunks for OpenAI, token ids for gRPC).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from splitserve.measure.results import RequestRecord

BACKENDS = ("openai-chat", "openai-completions", "grpc")


@dataclass(frozen=True)
class Prompt:
    messages: list[dict[str, str]]  # the chat form: system, earlier turns, this user turn
    text: str  # the completions form: the same content as one string
    prompt_len: int  # the dataset's count, used when the server sends no usage
    output_len: int  # max_tokens
    tag: str


class Outcome(NamedTuple):
    record: RequestRecord
    text: str


@dataclass(frozen=True)
class BackendConfig:
    kind: str  # one of BACKENDS
    base_url: str | None = None  # HTTP backends: http://host:port (no /v1)
    model: str | None = None  # None: the first of GET /v1/models
    api_key: str | None = None
    grpc_address: str | None = None
    ignore_eos: bool = False
    timeout_s: float = 600.0  # per request, whole answer; generous: a queued request at a high rate waits long
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in BACKENDS:
            raise ValueError(f"backend {self.kind!r}: one of {', '.join(BACKENDS)}")
        if self.kind == "grpc" and not self.grpc_address:
            raise ValueError("backend grpc needs --grpc-address")
        if self.kind != "grpc" and not self.base_url:
            raise ValueError(f"backend {self.kind} needs --base-url")

    @property
    def chat(self) -> bool:
        """Whether the backend can carry a conversation (messages with roles)."""
        return self.kind != "openai-completions"


class Backend(Protocol):
    async def send(self, p: Prompt, t0: float) -> Outcome:
        """Send one request and time it; `t0` is the run's start on the backend's clock. Never raises for a
        failed request: the record's error says what went wrong."""
        ...

    async def close(self) -> None: ...


class _Timer:
    """Chunk arrival times of one request -> its record."""

    def __init__(self, clock: Callable[[], float], t0: float, p: Prompt) -> None:
        self.clock, self.t0, self.p = clock, t0, p
        self.sent = clock()
        self.last: float | None = None
        self.ttft = 0.0
        self.itl: list[float] = []
        self.chunks = 0  # chunks with output
        self.tokens: int | None = None  # client-counted tokens, where the protocol says (gRPC)
        self.usage_prompt: int | None = None
        self.usage_output: int | None = None
        self.usage_cached: int | None = None

    def output(self, tokens: int | None = None) -> None:
        now = self.clock()
        if self.last is None:
            self.ttft = now - self.sent
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.chunks += 1
        if tokens is not None:
            self.tokens = (self.tokens or 0) + tokens

    def record(self, error: str | None) -> RequestRecord:
        if error is None and self.last is None:
            error = "no output"
        counted = self.tokens if self.tokens is not None else self.chunks
        return RequestRecord(
            tag=self.p.tag,
            prompt_len=self.usage_prompt if self.usage_prompt is not None else self.p.prompt_len,
            output_len=self.usage_output if self.usage_output is not None else counted,
            start_s=self.sent - self.t0,
            ttft_s=self.ttft,
            itl_s=self.itl,
            latency_s=self.clock() - self.sent,
            cached_len=self.usage_cached if self.usage_cached is not None else -1,
            error=error,
        )


# ---- OpenAI-compatible HTTP ----------------------------------------------------------


class OpenAIBackend:
    """POST /v1/chat/completions or /v1/completions, streamed as server-sent events."""

    def __init__(self, cfg: BackendConfig, model: str, clock: Callable[[], float]) -> None:
        import aiohttp

        self.cfg, self.model, self.clock = cfg, model, clock
        self.chat = cfg.kind == "openai-chat"
        self.url = f"{str(cfg.base_url).rstrip('/')}/v1/{'chat/completions' if self.chat else 'completions'}"
        self.headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        # no connection cap: --max-concurrency is the only limit on requests in flight
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=cfg.timeout_s), connector=aiohttp.TCPConnector(limit=0)
        )

    def body(self, p: Prompt) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": p.output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.cfg.extra_body,
        }
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True
        if self.chat:
            body["messages"] = p.messages
        else:
            body["prompt"] = p.text
        return body

    async def send(self, p: Prompt, t0: float) -> Outcome:
        import aiohttp

        timer = _Timer(self.clock, t0, p)
        text: list[str] = []
        try:
            async with self.session.post(self.url, json=self.body(p), headers=self.headers) as resp:
                if resp.status != 200:
                    why = (await resp.text())[:300]
                    return Outcome(timer.record(f"HTTP {resp.status}: {why}"), "")
                async for raw in resp.content:
                    error = self._event(raw, timer, text)
                    if error is not None:
                        return Outcome(timer.record(error), "".join(text))
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # ValueError: an event that is not JSON
            return Outcome(timer.record(f"{type(e).__name__}: {e}"), "".join(text))
        return Outcome(timer.record(None), "".join(text))

    def _event(self, raw: bytes, timer: _Timer, text: list[str]) -> str | None:
        """One SSE line; returns an error message if the stream reported one."""
        line = raw.strip()
        if not line.startswith(b"data:"):
            return None
        data = line[5:].strip()
        if data == b"[DONE]":
            return None
        event = json.loads(data)
        if "error" in event:
            err = event["error"]
            return f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
        if usage := event.get("usage"):
            timer.usage_prompt = usage.get("prompt_tokens")
            timer.usage_output = usage.get("completion_tokens")
            timer.usage_cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if piece:  # a role-only or empty chunk is not output the user sees
                text.append(piece)
                timer.output()
        return None

    async def close(self) -> None:
        await self.session.close()


async def first_model(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    """The served model's name: the first entry of GET /v1/models."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        async with s.get(f"{base_url.rstrip('/')}/v1/models", headers=headers) as resp:
            resp.raise_for_status()
            data = (await resp.json())["data"]
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])


# ---- splitserve gRPC ---------------------------------------------------------------------


class GrpcBackend:
    """splitserve's public Generate stream; the prompt goes as chat messages (the chat template applies)."""

    def __init__(self, cfg: BackendConfig, clock: Callable[[], float]) -> None:
        import grpc

        from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg

        self.cfg, self.clock = cfg, clock
        self.channel = grpc.aio.insecure_channel(str(cfg.grpc_address))
        self.stub = pbg.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {cfg.api_key}"),) if cfg.api_key else ()

    async def send(self, p: Prompt, t0: float) -> Outcome:
        import grpc

        from splitserve.proto.splitserve.v1 import generate_pb2 as pb

        req = pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in p.messages]),
            sampling=pb.SamplingParams(max_tokens=p.output_len, ignore_eos=self.cfg.ignore_eos or None),
        )
        timer = _Timer(self.clock, t0, p)
        text: list[str] = []
        try:
            call = self.stub.Generate(req, timeout=self.cfg.timeout_s, metadata=self.metadata)
            async for r in call:
                if r.HasField("usage"):
                    timer.usage_prompt, timer.usage_output = r.usage.prompt_tokens, r.usage.completion_tokens
                    timer.usage_cached = r.usage.cached_tokens
                if r.token_ids:
                    text.append(r.text)
                    timer.output(len(r.token_ids))
        except grpc.aio.AioRpcError as e:
            return Outcome(timer.record(f"gRPC {e.code().name}: {e.details()}"), "".join(text))
        return Outcome(timer.record(None), "".join(text))

    async def close(self) -> None:
        await self.channel.close()


async def open_backend(cfg: BackendConfig, clock: Callable[[], float]) -> Backend:
    if cfg.kind == "grpc":
        return GrpcBackend(cfg, clock)
    model = cfg.model or await first_model(str(cfg.base_url), cfg.api_key)
    return OpenAIBackend(cfg, model, clock)
