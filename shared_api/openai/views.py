"""OpenAI-compatible routes: `POST /v1/chat/completions` and `POST /v1/completions` (plain and
SSE stream), `POST /v1/embeddings` and `GET /v1/models`. Same bearer tokens; the principal needs
the `chat` action. Temporary requests: no receipts, nothing journaled; pages come from the same KV
pool as conversation inputs, embeddings from the same forward as memory.

Every request field OpenAI defines is honoured or refused by name (`FIELDS`): a refused one (or
an unknown one) is a 400 `invalid_request_error` whose `param` names it, never silently ignored.
Errors use OpenAI's shape ({"error": {"message", "type", "param", "code"}}), which keeps the
`code` and `message` of the one error body; an unknown model is 404 `model_not_found`.
"""
from __future__ import annotations

import asyncio
import base64
import codecs
import json
import re
import secrets
import struct
import time
from typing import Any, AsyncIterator, Callable, Iterable, Mapping

from django.conf import settings
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse

from gpu_worker.contract import tool_calls
from gpu_worker.contract.chat import Chat
from gpu_worker.contract.commands import typed
from gpu_worker.contract.limits import MAX_COMPLETION_LOGPROBS, MAX_MEDIA, MAX_TOP_LOGPROBS
from gpu_worker.contract.wire import Reply

from ..device_client import mux
from ..errors import WWW_AUTHENTICATE, ServiceError
from .fields import CallStream, call_object, structured_args, tool_fields, utf8_text

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
               409: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
               429: "rate_limit_error",
               503: "server_error", 500: "server_error"}
# the request field a refusal code is about (its `param`)
PARAMS = {"invalid_model": "model", "model_not_found": "model", "invalid_messages": "messages",
          "context_length_exceeded": "messages", "invalid_max_tokens": "max_tokens",
          "invalid_temperature": "temperature", "invalid_top_p": "top_p", "invalid_stop": "stop",
          "invalid_stream_options": "stream_options", "invalid_n": "n", "invalid_seed": "seed",
          "invalid_prompt": "prompt", "invalid_input": "input", "invalid_encoding_format": "encoding_format",
          "invalid_dimensions": "dimensions",
          "invalid_presence_penalty": "presence_penalty", "invalid_frequency_penalty": "frequency_penalty",
          "invalid_logprobs": "logprobs", "invalid_top_logprobs": "top_logprobs",
          "invalid_response_format": "response_format", "invalid_tools": "tools",
          "invalid_tool_choice": "tool_choice", "invalid_parallel_tool_calls": "parallel_tool_calls",
          # an image part of a message (the device's image refusals too)
          "invalid_image_url": "messages", "invalid_image_data": "messages", "model_lacks_media": "messages",
          "media_not_image": "messages", "media_truncated": "messages", "media_too_many_pixels": "messages"}
# Chat Completions request fields: honoured, or what is refused. A field OpenAI defines but this
# service does not implement is refused unless it holds its no-op value (the value listed).
HONOURED = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "stream",
            "stream_options", "n", "seed", "user", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs",
            "response_format", "tools", "tool_choice", "parallel_tool_calls"}
NO_OP: dict[str, tuple[object, ...]] = {"logit_bias": ({}, None),
         "store": (False, None), "functions": ([], None),  # (the deprecated forms of tools and tool_choice)
         "function_call": ("none", None), "modalities": (["text"], None),
         "audio": (None,), "prediction": (None,), "metadata": ({}, None), "service_tier": ("auto", "default", None),
         "reasoning_effort": (None,), "web_search_options": (None,)}
COMPLETION_HONOURED = {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "stream", "stream_options",
                       "n", "seed", "user", "presence_penalty", "frequency_penalty", "logprobs"}
COMPLETION_NO_OP: dict[str, tuple[object, ...]] = {"echo": (False, None), "best_of": (1, None),
                                                "suffix": (None, ""), "logit_bias": ({}, None)}




class RequestRefused(ServiceError):
    """A refusal about one request field (its OpenAI `param`)."""

    def __init__(self, param: str, message: str, code: str = "unsupported_parameter") -> None:
        super().__init__(400, code, message)
        self.param = param


