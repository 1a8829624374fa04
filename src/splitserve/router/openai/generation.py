"""What the HTTP door uses of the gRPC service (router/server.py's `GenerationService`): the
door joins the gRPC path at the same admission, streams the admitted request the same way, and
reads the service's API keys and tokenizer. Nothing else of the service is the door's.
`Router.start` hands its `GenerationService` in as a `Generation[Admitted]`, where mypy checks
that the service satisfies this.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol, TypeVar

from opentelemetry.context import Context

from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.router.request import RequestRun
from splitserve.router.tenants import KeyRing
from splitserve.router.tokenizer import RouterTokenizer


class Admission(Protocol):
    """A request past admission, as the door holds it until it hands it back."""

    @property
    def run(self) -> RequestRun:
        """The request's attempts; the door waits on `run.admitted` before a stream's first byte."""
        ...


AdmissionT = TypeVar("AdmissionT", bound=Admission)


class Generation(Protocol[AdmissionT]):
    """The gRPC service as the door sees it; `AdmissionT` is what its `admit` hands out and
    its `stream` and `release` take back."""

    @property
    def keys(self) -> KeyRing:
        """The tenants' API keys (the door's middleware checks them before a body is read)."""
        ...

    @property
    def tokenizer(self) -> RouterTokenizer:
        """For the vocabulary's size, the tool-call syntax, and tokens' texts."""
        ...

    async def admit(
        self,
        request: pb.GenerateRequest,
        authorization: str | None,
        time_remaining: float | None,
        trace_parent: Context | None = None,
        front_door: str = "grpc",
        priority: str | None = None,
    ) -> AdmissionT:
        """Everything a request must pass before it runs; RequestFailed says what it did not."""
        ...

    def stream(self, admitted: AdmissionT) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Run an admitted request; its failures come out as RequestFailed. The door closes it
        (`aclose`) when it is done with it, early or not."""
        ...

    def release(self, admitted: AdmissionT) -> None:
        """Give back what a request that never ran holds of its tenant's limits (once)."""
        ...
