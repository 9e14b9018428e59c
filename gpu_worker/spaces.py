"""Spaces, members and conversations (SPEC "Scope" and "Resources"), mixed into the Device.

Rights are three bits. The owner has all three, always (an owner row cannot be changed, so a
space can never lose its last manager). Anyone else has exactly the rights of their explicit
member row if one exists (a zero-rights row blocks implicit instance access), else read+write
on an instance space, else nothing. Every admission and read intersects those rights with the
principal's current grants; a space the caller has no effective right on is 404, a missing
right on a visible space 403. Visibility over all spaces is computed on the tables' device as
one batch of tensor operations.
"""
import torch

from . import ids
from .kinds import Kind
from .protocol import DeviceError
from .tables import C, M, R, S, Right, Scope, join16, split16

ALL_RIGHTS = Right.READ | Right.WRITE | Right.MANAGE
INSTANCE_RIGHTS = Right.READ | Right.WRITE
GRANT_RIGHTS = {"shared_read": Right.READ, "shared_write": Right.WRITE, "shared_manage": Right.MANAGE}
RIGHT_NAMES = {"read": Right.READ, "write": Right.WRITE, "manage": Right.MANAGE}
SCOPES = {"private": Scope.PRIVATE, "room": Scope.ROOM, "instance": Scope.INSTANCE}
SCOPE_NAMES = {v: k for k, v in SCOPES.items()}


def right_names(bits):
    return sorted(name for name, bit in RIGHT_NAMES.items() if bits & bit)


