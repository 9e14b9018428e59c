"""OpenAI-compatible Chat Completions: `POST /v1/chat/completions` (plain and SSE stream) and
`GET /v1/models`. Same bearer tokens; the principal needs the `chat` action. Temporary requests:
no receipts, nothing journaled; pages come from the same KV pool as conversation inputs.
Errors use OpenAI's shape ({"error": {"message", "type", "param", "code"}}), which keeps the
`code` and `message` of the one error body.
"""
from __future__ import annotations

import asyncio
import codecs
import json
import secrets
import time
from typing import Any, AsyncIterator

from django.conf import settings
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from gpu_worker.contract.ids import MAX_COUNTER
from gpu_worker.contract.limits import MAX_CHAT_BODY_BYTES
from gpu_worker.contract.vocabulary import CHAT
from gpu_worker.contract.wire import Message

from .auth import authenticate_request
from .device_client import mux
from .errors import WWW_AUTHENTICATE, ServiceError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 429: "rate_limit_error", 503: "server_error", 500: "server_error"}


def openai_error(status: int, code: str, message: str, param: str | None = None) -> HttpResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}
    response = HttpResponse(json.dumps(body), status=status, content_type="application/json")
    if status == 401:
        response["WWW-Authenticate"] = WWW_AUTHENTICATE
    return response


async def _principal(request: HttpRequest) -> str:
    return (await authenticate_request(request, CHAT)).principal_id


