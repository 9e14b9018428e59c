"""Mutations with work before their admission (a kind's `prepare`: a memory correction's
embedding). The tick thread only admits and commits, so work proportional to a command runs on a
helper thread first, and the command is admitted when it is back, ahead of the inbox, with what
the work made recorded in its admission transfer (extra["prepared"]): a replay needs no model.

Admission (`admit`) makes every check of the mutation's envelope first, in their documented
order, and answers an exact retry with its receipt without any work; a command that passes them
comes to `start`, on the tick thread: what its kind can refuse before the work (`prepare` runs the
kind's check) is answered at once; the work counts against the principal's `chats` quota while it
runs (kinds/embeddings.off_tick); the command then waits in the device's `prepared` queue, which
the next tick admits first (Tick.gather), every check made again there. The one such work today is
an embedding: a failed one answers 500 `embedding_failed` and admits nothing; a client that went
away meanwhile is not admitted for.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

from ..contract.errors import ServiceError
from ..contract.wire import Message, reply
from ..kinds import embeddings, quotas
from ..kinds.kind import Admitting, OperationKind, Publishing

if TYPE_CHECKING:
    from ..storage.committer import Batch

# a command whose work is done: (connection, its message, what the work made)
Prepared = tuple[object, Message, bytes]


class Preparing(Admitting, Publishing, Protocol):
    @property
    def prepared(self) -> deque[Prepared]: ...


def start(d: Preparing, conn: object, msg: Message, kind: OperationKind, batch: Batch) -> None:
    assert kind.prepare is not None
    req_id = msg.get("id")
    try:
        principal = d.principal(msg, kind.action)
        args = d.args(msg, kind.args)
        prow = d.state.participants.by_principal.get(principal)
        quotas.check(d, principal, prow, "chats")
        work = kind.prepare(d, principal, prow, args)
    except ServiceError as err:
        batch.replies.append((conn, reply(req_id, err.status, err.body())))
        return

    def back(value: bytes | None, error: BaseException | None) -> None:
        if error is not None or value is None:
            failed = ServiceError(500, "embedding_failed", f"the text could not be embedded: {error}")
            d.subscriptions.outbox.append((conn, reply(req_id, failed.status, failed.body())))
            return
        d.prepared.append((conn, msg, value))
    embeddings.off_tick(d, conn, principal, work, back)
