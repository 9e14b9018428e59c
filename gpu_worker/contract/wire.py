"""The socket protocol between gateway and device: frames and their maps (docs/protocol.md).

A frame is a 4-byte big-endian length followed by one msgpack map. Requests carry
``{"v": PROTOCOL_VERSION, "id": int, "op": str, "principal": hex|None, "args": {...}}``;
replies carry ``{"id": int, "status": int, "body": bytes, "headers": {...}?, "more": bool?}``
where ``body`` is the exact JSON the gateway sends to its client (the device renders receipts
once, so a receipt read back after a restart is the same bytes).
"""
from __future__ import annotations

import json
import struct
import threading
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
LENGTH = struct.Struct(">I")
MAX_FRAME = 1 << 24
VERSION_REFUSED = (b'{"error":{"code":"protocol_version","message":"unsupported device protocol version; '
                   b'expected 1"}}')

Message = dict[str, Any]


class ProtocolError(Exception):
    pass


class RawJSON(bytes):
    """Already-rendered JSON bytes, embedded verbatim by dumps() (receipts are rendered once)."""


_MARK = "\x00raw{}\x00"


def dumps(obj: Any) -> bytes:
    """Deterministic compact JSON (sorted keys): the same state always renders to the same bytes.

    RawJSON values inside obj are spliced in as they are, so a list of receipts contains each
    receipt's exact bytes."""
    if isinstance(obj, RawJSON):
        return bytes(obj)
    raws: list[RawJSON] = []

    def default(o: Any) -> str:
        if isinstance(o, RawJSON):
            raws.append(o)
            return _MARK.format(len(raws) - 1)
        raise TypeError(f"{type(o).__name__} is not JSON serialisable")

    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=default).encode()
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(_MARK.format(i)).encode(), bytes(raw), 1)
    return text


_local = threading.local()


def pack(obj: Any) -> bytes:
    """msgpack.packb(obj, use_bin_type=True), with one Packer per thread: packb builds a new
    Packer (and its 256 KiB buffer) per call, which costs a busy device measurably."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    data: bytes = packer.pack(obj)
    return data


def encode_frame(obj: Message) -> bytes:
    payload = pack(obj)
    if len(payload) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return LENGTH.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> Message:
    """One frame's payload as a map; ProtocolError for anything else (the connection is closed)."""
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError) as exc:  # msgpack's errors (ExtraData, FormatError ...) are ValueErrors
        raise ProtocolError(f"frame is not msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a map")
    return obj


def reply(req_id: Any, status: int, body: bytes, headers: dict[str, str] | None = None) -> Message:
    msg: Message = {"id": req_id, "status": status, "body": body}
    if headers:
        msg["headers"] = headers
    return msg


class FrameReader:
    """Splits a byte stream into frame payloads: every client of the device socket (blocking or
    asyncio) feeds what it received and takes whole messages out, so one piece of code knows the
    framing."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        buffer = self._buffer
        buffer += data
        messages = []
        while len(buffer) >= 4:
            (n,) = LENGTH.unpack_from(buffer)
            if n > MAX_FRAME:
                raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
            if len(buffer) < 4 + n:
                break
            messages.append(decode_payload(bytes(buffer[4:4 + n])))
            del buffer[:4 + n]
        return messages

    @property
    def pending(self) -> int:
        """Bytes received that do not yet make a whole frame."""
        return len(self._buffer)
