"""The replication link's frames as declared types (the link's protocol: replication/__init__.py).

Frames travel as msgpack maps, told apart by the keys they carry (a frame with "beat" is a beat,
one with "cut" but no "data" a cut ...). A side builds every frame it sends as the Struct of its
kind and encodes it with wire.encode_frame: the map of its fields, a field at its default left out
(msgspec's omit_defaults; the keys that tell a frame's kind have none). A side reads each map through
`hello`, `ack` (the primary) or `from_primary` (the standby): the frame's kind by its keys, then
its fields checked by msgspec against the Struct of that kind (a missing field or one of another
type is a ProtocolError, as a malformed frame always was), the absent ones at their defaults.
"""
from __future__ import annotations

from typing import Literal, TypeVar, Union

import msgspec

from gpu_worker.contract.wire import Message, ProtocolError


class Frame(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A frame of the primary after the hello carries its leadership generation `g` (its link's
    sender sets it: primary_link.Link.frame)."""
    g: int | None = None


# ---- standby -> primary ---------------------------------------------------------------------------

class Hello(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """The standby's first frame: what its copy holds (its journal's position and the digest of the
    bytes before it, its runtime file copy's generation and components, its media)."""
    hello: Literal[1]
    segment: int
    offset: int
    digest: bytes  # SHA-256 of its segment's first `offset` bytes
    incarnation: bytes | None = None
    generation: int | None = None  # (checked once the primary would stream to it)
    components: dict[str, str] | None = None  # name -> SHA-256 hex
    media: list[str] | None = None
    member: str = ""
    leader: int = 0  # the newest leadership generation it followed


class Ack(Frame, kw_only=True, frozen=True):
    """Durable on the standby up to (segment, offset), as of the primary's `cut`."""
    ack: Literal[1]
    segment: int
    offset: int
    cut: int


# ---- primary -> standby ---------------------------------------------------------------------------

class Refused(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Not streamed to (then the primary closes); `again`: a passing reason, connect again."""
    refused: str
    again: bool = False


class Beat(Frame, kw_only=True, frozen=True):
    beat: int


class Rewind(Frame, kw_only=True, frozen=True):
    """Cut the journal back to the primary's takeover point (segment, offset)."""
    rewind: tuple[int, int]


class Replication(Frame, kw_only=True, frozen=True):
    """The primary's first frame after the hello (after a catch-up's): its mode, its cut count, the
    sync point and its takeover points."""
    replication: Literal["sync", "async"]
    cut: int = 0
    sync_at: tuple[int, int] = (0, 0)
    takeovers: list[tuple[int, int]] = []

    @property
    def leader(self) -> int:
        return self.g or 0


class Piece(Frame, kw_only=True, frozen=True):
    """A piece of a runtime file component, a checkpoint's or a catch-up's (the generation it is of)."""
    checkpoint: int | None = None
    catchup: int | None = None
    component: str
    kind: str
    offset: int
    data: bytes


class CheckpointEnd(Frame, kw_only=True, frozen=True):
    """A checkpoint's end: the components its pieces made, the names to drop, the last segment folded."""
    checkpoint: int
    components: list[str] | dict[str, str]
    drop: list[str]
    through: int | None = None


class CatchUpEnd(Frame, kw_only=True, frozen=True):
    """A catch-up's end: every component's SHA-256, the names to drop, whether the journal stays."""
    catchup: int
    components: dict[str, str]
    drop: list[str]
    journal: str | None = None


class MediaPiece(Frame, kw_only=True, frozen=True):
    media: str  # its sha256 (hex)
    size: int
    offset: int
    data: bytes


class Cut(Frame, kw_only=True, frozen=True):
    """The primary's journal was cut back (a failed tick): it ends at (segment, offset)."""
    cut: int
    segment: int
    offset: int


class Bytes(Frame, kw_only=True, frozen=True):
    """Journal bytes at (segment, offset), in journal order."""
    segment: int
    offset: int
    data: bytes


FromPrimary = Union[Refused, Beat, Rewind, Replication, Piece, CheckpointEnd, CatchUpEnd, MediaPiece, Cut, Bytes]

T = TypeVar("T")


def _as(msg: Message, kind: type[T], what: str) -> T:
    try:
        return msgspec.convert(msg, kind)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"not {what}: {sorted(msg)} ({exc})") from None


def hello(msg: Message) -> Hello:
    found = _as(msg, Hello, "a hello")
    if found.segment < 0 or found.offset < 0:
        raise ProtocolError(f"not a hello: {sorted(msg)}")
    return found


def ack(msg: Message) -> Ack:
    return _as(msg, Ack, "an acknowledgement")


def from_primary(msg: Message) -> FromPrimary:
    """A primary's frame by the keys it carries, in the order the standby always told them apart."""
    if "refused" in msg:
        return _as(msg, Refused, "a refusal")
    if "beat" in msg:
        return _as(msg, Beat, "a beat")
    if "rewind" in msg:
        return _as(msg, Rewind, "a rewind")
    if "replication" in msg:
        return _as(msg, Replication, "a replication frame")
    if ("checkpoint" in msg or "catchup" in msg) and "data" in msg:
        return _as(msg, Piece, "a runtime file component's piece")
    if "checkpoint" in msg:
        return _as(msg, CheckpointEnd, "a checkpoint's end")
    if "catchup" in msg:
        return _as(msg, CatchUpEnd, "a catch-up's end")
    if "media" in msg:
        return _as(msg, MediaPiece, "a media piece")
    if "cut" in msg:
        return _as(msg, Cut, "a cut")
    return _as(msg, Bytes, "journal bytes")
