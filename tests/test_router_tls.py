"""TLS at the front door, against fake workers: the openai client over HTTPS and a gRPC client
over TLS, each trusting a self-signed CA made here; mutual TLS that refuses a client without a
certificate; and a certificate rotated under 20 live streams, which all finish while the next
connection gets the new certificate."""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path
from typing import Any

import grpc
import httpx2
import openai
import pytest
from cryptography import x509

from splitserve.proto.splitserve.v1 import generate_pb2 as pb
from splitserve.proto.splitserve.v1 import generate_pb2_grpc as gpb_grpc
from splitserve.router.config import Listeners
from splitserve.router.server import Router
from splitserve.runtime.tls import TLSFiles, issue_cert, make_ca
from tests.router_helpers import with_fake_cluster

pytestmark = pytest.mark.timeout(60)

ANSWER = "Hello, world!"
SCRIPT = list(ANSWER.encode())


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, TLSFiles]:
    ca = make_ca(tmp_path / "ca")
    return {
        "ca": ca,
        "server": issue_cert(ca, tmp_path / "server", "server"),
        "client": issue_cert(ca, tmp_path / "client", "client"),
        "stranger": issue_cert(make_ca(tmp_path / "other-ca"), tmp_path / "stranger", "stranger"),
    }


async def with_router(tls: TLSFiles, body: Any, token_delay_s: float = 0.0) -> Any:
    listeners = Listeners(host="127.0.0.1", grpc_port=0, http_port=0, api_key="k", tls=tls)
    return await with_fake_cluster(body, SCRIPT, token_delay_s=token_delay_s, listeners=listeners)


def client_context(ca: TLSFiles, cert: TLSFiles | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca.certfile)
    if cert is not None:
        ctx.load_cert_chain(cert.certfile, cert.keyfile)
    return ctx


def openai_client(router: Router, ctx: ssl.SSLContext) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"https://127.0.0.1:{router.http_port}/v1",
        api_key="k",
        max_retries=0,
        http_client=httpx2.AsyncClient(verify=ctx, limits=httpx2.Limits(max_connections=64)),
    )


async def grpc_generate(router: Router, ca: TLSFiles, cert: TLSFiles | None = None) -> str:
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(ca.certfile).read_bytes(),
        private_key=Path(cert.keyfile).read_bytes() if cert else None,
        certificate_chain=Path(cert.certfile).read_bytes() if cert else None,
    )
    async with grpc.aio.secure_channel(f"127.0.0.1:{router.port}", creds) as ch:
        stub = gpb_grpc.GenerationStub(ch)
        out = []
        async for r in stub.Generate(pb.GenerateRequest(text="hi"), metadata=(("authorization", "Bearer k"),)):
            out.append(r.text)
        return "".join(out)


def test_both_doors_over_tls_with_a_self_signed_ca(pki: dict[str, TLSFiles]) -> None:
    async def body(router: Router) -> tuple[str | None, str]:
        async with openai_client(router, client_context(pki["ca"])) as client:
            r = await client.completions.create(model="splitserve", prompt="hi", max_tokens=32)
        return r.choices[0].text, await grpc_generate(router, pki["ca"])

    server = pki["server"]
    text, grpc_text = asyncio.run(with_router(TLSFiles(server.certfile, server.keyfile), body))
    assert text == ANSWER and grpc_text == ANSWER


def test_mutual_tls_refuses_a_client_without_a_certificate_of_the_ca(pki: dict[str, TLSFiles]) -> None:
    async def body(router: Router) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for who, cert in (("none", None), ("stranger", pki["stranger"]), ("client", pki["client"])):
            try:
                async with openai_client(router, client_context(pki["ca"], cert)) as client:
                    r = await client.completions.create(model="splitserve", prompt="hi", max_tokens=32)
                out[f"http {who}"] = r.choices[0].text
            except openai.APIConnectionError:
                out[f"http {who}"] = "refused"
            try:
                out[f"grpc {who}"] = await asyncio.wait_for(grpc_generate(router, pki["ca"], cert), 10)
            except grpc.aio.AioRpcError as e:
                out[f"grpc {who}"] = e.code()
        return out

    out = asyncio.run(with_router(pki["server"], body))  # the server's files name the CA: mutual TLS
    assert out["http none"] == out["http stranger"] == "refused"
    assert out["grpc none"] == out["grpc stranger"] == grpc.StatusCode.UNAVAILABLE
    assert out["http client"] == out["grpc client"] == ANSWER


def served_serial(port: int, ca: TLSFiles, alpn: str) -> int:
    """The serial number of the certificate a new connection to `port` is given."""
    ctx = client_context(ca)
    ctx.set_alpn_protocols([alpn])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return int(x509.load_der_x509_certificate(der).serial_number)


def test_a_certificate_rotated_under_20_live_streams_drops_none(tmp_path: Path, pki: dict[str, TLSFiles]) -> None:
    async def body(router: Router) -> tuple[list[str], dict[str, int]]:
        client = openai_client(router, client_context(pki["ca"]))
        started = asyncio.Event()
        count = [0]

        async def stream() -> str:
            chunks = await client.completions.create(model="splitserve", prompt="hi", max_tokens=32, stream=True)
            text = ""
            async for c in chunks:
                if c.choices and c.choices[0].text:
                    if not text:
                        count[0] += 1
                        if count[0] == 20:
                            started.set()
                    text += c.choices[0].text
            return text

        streams = [asyncio.create_task(stream()) for _ in range(20)]
        await asyncio.wait_for(started.wait(), 20)
        serials = {"before": await asyncio.to_thread(served_serial, router.http_port, pki["ca"], "http/1.1")}
        rotated = issue_cert(pki["ca"], tmp_path / "server", "server")  # the same paths, a new certificate
        assert rotated.certfile == pki["server"].certfile
        new = int(x509.load_pem_x509_certificate(Path(rotated.certfile).read_bytes()).serial_number)
        for port, alpn in ((router.http_port, "http/1.1"), (router.port, "h2")):
            for _ in range(100):  # a reload is checked once a second
                serials[alpn] = await asyncio.to_thread(served_serial, port, pki["ca"], alpn)
                if serials[alpn] == new:
                    break
                await asyncio.sleep(0.05)
        serials["new"] = new
        assert not any(s.done() for s in streams)  # they were all live across the rotation
        texts = await asyncio.gather(*streams)
        await client.close()  # on this loop: a client left to the collector closes on a closed one
        return texts, serials

    server = pki["server"]
    texts, serials = asyncio.run(with_router(TLSFiles(server.certfile, server.keyfile), body, token_delay_s=0.3))
    assert texts == [ANSWER] * 20
    assert serials["before"] != serials["new"] == serials["http/1.1"] == serials["h2"]
