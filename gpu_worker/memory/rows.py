"""The 128-byte memory metadata row (docs/memory.md): its binary layout, and its JSON form as
memory lists and detail reads show it.

    offset size  field
         0   16  object lineage   } the object's ID, mem-{lineage}-{id}
        16   16  object id        }
        32    8  version          u64, 1 when retained, +1 at each change
        40    2  kind             u16, Kind
        42    1  scope            u8, the owning space's scope (1 private, 2 room, 3 instance)
        43    1  flags            u8, Flag bits: 1 published, 2 managed, 4 interpreted
        44    4  byte length      u32, payload bytes
        48   16  owner            the memory owner: a private space's derived owner
                                  (derived.memory_owner), a room's space id, zeros for the instance
        64   16  room lineage     } a room-scoped row's exact space ID, spc-{lineage}-{id};
        80   16  room id          } zeros otherwise
        96   16  source           the operation that wrote the row, op-{object lineage}-{source}
       112   16  actor            the participant whose operation it was, par-{actor}

All integers little-endian; the row is exactly 128 bytes (`ROW.size`), every byte assigned. A
published copy's provenance (its source object and source version, 40 bytes) does not fit in it:
the memory table keeps it beside the row (`Provenance`), and the JSON form shows both."""
from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from enum import IntEnum, IntFlag
from typing import Any, NamedTuple

from ..contract.ids import operation_id, participant_id, space_id

ROW = struct.Struct("<16s16sQHBBI16s16s16s16s16s")
assert ROW.size == 128
ZERO = bytes(16)
MAX_BYTE_LENGTH = (1 << 32) - 1


class Kind(IntEnum):
    SOURCE = 1          # an input's source text (retention mode 1 and 2)
    INTERPRETATION = 2  # the model's short interpretation of a turn (mode 2)
    CONTROL = 3         # an affect-managed lease's control record: management flag, completion state


class Flag(IntFlag):
    PUBLISHED = 1    # a copy made by a publication (its source object and version: `Provenance`)
    MANAGED = 2      # written under an affect-managed lease (revision 5)
    INTERPRETED = 4  # a turn's source whose interpretation was retained later (that made it version 2)


# a correction's receipt keeps the version it replaced as its result bytes: the object (lineage,
# id), that version, then its payload (kinds/memory_versions.py)
SUPERSEDED = struct.Struct("<16s16sQ")
PROVENANCE = struct.Struct("<16s16sQ")  # a published copy's source object (lineage, id) and version
NO_PROVENANCE = bytes(PROVENANCE.size)


@dataclass(frozen=True)
class Provenance:
    """Where a published copy came from: its source object and the version it copied (the
    publication's admission record). Kept beside the 128-byte row, which has no room for it
    (table.py `provenance`; docs/memory.md "The metadata row")."""
    lineage: bytes
    object: bytes
    version: int

    def pack(self) -> bytes:
        return PROVENANCE.pack(self.lineage, self.object, self.version)

    @classmethod
    def unpack(cls, raw: bytes) -> "Provenance | None":
        """None for the zeros of a row that is not a copy (or a copy loaded from a checkpoint
        written before provenance was kept)."""
        if raw == NO_PROVENANCE:
            return None
        return cls(*PROVENANCE.unpack(raw))

    def to_json(self) -> dict[str, str]:
        return {"object": memory_id(self.lineage, self.object), "version": str(self.version)}


SCOPES = {1: "private", 2: "room", 3: "instance"}


def memory_id(lineage: bytes, raw: bytes) -> str:
    return f"mem-{lineage.hex()}-{raw.hex()}"


@dataclass(frozen=True)
class MemoryRow:
    lineage: bytes
    object: bytes
    version: int
    kind: Kind
    scope: int
    flags: Flag
    byte_length: int
    owner: bytes
    room_lineage: bytes
    room: bytes
    source: bytes
    actor: bytes

    def pack(self) -> bytes:
        if not 1 <= self.version < 1 << 64:
            raise ValueError(f"version {self.version} is out of range")
        if not 0 <= self.byte_length <= MAX_BYTE_LENGTH:
            raise ValueError(f"byte length {self.byte_length} is out of range")
        if self.scope not in SCOPES:
            raise ValueError(f"scope {self.scope} is not 1, 2 or 3")
        if (self.scope == 2) != (self.room != ZERO or self.room_lineage != ZERO):
            raise ValueError("a room ID is set exactly when the scope is room")
        if self.scope == 2 and self.owner != self.room:
            raise ValueError("a room's memory owner is the room itself")
        if self.scope == 3 and self.owner != ZERO:
            raise ValueError("the instance's memory owner is written as zeros")
        return ROW.pack(self.lineage, self.object, self.version, int(self.kind), self.scope, int(self.flags),
                        self.byte_length, self.owner, self.room_lineage, self.room, self.source, self.actor)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> "MemoryRow":
        (lineage, obj, version, kind, scope, flags, length, owner, room_lineage, room, source,
         actor) = ROW.unpack(raw)
        return cls(lineage, obj, version, Kind(kind), scope, Flag(flags), length, owner, room_lineage, room,
                   source, actor)

    def owner_name(self) -> str:
        """The owner as spaces show their `memory_owner` (kinds/spaces.memory_owner)."""
        if self.scope == 2:
            return space_id(self.room_lineage, self.room)
        if self.scope == 3:
            return "instance"
        return "private-" + self.owner.hex()

    def corrected(self, byte_length: int) -> "MemoryRow":
        """The row at its next version with a new payload of `byte_length` bytes (a correction)."""
        return replace(self, version=self.version + 1, byte_length=byte_length)

    def bumped(self, flags: Flag) -> "MemoryRow":
        """The row at its next version, with `flags` added (a change to the object)."""
        return replace(self, version=self.version + 1, flags=self.flags | flags)

    def to_json(self, provenance: Provenance | None = None, expires: int = 0) -> dict[str, Any]:
        """The row as lists and detail reads show it (counters as decimal strings), with a
        published copy's provenance (`published_from`, null for any other row) and the instant it
        expires (`expires_at_ns`, wall-clock ns, null for a row that does not)."""
        return {
            "object": memory_id(self.lineage, self.object),
            "version": str(self.version),
            "kind": self.kind.name.lower(),
            "scope": SCOPES[self.scope],
            "published": bool(self.flags & Flag.PUBLISHED),
            "managed": bool(self.flags & Flag.MANAGED),
            "interpreted": bool(self.flags & Flag.INTERPRETED),
            "owner": self.owner_name(),
            "room": space_id(self.room_lineage, self.room) if self.scope == 2 else None,
            "byte_length": str(self.byte_length),
            "source": operation_id(self.lineage, self.source),
            "actor": participant_id(self.actor),
            "published_from": provenance.to_json() if provenance is not None else None,
            "expires_at_ns": str(expires) if expires else None,
        }


class Forgotten(NamedTuple):
    """A forgotten object: its id, the operation that wrote it (an input, or a publication for a
    copy), its actor (participant raw id), its memory kind and whether it is a published copy."""
    object: bytes
    source: bytes
    actor: bytes
    kind: int
    published: bool