def openai_error(status: int, code: str, message: str, param: str | None = None) -> HttpResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param or PARAMS.get(code), "code": code}}
    response = HttpResponse(json.dumps(body), status=status, content_type="application/json")
    if status == 401:
        response["WWW-Authenticate"] = WWW_AUTHENTICATE
    return response


# the front (shared_api/http/front.py) authenticates the request and checks its `chat` action from
# the headers, before it reads the body, and leaves the principal here: these views run only there
PRINCIPAL = "aotx_principal"


def _principal(request: HttpRequest) -> str:
    principal: str = getattr(request, PRINCIPAL)
    return principal


IMAGE_URL = re.compile(r"data:(image/[A-Za-z0-9.+-]+)(?:;[A-Za-z0-9=.+-]+)*;base64,", re.ASCII)


def _image(part: dict[str, Any]) -> bytes:
    """The bytes of an `image_url` part: a base64 `data:image/...;base64,` URL (never fetched
    otherwise); the body limit (MAX_CHAT_BODY_BYTES) bounds them. Whether they are an image a
    model takes is the device's check."""
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise ServiceError(400, "invalid_messages", "an image_url part needs image_url.url")
    if isinstance(image_url, dict) and (set(image_url) - {"url", "detail"} or
                                        image_url.get("detail", "auto") not in ("auto", None)):
        raise ServiceError(400, "invalid_messages", "image_url holds only url (and detail \"auto\")")
    match = IMAGE_URL.match(url)
    if match is None:
        raise ServiceError(400, "invalid_image_url", "an image_url must be a base64 data URL "
                                                     "(data:image/<type>;base64,...); this service fetches no URL")
    try:
        return base64.b64decode(url[match.end():], validate=True)
    except ValueError:
        raise ServiceError(400, "invalid_image_data", "the image_url's base64 data is malformed") from None


def _message(message: dict[str, Any], images: list[bytes]) -> dict[str, object]:
    """The device's message: its content a string, or (with images) text and `{"type": "image"}`
    parts in order, each image's bytes appended to `images` (docs/protocol.md, chat.completions);
    an assistant's calls and a tool result's call id as fields.tool_fields gives them."""
    extra = tool_fields(message)
    if "tool_calls" in extra and message.get("content") is None:
        message = {**message, "content": ""}
    return {**_content(message, images), **extra}


def _content(message: dict[str, Any], images: list[bytes]) -> dict[str, object]:
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...} | {"type": "image_url", ...}, ...]
        parts: list[dict[str, str]] = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append({"type": "text", "text": utf8_text(p["text"], "invalid_messages", "message content")})
            elif isinstance(p, dict) and p.get("type") == "image_url":
                images.append(_image(p))
                if len(images) > MAX_MEDIA:
                    raise ServiceError(400, "invalid_messages", f"the messages hold more than {MAX_MEDIA} images")
                parts.append({"type": "image"})
            else:
                raise ServiceError(400, "invalid_messages", "content parts are text or image_url")
        if all(p["type"] == "text" for p in parts):
            content = "".join(p["text"] for p in parts)
        else:
            return {"role": message.get("role"), "content": parts}
    if not isinstance(content, str):
        raise ServiceError(400, "invalid_messages", "message content must be a string or content parts")
    return {"role": message.get("role"), "content": utf8_text(content, "invalid_messages", "message content")}


def _fields(body: Mapping[str, object], honoured: set[str], no_op: dict[str, tuple[object, ...]]) -> None:
    """Refuse (400, naming it) a field this route does not implement with a value that would
    change the answer, and any field OpenAI does not define."""
    for name in sorted(body):
        if name in honoured:
            continue
        if name not in no_op:
            raise RequestRefused(name, f"Unrecognized request argument supplied: {name}", "unknown_parameter")
        if body[name] not in no_op[name]:
            raise RequestRefused(name, f"{name} is not supported by this service "
                                       f"(accepted only as {', '.join(json.dumps(v) for v in no_op[name])})")


