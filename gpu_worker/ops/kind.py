"""What an operation kind is: the small interface every mutation implements, and the kind codes
the journal records (docs/adding-an-operation-kind.md).

A kind's functions take the Device first. `check` validates a new operation against the current
state and changes nothing (a refusal is a ServiceError); what it returns is recorded in the
admission transfer (IDs, never rows, so replay re-resolves them). `apply` cannot fail: it changes
the tables live and at replay alike and returns the row of the operation's target. `target_id`
renders that target in the receipt, `visible_to` says whether another participant may read the
receipt, `columns` fills receipt columns of the kind's own, `saved` runs once a live admission is
saved (an input starts executing and its event is pushed), `memory` renders the memory objects it
wrote into its receipt.
"""
from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING, Any, Callable

from ..contract.commands import TYPES, Mutation
from ..contract.vocabulary import COMMANDS

if TYPE_CHECKING:
    from ..admission import Admission
    from ..contract.wire import Message
    from ..device import Device
    from ..storage.committer import Batch


class Kind(IntEnum):
    """Kind codes, recorded in admission transfers and receipt rows: part of the journal format."""
    PARTICIPANT_REGISTER = 1
    SPACE_CREATE = 2
    MEMBER_SET = 3
    CONVERSATION_CREATE = 4
    RETIREMENT = 5
    INPUT = 6
    CANCELLATION = 7
    SPACE_DELETE = 8
    CONVERSATION_DELETE = 9
    PUBLICATION = 10


# check(device, principal, participant row or None, the kind's arguments (its type in
# contract/commands.py, already checked there), operation key, sequence) -> admission extra
Check = Callable[["Device", bytes, "int | None", Any, bytes, int], dict[str, Any]]
# apply(device, admission, participant row, journal transfer seq (None at replay), receipt row) -> target row
Apply = Callable[["Device", "Admission", int, "int | None", int], int]
# target_id(device, receipt row values, the participant's lineage) -> the receipt's "target"
TargetId = Callable[["Device", list[int], bytes], str]
# visible_to(device, reader principal, reader participant row or None, receipt row values) -> bool
VisibleTo = Callable[["Device", bytes, "int | None", list[int]], bool]
# columns(device, admission) -> {receipt column: value}
Columns = Callable[["Device", "Admission"], dict[int, int]]
# memory(device, receipt row values, the participant's lineage) -> the receipt's "memory" (JSON text)
MemoryJson = Callable[["Device", list[int], bytes], str]
# saved(device, receipt row): the admission is saved (live only; replay finds it saved)
Saved = Callable[["Device", int], None]
# a read: read(device, principal bytes (None for ops commands), its arguments (the command's type
# in contract/commands.py)) -> (status, body)
Read = Callable[["Device", Any, Any], tuple[int, Any]]
# a command answered outside a tick's order: later(device, connection, message, the tick's batch)
# -> journal records used
Later = Callable[["Device", object, "Message", "Batch"], int]


def owner_only(device: Device, principal: bytes, reader: int | None, row: list[int]) -> bool:
    """The default: only the participant that made the operation reads its receipt."""
    return False


class OperationKind:
    __slots__ = ("code", "op", "name", "action", "args", "check", "apply", "target_id", "visible_to", "columns", "executes",
                 "saved", "memory")

    def __init__(self, code: Kind, op: str, *, check: Check, apply: Apply, target_id: TargetId,
                 visible_to: VisibleTo = owner_only, columns: Columns | None = None, executes: bool = False,
                 saved: Saved | None = None, memory: MemoryJson | None = None) -> None:
        command = COMMANDS[op]
        if command.receipt_kind is None or command.action is None:
            raise ValueError(f"{op} is not a mutation command of the contract")
        self.code = int(code)
        self.op = op
        self.name = command.receipt_kind     # the receipt's "kind"
        self.action = command.action         # the gateway action the principal needs
        args = TYPES[op]
        assert issubclass(args, Mutation), f"{op}'s arguments must carry the mutation envelope"
        self.args: type[Mutation] = args     # its arguments' declared type
        self.check = check
        self.apply = apply
        self.target_id = target_id
        self.visible_to = visible_to
        self.columns = columns
        # True: the operation runs after its admission (lease, engine, completion); every other
        # kind finishes at admission, and the transfer that saves the admission saves its result
        self.executes = executes
        self.saved = saved  # what follows once the admission is saved (start execution, push events)
        self.memory = memory  # the memory it wrote, for its receipt (None: "memory": null)

    def __repr__(self) -> str:
        return f"OperationKind({self.name})"
