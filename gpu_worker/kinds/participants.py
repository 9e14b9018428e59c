"""Participants: registration (the first mutation of every principal) and participant reads.
A principal's lineage and participant ID exist before it registers (derived from the file
incarnation); registering gives it a table row and its sequence counters."""
from __future__ import annotations

from typing import TypedDict

from ..contract import ids
from ..contract.commands import Mutation, NoArgs, ParticipantRef
from ..contract.errors import ServiceError
from ..state.tables import P, R, split16
from .kind import Admission, Extra, Kind, OperationKind, Read, Tables



def check(d: Tables, principal: bytes, prow: int | None, args: Mutation, key: bytes,
          sequence: int) -> Extra:
    if prow is not None:
        raise ServiceError(409, "already_registered", "the participant is already registered")
    if not d.state.participants.free:
        raise ServiceError(507, "participant_capacity", "the participant table is full")
    return {}


def apply(d: Tables, a: Admission, prow: int, transfer_seq: int | None, rrow: int) -> int:
    participants = d.state.participants
    prow = participants.free.pop()
    hi, lo = split16(a.principal)
    t = d.state.tables
    t.put_cols(t.participants, prow, 0, [1, a.sequence + 1, 1, hi, lo, rrow])
    participants.add(prow, a.principal)
    return prow


def target_id(d: Tables, row: list[int], lineage: bytes) -> str:
    return d.state.participants.public_id[row[R.TARGET]]


REGISTER: OperationKind = OperationKind(Kind.PARTICIPANT_REGISTER, "participant.register", check=check, apply=apply,
                         target_id=target_id)


class ParticipantView(TypedDict):
    """A participant resource as a read renders it."""
    id: str | None
    registered: bool
    lineage: str
    next_sequence: str | None
    retry_floor: str | None


def view(d: Tables, prow: int, *, own: bool) -> ParticipantView:
    """A participant resource; sequence counters are null for anyone but its own principal."""
    row = d.state.tables.row(d.state.tables.participants, prow)
    return {"id": d.state.participants.public_id[prow], "registered": True,
            "lineage": d.state.participants.lineage_hex[prow],
            "next_sequence": str(row[P.NEXT_SEQUENCE]) if own else None,
            "retry_floor": str(row[P.RETRY_FLOOR]) if own else None}


def get_own(d: Tables, principal: bytes, args: NoArgs) -> tuple[int, object]:
    participants = d.state.participants
    prow = participants.by_principal.get(principal)
    if prow is None:
        return 200, {"id": None, "registered": False, "lineage": participants.lineage_of(principal).hex(),
                     "next_sequence": "1", "retry_floor": "1"}
    return 200, view(d, prow, own=True)


def get_other(d: Tables, principal: bytes, args: ParticipantRef) -> tuple[int, object]:
    participants = d.state.participants
    m = ids.PARTICIPANT_ID.match(args.participant)
    prow = participants.by_raw.get(bytes.fromhex(m.group(1))) if m else None
    if prow is None:
        raise ServiceError(404, "participant_not_found", "no such registered participant")
    return 200, view(d, prow, own=participants.by_principal.get(principal) == prow)


READS: dict[str, Read] = {"participant.get": get_own, "participants.get": get_other}
