"""Memory that expires (docs/memory.md "Expiry"): a space may carry a time to live for the rows
retained in it (`memory_ttl_seconds` at its creation), and an input one for the rows it retains
(its own `memory_ttl_seconds`, else its space's); a published copy takes its destination's.

The instant a row expires is fixed when it is written, by the device's wall clock, and journaled
with it (the MEMORY transfer's `expires`, a publication's admission), so a replay sets the same
instant. From that instant the row is gone from every read and from recall
(MemoryTable.current_owners: a read asks the clock, never the gateway), and the device forgets
it: a tick whose clock is past the earliest expiry appends one EXPIRY transfer naming up to
BATCH expired objects, which forgets each as a deletion does (kinds/memory_deletions.erase:
its bytes leave the runtime file at the next checkpoint), live and at replay alike.

    EXPIRY payload (msgpack): [at_ns, [object id (16 bytes), ...]]
"""
from __future__ import annotations

from typing import Any

import msgpack

from ..kinds.kind import Journaling, Tables
from ..kinds.memory_deletions import erase
from ..state.tables import C, R, S
from ..storage.journal import Transfer, TransferKind, record_count
from . import table

BATCH = 256  # expired objects one EXPIRY transfer forgets


def ttl_expiry(ttl_seconds: int) -> int:
    """The instant a row written now with this time to live expires (0: it never does)."""
    return table.now() + ttl_seconds * 1_000_000_000 if ttl_seconds else 0


def space_ttl(d: Tables, srow: int) -> int:
    t = d.state.tables
    return t.value(t.spaces, srow, S.MEMORY_TTL)


def input_expiry(d: Tables, rrow: int, body: dict[str, Any]) -> int:
    """When the rows an input retains expire: its own time to live, else its space's."""
    ttl = body.get("memory_ttl_seconds")
    if not ttl:
        t = d.state.tables
        ttl = space_ttl(d, t.value(t.conversations, t.value(t.receipts, rrow, R.TARGET), C.SPACE))
    return ttl_expiry(int(ttl))


def journal(d: Journaling, budget: int) -> int:
    """On the tick thread: once the earliest expiry has passed, one EXPIRY transfer for the rows
    expired by now (BATCH at most), applied as it is appended; the journal records it used."""
    rows = d.state.memory
    at = table.now()
    if not rows.soonest or at < rows.soonest or budget <= 0 or not d.holds.writable:
        return 0
    slots = rows.expired(at, BATCH)
    if not slots:
        rows.find_soonest()  # (the due ones are pending rows, or gone)
        return 0
    payload: bytes = msgpack.packb([at, [rows.row(slot).object for slot in slots]], use_bin_type=True)
    apply(d, payload, None)
    d.append(TransferKind.EXPIRY, payload)
    return record_count(len(payload))


def apply(d: Journaling, payload: bytes, transfer: Transfer | None) -> None:
    """An EXPIRY transfer, live (as it is appended) and at replay: each object it names that is
    still there is forgotten."""
    _, objects = msgpack.unpackb(payload)
    rows = d.state.memory
    for obj in objects:
        slot = rows.by_id.get(obj)
        if slot is not None:
            erase(d, slot)
    rows.find_soonest()


def replay(d: Journaling, transfer: Transfer) -> None:
    apply(d, transfer.payload, transfer)
