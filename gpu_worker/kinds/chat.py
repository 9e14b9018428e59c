"""Ordinary Chat Completions at the device: temporary requests on the same KV pool as
conversation inputs, with no receipt and nothing journaled (SPEC: "Ordinary Chat Completions
keeps its separate, temporary request contract").

`chat.completions` answers later than its tick: token bytes stream back as frames with
`"more": true` (when asked to stream; raw bytes, so a character may be split between frames and
the gateway decodes them incrementally; with `logprobs` each frame also carries its tokens' OpenAI
logprobs entries) and the last frame carries the finish reason and token counts (and, not
streamed, every token's logprobs entry). A closed gateway connection cancels its chats and frees their pages.

Structured outputs and function calling: `response_format` (a JSON schema, or any JSON object)
and `tools` hold the answer to a grammar (engine/grammar.py), compiled on the helper thread that
tokenizes the prompt (its cost grows with the schema; compiled grammars are kept by digest). A
schema or tool the grammar library cannot enforce is a 400 naming what. The tools are written into
the prompt by the template where it renders them, else as contract/tool_calls.py renders them;
the answer's calls are read back by the gateway.

Images (OpenAI `image_url` parts, decoded by the gateway): `images` holds their bytes, one per
`{"type": "image"}` part of the messages. A model whose card does not declare `image` refuses them
(400 `model_lacks_media`); on the tick thread each is only header-checked (images.check_file, as an
input's images at admission) and charged `image_token_budget` tokens; decoding, the vision tower and
the prompt's tokenization run on a helper thread, and the engine gets the prompt with `images=`.
"""
from __future__ import annotations

import io
import time
from typing import TYPE_CHECKING, Any

from ..contract.chat import PENALTIES, Chat as ChatArgs
from ..contract.commands import NoArgs
from ..contract.errors import ServiceError
from ..contract.vocabulary import CHAT
from ..contract.wire import Message, dumps, reply
from ..contract import structured, tool_calls
from ..engine.block_manager import pages_for
from ..engine.engine import TokenLogprobs
from ..engine.grammar import Grammar, GrammarError, schema_grammar, tool_grammar
from ..engine.vision import MediaError, PreparedImage
from . import quotas

from .kind import Chatting, Executing, Publishing, Read, Rendering, Reporting, Streaming

if TYPE_CHECKING:
    from ..pipeline.prompt import ControlTokens
    from ..storage.committer import Batch

FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}



def start(d: Chatting, conn: object, msg: Message, batch: Batch) -> int:
    """Check a chat, tokenize its messages on a thread of their own (a long prompt must not stall
    the tick thread), then hand it to the engine. Refusals found here are answered in this tick;
    those that need the prompt's length, as soon as it is known. Journals nothing."""
    req_id: int = msg["id"]  # (a request of the socket: wire.decode_request)
    try:
        principal = d.principal(msg, CHAT)
        if d.runner is None:
            raise ServiceError(503, "engine_unavailable", "this device runs no generation engine")
        args = d.args(msg, ChatArgs)  # every check that needs no state is made there
        messages, prompt = args.messages, args.prompt
        if prompt is not None:  # /v1/completions: a plain prompt, tokenized as text
            size = len(prompt)
        else:
            assert messages is not None
            size = sum(len(text) for m in messages for text in _texts(m["content"]))
        images = args.images or []
        card = model_card(d, args.model)
        image_tokens = 0
        if images:
            from ..pipeline.images import check_file  # pipeline/images.py imports kinds (its media reads)

            capabilities = card.get("capabilities") or {}
            if "image" not in capabilities.get("media_types", []) or getattr(d.runner.engine, "vision", None) is None:
                raise ServiceError(400, "model_lacks_media", f"model {card['name']!r} does not take images")
            for i, data in enumerate(images):  # the header and tail only (images.py): nothing decoded here
                check_file(io.BytesIO(data), f"image {i + 1}")
            image_tokens = int(capabilities["image_token_budget"]) * len(images)
        max_tokens = args.max_tokens
        quotas.check(d, principal, d.state.participants.by_principal.get(principal), "chats")
        # a prompt that cannot fit is refused before it is tokenized (a 1 MB prompt took seconds)
        fewest = d.runner.engine.tokenizer.fewest_tokens(size)
        if image_tokens:  # each image charged its budget, as an input's images are (images.check)
            fewest = (fewest or 0) + image_tokens
        profile = d.runtime.runtime_profile
        capacity = profile["page_grant"] * profile["page_size"]
        if fewest is not None and fewest + (max_tokens or 1) - 1 > capacity:
            raise ServiceError(400, "context_length_exceeded",
                               f"the prompt holds at least {fewest} tokens{' with its images' if images else ''}; "
                               f"with max_tokens "
                               f"{max_tokens or 1} that exceeds the page grant of {capacity} tokens")
    except ServiceError as err:
        batch.replies.append((conn, reply(req_id, err.status, err.body())))
        return 0
    d.usage.chats_tokenizing[principal] += 1  # counted against its chats quota until it ends
    engine = d.runner.engine
    control = d.control_tokens
    d.off_thread(lambda: _prompt(engine, args, images, control),
                 lambda result, error: _submit(d, conn, req_id, principal, args, result, error))
    return 0


