"""TLS for the links between machines (docs/replication.md, "Across machines"): the replication
link over TCP, authenticated and encrypted both ways.

A cluster has one certificate authority of its own. Each machine gets a directory with the CA's
certificate (`ca.pem`) and its own key and certificate (`key.pem`, `cert.pem`), signed by that CA
and naming `NAME` (one name for the whole cluster, not a host: primaries and standbys change
places). Both ends present their certificate and accept only one the cluster's CA signed: a
process without one cannot say hello, stream or acknowledge, and nothing crosses in clear.

    python -m gpu_worker link-tls DIR NODE [NODE ...]   # DIR/ca.pem, DIR/ca.key (kept), DIR/NODE/

Made with the `cryptography` package (ECDSA P-256, ten years); `ssl` from the standard library
speaks TLS 1.3.
"""
from __future__ import annotations

import datetime
import os
import socket
import ssl
import sys
import threading
from typing import Any

NAME = "aotx-replication"
FILES = ("ca.pem", "cert.pem", "key.pem")


def context(directory: str, server: bool) -> ssl.SSLContext:
    """The link's TLS context from `directory` (FILES): TLS 1.3, the peer's certificate required
    and checked against ca.pem, this side's presented."""
    missing = [f for f in FILES if not os.path.exists(os.path.join(directory, f))]
    if missing:
        raise ValueError(f"link TLS directory {directory} lacks {', '.join(missing)} "
                         "(python -m gpu_worker link-tls makes them)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(os.path.join(directory, "ca.pem"))
    ctx.load_cert_chain(os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem"))
    if not server:
        ctx.check_hostname = True
    ctx.aotx_name = NAME  # type: ignore[attr-defined]  # (replication.tls_name: what the client checks)
    return ctx


class TlsSocket:
    """TLS over a connected socket, safe for one thread reading while another writes (a primary's
    link has a sender and an acknowledgement reader). OpenSSL's SSL object must not be used by two
    threads at once, so TLS runs in memory (ssl.SSLObject over MemoryBIOs) under a lock held only
    for the in-memory work; the socket's own reads and writes happen outside it (writes in order,
    under a second lock). The methods the links use: sendall, recv, settimeout, shutdown, close,
    getpeername, family."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None = None) -> None:
        self.sock = sock
        self.family = sock.family
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = ctx.wrap_bio(self._in, self._out, server_side=server_side, server_hostname=server_hostname)
        self._lock = threading.Lock()       # the SSLObject and its BIOs
        self._sending = threading.Lock()    # the socket's writes, in the order the TLS records were made
        while True:
            try:
                with self._lock:
                    self._tls.do_handshake()
                self._flush()
                return
            except ssl.SSLWantReadError:
                self._flush()
                if not self._fill():
                    raise ConnectionError("the peer closed the link during the TLS handshake") from None

    def _flush(self) -> None:
        with self._sending:
            with self._lock:
                data = self._out.read()
            if data:
                self.sock.sendall(data)

    def _fill(self) -> bool:
        data = self.sock.recv(1 << 16)
        if not data:
            return False
        with self._lock:
            self._in.write(data)
        return True

    def sendall(self, data: bytes) -> None:
        with self._sending:
            with self._lock:
                view = memoryview(data)
                while view:
                    view = view[self._tls.write(view):]
                out = self._out.read()
            self.sock.sendall(out)

    def recv(self, size: int) -> bytes:
        while True:
            try:
                with self._lock:
                    data = self._tls.read(size)
            except ssl.SSLWantReadError:
                if not self._fill():
                    return b""
                continue
            except ssl.SSLZeroReturnError:
                return b""
            finally:
                if self._out.pending:  # (a read may answer something: a key update)
                    self._flush()
            return data

    def settimeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def getpeername(self) -> Any:
        return self.sock.getpeername()

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()


def _write(path: str, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def make(directory: str, nodes: list[str]) -> None:
    """The cluster's CA in `directory` (made once, kept), and a key and certificate for each node
    in `directory/NODE/` with the CA's certificate beside them."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    os.makedirs(directory, mode=0o700, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    later = now + datetime.timedelta(days=3650)
    ca_key_path, ca_path = os.path.join(directory, "ca.key"), os.path.join(directory, "ca.pem")
    if os.path.exists(ca_key_path):
        with open(ca_key_path, "rb") as f:
            loaded = serialization.load_pem_private_key(f.read(), None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{ca_key_path} is not this tool's CA key (ECDSA)")
        ca_key = loaded
        with open(ca_path, "rb") as f:
            ca = x509.load_pem_x509_certificate(f.read())
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aotx link CA")])
        ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(ca_key.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(later)
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .sign(ca_key, hashes.SHA256()))
        _write(ca_key_path, ca_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()), 0o600)
        _write(ca_path, ca.public_bytes(serialization.Encoding.PEM), 0o644)
    for node in nodes:
        out = os.path.join(directory, node)
        os.makedirs(out, mode=0o700, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{NAME} {node}")]))
                .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now).not_valid_after(later)
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(NAME)]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(os.path.join(out, "key.pem"), key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), 0o600)
        _write(os.path.join(out, "cert.pem"), cert.public_bytes(serialization.Encoding.PEM), 0o644)
        _write(os.path.join(out, "ca.pem"), ca.public_bytes(serialization.Encoding.PEM), 0o644)


def main(argv: list[str]) -> int:
    """`python -m gpu_worker link-tls DIR NODE [NODE ...]`."""
    if len(argv) < 2:
        print("usage: python -m gpu_worker link-tls DIR NODE [NODE ...]", file=sys.stderr)
        return 2
    make(argv[0], argv[1:])
    for node in argv[1:]:
        print(os.path.join(argv[0], node))
    return 0
