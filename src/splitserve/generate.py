"""`splitserve generate "prompt"`: stream an answer to the terminal, through a
router's gRPC API (--address) or from an engine in this process (--local)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc


def add_arguments(p: argparse.ArgumentParser) -> None:
    from splitserve.engine.flags import add_engine_arguments

    p.add_argument("prompt", help="the user message (rendered with the model's chat template)")
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    p.add_argument("--local", action="store_true", help="run the engine in this process instead of calling a router")
    p.add_argument("--address", default="127.0.0.1:50051", help="router gRPC address")
    p.add_argument("--api-key", default=None, help="the router's API key, sent as a bearer token")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of this probability")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the likeliest's")
    p.add_argument("--seed", type=int, default=None, help="seeded sampling: the same tokens for the same seed")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="divides the logits of tokens seen (1: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted once from a generated token's logit")
    p.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="subtracted per occurrence of a generated token"
    )
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")
    p.add_argument("--stats", action="store_true", help="print TTFT and tokens/s to stderr at the end")
    p.add_argument(
        "--wait-s",
        type=float,
        default=300.0,
        help="how long to wait for the server to be ready (its workers loaded and warmed up) before giving up",
    )
    add_engine_arguments(p)


def _messages(a: argparse.Namespace) -> list[tuple[str, str]]:
    msgs = [("system", a.system)] if a.system else []
    return msgs + [("user", a.prompt)]


def run(a: argparse.Namespace) -> int:
    try:
        return _local(a) if a.local else _remote(a)
    except ValueError as e:
        print(f"splitserve generate: {e}", file=sys.stderr)
        return 2


def _local(a: argparse.Namespace) -> int:
    from splitserve.engine.engine import Engine
    from splitserve.engine.flags import engine_config_from_args
    from splitserve.engine.preflight import engine_problems
    from splitserve.engine.sampling import SamplingParams
    from splitserve.engine.tokenizer import IncrementalDetokenizer
    from splitserve.router.stop import StopMatcher

    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    engine_cfg = engine_config_from_args(a)
    # the header's checks before the weights load: a bad flag costs a second, not the load
    problems = engine_problems(a.model, {"--tensor-parallel-size": engine_cfg.tensor_parallel_size})
    if problems:
        raise ValueError("\n".join(p.line() for p in problems))
    engine, tokenizer = Engine.from_path(a.model, engine_cfg, progress=sys.stderr.isatty())
    if a.raw:
        prompt = tokenizer.encode(a.prompt, add_special_tokens=True)
    else:
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in _messages(a)]))
    params = SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        seed=a.seed,
        repetition_penalty=a.repetition_penalty,
        presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty,
        stop=tuple(a.stop),
        ignore_eos=a.ignore_eos,
    )
    engine.add_request("local", prompt, params)
    detok, stops = IncrementalDetokenizer(tokenizer), StopMatcher(a.stop)
    start, first, n, stopped = time.perf_counter(), None, 0, False
    while engine.has_work and not stopped:
        for out in engine.step():
            first = first or time.perf_counter()
            n += 1
            released = stops.feed(detok.push(out.token_id) + (detok.flush() if out.finished else ""))
            sys.stdout.write(released.text)
            sys.stdout.flush()
            if released.stopped:
                engine.abort("local")
                stopped = True
    if not stopped:
        sys.stdout.write(stops.flush())  # text held back for a stop string that never completed
    sys.stdout.write("\n")
    sys.stdout.flush()
    _print_stats(a, start, first, n)
    return 0


def _remote(a: argparse.Namespace) -> int:
    import grpc

    from splitserve.proto.splitserve.v1 import generate_pb2 as pb
    from splitserve.proto.splitserve.v1 import generate_pb2_grpc as pbg

    sp = pb.SamplingParams(
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        repetition_penalty=a.repetition_penalty,
        presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty,
        max_tokens=a.max_tokens,
        stop=a.stop,
        ignore_eos=a.ignore_eos,
    )
    if a.seed is not None:
        sp.seed = a.seed
    if a.raw:
        req = pb.GenerateRequest(text=a.prompt, sampling=sp)
    else:
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in _messages(a)])
        req = pb.GenerateRequest(chat=chat, sampling=sp)
    metadata = (("authorization", f"Bearer {a.api_key}"),) if a.api_key else ()
    with grpc.insecure_channel(a.address) as channel:
        if not wait_ready(channel, a.address, a.wait_s):
            return 1
        start, first, n = time.perf_counter(), None, 0
        try:
            for resp in pbg.GenerationStub(channel).Generate(req, metadata=metadata, timeout=600):
                if resp.token_ids:
                    first = first or time.perf_counter()
                    n += len(resp.token_ids)
                sys.stdout.write(resp.text)
                sys.stdout.flush()
        except grpc.RpcError as e:
            print(f"\nsplitserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    sys.stdout.flush()
    _print_stats(a, start, first, n)
    return 0


def wait_ready(channel: grpc.Channel, address: str, wait_s: float) -> bool:
    """Until the router's health is SERVING (its pools have ready workers), up to `wait_s`; says once
    on stderr what it waits for. False, with the reason printed, when the time runs out."""
    import grpc

    from splitserve.proto.grpc.health.v1 import health_pb2, health_pb2_grpc

    serving = health_pb2.HealthCheckResponse.SERVING
    end = time.monotonic() + wait_s
    said = ""

    def say(why: str) -> None:
        nonlocal said
        if why != said:
            print(f"splitserve generate: waiting for {address} to be ready: {why}", file=sys.stderr, flush=True)
            said = why

    def give_up() -> bool:
        said_ = said or "nothing listening there"
        print(f"splitserve generate: {address} was not ready within {wait_s:g} s ({said_})", file=sys.stderr)
        return False

    connected = grpc.channel_ready_future(channel)
    try:
        connected.result(timeout=min(1.0, wait_s))
    except grpc.FutureTimeoutError:
        say("nothing listening there yet")
        try:
            connected.result(timeout=max(end - time.monotonic(), 0.001))
        except grpc.FutureTimeoutError:
            return give_up()
    while True:
        left = end - time.monotonic()
        try:
            # Watch pushes every change of status: no polling. wait_for_ready: a router not yet
            # listening is waited for too, rather than failing at once.
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(), timeout=max(left, 0.001), wait_for_ready=True
            )
            for status in watch:
                if status.status == serving:
                    watch.cancel()
                    return True
                say("the server is up, its worker pools are not ready yet (health NOT_SERVING)")
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() >= end:
                return give_up()
            if e.code() != grpc.StatusCode.UNAVAILABLE:  # health not served, wrong address kind, ...
                why = f"{e.code().name}: {e.details()}"
                print(f"splitserve generate: health check of {address}: {why}", file=sys.stderr)
                return False
            say("nothing listening there yet")


def _print_stats(a: argparse.Namespace, start: float, first: float | None, n: int) -> None:
    if a.stats and first is not None:
        end = time.perf_counter()
        rate = (n - 1) / (end - first) if n > 1 and end > first else 0.0
        print(
            f"[ttft {1000 * (first - start):.0f} ms, {n} tokens, {rate:.1f} tokens/s after the first]", file=sys.stderr
        )
