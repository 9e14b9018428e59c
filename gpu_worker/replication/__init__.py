"""Journal shipping to a standby device (docs/replication.md).

The primary's `Shipper` (primary.py) sends every tick's journal bytes to one standby as the tick
starts on the primary's disk, and, for a standby that connects late or comes back, the bytes it
lacks from the primary's segment files first. The standby's `Mirror` (standby.py) writes them
into its own journal directory at the same segment and offset — the same files, byte for byte —
makes them durable with one fdatasync per batch of frames, and acknowledges the position it
holds. In `sync` replication a transfer is saved (its replies go out, its `on_saved` work starts)
only once the primary's fdatasync and the standby's acknowledgement both cover it.

The link: length-prefixed msgpack frames (gpu_worker/contract/wire.py's framing) on one stream
socket (a Unix socket path, or HOST:PORT over TCP):

    standby -> primary  {"hello": 1, "incarnation": <16 bytes>, "segment": N, "offset": O,
                         "digest": <SHA-256 of its segment N's first O bytes>}
    primary -> standby  {"replication": "sync" | "async", "cut": C}    (first: the standby records it)
    primary -> standby  {"segment": N, "offset": O, "data": <bytes>}    (many; in journal order)
    primary -> standby  {"cut": C, "segment": N, "offset": O}           (a failed tick: the journal ends at O)
    standby -> primary  {"ack": 1, "segment": N, "offset": O, "cut": C} (durable up to there, after cut C)
    primary -> standby  {"refused": "<why>"}                            (then it closes)
"""
from __future__ import annotations

import os
import socket

from gpu_worker.contract.wire import FrameReader, Message

# the runtime file component a takeover writes, making the file generation its receipts carry
# (Device._failover_generation; docs/replication.md, "Failover generations")
FAILOVER = "failover/takeover"
MARKER = "standby"        # DIR/standby: the replication a standby's journal was kept under (`--takeover` reads it)
SEGMENT_CHUNK = 1 << 20  # catch-up bytes per frame (within the framing's 16 MiB)
HELLO_SECONDS = 5.0      # how long a connecting standby has to say hello


def parse_address(address: str) -> tuple[int, str | tuple[str, int]]:
    """(socket family, address) of `PATH` (a Unix socket: it contains a '/') or `HOST:PORT`."""
    if "/" in address:
        return socket.AF_UNIX, address
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"replication address {address!r} is neither a socket path nor HOST:PORT")
    return socket.AF_INET6 if ":" in host else socket.AF_INET, (host.strip("[]"), int(port))


def connect(address: str, timeout: float) -> socket.socket:
    family, where = parse_address(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(where)
    except BaseException:
        sock.close()
        raise
    if family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


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


def read_frames(sock: socket.socket, reader: FrameReader) -> list[Message]:
    """The frames the next reads complete (at least one; the link's end raises ConnectionError)."""
    while True:
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the other side closed the replication link")
        frames = reader.feed(data)
        if frames:
            return frames
