"""Execution lease layouts (SPEC "Recorded state and recovery"), journaled in lease transfers.

A lease is a header and rows, little-endian:

    header (8 bytes)   row_count u32 @0 | revision u32 @4
    row, revisions 2-5 (40 bytes)
        request_index u32 @0 | slot u32 @4 | sequence u64 @8 | actor 16 bytes @16 |
        retention_mode u32 @32 | reserved u32 @36 (zero)
    row, revisions 0-1 (32 bytes, the original layout)
        request_index u32 @0 | slot u32 @4 | sequence u64 @8 | actor 16 bytes @16

Revision 2: the previous query and prompt bytes are kept as they are. Revision 3: compact context
rendering and the historical-data system rule (what this device writes for ordinary inputs).
Revision 4: source-only leases, sharing repeated source labels within the same context limit.
Revision 5: affect-managed leases, with revision 2's query format. Revisions 0 and 1 have no
retention mode in their rows: mode 2 interpretation is recorded in separate interpretation
records, so their rows read back with retention_mode None and recovery takes the mode from
those records. Retention mode 1 retains source text; mode 2 also performs qualified automatic
interpretation (recorded only when the requested model has the automatic-memory capability).
Every row is checked before anything is applied: a lease either decodes whole or is refused.
"""
import struct
from dataclasses import dataclass

from ..contract.vocabulary import CONTEXTS, RETENTIONS
from typing import Sequence

HEADER = struct.Struct("<II")                # row_count, revision
ROW = struct.Struct("<IIQ16sII")             # offsets 0, 4, 8, 16, 32, 36 -> 40 bytes
ROW_V0 = struct.Struct("<IIQ16s")            # offsets 0, 4, 8, 16 -> 32 bytes
assert HEADER.size == 8 and ROW.size == 40 and ROW_V0.size == 32

REVISIONS = range(0, 6)
COMPACT = 3          # what the device writes for ordinary inputs
SOURCE_ONLY = 4
AFFECT_MANAGED = 5
RETAIN_SOURCE = 1
RETAIN_AND_INTERPRET = 2


# the names inputs give them (contract/vocabulary.py), by retention mode and by lease revision
RETENTION_OF = {"source": RETAIN_SOURCE, "interpret": RETAIN_AND_INTERPRET}
REVISION_OF = {"compact": COMPACT, "source_only": SOURCE_ONLY, "managed": AFFECT_MANAGED, "plain": 2}
assert tuple(RETENTION_OF) == RETENTIONS and tuple(REVISION_OF) == CONTEXTS


class LeaseError(ValueError):
    pass


@dataclass(frozen=True)
class LeaseRow:
    request_index: int
    slot: int
    sequence: int
    actor: bytes
    retention_mode: int | None


def row_layout(revision: int) -> struct.Struct:
    return ROW_V0 if revision < 2 else ROW


def encode(revision: int, rows: Sequence[LeaseRow]) -> bytes:
    if revision not in REVISIONS:
        raise LeaseError(f"unknown lease revision {revision}")
    layout = row_layout(revision)
    out = bytearray(HEADER.pack(len(rows), revision))
    for row in rows:
        if len(row.actor) != 16:
            raise LeaseError("actor must be 16 bytes")
        if revision < 2:
            out += layout.pack(row.request_index, row.slot, row.sequence, row.actor)
        else:
            if row.retention_mode not in (RETAIN_SOURCE, RETAIN_AND_INTERPRET):
                raise LeaseError(f"retention mode {row.retention_mode} is not 1 or 2")
            out += layout.pack(row.request_index, row.slot, row.sequence, row.actor, row.retention_mode, 0)
    return bytes(out)


def decode(data: bytes) -> tuple[int, list[LeaseRow]]:
    """(revision, [LeaseRow]) or LeaseError: every row is checked before any is returned."""
    if len(data) < HEADER.size:
        raise LeaseError(f"lease of {len(data)} bytes is shorter than its header")
    count, revision = HEADER.unpack_from(data)
    if revision not in REVISIONS:
        raise LeaseError(f"unknown lease revision {revision}")
    layout = row_layout(revision)
    if len(data) != HEADER.size + count * layout.size:
        raise LeaseError(f"lease revision {revision} with {count} rows must be "
                         f"{HEADER.size + count * layout.size} bytes, not {len(data)}")
    rows: list[LeaseRow] = []
    for i in range(count):
        fields = layout.unpack_from(data, HEADER.size + i * layout.size)
        if revision < 2:
            rows.append(LeaseRow(*fields, None))  # type: ignore[call-arg]  # ROW_V0: the first four fields
            continue
        *head, mode, reserved = fields
        if reserved:
            raise LeaseError(f"lease row {i}: reserved word is {reserved}, not zero")
        if mode not in (RETAIN_SOURCE, RETAIN_AND_INTERPRET):
            raise LeaseError(f"lease row {i}: retention mode {mode} is not 1 or 2")
        rows.append(LeaseRow(*head, mode))  # type: ignore[call-arg]  # ROW: the first four fields
    return revision, rows