def _model(body: Mapping[str, object]) -> str:
    model = body.get("model")
    if not isinstance(model, str):
        raise ServiceError(400, "invalid_model", "model is required")
    return utf8_text(model, "invalid_model", "model")


def _request_args(body: object) -> dict[str, object]:
    if not isinstance(body, dict):
        raise ServiceError(400, "invalid_json", "the body must be a JSON object")
    _fields(body, HONOURED, NO_OP)
    model, messages = _model(body), body.get("messages")
    if not isinstance(messages, list) or not messages or any(not isinstance(m, dict) for m in messages):
        raise ServiceError(400, "invalid_messages", "messages must be a non-empty array of objects")
    images: list[bytes] = []
    args: dict[str, object] = {"model": model, "messages": [_message(m, images) for m in messages]}
    if images:
        args["images"] = images
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and type(logprobs) is not bool:
        raise ServiceError(400, "invalid_logprobs", "logprobs must be a boolean")
    if top is not None:
        if type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ServiceError(400, "invalid_top_logprobs", f"top_logprobs must be an integer 0..{MAX_TOP_LOGPROBS}")
        if not logprobs:
            raise ServiceError(400, "invalid_top_logprobs", "top_logprobs requires logprobs: true")
    if logprobs:
        args["logprobs"] = top or 0
    return {**args, **structured_args(body), **_sampling(body)}


