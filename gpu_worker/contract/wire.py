"""The socket protocol between gateway and device: frames and their maps (docs/protocol.md).

A frame is a 4-byte big-endian length followed by one msgpack map. Requests carry
``{"v": PROTOCOL_VERSION, "id": int, "op": str, "principal": hex|None, "args": {...}}``;
replies carry ``{"id": int, "status": int, "body": bytes, "headers": {...}?, "more": bool?}``
where ``body`` is the exact JSON the gateway sends to its client (the device renders receipts
once, so a receipt read back after a restart is the same bytes).

Both sides hold a reply as a `Reply`, a Struct of every field a reply frame may carry: the device
builds one for each answer (`reply`, and the streams' frames in loop/subscriptions.py) and encodes
it with `encode_reply`, leaving out the fields at their defaults; a gateway decodes each frame
straight into one (ReplyReader). The bytes on the wire are the maps above.
"""
from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeAlias, TypeVar, Union

import msgpack
import msgspec

PROTOCOL_VERSION = 1
LENGTH = struct.Struct(">I")
MAX_FRAME = 1 << 24
VERSION_REFUSED = (b'{"error":{"code":"protocol_version","message":"unsupported device protocol version; '
                   b'expected 1"}}')

# A JSON value as json.loads gives it (and dumps takes it, with RawJSON for an embedded document).
JSON: TypeAlias = Union[None, bool, int, float, str, list["JSON"], dict[str, "JSON"]]
JSONObject: TypeAlias = dict[str, JSON]

# A frame's map as msgpack decodes it: a request the device reads (`v`, `id`, `op`, `principal`,
# `args`), a replication frame before it is typed (replication/frames.py).
Message = dict[str, Any]


class Reply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A reply frame (docs/protocol.md, "Frames", "Subscriptions"): a one-reply command's answer,
    or one frame of a stream (a chat's tokens, a subscription's events). The device encodes only
    the fields not at their defaults (`body` always); a reader finds the defaults here for the
    rest."""
    status: int
    body: bytes
    id: int | None = None  # the request answered; None with `ids`
    ids: list[int] | None = None  # a frame for several subscriptions of one connection
    headers: dict[str, str] | None = None  # HTTP headers the gateway adds to its answer
    more: bool = False  # True on every frame of a stream but its last
    g: int | None = None  # the leadership generation of the device that answered (etcd)
    event: str | None = None  # a stream frame's kind: accepted, open, gap, event, output, terminal
    cursor: str | None = None  # where a subscriber resumes after this frame
    index: int = 0  # a streamed chat token's choice (n > 1)
    logprobs: list[dict[str, object]] | None = None  # a streamed chat token's logprobs entries


Answer: TypeAlias = tuple[object, Reply]  # (the device's connection, a reply on it)


class ProtocolError(Exception):
    pass


class RawJSON(bytes):
    """Already-rendered JSON bytes, embedded verbatim by dumps() (receipts are rendered once)."""


_MARK = "\x00raw{}\x00"


def dumps(obj: object) -> bytes:
    """Deterministic compact JSON (sorted keys): the same state always renders to the same bytes.

    RawJSON values inside obj are spliced in as they are, so a list of receipts contains each
    receipt's exact bytes."""
    if isinstance(obj, RawJSON):
        return bytes(obj)
    raws: list[RawJSON] = []

    def default(o: object) -> str:
        if isinstance(o, RawJSON):
            raws.append(o)
            return _MARK.format(len(raws) - 1)
        raise TypeError(f"{type(o).__name__} is not JSON serialisable")

    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=default).encode()
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(_MARK.format(i)).encode(), bytes(raw), 1)
    return text


_local = threading.local()


def pack(obj: object) -> bytes:
    """msgpack.packb(obj, use_bin_type=True), with one Packer per thread: packb builds a new
    Packer (and its 256 KiB buffer) per call, which costs a busy device measurably."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    data: bytes = packer.pack(obj)
    return data


_ENCODER = msgspec.msgpack.Encoder()  # (a Struct with omit_defaults: its fields at their defaults left out)


def encode_frame(obj: msgspec.Struct | Mapping[str, object]) -> bytes:
    """One frame: a replication frame (replication/frames.py), or a request's map (a test's)."""
    return _framed(_ENCODER.encode(obj))


def encode_reply(msg: Reply) -> bytes:
    """A reply's frame (the device's loop sends every reply through it)."""
    return _framed(_ENCODER.encode(msg))


def _framed(payload: bytes) -> bytes:
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


def decode_request(payload: bytes) -> Message:
    """One request's map, its `id` an int (every reply to it carries it: `Reply.id`, `Reply.ids`);
    ProtocolError for anything else (the connection is closed)."""
    msg = decode_payload(payload)
    if type(msg.get("id")) is not int:
        raise ProtocolError(f"a request's id is {type(msg.get('id')).__name__}, not an integer")
    return msg


def reply(req_id: int | None, status: int, body: bytes, headers: dict[str, str] | None = None) -> Reply:
    """The one reply to request `req_id` (None: one the device made itself, answered to no connection)."""
    return Reply(id=req_id, status=status, body=body, headers=headers or None)


_REPLY = msgspec.msgpack.Decoder(Reply)


def decode_reply(payload: bytes) -> Reply:
    """One reply frame's payload; ProtocolError for anything but a reply map."""
    try:
        return _REPLY.decode(payload)
    except msgspec.DecodeError as exc:  # (ValidationError is a DecodeError)
        raise ProtocolError(f"frame is not a reply: {exc}") from None


F = TypeVar("F")


class Frames(Generic[F]):
    """Splits a byte stream into frames, each decoded by `decode`: every reader of the device
    socket and of a replication link feeds what it received and takes whole frames out, so one
    piece of code knows the framing."""

    __slots__ = ("_buffer", "_decode")

    def __init__(self, decode: Callable[[bytes], F]) -> None:
        self._buffer = bytearray()
        self._decode = decode

    def feed(self, data: bytes) -> list[F]:
        buffer = self._buffer
        buffer += data
        messages: list[F] = []
        while len(buffer) >= 4:
            (n,) = LENGTH.unpack_from(buffer)
            if n > MAX_FRAME:
                raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
            if len(buffer) < 4 + n:
                break
            messages.append(self._decode(bytes(buffer[4:4 + n])))
            del buffer[:4 + n]
        return messages

    @property
    def pending(self) -> int:
        """Bytes received that do not yet make a whole frame."""
        return len(self._buffer)


class FrameReader(Frames[Message]):
    """Frames as maps (the device's requests, replication frames)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(decode_payload)


class ReplyReader(Frames[Reply]):
    """Frames as Replies (a client of the device socket)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(decode_reply)
