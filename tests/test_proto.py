"""The committed generated Python is exactly what the .proto files produce."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.proto import generate


def test_regenerating_changes_nothing(tmp_path: Path) -> None:
    written = generate.generate(tmp_path)
    assert written, "no .proto files found"
    for path in written:
        rel = path.relative_to(tmp_path)
        committed = generate.PROTO_ROOT / rel
        assert committed.exists(), f"{rel} is generated but not committed; run `make proto`"
        assert committed.read_bytes() == path.read_bytes(), f"{rel} is stale; run `make proto`"


def test_generated_modules_import_inside_the_package() -> None:
    from splitserve.proto.grpc.health.v1 import health_pb2, health_pb2_grpc
    from splitserve.proto.splitserve.internal.v1 import worker_pb2, worker_pb2_grpc
    from splitserve.proto.splitserve.v1 import generate_pb2, generate_pb2_grpc

    assert generate_pb2.DESCRIPTOR.package == "splitserve.v1"
    assert worker_pb2.DESCRIPTOR.package == "splitserve.internal.v1"
    assert health_pb2.DESCRIPTOR.services_by_name["Health"].full_name == "grpc.health.v1.Health"
    for mod in (generate_pb2_grpc, worker_pb2_grpc, health_pb2_grpc):
        assert mod.__name__.startswith("splitserve.proto.")


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "max_tokens",
        "logprobs",
        "ignore_eos",
    ],
)
def test_public_sampling_fields_have_presence(field: str) -> None:
    """Unset must stay distinguishable from 0, so the server's defaults apply."""
    from splitserve.proto.splitserve.v1 import generate_pb2

    sp = generate_pb2.SamplingParams()
    assert not sp.HasField(field)
    setattr(sp, field, type(getattr(sp, field))())  # the zero value, set explicitly
    assert sp.HasField(field)


def test_decode_events_are_a_oneof() -> None:
    from splitserve.proto.splitserve.internal.v1 import worker_pb2 as w

    ev = w.DecodeEvent(reservation=w.Reservation(ticket=b"\x01" * 16, block_ids=[3, 4]))
    assert ev.WhichOneof("event") == "reservation"
    ev.tokens.token_ids.append(5)
    assert ev.WhichOneof("event") == "tokens"


def test_whose_request_it_is_crosses_in_the_handoff_and_a_bad_one_is_refused() -> None:
    from splitserve.engine.handoff import Handoff
    from splitserve.engine.prefill_order import Share
    from splitserve.engine.sampling import SamplingParams
    from splitserve.proto import convert

    h = Handoff([1, 2, 3], SamplingParams(max_tokens=4), share=Share("search", 2.0, 0))
    assert convert.handoff_from_proto(convert.handoff_to_proto(h)).share == Share("search", 2.0, 0)
    unset = convert.handoff_to_proto(h)
    unset.ClearField("share")  # a router that sends none: no tenant
    assert convert.handoff_from_proto(unset).share == Share()
    bad = convert.handoff_to_proto(h)
    bad.share.band = 7
    with pytest.raises(ValueError, match="handoff.share: band 7"):
        convert.handoff_from_proto(bad)