def _sampling(body: Mapping[str, object]) -> dict[str, object]:
    """The generation options both completion routes share, in the device's words (their values
    are checked by the command's declared type, gpu_worker/contract/commands.Chat): OpenAI's
    aliases and forms (max_completion_tokens, a stop string) become the device's."""
    stream = body.get("stream")
    args: dict[str, object] = {"stream": False if stream is None else stream}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        args["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        args["stop"] = [utf8_text(s, "invalid_stop", "stop") if isinstance(s, str) else s for s in stop] \
            if isinstance(stop, list) else stop
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ServiceError(400, "invalid_stream_options", "stream_options must be an object")
    for name in ("temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            args[name] = body[name]
    return args


def _completion_args(body: object) -> dict[str, object]:
    """/v1/completions: one plain prompt (a string, or an array holding one)."""
    if not isinstance(body, dict):
        raise ServiceError(400, "invalid_json", "the body must be a JSON object")
    _fields(body, COMPLETION_HONOURED, COMPLETION_NO_OP)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ServiceError(400, "invalid_prompt", "prompt must be a non-empty string (token arrays and several "
                                                  "prompts are not supported)")
    logprobs = body.get("logprobs")
    if logprobs is not None and (type(logprobs) is not int or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS):
        raise ServiceError(400, "invalid_logprobs", f"logprobs must be an integer 0..{MAX_COMPLETION_LOGPROBS}")
    # OpenAI's default for this route is 16 tokens
    return {"model": _model(body), "prompt": utf8_text(prompt, "invalid_prompt", "prompt"),
            **({"logprobs": logprobs} if logprobs is not None else {}), **_sampling({"max_tokens": 16, **body})}


def _usage(result: dict[str, Any]) -> dict[str, int]:
    return {"prompt_tokens": result["prompt_tokens"], "completion_tokens": result["completion_tokens"],
            "total_tokens": result["prompt_tokens"] + result["completion_tokens"]}


class Shape:
    """How a completion route renders its answer: chat (messages) or text (a plain prompt)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.prefix = "chatcmpl-" if chat else "cmpl-"
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def logprobs(self, entries: list[dict[str, Any]] | None, offset: int = 0) -> dict[str, object] | None:
        """OpenAI's logprobs object of a choice or chunk from the device's token entries: chat's
        {"content": [...]}, or the completions route's parallel lists (`offset`: the text's length
        before these tokens, for text_offset)."""
        if entries is None:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    def whole(self, completion_id: str, created: int, model: str, result: dict[str, Any],
              tools: bool = False) -> dict[str, object]:
        """The completion object; with `tools`, an answer that is calls becomes `tool_calls`."""
        choices = []
        for one in result.get("choices") or [{"index": 0, **result}]:  # n > 1 lists each choice
            choice: dict[str, object] = {"index": one["index"], "finish_reason": one["finish_reason"],
                                      "logprobs": self.logprobs(one.get("logprobs"))}
            calls = tool_calls.parse(one["text"]) if tools and one["finish_reason"] == "stop" else None
            if calls:
                choice["finish_reason"] = "tool_calls"
                choice["message"] = {"role": "assistant", "content": None, "refusal": None,
                                     "tool_calls": [call_object(name, arguments) for name, arguments in calls]}
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": one["text"]}
            else:
                choice["text"] = one["text"]
            choices.append(choice)
        return {"id": completion_id, "object": self.object, "created": created, "model": model, "choices": choices,
                "usage": _usage(result)}

    def chunk(self, completion_id: str, created: int, model: str, text: str | None, finish: str | None = None,
              first: bool = False, logprobs: dict[str, object] | None = None, index: int = 0,
              call: dict[str, object] | None = None) -> str:
        choice: dict[str, object] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
        if call is not None:  # one whole tool call: its index among the choice's calls, id, name, arguments
            choice["delta"] = {"tool_calls": [call]}
        elif self.chat:
            choice["delta"] = ({"role": "assistant", "content": ""} if first else
                               {} if text is None else {"content": text})
        else:
            choice["text"] = text or ""
        chunk = {"id": completion_id, "object": self.chunk_object, "created": created, "model": model,
                 "choices": [choice]}
        return f"data: {json.dumps(chunk)}\n\n"

    def usage_chunk(self, completion_id: str, created: int, model: str, result: dict[str, Any]) -> str:
        chunk = {"id": completion_id, "object": self.chunk_object, "created": created, "model": model,
                 "choices": [], "usage": _usage(result)}
        return f"data: {json.dumps(chunk)}\n\n"


CHAT_SHAPE, TEXT_SHAPE = Shape(True), Shape(False)


def _device_error(msg: Reply) -> HttpResponse:
    error = json.loads(msg.body)["error"]
    if error["code"] == "model_not_available":  # OpenAI's answer for a model it does not serve
        return openai_error(404, "model_not_found", error["message"], "model")
    return openai_error(msg.status, error["code"], error["message"])


def _refusal(err: ServiceError) -> HttpResponse:
    return openai_error(err.status, err.code, err.message, getattr(err, "param", None))


async def _body(request: HttpRequest) -> tuple[str, Any]:
    """(principal, parsed JSON body) of an OpenAI POST (the token is checked before the body)."""
    principal = _principal(request)  # (the front read the body within MAX_CHAT_BODY_BYTES)
    try:
        return principal, json.loads(request.body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ServiceError(400, "invalid_json", f"the body is not JSON: {exc}") from None


async def chat_completions(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    return await _complete(request, _request_args, CHAT_SHAPE)


async def completions(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    return await _complete(request, _completion_args, TEXT_SHAPE)


async def _complete(request: HttpRequest, parse: Callable[[object], dict[str, object]],
                    shape: Shape) -> HttpResponse | StreamingHttpResponse:
    """Both completion routes: the device's `chat.completions` (messages, or a plain prompt)."""
    if request.method != "POST":
        return openai_error(405, "method_not_allowed", "use POST")
    try:
        principal, body = await _body(request)
        args = typed("chat.completions", parse(body))
    except ServiceError as err:
        return _refusal(err)
    assert isinstance(args, Chat)
    calls_possible = bool(args.tools) and args.tool_choice != "none"
    completion_id = shape.prefix + secrets.token_hex(12)
    created = int(time.time())
    if not args.stream:
        # A whole completion can take longer than the device timeout (which bounds an answer that
        # should come at once): wait for it up to AOTX_CHAT_TIMEOUT, then stop it.
        try:
            pending = await mux().open("chat.completions", principal, args)
        except ServiceError as err:
            return openai_error(err.status, err.code, err.message)
        accepted = False
        try:
            msg = await pending.next(mux().timeout)  # "accepted" (or a refusal): the device answers at once
            if msg.more:
                accepted = True
                msg = await pending.next(settings.AOTX_CHAT_TIMEOUT)
        except ServiceError as err:
            return openai_error(err.status, err.code, err.message)
        except asyncio.TimeoutError:
            await pending.close()
            if not accepted:  # the device did not answer at all
                return openai_error(503, "device_timeout", f"the device did not answer within {mux().timeout:g}s")
            # (the device's own execution deadline ends it first, unless AOTX_CHAT_TIMEOUT is lower)
            return openai_error(504, "deadline_exceeded", f"the completion took longer than "
                                                          f"{settings.AOTX_CHAT_TIMEOUT:g}s; it was stopped (stream "
                                                          "it to see tokens as they come)")
        except asyncio.CancelledError:  # the client went away (the front cancels the view): the chat stops
            await pending.close()
            raise
        if msg.status != 200:
            return _device_error(msg)
        return HttpResponse(json.dumps(shape.whole(completion_id, created, args.model, json.loads(msg.body),
                                                   tools=calls_possible)),
                            content_type="application/json")
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))  # an object: parse checked
    try:
        device = await mux().open("chat.completions", principal, args)
    except ServiceError as err:
        return openai_error(err.status, err.code, err.message)
    timeout = mux().timeout
    try:
        first = await device.next(timeout)
    except ServiceError as err:
        return openai_error(err.status, err.code, err.message)
    except asyncio.TimeoutError:
        await device.close()
        return openai_error(503, "device_timeout", "the device did not answer in time")
    except asyncio.CancelledError:  # the client went away before the stream began: the chat stops
        await device.close()
        raise
    if first.status != 200:
        return _device_error(first)
    model = args.model

    async def events() -> AsyncIterator[str]:
        # The HTTP front (or Django's ASGI handler) cancels this generator when the client disconnects;
        # closing the stream then cancels the chat on the device and frees its pages.
        n = args.n
        # per choice: its UTF-8 decoder (a character may be split between frames) and its text's length so far
        decoders = [codecs.getincrementaldecoder("utf-8")("replace") for _ in range(n)]
        written = [0] * n
        # with tools: each choice's text held while it may be calls, and the logprobs entries held with it
        streams = [CallStream() for _ in range(n)] if calls_possible else None
        held: list[list[Any]] = [[] for _ in range(n)]

        def out(index: int, text: str, entries: list[Any] | None) -> Iterable[str]:
            calls: list[dict[str, object]] = []
            if streams is not None:
                held[index] += entries or []
                text, calls = streams[index].feed(text)
                entries, held[index] = (held[index] or None, []) if text or calls else (None, held[index])
                if calls:
                    entries = None  # (a call's tokens have no content logprobs)
            if text or entries:
                yield shape.chunk(completion_id, created, model, text, index=index,
                                  logprobs=shape.logprobs(entries, written[index]))
                written[index] += len(text)
            for call in calls:
                yield shape.chunk(completion_id, created, model, None, index=index, call=call)

        try:
            if shape.chat:
                for index in range(n):
                    yield shape.chunk(completion_id, created, model, None, first=True, index=index)
            msg = first
            while msg.more:
                index = msg.index
                for chunk in out(index, decoders[index].decode(msg.body), msg.logprobs):
                    yield chunk
                msg = await device.next(timeout)
            if msg.status != 200:
                error = json.loads(msg.body)["error"]
                yield f"data: {json.dumps({'error': {'message': error['message'], 'code': error['code']}})}\n\n"
                return
            result = json.loads(msg.body)
            for index, one in enumerate(result.get("choices") or [result]):
                for chunk in out(index, decoders[index].decode(b"", final=True), None):
                    yield chunk
                reason = one["finish_reason"]
                if streams is not None:
                    rest, reason = streams[index].finish(reason)
                    if rest or held[index]:
                        yield shape.chunk(completion_id, created, model, rest, index=index,
                                          logprobs=shape.logprobs(held[index] or None, written[index]))
                yield shape.chunk(completion_id, created, model, None, reason, index=index)
            if include_usage:
                yield shape.usage_chunk(completion_id, created, model, result)
            yield "data: [DONE]\n\n"
        except ServiceError as err:
            yield f"data: {json.dumps({'error': {'message': err.message, 'code': err.code}})}\n\n"
        except asyncio.TimeoutError:
            yield f"data: {json.dumps({'error': {'message': 'the device did not answer in time', 'code': 'device_timeout'}})}\n\n"
        finally:
            await device.close()

    response = StreamingHttpResponse(events(), content_type="text/event-stream")
    response["X-Accel-Buffering"] = "no"
    return response


EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}


async def embeddings(request: HttpRequest) -> HttpResponse:
    """`POST /v1/embeddings {model, input: str | [str], encoding_format?: float|base64,
    dimensions?}`: the packed embedding model. Token arrays are refused (this model's tokenizer is
    not OpenAI's); `dimensions` must be the model's own."""
    if request.method != "POST":
        return openai_error(405, "method_not_allowed", "use POST")
    try:
        principal, body = await _body(request)
        if not isinstance(body, dict):
            raise ServiceError(400, "invalid_json", "the body must be a JSON object")
        _fields(body, EMBEDDING_FIELDS, {})
        model, texts = _model(body), body.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if (not isinstance(texts, list) or not texts
                or any(not isinstance(t, str) or not t for t in texts)):
            raise ServiceError(400, "invalid_input", "input must be a non-empty string or array of non-empty "
                                                     "strings (token arrays are not supported)")
        texts = [utf8_text(t, "invalid_input", "input") for t in texts]
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise ServiceError(400, "invalid_encoding_format", "encoding_format must be float or base64")
        dimensions = body.get("dimensions")
        if dimensions is not None and type(dimensions) is not int:
            raise ServiceError(400, "invalid_dimensions", "dimensions must be an integer")
        msg = await mux().call("embeddings", principal, {"model": model, "input": texts})
    except ServiceError as err:
        return _refusal(err)
    except asyncio.TimeoutError:
        return openai_error(503, "device_timeout", "the device did not answer in time")
    if msg.status != 200:
        return _device_error(msg)
    result = json.loads(msg.body)
    dim = result["dim"]
    if dimensions is not None and dimensions != dim:
        return openai_error(400, "invalid_dimensions", f"this model's embeddings have {dim} dimensions", "dimensions")
    raw = base64.b64decode(result["vectors"])
    size = dim * 4
    data = []
    for i in range(len(texts)):
        chunk = raw[i * size:(i + 1) * size]
        vector: str | list[float] = base64.b64encode(chunk).decode() if encoding == "base64" else \
            list(struct.unpack(f"<{dim}f", chunk))
        data.append({"object": "embedding", "index": i, "embedding": vector})
    tokens = result["prompt_tokens"]
    return HttpResponse(json.dumps({"object": "list", "data": data, "model": model,
                                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}),
                        content_type="application/json")


async def models(request: HttpRequest) -> HttpResponse:
    if request.method != "GET":
        return openai_error(405, "method_not_allowed", "use GET")
    try:
        principal = _principal(request)
        msg = await mux().call("models.list", principal, {})
    except ServiceError as err:
        return openai_error(err.status, err.code, err.message)
    except asyncio.TimeoutError:
        return openai_error(503, "device_timeout", "the device did not answer in time")
    if msg.status != 200:
        return _device_error(msg)
    data = [{"id": m["name"], "object": "model", "created": 0, "owned_by": "aotx"}
            for m in json.loads(msg.body)["models"]]  # the generation model, then the embedding model
    return HttpResponse(json.dumps({"object": "list", "data": data}), content_type="application/json")


# path -> view: the URLconf's /v1 routes, which the HTTP front answers itself (shared_api/http/front.py)
ROUTES = {"/v1/chat/completions": chat_completions, "/v1/completions": completions, "/v1/embeddings": embeddings,
          "/v1/models": models}
