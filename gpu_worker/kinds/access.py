"""Scope and rights (SPEC "Scope"): who may read, write or manage a space, as every operation and
read asks it.

Rights are three bits. The owner has all three, always (an owner row cannot be changed, so a
space can never lose its last manager). Anyone else has exactly the rights of their explicit
member row if one exists (a zero-rights row blocks implicit instance access), else read+write
on an instance space, else nothing. Every admission and read intersects those rights with the
principal's current grants; a space the caller has no effective right on is 404, a missing
right on a visible space 403. Visibility over all spaces is computed on the tables' device as
one batch of tensor operations.
"""
from __future__ import annotations

from typing import Any

import torch

from ..contract import ids
from ..contract.errors import ServiceError
from ..contract.vocabulary import MANAGE, PERMISSIONS, READ, WRITE
from ..state.tables import C, M, S, Right, Scope, join16
from .kind import Caller, Tables


ALL_RIGHTS = Right.READ | Right.WRITE | Right.MANAGE
INSTANCE_RIGHTS = Right.READ | Right.WRITE
GRANT_RIGHTS = {READ: Right.READ, WRITE: Right.WRITE, MANAGE: Right.MANAGE}
RIGHT_NAMES = {name: Right[name.upper()] for name in PERMISSIONS}  # the contract's names, the tables' bits


def right_names(bits: int) -> list[str]:
    return sorted(name for name, bit in RIGHT_NAMES.items() if bits & bit)


def grant_mask(d: Caller, principal: bytes) -> int:
    actions = d.grants.actions(principal.hex())
    return sum(bit for action, bit in GRANT_RIGHTS.items() if action in actions)


def stored_rights(d: Tables, prow: int, srow: int) -> int:
    t = d.state.tables
    row = t.row(t.spaces, srow)
    if row[S.STATE] != 1:  # a deleted space (kinds/deletions.py): nobody's
        return 0
    if row[S.OWNER] == prow:
        return ALL_RIGHTS
    mrow = d.state.members.rows.get((srow, prow))
    if mrow is not None:
        return t.value(t.members, mrow, M.RIGHTS)
    return INSTANCE_RIGHTS if row[S.SCOPE] == Scope.INSTANCE else 0


def effective_rights(d: Caller, principal: bytes, prow: int | None, srow: int) -> int:
    if prow is None:
        return 0
    return stored_rights(d, prow, srow) & grant_mask(d, principal)


def visible_spaces(d: Caller, principal: bytes, prow: int | None) -> torch.Tensor:
    """Effective rights of prow on every space, as one tensor (0 = not visible)."""
    t = d.state.tables
    spaces = t.spaces
    rights = torch.zeros(spaces.shape[0], dtype=torch.int64, device=t.device)
    if prow is None:
        return rights
    live = spaces[:, S.STATE] == 1
    rights = torch.where(live & (spaces[:, S.SCOPE] == Scope.INSTANCE), int(INSTANCE_RIGHTS), 0)
    members = t.members
    mine = members[(members[:, M.STATE] == 1) & (members[:, M.PARTICIPANT] == prow)]
    rights = rights.index_put((mine[:, M.SPACE],), mine[:, M.RIGHTS])
    rights = torch.where(live & (spaces[:, S.OWNER] == prow), int(ALL_RIGHTS), rights)
    return torch.where(live, rights & grant_mask(d, principal), 0)


def space_row(d: Caller, value: Any, principal: bytes, prow: int | None, need: int) -> int:
    """The row of a space ID the caller holds `need` on: 404 when it sees no such space, 403
    when it sees it without that right."""
    m = ids.SPACE_ID.match(value) if isinstance(value, str) else None
    srow = d.state.spaces.get(ids.split_id(m)) if m else None
    rights = effective_rights(d, principal, prow, srow) if srow is not None else 0
    if not rights:
        raise ServiceError(404, "space_not_found", f"no space {value} visible to this principal")
    if not rights & need:
        raise ServiceError(403, "right_missing", f"this participant lacks the {right_names(need)[0]} right on {value}")
    assert srow is not None
    return srow


def conversation_row(d: Caller, value: Any, principal: bytes, prow: int | None, need: int) -> int:
    """As space_row, for a conversation (rights are those on its space)."""
    m = ids.CONVERSATION_ID.match(value) if isinstance(value, str) else None
    crow = d.state.conversations.by_id.get(ids.split_id(m)) if m else None
    if crow is not None:
        t = d.state.tables
        rights = effective_rights(d, principal, prow, t.value(t.conversations, crow, C.SPACE))
        if rights & need:
            return crow
        if rights:
            raise ServiceError(403, "right_missing", f"this participant lacks the {right_names(need)[0]} right "
                                                     f"on the space of {value}")
    raise ServiceError(404, "conversation_not_found", f"no conversation {value} visible to this principal")


def space_readable(d: Caller, principal: bytes, reader: int | None, srow: int) -> bool:
    return bool(effective_rights(d, principal, reader, srow) & Right.READ)


def space_id(d: Tables, srow: int) -> str:
    t = d.state.tables
    row = t.row(t.spaces, srow)
    # the owner's lineage when it was created (a restore gives participants new lineages, not old IDs)
    return ids.space_id(d.state.participants.lineage_at(row[S.OWNER], row[S.CREATED]),
                        join16(row[S.ID_HI], row[S.ID_LO]))


def conversation_id(d: Tables, crow: int) -> str:
    t = d.state.tables
    row = t.row(t.conversations, crow)
    return ids.conversation_id(d.state.participants.lineage_at(row[C.CREATOR], row[C.CREATED]),
                               join16(row[C.ID_HI], row[C.ID_LO]))
