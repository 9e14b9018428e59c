"""Members (SPEC "Scope"): explicit rights rows of a space, set by a manager. An empty
permissions array leaves a zero-rights row, which also blocks implicit instance access; the
owner's rights are fixed."""
from __future__ import annotations


import numpy as np

from .. import native
from ..contract.commands import MemberSet, SpacePage
from ..contract import ids
from ..contract.errors import ServiceError
from ..state.tables import M, R, S, Right
from . import access, events
from .kind import ADMISSION_VERSION, Admission, Caller, Extra, Kind, OperationKind, Read, Run, Serving, Tables
from .lists import page
from .spaces import halves, sixteens, space_key



def check(d: Caller, principal: bytes, prow: int | None, args: MemberSet, key: bytes,
          sequence: int) -> Extra:
    state = d.state
    srow = access.space_row(d, args.space, principal, prow, Right.MANAGE)
    m = ids.PARTICIPANT_ID.match(args.participant)
    member = state.participants.by_raw.get(bytes.fromhex(m.group(1))) if m else None
    if member is None:
        raise ServiceError(404, "participant_not_found", f"no registered participant {args.participant}")
    if member == state.tables.value(state.tables.spaces, srow, S.OWNER):
        raise ServiceError(409, "owner_rights_fixed", "the space owner always has read, write and manage")
    if (srow, member) not in state.members.rows and not state.members.free:
        raise ServiceError(507, "member_capacity", f"the member table is full ({state.capacities['members']})")
    space = ids.SPACE_ID.match(args.space)
    assert space is not None
    return {"space": list(ids.split_id(space)), "participant": state.participants.raw[member],
            "rights": sum(access.RIGHT_NAMES[p] for p in args.permissions)}


def apply(d: Tables, a: Admission, prow: int, transfer_seq: int | None, rrow: int) -> int:
    state = d.state
    srow = state.spaces.row(space_key(a.extra["space"]))
    member = state.participants.by_raw[a.extra["participant"]]
    t = state.tables
    mrow = state.members.rows.get((srow, member))
    if mrow is None:  # a new row, whole: STATE, SPACE, PARTICIPANT, RIGHTS, CREATED
        mrow = state.members.rows[(srow, member)] = state.members.free.pop()
        t.put_cols(t.members, mrow, 0, (1, srow, member, a.extra["rights"], state.admissions))
    else:
        t.put_value(t.members, mrow, M.RIGHTS, a.extra["rights"])
    return srow


_member_sets = native.load("jcodec").member_sets
_ROW_WIDTH = M.CREATED + 1
assert (M.STATE, M.SPACE, M.PARTICIPANT, M.RIGHTS, M.CREATED) == (0, 1, 2, 3, 4)


def decode_run(payloads: list[bytes]) -> Run | None:
    """A run of member rows set, as columns, decoded natively (jcodec.member_sets); None when a
    payload is not exactly as Admission.encode packs one."""
    columns = _member_sets(payloads, ADMISSION_VERSION, int(Kind.MEMBER_SET))
    if columns is None:
        return None
    sequences, keys, ops, commands, lengths, space_lineages, space_ids, participants, rights = columns
    return Run(np.frombuffer(sequences, dtype=np.int64), halves(keys), halves(ops), commands,
               np.frombuffer(lengths, dtype=np.int64),
               (sixteens(space_lineages), sixteens(space_ids), sixteens(participants),
                np.frombuffer(rights, dtype=np.int64).tolist()))


def apply_run(d: Tables, run: Run, prows: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """`apply` of each member row set in the run, in order: a pair's first row takes the lowest
    free row (STATE, SPACE, PARTICIPANT, CREATED), and its rights are the last the run sets; the
    new rows in one write, the rights in another."""
    state = d.state
    space_lineages, space_ids, participants, rights = run.extra
    row_of, by_raw, members = state.spaces.row, state.participants.by_raw, state.members
    srows = [row_of(key) for key in zip(space_lineages, space_ids)]
    new: list[list[int]] = []
    last: dict[int, int] = {}  # member row -> the rights the run leaves it
    for srow, participant, counter, right in zip(srows, participants, counters.tolist(), rights):
        member = by_raw[participant]
        mrow = members.rows.get((srow, member))
        if mrow is None:
            mrow = members.rows[(srow, member)] = members.free.pop()
            new.append([mrow, 1, srow, member, 0, counter])
        last[mrow] = right
    t = state.tables
    if new:
        made = np.array(new, dtype=np.int64)
        made[:, 1 + M.RIGHTS] = [last[mrow] for mrow in made[:, 0].tolist()]
        t.put_rows(t.members, made[:, 0], made[:, 1:])
    for mrow, right in last.items():
        t.put_value(t.members, mrow, M.RIGHTS, right)
    return np.array(srows, dtype=np.int64)


def target_id(d: Tables, row: list[int], lineage: bytes) -> str:
    return access.space_id(d, row[R.TARGET])


def visible_to(d: Caller, principal: bytes, reader: int | None, row: list[int]) -> bool:
    return access.space_readable(d, principal, reader, row[R.TARGET])


def saved(d: Serving, rrow: int) -> None:
    """Rights changed: open streams of readers who lost theirs end (kinds/events.py)."""
    events.recheck(d)


SET: OperationKind = OperationKind(Kind.MEMBER_SET, "members.set", check=check, apply=apply, target_id=target_id,
                    visible_to=visible_to, saved=saved, runs=(decode_run, apply_run))


def list_members(d: Caller, principal: bytes, args: SpacePage) -> tuple[int, object]:
    """The owner (implicit, on the first page) then the explicit rows in creation order; a page
    holds at most `limit` items, the owner taking one of the first page's places. Cursors are the
    explicit rows' creation counters; after a first page of the owner alone it is "0", which no
    row was created at (every admission counts from 1), so the next page starts at the first row."""
    state = d.state
    srow = access.space_row(d, args.space, principal, state.participants.by_principal.get(principal),
                            Right.READ)
    cursor, limit = args.after, args.limit
    t = state.tables
    members = t.members
    live = (members[:, M.STATE] == 1) & (members[:, M.SPACE] == srow)
    names = state.participants.public_id
    items = []
    if cursor is None:
        items.append({"participant": names[t.value(t.spaces, srow, S.OWNER)],
                      "permissions": access.right_names(access.ALL_RIGHTS), "explicit": False})
        limit -= 1
    if limit:
        rows, next_cursor = page(members, M.CREATED, live, cursor, limit)
    else:  # the first page is the owner alone: the explicit rows, if any, follow from "0"
        rows, next_cursor = [], "0" if bool(live.any()) else None
    for mrow in rows:
        row = t.row(members, mrow)
        items.append({"participant": names[row[M.PARTICIPANT]], "permissions": access.right_names(row[M.RIGHTS]),
                      "explicit": True})
    return 200, {"items": items, "next_cursor": next_cursor}


READS: dict[str, Read] = {"members.list": list_members}
