"""Members (SPEC "Scope"): explicit rights rows of a space, set by a manager. An empty
permissions array leaves a zero-rights row, which also blocks implicit instance access; the
owner's rights are fixed."""
from __future__ import annotations

from typing import Any

from ..contract.commands import MemberSet, SpacePage
from ..contract import ids
from ..contract.errors import ServiceError
from ..state.tables import M, R, S, Right
from . import access, events
from .kind import Admission, Caller, Context, Kind, OperationKind, Read, Tables
from .lists import page
from .spaces import space_key



def check(d: Caller, principal: bytes, prow: int | None, args: MemberSet, key: bytes,
          sequence: int) -> dict[str, Any]:
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
    if mrow is None:
        mrow = state.members.rows[(srow, member)] = state.members.free.pop()
        t.write_row(t.members, mrow, {M.STATE: 1, M.SPACE: srow, M.PARTICIPANT: member, M.CREATED: state.admissions})
    t.write_row(t.members, mrow, {M.RIGHTS: a.extra["rights"]})
    return srow


def target_id(d: Tables, row: list[int], lineage: bytes) -> str:
    return access.space_id(d, row[R.TARGET])


def visible_to(d: Caller, principal: bytes, reader: int | None, row: list[int]) -> bool:
    return access.space_readable(d, principal, reader, row[R.TARGET])


def saved(d: Context, rrow: int) -> None:
    """Rights changed: open streams of readers who lost theirs end (ops/events.py)."""
    events.recheck(d)


SET: OperationKind = OperationKind(Kind.MEMBER_SET, "members.set", check=check, apply=apply, target_id=target_id,
                    visible_to=visible_to, saved=saved)


def list_members(d: Caller, principal: bytes, args: SpacePage) -> tuple[int, Any]:
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