def _texts(content: str | list[dict[str, Any]]) -> list[str]:
    return [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]


Prepared = tuple[list[int], list[PreparedImage], Grammar | None]


def _prompt(engine: Any, args: ChatArgs, images: list[bytes], control: ControlTokens) -> Prepared:
    """On a helper thread: the text checked for the model's control tokens (400 `reserved_token`,
    as for an input's text: proportional to the messages, so here and not on the tick thread), the
    answer's grammar compiled, the images decoded, preprocessed and encoded, and the prompt tokenized."""
    prompt, messages = args.prompt, args.messages or []
    texts = [prompt] if prompt is not None else [t for m in messages for t in _texts(m["content"])]
    texts += [c["name"] + c["arguments"] for m in messages for c in m.get("tool_calls", ())]
    if args.tools:
        texts.append(dumps(args.tools).decode())
    for text in texts:
        token = control.find(text)
        if token is not None:
            raise ServiceError(400, "reserved_token", f"a message contains the model's control token {token}")
    grammar = _grammar(engine, args)
    tokenizer = engine.tokenizer
    if prompt is not None:
        return tokenizer.encode_text(prompt), [], grammar
    tools = args.tools if args.tools and args.tool_choice != "none" else None
    if tokenizer.renders_tools:
        messages, template_tools = tool_calls.template_messages(messages), tools
    else:
        messages, template_tools = tool_calls.render(messages, tools), None
    if template_tools:
        template_tools = [{"type": "function", "function": t} for t in template_tools]
    prepared = [engine.vision.prepare(data) for data in images]
    if not prepared:
        return tokenizer.encode_chat(messages, tools=template_tools), [], grammar
    return tokenizer.encode_chat(messages, images=[image.prompt for image in prepared],
                                 tools=template_tools), prepared, grammar


def _grammar(engine: Any, args: ChatArgs) -> Grammar | None:
    """The compiled grammar its answer is held to (None: free text)."""
    schema = structured.schema_of(args.response_format)
    tools = args.tools if args.tool_choice != "none" else None
    try:
        if tools:
            return engine.grammars.compile(tool_grammar(tools, args.tool_choice or "auto", args.parallel_tool_calls,
                                                        schema))
        if schema is not None:
            return engine.grammars.compile(schema_grammar(schema))
    except GrammarError as err:
        code, what = ("invalid_tools", "the tools' parameters") if tools else (
            "invalid_response_format", "response_format's schema")
        raise ServiceError(400, code, f"{what} cannot be enforced: {err}") from None
    return None


