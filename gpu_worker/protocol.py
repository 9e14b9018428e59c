"""The socket protocol between gateway and device: the only seam between the two.

A frame is a 4-byte big-endian length followed by one msgpack map. Requests carry
``{"v": PROTOCOL_VERSION, "id": int, "op": str, "principal": hex|None, "args": {...}}``;
replies carry ``{"id": int, "status": int, "body": bytes, "headers": {...}}`` where ``body`` is
the exact JSON the gateway sends to its client (the device renders receipts once, so a receipt
read back after a restart is the same bytes). See docs/protocol.md.
"""
import json
import struct
import threading

import msgpack

PROTOCOL_VERSION = 1
LENGTH = struct.Struct(">I")
MAX_FRAME = 1 << 24


class ProtocolError(Exception):
    pass


class DeviceError(Exception):
    """A client-visible refusal: HTTP status, stable code, one-line message, optional details."""

    def __init__(self, status, code, message, **details):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details

    def body(self):
        return dumps({"error": {"code": self.code, "message": self.message, **self.details}})


class RawJSON(bytes):
    """Already-rendered JSON bytes, embedded verbatim by dumps() (receipts are rendered once)."""


_MARK = "\x00raw{}\x00"


def dumps(obj):
    """Deterministic compact JSON (sorted keys): the same state always renders to the same bytes.

    RawJSON values inside obj are spliced in as they are, so a list of receipts contains each
    receipt's exact bytes."""
    if isinstance(obj, RawJSON):
        return bytes(obj)
    raws = []

    def default(o):
        if isinstance(o, RawJSON):
            raws.append(o)
            return _MARK.format(len(raws) - 1)
        raise TypeError(f"{type(o).__name__} is not JSON serialisable")

    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=default).encode()
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(_MARK.format(i)).encode(), bytes(raw), 1)
    return text


_local = threading.local()


def pack(obj):
    """msgpack.packb(obj, use_bin_type=True), with one Packer per thread: packb builds a new
    Packer (and its 256 KiB buffer) per call, which showed as 6% of a busy device's time."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)


def encode_frame(obj):
    payload = pack(obj)
    if len(payload) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return LENGTH.pack(len(payload)) + payload


def decode_payload(payload):
    """One frame's payload as a map; ProtocolError for anything else (the connection is closed)."""
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError) as exc:  # msgpack's errors (ExtraData, FormatError ...) are ValueErrors
        raise ProtocolError(f"frame is not msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a map")
    return obj


def reply(req_id, status, body, headers=None):
    msg = {"id": req_id, "status": status, "body": body}
    if headers:
        msg["headers"] = headers
    return msg
