"""n samples, logprobs and migration over the handoff protocol, through the router and the fake
workers over real gRPC on loopback."""

from __future__ import annotations

from collections import defaultdict

import pytest

from splitserve.bench.fake_workers import DECODE_LOGPROB, EOS, PREFILL_LOGPROB, PROMPT_LOGPROB
from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.config import RoutingConfig
from tests.test_router_server import LONG, cluster, run

pytestmark = pytest.mark.timeout(60)

TEXTS = ["first answer", "the second one", "3rd"]
SCRIPTS = [list(t.encode()) for t in TEXTS]
LOCAL = RoutingConfig(local_prefill_max_tokens=10_000)  # every prompt prefilled on the decode worker
REMOTE = RoutingConfig(mode="disaggregated")


def by_sample(responses: list[pb.GenerateResponse]) -> dict[int, list[pb.GenerateResponse]]:
    out: dict[int, list[pb.GenerateResponse]] = defaultdict(list)
    for r in responses:
        out[r.index].append(r)
    return dict(out)


def text_of(responses: list[pb.GenerateResponse]) -> str:
    return "".join(r.text for r in responses)


def ids_of(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def assert_each_sample_whole(rs: list[pb.GenerateResponse], texts: list[str]) -> None:
    """Every sample's text and ids, each ended once by STOP at its EOS, usage once at the end."""
    samples = by_sample(rs)
    assert sorted(samples) == list(range(len(texts)))
    for i, text in enumerate(texts):
        assert text_of(samples[i]) == text
        assert ids_of(samples[i]) == [*text.encode(), EOS]
        assert [r.finish_reason for r in samples[i] if r.finish_reason] == [pb.FINISH_REASON_STOP]
        assert samples[i][-1].finish_reason == pb.FINISH_REASON_STOP
    assert [r.HasField("usage") for r in rs] == [False] * (len(rs) - 1) + [True]
    assert rs[-1].usage.completion_tokens == sum(len(t) + 1 for t in texts)


@pytest.mark.parametrize("routing", [LOCAL, REMOTE], ids=["local", "remote"])
def test_three_samples_each_stream_and_finish_and_usage_sums(routing: RoutingConfig) -> None:
    async def scenario() -> None:
        async with cluster(
            routing=routing, decode=[{"sample_scripts": SCRIPTS}], prefill=[{"sample_scripts": SCRIPTS}]
        ) as c:
            rs = await c.generate(request_id="n3", text=LONG, sampling=pb.SamplingParams(n=3))
            assert_each_sample_whole(rs, TEXTS)
            assert all(r.request_id == "n3" for r in rs)
            (dreq,) = c.decode[0].requests
            assert dreq.handoff.sampling.n == 3 and not dreq.handoff.samples  # fresh: all three to start
            if routing is REMOTE:
                assert [r.index for r in rs[:3]] == [0, 1, 2]  # the prefill worker's first tokens, sent at once
                assert [r.token_ids for r in rs[:3]] == [[s[0]] for s in SCRIPTS]
                (preq,) = c.prefill[0].requests
                assert preq.handoff.sampling.n == 3 and not preq.handoff.samples

    run(scenario)


def test_each_sample_keeps_its_own_budget_and_stop_strings() -> None:
    async def scenario() -> None:
        async with cluster(routing=LOCAL, decode=[{"sample_scripts": SCRIPTS, "token_delay_s": 0.002}]) as c:
            rs = await c.generate(
                text="hi",
                sampling=pb.SamplingParams(n=3, max_tokens=12, stop=["second"]),
                stream_options=pb.StreamOptions(continuous_usage=True),
            )
            samples = by_sample(rs)
            assert text_of(samples[0]) == "first answer"  # its budget, before its EOS
            assert samples[0][-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert text_of(samples[1]) == "the "  # its stop string: the worker's later tokens are not sent
            assert ids_of(samples[1]) == list(b"the second")
            assert samples[1][-1].finish_reason == pb.FINISH_REASON_STOP
            assert (text_of(samples[2]), samples[2][-1].finish_reason) == ("3rd", pb.FINISH_REASON_STOP)
            assert all(r.HasField("usage") for r in rs)
            counted = [r.usage.completion_tokens for r in rs if r.token_ids]  # one token a response here
            assert counted == list(range(1, len(counted) + 1))
            assert rs[-1].usage.completion_tokens == 12 + len("the second") + 4
            # the worker hears that sample 1 ended here (the others went on), and of no other
            (dreq,) = c.decode[0].requests
            assert c.decode[0].sample_cancels == [(dreq.request_id, 1)]

    run(scenario)


def test_logprobs_and_top_logprobs_come_with_each_token() -> None:
    async def scenario() -> None:
        async with cluster(routing=REMOTE) as c:
            rs = await c.generate(text=LONG, sampling=pb.SamplingParams(logprobs=True, top_logprobs=2, max_tokens=3))
            tokens = [r for r in rs if r.token_ids]
            for r, value in zip(tokens, [PREFILL_LOGPROB, DECODE_LOGPROB, DECODE_LOGPROB], strict=True):
                (t,) = r.token_ids
                assert list(r.logprobs) == [value]  # the first from the prefill worker, then the decode worker's
                (top,) = r.top_logprobs
                assert (list(top.token_ids), list(top.logprobs)) == ([t, t + 1], [value, value - 1])
            rs = await c.generate(text=LONG, sampling=pb.SamplingParams(logprobs=True, max_tokens=2))
            assert all(len(r.logprobs) == len(r.token_ids) and not r.top_logprobs for r in rs)
            rs = await c.generate(text=LONG, sampling=pb.SamplingParams(max_tokens=2))
            assert not any(r.logprobs or r.top_logprobs for r in rs)

    run(scenario)


@pytest.mark.parametrize("routing", [LOCAL, REMOTE], ids=["local", "remote"])
def test_prompt_logprobs_come_on_the_first_response_only(routing: RoutingConfig) -> None:
    async def scenario() -> None:
        async with cluster(routing=routing) as c:
            prompt = "abc"
            rs = await c.generate(text=prompt, sampling=pb.SamplingParams(prompt_logprobs=3, n=2, max_tokens=2))
            first = rs[0].prompt_logprobs
            assert [p.token_id for p in first] == list(prompt.encode())
            assert not first[0].HasField("logprob")  # nothing precedes the first token
            for p in first[1:]:
                assert p.logprob == PROMPT_LOGPROB
                assert list(p.top.token_ids) == [p.token_id, p.token_id + 1]  # k - 1 = 2 others
            assert not any(r.prompt_logprobs for r in rs[1:])
            rs = await c.generate(text=prompt, sampling=pb.SamplingParams(max_tokens=2))
            assert not any(r.prompt_logprobs for r in rs)

    run(scenario)


# ---- migration: each unfinished sample goes on where it stopped


def test_a_two_sample_request_migrates_with_each_samples_tokens() -> None:
    async def scenario() -> None:
        scripts = SCRIPTS[:2]
        # d0 looks idle and dies after 5 tokens (samples 0, 1, 0, 1, 0); d1 looks busy: only the fallback
        async with cluster(
            routing=LOCAL,
            decode=[
                {"sample_scripts": scripts, "die_after_tokens": 5},
                {"sample_scripts": scripts, "extra_queued_tokens": 8000},
            ],
        ) as c:
            rs = await c.generate(text=LONG, sampling=pb.SamplingParams(n=2, logprobs=True, top_logprobs=1))
            assert_each_sample_whole(rs, TEXTS[:2])
            (moved,) = c.decode[1].requests
            h = moved.handoff
            assert [(s.index, list(s.output_token_ids)) for s in h.samples] == [
                (0, scripts[0][:3]),
                (1, scripts[1][:2]),
            ]
            for s in h.samples:  # the logprobs the client was sent, one per handed-over token
                assert [lp.logprob for lp in s.logprobs] == [DECODE_LOGPROB] * len(s.output_token_ids)
                assert [list(lp.top_token_ids) for lp in s.logprobs] == [[t] for t in s.output_token_ids]
            assert h.sampling.n == 2 and h.sampling.max_tokens == 256  # the request's, not less what was sent
            assert list(h.prompt_token_ids) == list(LONG.encode())
            assert c.router.metrics.migrations._value.get() == 1

    run(scenario)


def test_a_finished_sample_is_not_handed_over() -> None:
    async def scenario() -> None:
        scripts = [list(b"ok"), list(b"a much longer answer")]
        # sample 0 ends after 3 tokens (o, k, EOS); d0 dies after 8 tokens
        async with cluster(
            routing=LOCAL,
            decode=[
                {"sample_scripts": scripts, "die_after_tokens": 8},
                {"sample_scripts": scripts, "extra_queued_tokens": 8000},
            ],
        ) as c:
            rs = await c.generate(text="hi", sampling=pb.SamplingParams(n=2))
            assert_each_sample_whole(rs, ["ok", "a much longer answer"])
            (moved,) = c.decode[1].requests
            assert [(s.index, list(s.output_token_ids)) for s in moved.handoff.samples] == [(1, scripts[1][:5])]

    run(scenario)


def test_a_migration_to_a_remote_prefill_sends_only_the_new_tokens() -> None:
    async def scenario() -> None:
        scripts = [list(b"ok"), list(b"a much longer answer")]
        # the prefill worker samples o and a; d0 sends k, " ", EOS (sample 0 ends), m, u, and dies
        async with cluster(
            routing=REMOTE,
            decode=[
                {"sample_scripts": scripts, "die_after_tokens": 5},
                {"sample_scripts": scripts, "extra_queued_tokens": 8000},
            ],
            prefill=[{"sample_scripts": scripts}],
        ) as c:
            rs = await c.generate(text=LONG, sampling=pb.SamplingParams(n=2, logprobs=True))
            assert_each_sample_whole(rs, ["ok", "a much longer answer"])
            for s in by_sample(rs).values():
                assert all(len(r.logprobs) == len(r.token_ids) for r in s)
            first, second = c.prefill[0].requests
            assert not first.handoff.samples
            (sample,) = second.handoff.samples  # the one sample left, with what the client has of it
            assert (sample.index, list(sample.output_token_ids)) == (1, list(b"a mu"))
            assert [r.prefill_mode for r in c.decode[1].requests] == [wpb.PREFILL_MODE_REMOTE]

    run(scenario)


def test_samples_of_different_lengths_are_prefilled_on_the_decode_worker() -> None:
    """A prefill worker fills one context; two samples that went on have two: the replacement
    decode worker prefills them itself, and no Prefill call is made for them."""

    async def scenario() -> None:
        scripts = SCRIPTS[:2]
        async with cluster(
            routing=REMOTE,
            decode=[
                {"sample_scripts": scripts, "die_after_tokens": 4},
                {"sample_scripts": scripts, "extra_queued_tokens": 8000},
            ],
            prefill=[{"sample_scripts": scripts}],
        ) as c:
            rs = await c.generate(text=LONG, sampling=pb.SamplingParams(n=2))
            assert_each_sample_whole(rs, TEXTS[:2])
            (moved,) = c.decode[1].requests
            assert moved.prefill_mode == wpb.PREFILL_MODE_LOCAL
            # the prefill worker's first token and d0's two of each sample: 3 each
            assert [(s.index, list(s.output_token_ids)) for s in moved.handoff.samples] == [
                (0, scripts[0][:3]),
                (1, scripts[1][:3]),
            ]
            assert len(c.prefill[0].requests) == 1  # the first attempt's only

    run(scenario)