def _submit(d: Chatting, conn: object, req_id: int, principal: bytes, args: ChatArgs,
            result: Prepared | None, error: BaseException | None) -> None:
    """On the tick thread, the prompt tokenized: refuse what does not fit, or start the chat."""
    d.usage.chat_prepared(principal)
    if getattr(conn, "closed", False) or d.runner is None:
        return  # its client went away meanwhile
    prompt, images, grammar = result if result is not None else (None, [], None)
    try:
        if isinstance(error, ServiceError):  # (a control token in the messages)
            raise error
        if isinstance(error, MediaError):  # damage inside the data, past the header checks
            raise ServiceError(error.status, error.code, f"an image could not be decoded: {error}")
        if error is not None or prompt is None:
            raise ServiceError(400, "invalid_messages", f"the messages could not be tokenized: {error}")
        profile = d.runtime.runtime_profile
        capacity = profile["page_grant"] * profile["page_size"]
        max_tokens = args.max_tokens
        if max_tokens is None:
            max_tokens = min(profile["max_output_tokens"], capacity - len(prompt) + 1)
        if max_tokens < 1 or len(prompt) + max_tokens - 1 > capacity:
            raise ServiceError(400, "context_length_exceeded",
                               f"{len(prompt)} prompt tokens and max_tokens {max_tokens} exceed the page grant of "
                               f"{capacity} tokens")
        pages = pages_for(len(prompt) + max_tokens - 1, profile["page_size"])
        n = args.n
        # with the page limits of its unfinished inputs, which share the pool; each choice reserves its own
        quotas.check(d, principal, d.state.participants.by_principal.get(principal), "kv_pages", pages * n)
    except ServiceError as err:
        d.subscriptions.outbox.append((conn, reply(req_id, err.status, err.body())))
        return
    seed = args.seed
    settings = {"max_new_tokens": max_tokens, "temperature": float(args.temperature),
                "top_p": float(args.top_p), "stop": tuple(args.stop or []), "page_limit": pages,
                "tenant": principal, "logprobs": args.logprobs,
                **{name: float(getattr(args, name)) for name in PENALTIES}}
    if grammar is not None:
        settings["grammar"] = grammar  # each choice gets a matcher of its own
    if images:
        settings["images"] = images  # each choice's prompt holds them (the prefix cache shares equal images' pages)
    topic = d.chats.next_id()
    choices: list[dict[str, Any]] = [{"text": bytearray(), "tokens": 0, "finish": None,
                "logprobs": [] if args.logprobs is not None else None} for _ in range(n)]
    # its execution deadline, as an input's (SPEC: a request past it returns 504): from now, the
    # runtime profile's deadline_ms (`check_deadlines` ends it)
    deadline_ns = time.time_ns() + int(profile["deadline_ms"]) * 1_000_000
    sub = d.subscriptions.open(conn, req_id, topic, principal,
                               {"stream": args.stream, "prompt_tokens": len(prompt), "pages": pages * n,
                                "choices": choices, "later": (prompt, settings, seed) if n > 1 else None,
                                "deadline_ns": deadline_ns})
    d.subscriptions.push(sub, b"", event="accepted")  # the gateway now waits for the whole completion
    d.runner.submit((*topic, 0), prompt, seed=seed, **settings)


def _submit_later_choices(d: Executing, topic: tuple[str, int], chat: dict[str, Any]) -> None:
    """Choices 1..n-1 start once the first has prefilled the prompt: its full pages are in the
    prefix cache by then (engine.py registers them after prefill), so the others reuse them
    instead of prefilling the prompt again. A seeded request's choice i samples with seed + i."""
    prompt, settings, seed = chat["later"]
    chat["later"] = None
    if d.runner is None:
        return
    for i in range(1, len(chat["choices"])):
        d.runner.submit((*topic, i), prompt, seed=None if seed is None else (seed + i) % (1 << 63), **settings)


def cancel(d: Executing, topic: tuple[str, int], choices: int) -> None:
    """Stop every choice of a chat on the engine (a choice not started yet is unknown there: a no-op)."""
    if d.runner is not None:
        for i in range(choices):
            d.runner.cancel((*topic, i))


def token_logprobs(d: Executing, token: int, details: TokenLogprobs) -> dict[str, Any]:
    """OpenAI's logprobs entry of one token: its text, log-probability, bytes and top alternatives."""
    assert d.runner is not None  # its tokens came from the engine
    tokenizer = d.runner.engine.tokenizer

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        raw = tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}
    chosen, top = details
    return {**one(token, chosen), "top_logprobs": [one(t, lp) for t, lp in top]}


