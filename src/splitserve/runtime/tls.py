"""TLS for splitserve's ports: the files a listener serves, certificates reloaded while it runs,
and a small certificate authority for a cluster that has none of its own.

A listener's certificate and key are read again when either file changes (checked at most once
a second, and by gRPC at each new handshake), so a certificate rotated by cert-manager or an
ACME client is served to the next connection; connections already open keep the one they
began with, and no stream is dropped. With a CA file given, every client must present a
certificate that CA signed (mutual TLS).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import ssl
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import grpc

RELOAD_CHECK_S = 1.0


@dataclass(frozen=True)
class TLSFiles:
    """What one listener serves: its certificate chain and key (PEM), and the CA its clients'
    certificates must chain to (None: clients are not asked for one)."""

    certfile: str
    keyfile: str
    ca_certs: str | None = None

    def __post_init__(self) -> None:
        for what in ("certfile", "keyfile", "ca_certs"):
            path = getattr(self, what)
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"TLS {what} {path!r}: cannot read it")

    def stamp(self) -> tuple[float, float]:
        """When the certificate and key last changed (a rotation changes one or both)."""
        return (os.stat(self.certfile).st_mtime_ns, os.stat(self.keyfile).st_mtime_ns)

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        ca = Path(self.ca_certs).read_bytes() if self.ca_certs else None
        return Path(self.certfile).read_bytes(), Path(self.keyfile).read_bytes(), ca


class ReloadingSSLContext:
    """An ssl.SSLContext for a server socket whose certificate follows its files: `maybe_reload`
    (called at most once a second by whoever serves) loads a changed pair into the same context,
    which every later handshake uses."""

    def __init__(self, files: TLSFiles, clock: Callable[[], float] = time.monotonic) -> None:
        self.files = files
        self.clock = clock
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        if files.ca_certs:
            self.context.load_verify_locations(files.ca_certs)
            self.context.verify_mode = ssl.CERT_REQUIRED
        self._stamp = files.stamp()
        self.context.load_cert_chain(files.certfile, files.keyfile)
        self._checked = clock()
        self.reloads = 0

    def maybe_reload(self) -> bool:
        """Load the certificate again if its files changed; whether it did. A pair caught half
        written (the new certificate, the old key) fails to load and is tried again next time."""
        now = self.clock()
        if now - self._checked < RELOAD_CHECK_S:
            return False
        self._checked = now
        try:
            stamp = self.files.stamp()
            if stamp == self._stamp:
                return False
            self.context.load_cert_chain(self.files.certfile, self.files.keyfile)
        except (OSError, ssl.SSLError):
            return False
        self._stamp = stamp
        self.reloads += 1
        return True


def grpc_server_credentials(files: TLSFiles) -> grpc.ServerCredentials:
    """gRPC's credentials for `files`, the certificate read again at a new handshake after its
    files change (gRPC asks the fetcher at each handshake; a stat is all it costs)."""

    def config() -> grpc.ServerCertificateConfiguration:
        cert, key, ca = files.read()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    stamp = [files.stamp()]

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        try:
            now = files.stamp()
            if now == stamp[0]:
                return None
            fresh = config()
        except OSError:
            return None
        stamp[0] = now
        return fresh

    # (the stubs say the fetcher returns a configuration; gRPC's docs: None means "no change")
    fetcher = cast(Callable[[], grpc.ServerCertificateConfiguration], fetch)
    return grpc.dynamic_ssl_server_credentials(config(), fetcher, require_client_authentication=bool(files.ca_certs))


# ---- a certificate authority of the cluster's own


def _name(common_name: str) -> object:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(directory: str | Path, common_name: str = "splitserve cluster CA", days: int = 365) -> TLSFiles:
    """A new CA in `directory` (ca.pem, ca-key.pem, the key readable by its owner only)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    directory = Path(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = _name(common_name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)  # type: ignore[arg-type]
        .issuer_name(name)  # type: ignore[arg-type]
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _write(directory, "ca", cert, key)


def issue_cert(
    ca: TLSFiles,
    directory: str | Path,
    name: str,
    hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
    days: int = 30,
) -> TLSFiles:
    """A certificate `ca` signs for `hosts` (IP addresses and DNS names), usable by a server and
    as a client's (mutual TLS), in `directory` as NAME.pem and NAME-key.pem; its ca_certs is the
    CA's, so a listener given it asks its clients for one of the same CA's certificates."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_cert = x509.load_pem_x509_certificate(Path(ca.certfile).read_bytes())
    ca_key = serialization.load_pem_private_key(Path(ca.keyfile).read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))  # type: ignore[arg-type]
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    files = _write(Path(directory), name, cert, key)
    return TLSFiles(files.certfile, files.keyfile, ca.certfile)


def _write(directory: Path, stem: str, cert: object, key: object) -> TLSFiles:
    from cryptography.hazmat.primitives import serialization

    directory.mkdir(parents=True, exist_ok=True)
    certfile, keyfile = directory / f"{stem}.pem", directory / f"{stem}-key.pem"
    key_pem = key.private_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # written beside and renamed into place: a reader never sees half a file, and the key is
    # never readable by others, not even for an instant
    for path, data, mode in (
        (keyfile, key_pem, 0o600),
        (certfile, cert.public_bytes(serialization.Encoding.PEM), 0o644),  # type: ignore[attr-defined]
    ):
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return TLSFiles(str(certfile), str(keyfile))


# ---- the cluster's own planes: router to worker, prefill worker to decode worker

CLUSTER_NAME = "splitserve-cluster"  # the one name every member's certificate holds and every peer checks


@dataclass(frozen=True)
class ClusterTLS:
    """Mutual TLS inside a cluster: its CA, and the certificate and key every member presents
    (PEM bytes, so that they travel in a worker's config to a Ray actor on any node). A peer is
    one that holds a certificate of the CA; its name is checked as CLUSTER_NAME, whatever address
    it is reached at (a worker's address is known only once it listens)."""

    ca_pem: bytes = field(repr=False)
    cert_pem: bytes = field(repr=False)
    key_pem: bytes = field(repr=False)

    def grpc_server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem, require_client_auth=True
        )

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca_pem, self.key_pem, self.cert_pem)

    CHANNEL_OPTIONS = (("grpc.ssl_target_name_override", CLUSTER_NAME),)

    def ssl_context(self, server_side: bool) -> ssl.SSLContext:
        """A context for the KV plane's sockets: either side presents the cluster certificate and
        requires the other's."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_verify_locations(cadata=self.ca_pem.decode())
        ctx.verify_mode = ssl.CERT_REQUIRED
        _load_chain(ctx, self.cert_pem, self.key_pem)
        return ctx


def _load_chain(ctx: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> None:
    """ssl reads a certificate and key from files only: a private directory for the instant."""
    with tempfile.TemporaryDirectory(prefix="splitserve-tls-") as d:  # made 0700
        cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        for path, data in ((cert, cert_pem), (key, key_pem)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert, key)


def make_cluster_tls(days: int = 30) -> ClusterTLS:
    """A fresh CA and the cluster certificate it signs, for one `serve` (nothing written to disk)."""
    with tempfile.TemporaryDirectory(prefix="splitserve-ca-") as d:
        ca = make_ca(d, "splitserve cluster CA", days=days)
        member = issue_cert(ca, d, "cluster", hosts=(CLUSTER_NAME,), days=days)
        return ClusterTLS(
            Path(ca.certfile).read_bytes(), Path(member.certfile).read_bytes(), Path(member.keyfile).read_bytes()
        )


CLUSTER_FILES = ("ca.pem", "cluster.pem", "cluster-key.pem")  # --internal-tls-dir's, in ClusterTLS's order


def load_cluster_tls(directory: str) -> ClusterTLS:
    """An operator's cluster credentials: ca.pem, cluster.pem and cluster-key.pem in `directory`
    (the cluster certificate naming CLUSTER_NAME); ValueError naming what is missing."""
    files = {name: os.path.join(directory, name) for name in CLUSTER_FILES}
    missing = [name for name, path in files.items() if not os.access(path, os.R_OK)]
    if missing:
        raise ValueError(f"--internal-tls-dir {directory!r}: cannot read {', '.join(missing)}")
    read = {name: Path(path).read_bytes() for name, path in files.items()}
    return ClusterTLS(read["ca.pem"], read["cluster.pem"], read["cluster-key.pem"])


def save_cluster_tls(cluster: ClusterTLS, directory: str) -> None:
    """`cluster`'s files into `directory`, as `load_cluster_tls` reads them (the key readable by
    this user alone)."""
    for name, data in zip(CLUSTER_FILES, (cluster.ca_pem, cluster.cert_pem, cluster.key_pem), strict=True):
        path = Path(directory, name)
        path.write_bytes(data)
        path.chmod(0o600)


def add_internal_tls_argument(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "--internal-tls-dir",
        default=None,
        metavar="DIR",
        help="mutual TLS inside the cluster (router to workers, the KV plane) with the CA and certificate in DIR: "
        "ca.pem, and cluster.pem / cluster-key.pem naming 'splitserve-cluster' (serve makes its own unless given "
        "this or --insecure-internal)",
    )
