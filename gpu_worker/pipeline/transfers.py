"""The journal transfers of an input's life after its admission (gpu_worker/pipeline/execution.py):
the payloads of its LEASE, MEMORY, OUTPUT and COMPLETION transfers, and the input a replayed one
names (anything else fails closed)."""
from __future__ import annotations

import os

import msgpack

from ..kinds.kind import Journaling, Kind, Tables
from ..state.tables import Finish, R
from ..storage import leases
from ..storage.journal import JournalCorrupt, Transfer, segment_name


def actor_of(d: Tables, rrow: int) -> tuple[bytes, int]:
    t = d.state.tables
    row = t.row(t.receipts, rrow)
    return d.state.participants.raw[row[R.PARTICIPANT]], row[R.SEQUENCE]


def lease_revision(d: Tables, rrow: int) -> int:
    """The lease revision an input's admission recorded (its context rendering)."""
    t = d.state.tables
    return t.value(t.receipts, rrow, R.REVISION) - 1


def lease_payload(d: Tables, rrows: list[int]) -> bytes:
    """One lease for inputs of one revision, each row with its recorded retention mode."""
    t = d.state.tables
    rows = []
    for i, rrow in enumerate(rrows):
        actor, sequence = actor_of(d, rrow)
        rows.append(leases.LeaseRow(i, t.value(t.receipts, rrow, R.TARGET), sequence, actor,
                                    t.value(t.receipts, rrow, R.RETENTION)))
    return leases.encode(lease_revision(d, rrows[0]), rows)


def memory_payload(d: Tables, rrow: int, kind: int, flags: int, refused: int, text: bytes | None,
                   embedding: bytes | None, expires: int = 0) -> bytes:
    """A MEMORY transfer: the memory row an input retains (its source, from its saved command
    bytes, or an interpretation's text), or why it retains none (`refused`, a NotRetained code),
    and when the row expires (wall-clock ns, 0 never: memory/expiry.py; absent from transfers
    written before expiry)."""
    actor, sequence = actor_of(d, rrow)
    return msgpack.packb([actor, sequence, kind, flags, refused, text, embedding, expires], use_bin_type=True)


def output_payload(d: Tables, rrow: int, offset: int, data: bytes) -> bytes:
    actor, sequence = actor_of(d, rrow)
    return msgpack.packb([actor, sequence, offset, data], use_bin_type=True)


def completion_payload(d: Tables, rrow: int, finish: Finish, input_tokens: int, output_tokens: int) -> bytes:
    actor, sequence = actor_of(d, rrow)
    return msgpack.packb([actor, sequence, int(finish), input_tokens, output_tokens], use_bin_type=True)


def inconsistent(d: Journaling, transfer: Transfer | None, reason: str) -> Exception:
    if transfer is None:  # live: the device wrote it itself, so this is a bug, not a bad journal
        return RuntimeError(reason)
    return JournalCorrupt(os.path.join(d.journal_dir, segment_name(transfer.segment)), transfer.offset, reason)


def input_row(d: Journaling, actor: bytes, sequence: int, transfer: Transfer | None, what: str) -> int:
    """The input a lease/output/completion transfer names; anything else fails closed."""
    prow = d.state.participants.by_raw.get(actor)
    rrow = d.state.receipts.at(prow, sequence) if prow is not None else None
    if rrow is None or d.state.tables.value(d.state.tables.receipts, rrow, R.KIND) != Kind.INPUT:
        raise inconsistent(d, transfer, f"{what} transfer names no input at sequence {sequence}")
    return rrow
