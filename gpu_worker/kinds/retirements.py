"""Retirements (SPEC "Mutations and retries"): advance the participant's retry floor and free
every receipt below it, each of which must have a saved terminal result. The freed slots are
reused only once the retirement that carries the new floor is saved. A deleted space or
conversation whose last receipt this retires goes back to its table (kinds/deletions.py). A
retired input's turn is folded into its conversation's history first (kinds/history.py), so later
inputs keep it in their context."""
from __future__ import annotations

import bisect

import numpy as np

from ..contract.commands import Retirement
from ..contract.errors import ServiceError
from ..state.tables import P, R
from . import deletions, history
from .kind import Admission, Extra, Kind, OperationKind, Tables

_INPUT = int(Kind.INPUT)



def check(d: Tables, principal: bytes, prow: int | None, args: Retirement, key: bytes,
          sequence: int) -> Extra:
    assert prow is not None
    floor = args.retry_floor
    state = d.state
    t = state.tables
    current = t.value(t.participants, prow, P.RETRY_FLOOR)
    if floor <= current:
        raise ServiceError(409, "retry_floor_not_advanced", f"the retry floor is already {current}",
                           retry_floor=str(current))
    if floor > sequence:
        raise ServiceError(409, "retry_floor_ahead",
                           f"retry_floor {floor} is above this retirement's own sequence {sequence}")
    seqs = state.live_sequences(prow)
    for seq in seqs[:bisect.bisect_left(seqs, floor)]:
        if not t.value(t.receipts, state.receipts.row_of(prow, seq), R.TERM_TRANSFER):
            raise ServiceError(409, "unfinished_operations",
                               f"operation at sequence {seq} has no saved terminal result yet", sequence=str(seq))
    return {"retry_floor": floor}


def apply(d: Tables, a: Admission, prow: int, transfer_seq: int | None, rrow: int) -> int:
    floor = a.extra["retry_floor"]
    state = d.state
    t = state.tables
    receipts = state.receipts
    live = state.live_sequences(prow)
    # the freed receipts leave the index, their columns read, their inputs' turns folded, all in one
    # pass each (a retirement frees hundreds: one at a time was a fifth of a replay)
    freed, values = receipts.retire(prow, live[:bisect.bisect_left(live, floor)], t)
    inputs = np.flatnonzero(values[:, R.KIND] == _INPUT).tolist()
    if inputs:
        rows, rrows = values[inputs].tolist(), [freed[i] for i in inputs]
        history.fold(d, rows, rrows)  # their turns stay in the conversations' context
        gone: dict[int, set[int]] = {}
        for row, rrow in zip(rows, rrows):
            gone.setdefault(row[R.TARGET], set()).add(rrow)
        for crow, retired in gone.items():
            left = state.conversations.inputs_of(crow)
            state.conversations.inputs[crow] = [r for r in left if r not in retired] or None
    t.put_column(t.receipts, freed, R.STATE, 0)
    t.write_row(t.participants, prow, {P.RETRY_FLOOR: floor})
    # deleted rows no receipt names any more go back
    deletions.release_tombstones(d, values[:, R.KIND], values[:, R.TARGET])
    if transfer_seq is None:
        receipts.free.extend(freed)
    else:  # reusable only once the floor that retired them is saved
        receipts.release_on_save[transfer_seq] = freed
    return prow


def target_id(d: Tables, row: list[int], lineage: bytes) -> str:
    return d.state.participants.public_id[row[R.TARGET]]


RECORD: OperationKind = OperationKind(Kind.RETIREMENT, "retirements.record", check=check, apply=apply,
                                      target_id=target_id)
