"""The shared routes (DESIGN §4). Views are thin: check the gateway action, parse strictly,
call the device, pass its bytes through. The device re-checks grants and membership."""
from __future__ import annotations

import re
from typing import Any

from django.http import HttpResponse
from rest_framework.parsers import BaseParser
from rest_framework.request import Request
from rest_framework.views import APIView

from gpu_worker.contract.ids import SHA256
from gpu_worker.contract.limits import MAX_LIMIT, MAX_MEDIA, MAX_MEDIA_BYTES
from gpu_worker.contract.vocabulary import COMMANDS, MEDIA_TYPES, PERMISSIONS, SCOPES

from .auth import require_action
from .device_client import device_response
from .errors import ServiceError
from .openapi import doc
from .strict import Mutation, decimal_counter, hex32, resource_id

DIGITS = re.compile(r"[0-9]{1,4}")  # ASCII digits only: str.isdigit() also accepts "²" and "٣"
DIGITS_ANY = re.compile(r"[0-9]{1,18}")
INPUT_FIELDS = ("text", "model", "max_output_tokens", "pages", "temperature", "top_p", "media")


def list_args(request: Request, allowed: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(extra)
    cursor = request.query_params.get("cursor")
    if cursor is not None:
        decimal_counter(cursor, "cursor")
        args["cursor"] = cursor
    limit = request.query_params.get("limit")
    if limit is not None:
        if not DIGITS.fullmatch(limit) or not 1 <= int(limit) <= MAX_LIMIT:
            raise ServiceError(400, "bad_limit", f"limit must be an integer 1..{MAX_LIMIT}")
        args["limit"] = int(limit)
    no_query(request, allowed=("cursor", "limit", *allowed))
    return args


def no_query(request: Request, allowed: tuple[str, ...] = ()) -> None:
    unknown = sorted(set(request.query_params) - set(allowed))
    if unknown:
        raise ServiceError(400, "unknown_parameter", f"unknown query parameter(s): {', '.join(unknown)}")


class SharedView(APIView):
    """Each handler is marked (@doc) with the device command it calls; the command's gateway action
    (gpu_worker/contract/vocabulary.py) is checked before the request is parsed."""

    def initial(self, request: Any, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        command = getattr(getattr(self, request.method.lower(), None), "command", None)
        if command is not None:
            action = COMMANDS[command].action
            assert action is not None
            require_action(request.user, action)


class CapabilitiesView(SharedView):
    @doc("capabilities")
    def get(self, request: Request) -> HttpResponse:
        no_query(request)
        return device_response("capabilities", request)


class ParticipantView(SharedView):
    @doc("participant.get")
    def get(self, request: Request) -> HttpResponse:
        no_query(request)
        return device_response("participant.get", request)

    @doc("participant.register")
    def post(self, request: Request) -> HttpResponse:
        return device_response("participant.register", request, Mutation(request).args())


class OtherParticipantView(SharedView):
    @doc("participants.get")
    def get(self, request: Request, participant: str) -> HttpResponse:
        no_query(request)
        return device_response("participants.get", request, {"participant": resource_id(participant, "par")})


class SpacesView(SharedView):
    @doc("spaces.list")
    def get(self, request: Request) -> HttpResponse:
        return device_response("spaces.list", request, list_args(request))

    @doc("spaces.create")
    def post(self, request: Request) -> HttpResponse:
        mutation = Mutation(request, ("id", "scope"))
        fields = mutation.fields
        if "id" in fields:
            hex32(fields["id"], "id")
        if fields.get("scope", "private") not in SCOPES:
            raise ServiceError(400, "bad_field", "scope must be private, room or instance")
        return device_response("spaces.create", request, mutation.args(**fields))


class SpaceView(SharedView):
    @doc("spaces.get")
    def get(self, request: Request, space: str) -> HttpResponse:
        no_query(request)
        return device_response("spaces.get", request, {"space": resource_id(space, "spc")})


class MembersView(SharedView):
    @doc("members.list")
    def get(self, request: Request, space: str) -> HttpResponse:
        return device_response("members.list", request, list_args(request, space=resource_id(space, "spc")))

    @doc("members.set")
    def post(self, request: Request, space: str) -> HttpResponse:
        mutation = Mutation(request, ("participant", "permissions"), required=("participant", "permissions"))
        fields = mutation.fields
        resource_id(fields["participant"], "par")
        permissions = fields["permissions"]
        if (not isinstance(permissions, list) or any(p not in PERMISSIONS for p in permissions)
                or len(set(permissions)) != len(permissions)):
            raise ServiceError(400, "bad_field", "permissions must be an array of distinct values of read, write, manage")
        return device_response("members.set", request,
                               mutation.args(space=resource_id(space, "spc"), **fields))


class ConversationsView(SharedView):
    @doc("conversations.list")
    def get(self, request: Request, space: str) -> HttpResponse:
        return device_response("conversations.list", request,
                               list_args(request, space=resource_id(space, "spc")))

    @doc("conversations.create")
    def post(self, request: Request, space: str) -> HttpResponse:
        mutation = Mutation(request, ("id",))
        if "id" in mutation.fields:
            hex32(mutation.fields["id"], "id")
        return device_response("conversations.create", request,
                               mutation.args(space=resource_id(space, "spc"), **mutation.fields))


class SpaceDeletionView(SharedView):
    @doc("spaces.delete")
    def post(self, request: Request, space: str) -> HttpResponse:
        return device_response("spaces.delete", request, Mutation(request).args(space=resource_id(space, "spc")))


class ConversationDeletionView(SharedView):
    @doc("conversations.delete")
    def post(self, request: Request, conversation: str) -> HttpResponse:
        return device_response("conversations.delete", request,
                               Mutation(request).args(conversation=resource_id(conversation, "con")))


class ConversationView(SharedView):
    @doc("conversations.get")
    def get(self, request: Request, conversation: str) -> HttpResponse:
        no_query(request)
        return device_response("conversations.get", request, {"conversation": resource_id(conversation, "con")})


class ConversationEventsView(SharedView):
    """The plain read; with `stream=true` the gateway's ASGI application hands the request to the
    stream consumer (shared_api/streams.py) before it reaches Django."""

    @doc("conversations.events")
    def get(self, request: Request, conversation: str) -> HttpResponse:
        args = list_args(request, ("stream",), conversation=resource_id(conversation, "con"))
        stream = request.query_params.get("stream", "false")
        if stream not in ("true", "false"):
            raise ServiceError(400, "bad_field", "stream must be true or false")
        if stream == "true":
            raise not_streamed()
        return device_response("conversations.events", request, args)


class OperationEventsView(SharedView):
    """Always a stream (shared_api/streams.py); this view only answers where no stream consumer
    runs (it documents the route)."""

    @doc("operations.subscribe")
    def get(self, request: Request, operation: str) -> HttpResponse:
        resource_id(operation, "op")
        raise not_streamed()


def not_streamed() -> ServiceError:
    return ServiceError(406, "not_acceptable", "event streams are served by the gateway's ASGI application "
                                               "(manage.py serve), not by this Django entry point")


def _integer(fields: dict[str, Any], name: str) -> None:
    """An optional integer field, when present, is an integer (not null, a float or a bool)."""
    if name in fields and type(fields[name]) is not int:  # bool is an int subclass; floats are refused
        raise ServiceError(400, "bad_field", f"{name} must be a JSON integer")


def _number(fields: dict[str, Any], name: str) -> None:
    if name in fields and type(fields[name]) not in (int, float):
        raise ServiceError(400, "bad_field", f"{name} must be a JSON number")


class InputsView(SharedView):
    @doc("conversations.input")
    def post(self, request: Request, conversation: str) -> HttpResponse:
        mutation = Mutation(request, INPUT_FIELDS, required=("text", "model"))
        fields = mutation.fields
        if not isinstance(fields["text"], str) or not isinstance(fields["model"], str):
            raise ServiceError(400, "bad_field", "text and model must be strings")
        for name in ("max_output_tokens", "pages"):
            _integer(fields, name)
        for name in ("temperature", "top_p"):
            _number(fields, name)
        media = fields.get("media", [])
        if (not isinstance(media, list) or len(media) > MAX_MEDIA
                or any(not isinstance(m, dict) or set(m) != {"type", "sha256"} or m["type"] not in MEDIA_TYPES
                       or not isinstance(m["sha256"], str) or not SHA256.match(m["sha256"]) for m in media)):
            raise ServiceError(400, "bad_field", "media must be at most 8 rows of {type: image|audio, sha256: 64 "
                                             "lowercase hex}")
        return device_response("conversations.input", request,
                               mutation.args(conversation=resource_id(conversation, "con"), **fields))


class ResultView(SharedView):
    @doc("operations.result")
    def get(self, request: Request, operation: str) -> HttpResponse:
        no_query(request, allowed=("offset",))
        offset = request.query_params.get("offset", "0")
        if not DIGITS_ANY.fullmatch(offset):
            raise ServiceError(400, "bad_offset", "offset must be a non-negative integer")
        return device_response("operations.result", request,
                               {"operation": resource_id(operation, "op"), "offset": int(offset)})


class RawBytesParser(BaseParser):
    media_type = "*/*"

    # request.data is the body itself, bytes, where BaseParser promises a mapping
    def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> bytes:  # type: ignore[override]
        data = stream.read(MAX_MEDIA_BYTES + 1) if stream is not None else b""
        if len(data) > MAX_MEDIA_BYTES:
            raise ServiceError(413, "media_too_large", f"a media source is at most {MAX_MEDIA_BYTES} bytes")
        return data


class MediaView(SharedView):
    """PUT /aotx/v1/media/{sha256}: upload a media source owned by the caller's participant.
    The type comes from Content-Type (image/* or audio/*); the bytes must hash to the path."""
    parser_classes = [RawBytesParser]

    @doc("media.put")
    def put(self, request: Request, sha256: str) -> HttpResponse:
        if not SHA256.match(sha256):
            raise ServiceError(400, "bad_id", "the path must be the 64 lowercase hex sha256 of the bytes")
        kind = request.content_type.split("/", 1)[0]
        if kind not in MEDIA_TYPES:
            raise ServiceError(415, "unsupported_media_type", "Content-Type must be image/* or audio/*")
        data = request.data if isinstance(request.data, bytes) else b""
        return device_response("media.put", request, {"sha256": sha256, "data": data, "type": kind})


class OperationsView(SharedView):
    @doc("operations.list")
    def get(self, request: Request) -> HttpResponse:
        return device_response("operations.list", request, list_args(request))


class OperationView(SharedView):
    @doc("operations.get")
    def get(self, request: Request, operation: str) -> HttpResponse:
        no_query(request)
        return device_response("operations.get", request, {"operation": resource_id(operation, "op")})


class RetirementsView(SharedView):
    @doc("retirements.record")
    def post(self, request: Request) -> HttpResponse:
        mutation = Mutation(request, ("retry_floor",), required=("retry_floor",))
        floor = decimal_counter(mutation.fields["retry_floor"], "retry_floor", positive=True)
        return device_response("retirements.record", request, mutation.args(retry_floor=floor))


class CancellationsView(SharedView):
    @doc("cancellations.record")
    def post(self, request: Request) -> HttpResponse:
        mutation = Mutation(request, ("target_sequence",), required=("target_sequence",))
        target = decimal_counter(mutation.fields["target_sequence"], "target_sequence", positive=True)
        return device_response("cancellations.record", request, mutation.args(target_sequence=target))
