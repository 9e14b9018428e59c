"""The one registry of operation kinds and device commands. Admission, replay, receipt rendering
and visibility all read KINDS; the device's command dispatch reads MUTATIONS, READS and LATER.
An unknown kind or command is an error, never a fallback (tests/gpu_worker/ops/test_registry.py
checks the registry against the contract's command table).

To add a kind: one module in gpu_worker/ops/ with its OperationKind, one row below, its command in
gpu_worker/contract/vocabulary.py, its gateway route (docs/adding-an-operation-kind.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from . import (cancellations, chat, conversations, inputs, media, members, operations, participants, retirements,
               service, spaces)
from .kind import OperationKind

if TYPE_CHECKING:
    from ..contract.wire import Message
    from ..device import Device
    from ..storage.committer import Batch

# read(device, principal bytes (None for ops commands), args) -> (status, body)
Read = Callable[["Device", Any, dict[str, Any]], tuple[int, Any]]
# later(device, connection, message, the tick's batch) -> journal records used
Later = Callable[["Device", object, "Message", "Batch"], int]

_KINDS: tuple[OperationKind, ...] = (
    participants.REGISTER,
    spaces.CREATE,
    members.SET,
    conversations.CREATE,
    retirements.RECORD,
    inputs.SUBMIT,
    cancellations.RECORD,
)
KINDS: dict[int, OperationKind] = {k.code: k for k in _KINDS}   # by the code the journal records
MUTATIONS: dict[str, OperationKind] = {k.op: k for k in _KINDS}  # by device command

READS: dict[str, Read] = {
    **service.READS,
    **participants.READS,
    **spaces.READS,
    **members.READS,
    **conversations.READS,
    **operations.READS,
    **chat.READS,
}

# Commands answered outside the read/mutation order of a tick.
LATER: dict[str, Later] = {
    "checkpoint": service.defer_checkpoint,
    "chat.completions": chat.start,
    "media.put": media.put,
}
