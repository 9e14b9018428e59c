"""Ordinary Chat Completions at the device: temporary requests on the same KV pool as
conversation inputs, with no receipt and nothing journaled (SPEC: "Ordinary Chat Completions
keeps its separate, temporary request contract").

`chat.completions` answers later than its tick: token bytes stream back as frames with
`"more": true` (when asked to stream; raw bytes, so a character may be split between frames and
the gateway decodes them incrementally; with `logprobs` each frame also carries its tokens' OpenAI
logprobs entries) and the last frame carries the finish reason and token counts (and, not
streamed, every token's logprobs entry). A closed gateway connection cancels its chats and frees their pages.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from ..contract.errors import ServiceError
from ..contract.vocabulary import CHAT
from ..contract.wire import Message, dumps, reply
from ..engine.block_manager import pages_for
from ..engine.engine import MAX_TOP_LOGPROBS, TokenLogprobs
from . import quotas
from .inputs import model_card

from .kind import Read

if TYPE_CHECKING:
    from ..device import Device
    from ..storage.committer import Batch

ROLES = ("system", "user", "assistant")
PENALTIES = ("presence_penalty", "frequency_penalty")  # OpenAI's, on tokens already generated
FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


class Chats:
    """Numbers chat requests; each live chat is a subscription ("chat", number) whose frames are
    its tokens (loop/subscriptions.py)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    def next_id(self) -> tuple[str, int]:
        return ("chat", next(self._ids))


def start(d: Device, conn: object, msg: Message, batch: Batch) -> int:
    """Check a chat, tokenize its messages on a thread of their own (a long prompt must not stall
    the tick thread), then hand it to the engine. Refusals found here are answered in this tick;
    those that need the prompt's length, as soon as it is known. Journals nothing."""
    req_id = msg.get("id")
    try:
        principal = d.principal(msg, CHAT)
        if d.runner is None:
            raise ServiceError(503, "engine_unavailable", "this device runs no generation engine")
        args = d.args(msg)
        messages, prompt = args.get("messages"), args.get("prompt")
        if prompt is not None:  # /v1/completions: a plain prompt, tokenized as text
            if not isinstance(prompt, str) or not prompt or messages is not None:
                raise ServiceError(400, "invalid_prompt", "prompt must be a non-empty string (and no messages)")
            size = len(prompt)
        elif (not isinstance(messages, list) or not messages
                or any(not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str)
                       for m in messages)):
            raise ServiceError(400, "invalid_messages", "messages must be a non-empty list of {role, content}")
        else:
            size = sum(len(m["content"]) for m in messages)
        seed = args.get("seed")
        if seed is not None and (type(seed) is not int or not 0 <= seed < 1 << 63):
            raise ServiceError(400, "invalid_seed", "seed must be an integer 0..2^63-1")
        for name in PENALTIES:
            value = args.get(name, 0.0)
            if type(value) not in (int, float) or not -2 <= value <= 2:
                raise ServiceError(400, f"invalid_{name}", f"{name} must be a number in [-2, 2]")
        logprobs = args.get("logprobs")
        if logprobs is not None and (type(logprobs) is not int or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise ServiceError(400, "invalid_logprobs", f"logprobs must be an integer 0..{MAX_TOP_LOGPROBS}")
        model_card(d, args.get("model"))
        max_tokens = args.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ServiceError(400, "invalid_max_tokens", "max_tokens must be a positive integer")
        quotas.check(d, principal, d.state.participants.by_principal.get(principal), "chats")
        # a prompt that cannot fit is refused before it is tokenized (a 1 MB prompt took seconds)
        fewest = d.runner.engine.tokenizer.fewest_tokens(size)
        profile = d.runtime.runtime_profile
        capacity = profile["page_grant"] * profile["page_size"]
        if fewest is not None and fewest + (max_tokens or 1) - 1 > capacity:
            raise ServiceError(400, "context_length_exceeded",
                               f"the prompt holds at least {fewest} tokens; with max_tokens "
                               f"{max_tokens or 1} that exceeds the page grant of {capacity} tokens")
    except ServiceError as err:
        batch.replies.append((conn, reply(req_id, err.status, err.body())))
        return 0
    d.usage.chats_tokenizing[principal] += 1  # counted against its chats quota until it ends
    tokenizer = d.runner.engine.tokenizer
    d.off_thread(lambda: tokenizer.encode_text(prompt) if prompt is not None else tokenizer.encode_chat(messages),
                 lambda prompt, error: _submit(d, conn, req_id, principal, args, prompt, error))
    return 0


def _submit(d: Device, conn: Any, req_id: Any, principal: bytes, args: dict[str, Any], prompt: list[int] | None,
            error: BaseException | None) -> None:
    """On the tick thread, the prompt tokenized: refuse what does not fit, or start the chat."""
    d.usage.chat_prepared(principal)
    if getattr(conn, "closed", False) or d.runner is None:
        return  # its client went away meanwhile
    try:
        if error is not None or prompt is None:
            raise ServiceError(400, "invalid_messages", f"the messages could not be tokenized: {error}")
        profile = d.runtime.runtime_profile
        capacity = profile["page_grant"] * profile["page_size"]
        max_tokens = args.get("max_tokens")
        if max_tokens is None:
            max_tokens = min(profile["max_output_tokens"], capacity - len(prompt) + 1)
        if max_tokens < 1 or len(prompt) + max_tokens - 1 > capacity:
            raise ServiceError(400, "context_length_exceeded",
                               f"{len(prompt)} prompt tokens and max_tokens {max_tokens} exceed the page grant of "
                               f"{capacity} tokens")
        pages = pages_for(len(prompt) + max_tokens - 1, profile["page_size"])
        # with the page limits of its unfinished inputs, which share the pool
        quotas.check(d, principal, d.state.participants.by_principal.get(principal), "kv_pages", pages)
    except ServiceError as err:
        d.subscriptions.outbox.append((conn, reply(req_id, err.status, err.body())))
        return
    stop = args.get("stop") or []
    request_id = d.chats.next_id()
    sub = d.subscriptions.open(conn, req_id, request_id, principal,
                               {"stream": bool(args.get("stream")), "text": bytearray(), "tokens": 0,
                                "prompt_tokens": len(prompt), "pages": pages,
                                "logprobs": [] if args.get("logprobs") is not None else None})
    d.subscriptions.push(sub, b"", event="accepted")  # the gateway now waits for the whole completion
    d.runner.submit(request_id, prompt, max_new_tokens=max_tokens,
                    temperature=float(args.get("temperature", 1.0)), top_p=float(args.get("top_p", 1.0)),
                    stop=tuple(stop), page_limit=pages, tenant=principal, seed=args.get("seed"),
                    logprobs=args.get("logprobs"), **{name: float(args.get(name, 0.0)) for name in PENALTIES})


def token_logprobs(d: Device, token: int, details: TokenLogprobs) -> dict[str, Any]:
    """OpenAI's logprobs entry of one token: its text, log-probability, bytes and top alternatives."""
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        raw = d.runner.engine.tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}
    chosen, top = details
    return {**one(token, chosen), "top_logprobs": [one(t, lp) for t, lp in top]}