def event(d: Streaming, request_id: tuple[str, int, int], token: int | None, data: bytes, finish: str | None,
          details: TokenLogprobs | None = None) -> None:
    """One engine event of a chat's choice: token bytes (streamed or collected) with their logprobs
    when asked for, or its end; the chat ends when all its choices have."""
    topic, index = (request_id[0], request_id[1]), request_id[2]
    if token is not None:
        d.chats.output_tokens += 1
    subs = d.subscriptions.of(topic)
    if not subs:
        return  # its client went away
    sub = subs[0]
    chat = sub.data
    choice = chat["choices"][index]
    if token is not None:
        choice["tokens"] += 1
        if index == 0 and chat["later"] is not None:
            _submit_later_choices(d, topic, chat)
    entries = [token_logprobs(d, token, details)] if token is not None and details is not None else []
    if chat["stream"]:
        if data or entries:  # a token whose bytes are held (a possible stop string) still has its logprobs
            d.subscriptions.push(sub, data, index=index, logprobs=entries or None)  # (index 0 is left out)
    else:
        choice["text"] += data
        if choice["logprobs"] is not None:
            choice["logprobs"] += entries
    if finish is None:
        return
    if finish.startswith("failed"):
        error = ServiceError(500, "generation_failed", f"generation failed ({finish})")
        d.subscriptions.end(sub, error.status, error.body())
        cancel(d, topic, len(chat["choices"]))
        return
    choice["finish"] = FINISH.get(finish, "stop")
    if any(c["finish"] is None for c in chat["choices"]):
        return
    rendered = []
    for i, c in enumerate(chat["choices"]):
        one: dict[str, Any] = {"index": i, "finish_reason": c["finish"],
                               "text": bytes(c["text"]).decode("utf-8", "replace")}
        if c["logprobs"] is not None and not chat["stream"]:
            one["logprobs"] = c["logprobs"]
        rendered.append(one)
    first = rendered[0]
    body = {"finish_reason": first["finish_reason"], "prompt_tokens": chat["prompt_tokens"],
            "completion_tokens": sum(c["tokens"] for c in chat["choices"]), "text": first["text"],
            **({"logprobs": first["logprobs"]} if "logprobs" in first else {})}
    if len(rendered) > 1:
        body["choices"] = rendered
    d.subscriptions.end(sub, 200, dumps(body))


def check_deadlines(d: Streaming) -> None:
    """Chats past their execution deadline stop on the engine (their pages freed) and end 504
    `deadline_exceeded`, as an input's result read answers (between ticks: Device.idle)."""
    now = time.time_ns()
    for sub in [s for s in d.subscriptions.all() if s.topic[0] == "chat" and s.data.get("deadline_ns", now) < now]:
        cancel(d, sub.topic, len(sub.data["choices"]))
        error = ServiceError(504, "deadline_exceeded", "the completion exceeded its execution deadline (the runtime "
                                                       "profile's deadline_ms): it was stopped")
        d.subscriptions.end(sub, error.status, error.body())


def running(d: Publishing) -> int:
    """The chats under way (each is one subscription until its last frame)."""
    return sum(1 for sub in d.subscriptions.all() if sub.topic[0] == "chat")


def connection_closed(d: Streaming, conn: object) -> None:
    """The gateway went away (its client disconnected): its chats stop and free their pages; its
    other subscriptions simply end (disconnect never cancels an operation)."""
    for sub in d.subscriptions.connection_closed(conn):
        if sub.topic[0] == "chat":
            cancel(d, sub.topic, len(sub.data["choices"]))


def model_card(d: Reporting, name: object) -> dict[str, Any]:
    """The card of a served generation model, by name or digest (409 for any other)."""
    card: dict[str, Any] = d.runtime.json("gen/card")
    if name in (card["name"], d.model_digest):
        return card
    raise ServiceError(409, "model_not_available", f"model {name!r} is not served here; see /capabilities for the models")


def list_models(d: Rendering, principal: bytes, args: NoArgs) -> tuple[int, object]:
    card = d.runtime.json("gen/card")
    models = [{"name": card["name"], "digest": d.model_digest, "kind": "generation"}]
    if d.embedder is not None:
        models.append({"name": d.embedder.card.name, "digest": d.runtime.model_digest("emb"), "kind": "embedding"})
    return 200, {"models": models}


READS: dict[str, Read] = {"models.list": list_models}
