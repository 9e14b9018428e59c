"""`embeddings` (the gateway's `POST /v1/embeddings`): texts through the packed embedding model,
the same forward memory rows and recall queries use (engine/embedding.py). A temporary request,
as a chat is: no receipt, nothing journaled.

The texts are embedded on a helper thread (their size is the caller's, never the tick's); while
that runs the request counts against its principal's `chats` quota. Texts longer than the model's
`max_seq_length` tokens (256 for all-MiniLM-L6-v2) are truncated there, as sentence-transformers
does; `prompt_tokens` counts the tokens embedded. The answer carries the vectors as base64 of
little-endian float32, texts in order (the gateway renders OpenAI's shape).
"""
from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..contract.chat import Embeddings
from ..contract.errors import ServiceError
from ..contract.vocabulary import CHAT
from ..contract.wire import Message, dumps, reply
from . import quotas
from .kind import Executing, Serving

if TYPE_CHECKING:
    from ..engine.embedding import EmbeddingModel
    from ..storage.committer import Batch

T = TypeVar("T")


def embedding_model(d: Executing) -> EmbeddingModel:
    """The device's embedding model: 503 `engine_unavailable` where it runs none (an embeddings
    request, a memory search, a correction need one)."""
    if d.embedder is None:
        raise ServiceError(503, "engine_unavailable", "this device runs no embedding model")
    return d.embedder


def start(d: Serving, conn: object, msg: Message, batch: Batch) -> int:
    req_id = msg.get("id")
    try:
        principal = d.principal(msg, CHAT)
        model = embedding_model(d)
        args = d.args(msg, Embeddings)
        name = model.card.name
        if args.model != name:
            raise ServiceError(404, "model_not_found", f"embedding model {args.model!r} is not served here; "
                                                       f"the embedding model is {name!r}")
        texts = args.input
        quotas.check(d, principal, d.state.participants.by_principal.get(principal), "chats")
    except ServiceError as err:
        batch.replies.append((conn, reply(req_id, err.status, err.body())))
        return 0
    embedder = d.embedder

    def work() -> dict[str, Any]:
        ids = embedder.tokenize(texts)
        vectors = embedder.encode_ids(ids).cpu().numpy().astype("<f4")
        return {"dim": embedder.dim, "prompt_tokens": sum(len(i) for i in ids),
                "vectors": base64.b64encode(vectors.tobytes()).decode()}

    def then(body: dict[str, Any] | None, error: BaseException | None) -> None:
        if error is not None or body is None:
            err = ServiceError(500, "embedding_failed", f"embedding failed: {error}")
            d.subscriptions.outbox.append((conn, reply(req_id, err.status, err.body())))
            return
        d.subscriptions.outbox.append((conn, reply(req_id, 200, dumps(body))))
    off_tick(d, conn, principal, work, then)
    return 0


def off_tick(d: Serving, conn: object, principal: bytes, work: Callable[[], T],
             then: Callable[[T | None, BaseException | None], None]) -> None:
    """An embedding's `work` on a helper thread, counted against its principal's `chats` quota
    until it is back; `then` on the tick thread, unless its client went away meanwhile (an
    embeddings request's, a memory search's)."""
    d.usage.chats_tokenizing[principal] += 1

    def back(result: T | None, error: BaseException | None) -> None:
        d.usage.chat_prepared(principal)
        if not getattr(conn, "closed", False):
            then(result, error)
    d.off_thread(work, back)