def event(d: Device, request_id: tuple[str, int], token: int | None, data: bytes, finish: str | None,
          details: TokenLogprobs | None = None) -> None:
    """One engine event of a chat: token bytes (streamed or collected) with their logprobs when asked
    for, or its end."""
    subs = d.subscriptions.of(request_id)
    if not subs:
        return  # its client went away
    sub = subs[0]
    chat = sub.data
    if token is not None:
        chat["tokens"] += 1
    entries = [token_logprobs(d, token, details)] if token is not None and details is not None else []
    if chat["stream"]:
        if data or entries:  # a token whose bytes are held (a possible stop string) still has its logprobs
            d.subscriptions.push(sub, data, **({"logprobs": entries} if entries else {}))
    else:
        chat["text"] += data
        if chat["logprobs"] is not None:
            chat["logprobs"] += entries
    if finish is None:
        return
    if finish.startswith("failed"):
        error = ServiceError(500, "generation_failed", f"generation failed ({finish})")
        d.subscriptions.end(sub, error.status, error.body())
        return
    body = {"finish_reason": FINISH.get(finish, "stop"), "prompt_tokens": chat["prompt_tokens"],
            "completion_tokens": chat["tokens"], "text": bytes(chat["text"]).decode("utf-8", "replace")}
    if chat["logprobs"] is not None and not chat["stream"]:
        body["logprobs"] = chat["logprobs"]
    d.subscriptions.end(sub, 200, dumps(body))


def connection_closed(d: Device, conn: object) -> None:
    """The gateway went away (its client disconnected): its chats stop and free their pages; its
    other subscriptions simply end (disconnect never cancels an operation)."""
    for sub in d.subscriptions.connection_closed(conn):
        if sub.topic[0] == "chat" and d.runner is not None:
            d.runner.cancel(sub.topic)


def list_models(d: Device, principal: bytes, args: dict[str, Any]) -> tuple[int, Any]:
    card = d.runtime.json("gen/card")
    models = [{"name": card["name"], "digest": d.model_digest, "kind": "generation"}]
    if d.embedder is not None:
        models.append({"name": d.embedder.card.name, "digest": d.runtime.model_digest("emb"), "kind": "embedding"})
    return 200, {"models": models}


READS: dict[str, Read] = {"models.list": list_models}
