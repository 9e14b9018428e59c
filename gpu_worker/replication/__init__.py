"""Journal shipping to a standby device (docs/replication.md).

The primary's `Shipper` (primary.py) sends every tick's journal bytes to one standby as the tick
starts on the primary's disk, and, for a standby that connects late or comes back, the bytes it
lacks from the primary's segment files first. The standby's `Mirror` (mirror.py) writes them
into its own journal directory at the same segment and offset — the same files, byte for byte —
and makes them durable with one fdatasync per batch of frames; its `Standby` (standby.py), the
link, acknowledges the position it holds. In `sync` replication a transfer is saved (its replies
go out, its `on_saved` work starts) only once the primary's fdatasync and the standby's
acknowledgement both cover it.

The link: length-prefixed msgpack frames (gpu_worker/contract/wire.py's framing) on one stream
socket (a Unix socket path, or HOST:PORT over TCP):

    standby -> primary  {"hello": 1, "incarnation": <16 bytes>, "segment": N, "offset": O,
                         "digest": <SHA-256 of its segment N's first O bytes>, "member": M, "leader": G}
    primary -> standby  {"replication": "sync" | "async", "cut": C, "g": G, "sync_at": [N, O]}
                                                                        (first: the standby records it)
    primary -> standby  {"segment": N, "offset": O, "data": <bytes>, "g": G}  (many; in journal order)
    primary -> standby  {"beat": 1, "g": G}                             (when nothing else was sent for a while)
    primary -> standby  {"cut": C, "segment": N, "offset": O, "g": G}   (a failed tick: the journal ends at O)
    standby -> primary  {"ack": 1, "segment": N, "offset": O, "cut": C, "g": G}  (durable up to there)
    primary -> standby  {"refused": "<why>"}                            (then it closes)

Each side builds every frame it sends as its declared type and reads each it receives through
one (frames.py: Hello, Ack, and the primary's Replication, Bytes, Beat, Cut, Rewind, Piece,
CheckpointEnd, CatchUpEnd, MediaPiece, Refused), told apart by these keys; the maps on the link
are as above, a field at its default left out (a replication frame's "cut" of 0, a refusal's
"again" unless it is true) and read as that default.

Every frame after the hello and every acknowledgement carries the primary's leadership generation
G (etcd's, 0 without etcd); a standby never follows a generation older than one it followed, and
a primary takes no acknowledgement of another. Either side takes a link quiet for DEAD_SECONDS
(the primary beats every third of it, the standby acknowledges each beat) for dead. Over TCP the
link is TLS with a certificate on both sides (tls.py); a Unix socket stays on one machine.
"""
from __future__ import annotations

import os
import socket
import ssl

from gpu_worker.contract.wire import FrameReader, Message

# the runtime file component a takeover writes, making the file generation its receipts carry
# (Succession.failover_generation, recovery/succession.py; docs/replication.md, "Failover generations")
FAILOVER = "failover/takeover"
MARKER = "standby"        # DIR/standby: the replication a standby's journal was kept under (`--takeover` reads it)
SEGMENT_CHUNK = 1 << 20  # catch-up bytes per frame (within the framing's 16 MiB)
HELLO_SECONDS = 5.0      # how long a connecting standby has to say hello
DEAD_SECONDS = 3.0       # a link with no frame for this long is dead (the default lease: noticed within one)


def parse_address(address: str) -> tuple[int, str | tuple[str, int]]:
    """(socket family, address) of `PATH` (a Unix socket: it contains a '/') or `HOST:PORT`."""
    if "/" in address:
        return socket.AF_UNIX, address
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"replication address {address!r} is neither a socket path nor HOST:PORT")
    return socket.AF_INET6 if ":" in host else socket.AF_INET, (host.strip("[]"), int(port))


def _tcp_options(sock: socket.socket, dead_after: float) -> None:
    """No Nagle delay; the kernel gives up on unacknowledged sends after `dead_after`
    (TCP_USER_TIMEOUT) and probes a quiet connection (keepalive), so a silent partition breaks a
    blocked send or read instead of leaving it for TCP's minutes."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    quiet = max(1, int(dead_after))
    for option, value in (("TCP_USER_TIMEOUT", int(dead_after * 1000)), ("TCP_KEEPIDLE", quiet),
                          ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):  # (Linux)
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def connect(address: str, timeout: float, tls: ssl.SSLContext | None = None,
            dead_after: float = DEAD_SECONDS) -> socket.socket:
    """A link to `address`; over TCP, `tls` (an ssl.SSLContext: tls.py) is required and wraps it
    (the primary's certificate checked against the link's CA, this side's presented)."""
    family, where = parse_address(address)
    if family != socket.AF_UNIX and tls is None:
        raise ValueError(f"replication over TCP ({address}) needs TLS (--link-tls DIR): it crosses machines")
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        if family != socket.AF_UNIX:
            _tcp_options(sock, dead_after)
        sock.connect(where)
    except BaseException:
        sock.close()
        raise
    if tls is None or family == socket.AF_UNIX:
        return sock
    from .tls import TlsSocket
    try:
        return TlsSocket(sock, tls, server_side=False, server_hostname=tls_name(tls))  # type: ignore[return-value]
    except BaseException:
        sock.close()
        raise


def tls_name(tls: ssl.SSLContext) -> str:
    """The name a link's certificates carry (tls.py: one name for the whole cluster)."""
    return getattr(tls, "aotx_name", "aotx-replication")


def listen(address: str) -> socket.socket:
    family, where = parse_address(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_UNIX:
            if os.path.exists(address):
                os.unlink(address)  # a socket file left by a process that is gone (the journal lock says so)
        else:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(4)
    except BaseException:
        sock.close()
        raise
    return sock


def accepted(sock: socket.socket, tls: ssl.SSLContext | None, dead_after: float) -> socket.socket:
    """An accepted link, its TCP options set and, over TCP, its TLS handshake done (the standby's
    certificate required): within HELLO_SECONDS."""
    if sock.family == socket.AF_UNIX:
        return sock
    _tcp_options(sock, dead_after)
    if tls is None:
        raise ValueError("replication over TCP needs TLS (--link-tls DIR)")
    from .tls import TlsSocket
    sock.settimeout(HELLO_SECONDS)
    return TlsSocket(sock, tls, server_side=True)  # type: ignore[return-value]


def read_frames(sock: socket.socket, reader: FrameReader) -> list[Message]:
    """The frames the next reads complete (at least one; the link's end raises ConnectionError)."""
    while True:
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the other side closed the replication link")
        frames = reader.feed(data)
        if frames:
            return frames
