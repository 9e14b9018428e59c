"""OpenAI-compatible Chat Completions: `POST /v1/chat/completions` (plain and SSE stream) and
`GET /v1/models`. Same bearer tokens; the principal needs the `chat` action. Temporary requests:
no receipts, nothing journaled; pages come from the same KV pool as conversation inputs.
Errors use OpenAI's shape ({"error": {"message", "type", "param", "code"}}), which keeps the
`code` and `message` of the one error body.
"""
import asyncio
import codecs
import itertools
import json
import secrets
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from gpu_worker.protocol import LENGTH, PROTOCOL_VERSION, decode_payload, encode_frame

from . import config
from .errors import ApiError
from .models import Principal

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 429: "rate_limit_error", 503: "server_error", 500: "server_error"}
MAX_BODY = 1 << 20
_ids = itertools.count(1)


def openai_error(status, code, message, param=None):
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}
    response = HttpResponse(json.dumps(body), status=status, content_type="application/json")
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="aotx"'
    return response


async def _principal(request):
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "unauthenticated", "Authorization must be 'Bearer <token>'")
    principal = await sync_to_async(Principal.for_token)(token.strip())
    if principal is None:
        raise ApiError(401, "unauthenticated", "unknown or revoked token")
    if "chat" not in principal.current_actions():
        raise ApiError(403, "grant_missing", "this principal lacks the chat action")
    return principal.principal_id


class DeviceStream:
    """One asyncio connection to the device for one request (chat requests are long-lived)."""

    async def __aenter__(self):
        path = config.load(settings.AOTX_GATEWAY_CONFIG)["socket"]
        try:
            self.reader, self.writer = await asyncio.open_unix_connection(path)
        except OSError as exc:
            raise ApiError(503, "device_unavailable", f"the device is not reachable: {exc.strerror or exc}") from None
        return self

    async def __aexit__(self, *exc):
        self.writer.close()

    async def send(self, op, principal, args):
        self.id = next(_ids)
        self.writer.write(encode_frame({"v": PROTOCOL_VERSION, "id": self.id, "op": op, "principal": principal,
                                        "args": args}))
        await self.writer.drain()

    async def frame(self):
        try:
            header = await asyncio.wait_for(self.reader.readexactly(4), settings.AOTX_DEVICE_TIMEOUT)
            (n,) = LENGTH.unpack(header)
            return decode_payload(await self.reader.readexactly(n))
        except asyncio.TimeoutError:
            raise ApiError(503, "device_timeout", "the device did not answer in time") from None
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise ApiError(503, "device_unavailable", f"the device connection failed: {exc}") from None


def _content(message):
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
               for p in content):
            raise ApiError(400, "invalid_messages", "only text content parts are supported")
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, "invalid_messages", "message content must be a string or text parts")
    return content


def _request_args(body):
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", "the body must be a JSON object")
    model, messages = body.get("model"), body.get("messages")
    if not isinstance(model, str):
        raise ApiError(400, "invalid_model", "model is required")
    if not isinstance(messages, list) or not messages or any(not isinstance(m, dict) for m in messages):
        raise ApiError(400, "invalid_messages", "messages must be a non-empty array of objects")
    args = {"model": model, "messages": [{"role": m.get("role"), "content": _content(m)} for m in messages],
            "stream": bool(body.get("stream", False))}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if type(max_tokens) is not int or max_tokens < 1:
            raise ApiError(400, "invalid_max_tokens", "max_tokens must be a positive integer")
        args["max_tokens"] = max_tokens
    for name, low, high in (("temperature", 0, 2), ("top_p", 0, 1)):
        value = body.get(name)
        if value is not None:
            if type(value) not in (int, float) or not low <= value <= high or (name == "top_p" and value == 0):
                raise ApiError(400, f"invalid_{name}", f"{name} must be a number in [{low}, {high}]")
            args[name] = float(value)
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or any(not isinstance(s, str) or not s for s in stop):
            raise ApiError(400, "invalid_stop", "stop must be a string or up to 4 strings")
        args["stop"] = stop
    if body.get("n", 1) != 1:
        raise ApiError(400, "invalid_n", "only n=1 is supported")
    return args


def _usage(result):
    return {"prompt_tokens": result["prompt_tokens"], "completion_tokens": result["completion_tokens"],
            "total_tokens": result["prompt_tokens"] + result["completion_tokens"]}


def _completion(completion_id, created, model, result):
    return {"id": completion_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result["text"]},
                         "finish_reason": result["finish_reason"], "logprobs": None}],
            "usage": _usage(result)}


def _chunk(completion_id, created, model, delta, finish=None, usage=None):
    chunk = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk)}\n\n"


def _device_error(msg):
    error = json.loads(msg["body"])["error"]
    return openai_error(msg["status"], error["code"], error["message"])


@csrf_exempt
async def chat_completions(request):
    if request.method != "POST":
        return openai_error(405, "method_not_allowed", "use POST")
    try:
        principal = await _principal(request)
        if len(request.body) > MAX_BODY:
            raise ApiError(413, "body_too_large", "the body is too large")
        try:
            body = json.loads(request.body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ApiError(400, "invalid_json", f"the body is not JSON: {exc}") from None
        args = _request_args(body)
    except ApiError as err:
        return openai_error(err.status, err.code, err.message)
    completion_id = "chatcmpl-" + secrets.token_hex(12)
    created = int(time.time())
    if not args["stream"]:
        try:
            async with DeviceStream() as device:
                await device.send("chat.completions", principal, args)
                msg = await device.frame()
        except ApiError as err:
            return openai_error(err.status, err.code, err.message)
        if msg["status"] != 200:
            return _device_error(msg)
        return HttpResponse(json.dumps(_completion(completion_id, created, args["model"], json.loads(msg["body"]))),
                            content_type="application/json")
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    device = DeviceStream()
    try:
        await device.__aenter__()
        await device.send("chat.completions", principal, args)
        first = await device.frame()
    except ApiError as err:
        return openai_error(err.status, err.code, err.message)
    if first["status"] != 200:
        await device.__aexit__()
        return _device_error(first)

    async def events():
        # Django cancels this generator when the client disconnects (under daphne); closing the
        # device connection then cancels the chat and frees its pages.
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        try:
            yield _chunk(completion_id, created, args["model"], {"role": "assistant", "content": ""})
            msg = first
            while msg.get("more"):
                text = decoder.decode(msg["body"])
                if text:
                    yield _chunk(completion_id, created, args["model"], {"content": text})
                msg = await device.frame()
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
        except ApiError as err:
            yield f"data: {json.dumps({'error': {'message': err.message, 'code': err.code}})}\n\n"
        finally:
            await device.__aexit__()

    response = StreamingHttpResponse(events(), content_type="text/event-stream")
    response["X-Accel-Buffering"] = "no"
    return response


@csrf_exempt
async def models(request):
    if request.method != "GET":
        return openai_error(405, "method_not_allowed", "use GET")
    try:
        principal = await _principal(request)
        async with DeviceStream() as device:
            await device.send("models.list", principal, {})
            msg = await device.frame()
    except ApiError as err:
        return openai_error(err.status, err.code, err.message)
    if msg["status"] != 200:
        return _device_error(msg)
    data = [{"id": m["name"], "object": "model", "created": 0, "owned_by": "aotx"}
            for m in json.loads(msg["body"])["models"]]
    return HttpResponse(json.dumps({"object": "list", "data": data}), content_type="application/json")
