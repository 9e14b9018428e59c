"""`memory.search` (`GET /spaces/{space}/memory/search?q=...&limit=N`): the rows of a space's
memory most similar to a query, with their cosine similarity, best first.

It is recall as an input's prompt sees it, asked by a reader: the same embedding of the text (the
packed embedding model), the same rows (the space's memory owner: a private space's own, a room's,
or the instance's) and the same visibility (the owners whose memory the caller may read now,
grants intersected with membership, zero-rights fences included), without recall's floor and
margin (a search shows the scores and lets the caller judge). The query is embedded on a helper
thread (its cost is the caller's, never the tick's) and counts against the principal's `chats`
quota meanwhile, as an embeddings request does; the caller's rights are asked again when the
vector is back, so a right lost meanwhile is not searched with.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..contract.commands import MemorySearch
from ..contract.errors import ServiceError
from ..contract.vocabulary import READ
from ..contract.wire import Message, dumps, reply
from ..kinds import access, embeddings, quotas
from ..kinds.kind import Serving
from ..state.tables import Right
from .shared import nearest, readable_owners, row_json

if TYPE_CHECKING:
    from ..storage.committer import Batch


def start(d: Serving, conn: object, msg: Message, batch: Batch) -> int:
    """Check the caller and its read right on the space (404 / 403 now), then embed the query
    off the tick thread; `_answer` searches on the tick thread when the vector is back."""
    req_id = msg.get("id")
    try:
        principal = d.principal(msg, READ)
        embeddings.embedding_model(d)
        args = d.args(msg, MemorySearch)
        prow = d.state.participants.by_principal.get(principal)
        access.space_row(d, args.space, principal, prow, Right.READ)
        quotas.check(d, principal, prow, "chats")
    except ServiceError as err:
        batch.replies.append((conn, reply(req_id, err.status, err.body())))
        return 0
    embedder = d.embedder
    embeddings.off_tick(d, conn, principal, lambda: embedder.encode([args.q])[0],
                        lambda vector, error: _answer(d, conn, req_id, principal, args, vector, error))
    return 0


def _answer(d: Serving, conn: object, req_id: int | None, principal: bytes, args: MemorySearch,
            vector: torch.Tensor | None, error: BaseException | None) -> None:
    try:
        if error is not None or vector is None:
            raise ServiceError(500, "embedding_failed", f"the query could not be embedded: {error}")
        prow = d.state.participants.by_principal.get(principal)
        srow = access.space_row(d, args.space, principal, prow, Right.READ)  # its rights now
        items = [{"memory": row_json(d, slot), "score": round(score, 6)}
                 for score, slot in nearest(d, srow, vector, readable_owners(d, principal, prow), args.limit)]
    except ServiceError as err:
        d.subscriptions.outbox.append((conn, reply(req_id, err.status, err.body())))
        return
    d.subscriptions.outbox.append((conn, reply(req_id, 200, dumps({"items": items}))))