class SpaceCommands:
    def init_spaces(self):
        """Indexes of the space tables, derived from the tensors (empty or from a checkpoint)."""
        t = self.tables
        self.by_space = {}          # (lineage raw, id raw) -> space row
        self.by_conversation = {}   # (lineage raw, id raw) -> conversation row
        self.member_rows = {}       # (space row, participant row) -> member row
        for srow, row in enumerate(t.spaces.tolist()):
            if row[S.STATE]:
                self.by_space[(self.participant_ids[row[S.OWNER]][1], join16(row[S.ID_HI], row[S.ID_LO]))] = srow
        for crow, row in enumerate(t.conversations.tolist()):
            if row[C.STATE]:
                key = (self.participant_ids[row[C.CREATOR]][1], join16(row[C.ID_HI], row[C.ID_LO]))
                self.by_conversation[key] = crow
        for mrow, row in enumerate(t.members.tolist()):
            if row[M.STATE]:
                self.member_rows[(row[M.SPACE], row[M.PARTICIPANT])] = mrow
        self.free_spaces = t.unused_rows(t.spaces)
        self.free_members = t.unused_rows(t.members)
        self.free_conversations = t.unused_rows(t.conversations)

    # ---- rights ------------------------------------------------------------------------

    def grant_mask(self, principal):
        actions = self.grants.actions(principal.hex())
        return sum(bit for action, bit in GRANT_RIGHTS.items() if action in actions)

    def stored_rights(self, prow, srow):
        t = self.tables
        row = t.row(t.spaces, srow)
        if row[S.OWNER] == prow:
            return ALL_RIGHTS
        mrow = self.member_rows.get((srow, prow))
        if mrow is not None:
            return t.value(t.members, mrow, M.RIGHTS)
        return INSTANCE_RIGHTS if row[S.SCOPE] == Scope.INSTANCE else 0

    def effective_rights(self, principal, prow, srow):
        if prow is None:
            return 0
        return self.stored_rights(prow, srow) & self.grant_mask(principal)

    def visible_spaces(self, principal, prow):
        """Effective rights of prow on every space, as one tensor (0 = not visible)."""
        t = self.tables
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
        return torch.where(live, rights & self.grant_mask(principal), 0)

    def _space_row(self, value, principal, prow, need):
        m = ids.SPACE_ID.match(value) if isinstance(value, str) else None
        srow = self.by_space.get((bytes.fromhex(m.group(1)), bytes.fromhex(m.group(2)))) if m else None
        rights = self.effective_rights(principal, prow, srow) if srow is not None else 0
        if not rights:
            raise DeviceError(404, "space_not_found", f"no space {value} visible to this principal")
        if not rights & need:
            raise DeviceError(403, "right_missing", f"this participant lacks the {right_names(need)[0]} right "
                                                    f"on {value}")
        return srow

    def _conversation_row(self, value, principal, prow, need):
        m = ids.CONVERSATION_ID.match(value) if isinstance(value, str) else None
        crow = self.by_conversation.get((bytes.fromhex(m.group(1)), bytes.fromhex(m.group(2)))) if m else None
        if crow is not None:
            srow = self.tables.value(self.tables.conversations, crow, C.SPACE)
            rights = self.effective_rights(principal, prow, srow)
            if rights & need:
                return crow
            if rights:
                raise DeviceError(403, "right_missing", f"this participant lacks the {right_names(need)[0]} right "
                                                        f"on the space of {value}")
        raise DeviceError(404, "conversation_not_found", f"no conversation {value} visible to this principal")

    def receipt_visible_to(self, principal, caller, row):
        """Another participant's receipt is readable where its target space is readable."""
        kind = row[R.KIND]
        if kind in (Kind.SPACE_CREATE, Kind.MEMBER_SET):
            srow = row[R.TARGET]
        elif kind in (Kind.CONVERSATION_CREATE, Kind.INPUT):  # members may read each other's input results
            srow = self.tables.value(self.tables.conversations, row[R.TARGET], C.SPACE)
        else:
            return False
        return bool(self.effective_rights(principal, caller, srow) & Right.READ)

    # ---- IDs and views -------------------------------------------------------------------

    def memory_owner(self, scope, space):
        """Whose memory a space's conversations share. A room uses its exact space ID; an
        instance space the instance; each private space its own owner (derived from the space
        ID, so two private spaces never share one, even with one participant owning both)."""
        if scope == Scope.ROOM:
            return space
        if scope == Scope.INSTANCE:
            return "instance"
        return "private-" + ids.memory_owner(self.incarnation, space).hex()

    def space_id(self, srow):
        row = self.tables.row(self.tables.spaces, srow)
        return ids.space_id(self.participant_ids[row[S.OWNER]][1], join16(row[S.ID_HI], row[S.ID_LO]))

    def conversation_id(self, crow):
        row = self.tables.row(self.tables.conversations, crow)
        return ids.conversation_id(self.participant_ids[row[C.CREATOR]][1], join16(row[C.ID_HI], row[C.ID_LO]))

    def _space_view(self, srow, rights):
        row = self.tables.row(self.tables.spaces, srow)
        _, lineage, _, _, owner = self.participant_ids[row[S.OWNER]]
        space = ids.space_id(lineage, join16(row[S.ID_HI], row[S.ID_LO]))
        return {"id": space, "scope": SCOPE_NAMES[row[S.SCOPE]], "owner": owner,
                "memory_owner": self.memory_owner(row[S.SCOPE], space),
                "created_by_operation": ids.operation_id(lineage, join16(row[S.OP_HI], row[S.OP_LO])),
                "rights": right_names(rights)}

    def _conversation_view(self, crow):
        row = self.tables.row(self.tables.conversations, crow)
        lineage = self.participant_ids[row[C.CREATOR]][1]
        return {"id": ids.conversation_id(lineage, join16(row[C.ID_HI], row[C.ID_LO])),
                "space": self.space_id(row[C.SPACE]), "slot": str(crow),
                "created_by_operation": ids.operation_id(lineage, join16(row[C.OP_HI], row[C.OP_LO]))}

    @staticmethod
    def _page(table, created_col, mask, cursor, limit):
        """Rows of table where mask holds, in creation order after cursor: (rows, next_cursor)."""
        created = table[:, created_col]
        if cursor is not None:
            mask = mask & (created > cursor)
        rows = torch.nonzero(mask).flatten()
        order = torch.argsort(created[rows])
        rows = rows[order][: limit + 1].tolist()
        more = len(rows) > limit
        rows = rows[:limit]
        next_cursor = str(int(created[rows[-1]])) if more and rows else None
        return rows, next_cursor

    # ---- reads ---------------------------------------------------------------------------

    def list_spaces(self, msg):
        principal = self._principal(msg, "shared_read")
        cursor, limit = self.page_args(msg)
        rights = self.visible_spaces(principal, self.by_principal.get(principal))
        rows, next_cursor = self._page(self.tables.spaces, S.CREATED, rights != 0, cursor, limit)
        rights = rights.tolist()
        return 200, {"items": [self._space_view(r, rights[r]) for r in rows], "next_cursor": next_cursor}

    def get_space(self, msg):
        principal = self._principal(msg, "shared_read")
        prow = self.by_principal.get(principal)
        srow = self._space_row(self._args(msg).get("space"), principal, prow, Right.READ)
        return 200, self._space_view(srow, self.effective_rights(principal, prow, srow))

    def list_members(self, msg):
        principal = self._principal(msg, "shared_read")
        prow = self.by_principal.get(principal)
        srow = self._space_row(self._args(msg).get("space"), principal, prow, Right.READ)
        cursor, limit = self.page_args(msg)
        t = self.tables
        members = t.members
        mask = (members[:, M.STATE] == 1) & (members[:, M.SPACE] == srow)
        rows, next_cursor = self._page(members, M.CREATED, mask, cursor, limit)
        items = []
        if cursor is None:
            owner = t.value(t.spaces, srow, S.OWNER)
            items.append({"participant": self.participant_ids[owner][4],
                          "permissions": right_names(ALL_RIGHTS), "explicit": False})
        for mrow in rows:
            row = t.row(members, mrow)
            items.append({"participant": self.participant_ids[row[M.PARTICIPANT]][4],
                          "permissions": right_names(row[M.RIGHTS]), "explicit": True})
        return 200, {"items": items, "next_cursor": next_cursor}

    def list_conversations(self, msg):
        principal = self._principal(msg, "shared_read")
        prow = self.by_principal.get(principal)
        srow = self._space_row(self._args(msg).get("space"), principal, prow, Right.READ)
        cursor, limit = self.page_args(msg)
        conversations = self.tables.conversations
        mask = (conversations[:, C.STATE] == 1) & (conversations[:, C.SPACE] == srow)
        rows, next_cursor = self._page(conversations, C.CREATED, mask, cursor, limit)
        return 200, {"items": [self._conversation_view(r) for r in rows], "next_cursor": next_cursor}

    def get_conversation(self, msg):
        principal = self._principal(msg, "shared_read")
        crow = self._conversation_row(self._args(msg).get("conversation"), principal,
                                      self.by_principal.get(principal), Right.READ)
        return 200, self._conversation_view(crow)

    # ---- mutations: prepare validates and must not change state; apply cannot fail -------

    def _resource_key(self, args, key):
        value = args.get("id")
        if value is None:
            return key  # SPEC: an omitted resource ID uses the operation key
        if not isinstance(value, str) or not ids.HEX32.match(value):
            raise DeviceError(400, "bad_field", "id must be 32 lowercase hexadecimal digits")
        return bytes.fromhex(value)

    def _prepare_space(self, principal, prow, args, key, sequence):
        scope = SCOPES.get(args.get("scope", "private"))
        if scope is None:
            raise DeviceError(400, "bad_field", "scope must be private, room or instance")
        raw = self._resource_key(args, key)
        lineage = self.participant_ids[prow][1]
        if (lineage, raw) in self.by_space:
            raise DeviceError(409, "space_exists", f"space {ids.space_id(lineage, raw)} already exists")
        if not self.free_spaces:
            raise DeviceError(507, "space_capacity", f"the space table is full ({self.capacities['spaces']})")
        return {"id": raw, "scope": int(scope)}

    def _apply_space(self, a, prow, transfer_seq, rrow):
        srow = self.free_spaces.pop()
        id_hi, id_lo = split16(a.extra["id"])
        op_hi, op_lo = split16(a.op)
        self.tables.write_row(self.tables.spaces, srow, {
            S.STATE: 1, S.OWNER: prow, S.SCOPE: a.extra["scope"], S.ID_HI: id_hi, S.ID_LO: id_lo,
            S.CREATED: self.admissions, S.OP_HI: op_hi, S.OP_LO: op_lo})
        self.by_space[(self.participant_ids[prow][1], a.extra["id"])] = srow
        return srow

    def _prepare_member(self, principal, prow, args, key, sequence):
        srow = self._space_row(args.get("space"), principal, prow, Right.MANAGE)
        m = ids.PARTICIPANT_ID.match(args.get("participant", "")) if isinstance(args.get("participant"), str) else None
        member = self.by_participant.get(bytes.fromhex(m.group(1))) if m else None
        if member is None:
            raise DeviceError(404, "participant_not_found", f"no registered participant {args.get('participant')}")
        permissions = args.get("permissions")
        if not isinstance(permissions, list) or any(p not in RIGHT_NAMES for p in permissions) \
                or len(set(permissions)) != len(permissions):
            raise DeviceError(400, "bad_field", "permissions must be distinct values of read, write, manage")
        if member == self.tables.value(self.tables.spaces, srow, S.OWNER):
            raise DeviceError(409, "owner_rights_fixed", "the space owner always has read, write and manage")
        if (srow, member) not in self.member_rows and not self.free_members:
            raise DeviceError(507, "member_capacity", f"the member table is full ({self.capacities['members']})")
        space = ids.SPACE_ID.match(args["space"])
        return {"space": [bytes.fromhex(space.group(1)), bytes.fromhex(space.group(2))],
                "participant": self.participant_ids[member][2],
                "rights": sum(RIGHT_NAMES[p] for p in permissions)}

    def _apply_member(self, a, prow, transfer_seq, rrow):
        srow = self.by_space[tuple(a.extra["space"])]
        member = self.by_participant[a.extra["participant"]]
        t = self.tables
        mrow = self.member_rows.get((srow, member))
        if mrow is None:
            mrow = self.member_rows[(srow, member)] = self.free_members.pop()
            t.write_row(t.members, mrow, {M.STATE: 1, M.SPACE: srow, M.PARTICIPANT: member,
                                          M.CREATED: self.admissions})
        t.write_row(t.members, mrow, {M.RIGHTS: a.extra["rights"]})
        return srow

    def _prepare_conversation(self, principal, prow, args, key, sequence):
        self._space_row(args.get("space"), principal, prow, Right.WRITE)  # 404 / 403 before anything else
        raw = self._resource_key(args, key)
        lineage = self.participant_ids[prow][1]
        if (lineage, raw) in self.by_conversation:
            raise DeviceError(409, "conversation_exists", f"conversation {ids.conversation_id(lineage, raw)} "
                                                           "already exists")
        if not self.free_conversations:
            raise DeviceError(507, "conversation_capacity",
                              f"the conversation table is full ({self.capacities['conversations']})")
        space = ids.SPACE_ID.match(args["space"])
        return {"space": [bytes.fromhex(space.group(1)), bytes.fromhex(space.group(2))], "id": raw}

    def _apply_conversation(self, a, prow, transfer_seq, rrow):
        srow = self.by_space[tuple(a.extra["space"])]
        crow = self.free_conversations.pop()
        id_hi, id_lo = split16(a.extra["id"])
        op_hi, op_lo = split16(a.op)
        self.tables.write_row(self.tables.conversations, crow, {
            C.STATE: 1, C.SPACE: srow, C.CREATOR: prow, C.ID_HI: id_hi, C.ID_LO: id_lo,
            C.CREATED: self.admissions, C.OP_HI: op_hi, C.OP_LO: op_lo})
        self.by_conversation[(self.participant_ids[prow][1], a.extra["id"])] = crow
        return crow
