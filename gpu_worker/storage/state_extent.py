"""A checkpoint's state extent ("state/current", docs/checkpoint.md), read without torch: a boot
decodes its head, and so where the journal after it begins (`fold_point`), while torch is still
being imported (recovery/reading.py), and gpu_worker/storage/checkpoint.py encodes and loads it."""
from __future__ import annotations

import struct
from typing import Any

import msgpack

from .journal import ZERO_DIGEST

STATE = "state/current"
# A state extent of version 2 (docs/checkpoint.md): _MAGIC, the head's length (u64 LE), the head (a
# msgpack map), then the large byte strings the head names, back to back. The head names each by
# an ext value of code _SPILLED: its offset and length (u64 LE each) in what follows the head, so
# a boot reads them where the runtime file maps them instead of copying them out of a msgpack
# map (version 1: the whole extent one msgpack map; still read).
_MAGIC = b"AOTXST\x00\x02"
_HEAD = struct.Struct("<8sQ")
_SPILLED = 1
_SPAN = struct.Struct("<QQ")


class Spill:
    """The large byte strings of a state being encoded, and the ext values that name them."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def __call__(self, data: bytes) -> msgpack.ExtType:
        ext = msgpack.ExtType(_SPILLED, _SPAN.pack(self.size, len(data)))
        self.parts.append(data)
        self.size += len(data)
        return ext

    def extent(self, head: bytes) -> bytes:
        """The whole extent: its packed head (naming these strings), then the strings."""
        return b"".join([_HEAD.pack(_MAGIC, len(head)), head, *self.parts])


def decode_state(blob: bytes | memoryview) -> dict[str, Any]:
    """A state extent's map (either version); version 2's large byte strings come back as
    memoryviews of `blob`, not copies (a boot from a 600 MiB state spent a fifth of its time
    copying them)."""
    view = memoryview(blob)
    if view[:len(_MAGIC)] != _MAGIC:  # version 1: one msgpack map
        saved: dict[str, Any] = msgpack.unpackb(view, raw=False)
        return saved
    _, length = _HEAD.unpack_from(view)
    if _HEAD.size + length > len(view):
        raise ValueError("state extent: its head runs past its end")
    data = view[_HEAD.size + length:]

    def spilled(code: int, span: bytes) -> memoryview:
        if code != _SPILLED or len(span) != _SPAN.size:
            raise ValueError(f"state extent: an ext value of code {code} and {len(span)} bytes")
        at, n = _SPAN.unpack(span)
        if at + n > len(data):
            raise ValueError("state extent: a value runs past its end")
        return data[at:at + n]

    saved = msgpack.unpackb(view[_HEAD.size:_HEAD.size + length], raw=False, ext_hook=spilled)
    return saved


def fold_point(saved: dict[str, Any] | None) -> tuple[int, bytes]:
    """(last_seq, last_digest) of a decoded state extent (None: no checkpoint yet): where the
    journal after it begins."""
    return (saved["last_seq"], saved["last_digest"]) if saved is not None else (0, ZERO_DIGEST)
