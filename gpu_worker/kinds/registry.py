"""The one registry of operation kinds and device commands. Admission, replay, receipt rendering
and visibility all read KINDS; the device's command dispatch reads MUTATIONS, READS and LATER.
An unknown kind or command is an error, never a fallback (tests/gpu_worker/kinds/test_registry.py
checks the registry against the contract's command table).

To add a kind: one module in gpu_worker/kinds/ with its OperationKind, one row below, its command in
gpu_worker/contract/vocabulary.py, its gateway route (docs/adding-an-operation-kind.md).
"""
from __future__ import annotations

from ..memory import ops as memory_ops, search, shared as memory
from . import (cancellations, chat, conversations, deletions, embeddings, events, inputs, media, members,
               forks, memory_deletions, memory_versions, operations, participants, publications, retirements, service, spaces)
from .kind import Later, OperationKind, Read

_KINDS: tuple[OperationKind, ...] = (
    participants.REGISTER,
    spaces.CREATE,
    members.SET,
    conversations.CREATE,
    retirements.RECORD,
    inputs.SUBMIT,
    cancellations.RECORD,
    deletions.DELETE_SPACE,
    deletions.DELETE_CONVERSATION,
    publications.RECORD,
    memory_versions.RECORD,
    memory_deletions.DELETE,
    forks.FORK,
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
    **operations.OPS_READS,
    **events.READS,
    **chat.READS,
    **memory.READS,
    **memory_ops.READS,
}

# Commands answered outside the read/mutation order of a tick (a subscription's frames come later).
LATER: dict[str, Later] = {
    "checkpoint": service.defer_checkpoint,
    "audit.export": service.audit_export,
    "chat.completions": chat.start,
    "embeddings": embeddings.start,
    "memory.search": search.start,
    "media.put": media.put,
    "conversations.subscribe": events.open_conversation,
    "operations.subscribe": events.open_operation,
    "subscriptions.close": events.close,
    **memory_ops.LATER,
}
