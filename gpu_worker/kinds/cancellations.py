"""Cancellations (SPEC "Mutations and retries"): stop a running input of the caller's, named by
its exact sequence. Disconnect does not cancel; a cancellation cannot undo what is committed.
Only an input still running can be cancelled (others: 409 `not_cancellable`, `already_finished`)."""
from __future__ import annotations


from ..contract import ids
from ..contract.commands import Cancellation
from ..contract.errors import ServiceError
from ..state.tables import P, R, Terminal, join16
from .kind import Admission, Executing, Extra, Kind, OperationKind, Tables



def check(d: Executing, principal: bytes, prow: int | None, args: Cancellation, key: bytes,
          sequence: int) -> Extra:
    assert prow is not None
    target = args.target_sequence
    t = d.state.tables
    floor = t.value(t.participants, prow, P.RETRY_FLOOR)
    if target < floor:
        raise ServiceError(410, "below_retry_floor", f"target_sequence {target} is below the retry floor {floor}")
    rrow = d.state.receipts.at(prow, target)
    if rrow is None:
        raise ServiceError(404, "operation_not_found", f"no operation at sequence {target}")
    row = t.row(t.receipts, rrow)
    kind = d.kinds[row[R.KIND]]
    if not kind.executes:
        raise ServiceError(409, "not_cancellable", f"the operation at sequence {target} ({kind.name}) finished at "
                                                   "admission and cannot be cancelled", target_sequence=str(target))
    live = d.executions.live.get(rrow)
    if row[R.TERMINAL] != Terminal.NONE or (live is not None and live.finish):
        raise ServiceError(409, "already_finished", f"the input at sequence {target} has already finished",
                           target_sequence=str(target))
    return {"target_sequence": target}


def apply(d: Executing, a: Admission, prow: int, transfer_seq: int | None, rrow: int) -> int:
    if transfer_seq is not None:  # live: stop generation now; replay: the completion says how it ended
        d.stop_input(d.state.receipts.row_of(prow, a.extra["target_sequence"]))
    return prow


def columns(d: Tables, a: Admission) -> dict[int, int]:
    """The target operation, so the receipt can name it after the target is retired."""
    state = d.state
    target = state.receipts.row_of(state.participants.by_principal[a.principal], a.extra["target_sequence"])
    row = state.tables.row(state.tables.receipts, target)
    return {R.TARGET_OP_HI: row[R.OP_HI], R.TARGET_OP_LO: row[R.OP_LO]}


def target_id(d: Tables, row: list[int], lineage: bytes) -> str:
    return ids.operation_id(lineage, join16(row[R.TARGET_OP_HI], row[R.TARGET_OP_LO]))


RECORD: OperationKind = OperationKind(Kind.CANCELLATION, "cancellations.record", check=check, apply=apply,
                                      target_id=target_id, columns=columns)