def _text(value: str, code: str, name: str) -> str:
    """JSON admits lone surrogates (\\ud800) that no UTF-8 text holds: refuse them here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ServiceError(400, code, f"{name} holds a lone surrogate, which is not text") from None
    return value


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
               for p in content):
            raise ServiceError(400, "invalid_messages", "only text content parts are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ServiceError(400, "invalid_messages", "message content must be a string or text parts")
    return _text(content, "invalid_messages", "message content")


def _request_args(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ServiceError(400, "invalid_json", "the body must be a JSON object")
    model, messages = body.get("model"), body.get("messages")
    if not isinstance(model, str):
        raise ServiceError(400, "invalid_model", "model is required")
    _text(model, "invalid_model", "model")
    if not isinstance(messages, list) or not messages or any(not isinstance(m, dict) for m in messages):
        raise ServiceError(400, "invalid_messages", "messages must be a non-empty array of objects")
    args: dict[str, Any] = {"model": model, "stream": bool(body.get("stream", False)),
                            "messages": [{"role": m.get("role"), "content": _content(m)} for m in messages]}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if type(max_tokens) is not int or not 1 <= max_tokens <= MAX_COUNTER:
            raise ServiceError(400, "invalid_max_tokens", f"max_tokens must be an integer 1..{MAX_COUNTER}")
        args["max_tokens"] = max_tokens
    for name, low, high in (("temperature", 0, 2), ("top_p", 0, 1)):
        value = body.get(name)
        if value is not None:
            if type(value) not in (int, float) or not low <= value <= high or (name == "top_p" and value == 0):
                raise ServiceError(400, f"invalid_{name}", f"{name} must be a number in [{low}, {high}]")
            args[name] = float(value)
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or any(not isinstance(s, str) or not s for s in stop):
            raise ServiceError(400, "invalid_stop", "stop must be a string or up to 4 strings")
        args["stop"] = [_text(s, "invalid_stop", "stop") for s in stop]
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ServiceError(400, "invalid_stream_options", "stream_options must be an object")
    if body.get("n", 1) != 1:
        raise ServiceError(400, "invalid_n", "only n=1 is supported")
    return args


def _usage(result: dict[str, Any]) -> dict[str, int]:
    return {"prompt_tokens": result["prompt_tokens"], "completion_tokens": result["completion_tokens"],
            "total_tokens": result["prompt_tokens"] + result["completion_tokens"]}


def _completion(completion_id: str, created: int, model: str, result: dict[str, Any]) -> dict[str, Any]:
    return {"id": completion_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result["text"]},
                         "finish_reason": result["finish_reason"], "logprobs": None}],
            "usage": _usage(result)}


def _chunk(completion_id: str, created: int, model: str, delta: dict[str, Any], finish: str | None = None,
           usage: dict[str, int] | None = None) -> str:
    chunk = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk)}\n\n"


def _device_error(msg: Message) -> HttpResponse:
    error = json.loads(msg["body"])["error"]
    return openai_error(msg["status"], error["code"], error["message"])


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    if request.method != "POST":
        return openai_error(405, "method_not_allowed", "use POST")
    try:
        principal = await _principal(request)
        if len(request.body) > MAX_CHAT_BODY_BYTES:
            raise ServiceError(413, "body_too_large", "the body is too large")
        try:
            body = json.loads(request.body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ServiceError(400, "invalid_json", f"the body is not JSON: {exc}") from None
        args = _request_args(body)
    except ServiceError as err:
        return openai_error(err.status, err.code, err.message)
    completion_id = "chatcmpl-" + secrets.token_hex(12)
    created = int(time.time())
    if not args["stream"]:
        # A whole completion can take longer than the device timeout (which bounds an answer that
        # should come at once): wait for it up to AOTX_CHAT_TIMEOUT, then stop it.
        try:
            pending = await mux().open("chat.completions", principal, args)
        except ServiceError as err:
            return openai_error(err.status, err.code, err.message)
        try:
            msg = await pending.next(mux().timeout)  # "accepted" (or a refusal): the device answers at once
            if msg.get("more"):
                msg = await pending.next(settings.AOTX_CHAT_TIMEOUT)
        except ServiceError as err:
            return openai_error(err.status, err.code, err.message)
        except asyncio.TimeoutError:
            await pending.close()
            return openai_error(503, "device_timeout", f"the completion took longer than {settings.AOTX_CHAT_TIMEOUT:g}s; "
                                                       "it was stopped (stream it to see tokens as they come)")
        if msg["status"] != 200:
            return _device_error(msg)
        return HttpResponse(json.dumps(_completion(completion_id, created, args["model"], json.loads(msg["body"]))),
                            content_type="application/json")
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))  # an object: _request_args
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
    if first["status"] != 200:
        return _device_error(first)

    async def events() -> AsyncIterator[str]:
        # Django cancels this generator when the client disconnects (Django's ASGI handler); closing the
        # stream then cancels the chat on the device and frees its pages.
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        try:
            yield _chunk(completion_id, created, args["model"], {"role": "assistant", "content": ""})
            msg = first
            while msg.get("more"):
                text = decoder.decode(msg["body"])
                if text:
                    yield _chunk(completion_id, created, args["model"], {"content": text})
                msg = await device.next(timeout)
            if msg["status"] != 200:
                error = json.loads(msg["body"])["error"]
                yield f"data: {json.dumps({'error': {'message': error['message'], 'code': error['code']}})}\n\n"
                return
            result = json.loads(msg["body"])
            tail = decoder.decode(b"", final=True)
            if tail:
                yield _chunk(completion_id, created, args["model"], {"content": tail})
            yield _chunk(completion_id, created, args["model"], {}, result["finish_reason"])
            if include_usage:
                chunk = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                         "model": args["model"], "choices": [], "usage": _usage(result)}
                yield f"data: {json.dumps(chunk)}\n\n"
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


@csrf_exempt
async def models(request: HttpRequest) -> HttpResponse:
    if request.method != "GET":
        return openai_error(405, "method_not_allowed", "use GET")
    try:
        principal = await _principal(request)
        msg = await mux().call("models.list", principal, {})
    except ServiceError as err:
        return openai_error(err.status, err.code, err.message)
    except asyncio.TimeoutError:
        return openai_error(503, "device_timeout", "the device did not answer in time")
    if msg["status"] != 200:
        return _device_error(msg)
    data = [{"id": m["name"], "object": "model", "created": 0, "owned_by": "aotx"}
            for m in json.loads(msg["body"])["models"]]
    return HttpResponse(json.dumps({"object": "list", "data": data}), content_type="application/json")
