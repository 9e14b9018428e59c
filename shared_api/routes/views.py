"""The shared routes (DESIGN §4). Views are thin: parse strictly, name the device call
(DeviceCall), and the device's reply bytes go back as they are. The device re-checks grants and
membership.

Each route is a DRF view, and DRF dispatches it: its Request, its authentication and permission
classes (the principal the front admitted, with the action of the handler's command), its parsers (strict JSON, or
the raw bytes of a media upload), its content negotiation (one renderer, JSON) and the gateway's
exception handler (the one error body). The gateway's HTTP front (shared_api/http/front.py) calls
the view function once it has done what a server must do before reading a body (405, 401/403 from
the headers, 413 from the declared length, the principal's rates), hands DRF the body it read and
the principal it admitted, and makes the handler's DeviceCall through the pooled async device
client (`finalize_response` lets a DeviceCall through). docs/architecture.md, "The gateway", says
what that costs."""
from __future__ import annotations

import re
from typing import IO, Iterable, Mapping

from django.http import HttpResponseBase
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.parsers import BaseParser
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle
from rest_framework.views import APIView

from gpu_worker.contract.commands import typed
from gpu_worker.contract.limits import MAX_BODY_BYTES, MAX_LIMIT, MAX_MEDIA_BYTES, MAX_SEARCH_RESULTS

from ..errors import ServiceError
from ..http.auth import BearerAuthentication, admitted_principal
from .openapi import doc
from .strict import Mutation, StrictJSONParser, decimal_counter

DIGITS = re.compile(r"[0-9]{1,4}")  # ASCII digits only: str.isdigit() also accepts "²" and "٣"
DIGITS_ANY = re.compile(r"[0-9]{1,18}")
# a media upload's Content-Type (its parameters aside): type/subtype, the subtype an RFC 9110 token
MEDIA_TYPE = re.compile(r"(image|audio)/[A-Za-z0-9!#$%&'*+.^_`|~-]+", re.IGNORECASE)
INPUT_FIELDS = ("text", "model", "max_output_tokens", "pages", "temperature", "top_p", "media", "retention", "context",
                "response_format", "memory_ttl_seconds")
SPACE_FIELDS = ("id", "scope", "memory_ttl_seconds")


def list_args(request: Request, allowed: tuple[str, ...] = (), **extra: object) -> dict[str, object]:
    args: dict[str, object] = dict(extra)
    cursor = request.query_params.get("cursor")
    if cursor is not None:
        args["cursor"] = cursor
    limit = request.query_params.get("limit")
    if limit is not None:
        if not DIGITS.fullmatch(limit):
            raise ServiceError(400, "bad_limit", f"limit must be an integer 1..{MAX_LIMIT}")
        args["limit"] = int(limit)
    no_query(request, allowed=("cursor", "limit", *allowed))
    return args


def no_query(request: Request, allowed: tuple[str, ...] = ()) -> None:
    unknown = sorted(set(request.query_params) - set(allowed))
    if unknown:
        raise ServiceError(400, "unknown_parameter", f"unknown query parameter(s): {', '.join(unknown)}")


class DeviceCall:
    """What a route's handler asks of the device: the command and its arguments (the principal is
    the request's), built as the command's declared type (gpu_worker/contract/commands.py): every
    check that needs no state is made there, for the gateway and the device alike."""
    __slots__ = ("op", "args")

    def __init__(self, op: str, args: Mapping[str, object] | None = None) -> None:
        self.op = op
        self.args = typed(op, args)


class RememberedNegotiation(DefaultContentNegotiation):
    """DRF's content negotiation, its answer remembered per Accept header and format: a pure
    function of those and the view's renderers, which DRF otherwise works out by parsing the
    header's media ranges on every request (two fifths of its dispatch of a read here). At most
    KNOWN answers are kept (a client sending ever new headers only gets the parse each time)."""
    KNOWN = 256
    _known: dict[tuple[str | None, str | None, tuple[type[BaseRenderer], ...]], tuple[type[BaseRenderer], str]] = {}

    def select_renderer(self, request: Request, renderers: Iterable[BaseRenderer],
                        format_suffix: str | None = None) -> tuple[BaseRenderer, str]:
        renderers = list(renderers)
        key = (request.META.get("HTTP_ACCEPT"),
               format_suffix or request.query_params.get(self.settings.URL_FORMAT_OVERRIDE),
               tuple(type(renderer) for renderer in renderers))
        found = self._known.get(key)
        if found is None:
            renderer, media_type = super().select_renderer(request, renderers, format_suffix)
            if len(self._known) < self.KNOWN:
                self._known[key] = (type(renderer), media_type)
            return renderer, media_type
        kind, media_type = found
        return next(renderer for renderer in renderers if type(renderer) is kind), media_type


class SharedView(APIView):
    """Each handler is marked (@doc) with the device command it calls. `body_limit` is the most body
    bytes the route reads (the front answers 413 `body_code` from Content-Length, or as soon as a
    chunked body passes it)."""
    body_limit = MAX_BODY_BYTES
    body_code = "body_too_large"
    authentication_classes = [BearerAuthentication]
    permission_classes = [IsAuthenticated]  # (the command's action: `admit`'s, before the body)
    parser_classes: list[type[BaseParser]] = [StrictJSONParser]
    renderer_classes = [JSONRenderer]
    content_negotiation_class = RememberedNegotiation
    throttle_classes: list[type[BaseThrottle]] = []  # (rates: the front's, before the body)

    def initial(self, request: Request, *args: object, **kwargs: object) -> None:
        if admitted_principal(request) is None:  # (Django's handler, around the front)
            raise ServiceError(500, "internal_error", "the shared routes are answered by the gateway's front "
                                                      "(aotx_site.gateway:application); this request reached "
                                                      "Django's handler around it: see the gateway's deployment")
        super().initial(request, *args, **kwargs)

    def finalize_response(self, request: Request, response: HttpResponseBase | DeviceCall,  # type: ignore[override]
                          *args: object, **kwargs: object) -> HttpResponseBase | DeviceCall:
        if isinstance(response, DeviceCall):
            return response  # (the front makes the call)
        return super().finalize_response(request, response, *args, **kwargs)  # type: ignore[arg-type]


class CapabilitiesView(SharedView):
    @doc("capabilities")
    def get(self, request: Request) -> DeviceCall:
        no_query(request)
        return DeviceCall("capabilities")


class ParticipantView(SharedView):
    @doc("participant.get")
    def get(self, request: Request) -> DeviceCall:
        no_query(request)
        return DeviceCall("participant.get")

    @doc("participant.register")
    def post(self, request: Request) -> DeviceCall:
        return DeviceCall("participant.register", Mutation(request).args())


class OtherParticipantView(SharedView):
    @doc("participants.get")
    def get(self, request: Request, participant: str) -> DeviceCall:
        no_query(request)
        return DeviceCall("participants.get", {"participant": participant})


class SpacesView(SharedView):
    @doc("spaces.list")
    def get(self, request: Request) -> DeviceCall:
        return DeviceCall("spaces.list", list_args(request))

    @doc("spaces.create")
    def post(self, request: Request) -> DeviceCall:
        mutation = Mutation(request, SPACE_FIELDS)
        return DeviceCall("spaces.create", mutation.args(**mutation.fields))


class SpaceView(SharedView):
    @doc("spaces.get")
    def get(self, request: Request, space: str) -> DeviceCall:
        no_query(request)
        return DeviceCall("spaces.get", {"space": space})


class MembersView(SharedView):
    @doc("members.list")
    def get(self, request: Request, space: str) -> DeviceCall:
        return DeviceCall("members.list", list_args(request, space=space))

    @doc("members.set")
    def post(self, request: Request, space: str) -> DeviceCall:
        mutation = Mutation(request, ("participant", "permissions"), required=("participant", "permissions"))
        return DeviceCall("members.set", mutation.args(space=space, **mutation.fields))


class ConversationsView(SharedView):
    @doc("conversations.list")
    def get(self, request: Request, space: str) -> DeviceCall:
        return DeviceCall("conversations.list", list_args(request, space=space))

    @doc("conversations.create")
    def post(self, request: Request, space: str) -> DeviceCall:
        mutation = Mutation(request, ("id",))
        return DeviceCall("conversations.create", mutation.args(space=space, **mutation.fields))


class SpaceDeletionView(SharedView):
    @doc("spaces.delete")
    def post(self, request: Request, space: str) -> DeviceCall:
        return DeviceCall("spaces.delete", Mutation(request).args(space=space))


class ConversationDeletionView(SharedView):
    @doc("conversations.delete")
    def post(self, request: Request, conversation: str) -> DeviceCall:
        return DeviceCall("conversations.delete", Mutation(request).args(conversation=conversation))


class ConversationForksView(SharedView):
    @doc("conversations.fork")
    def post(self, request: Request, conversation: str) -> DeviceCall:
        """A fork: a new conversation in the source's space whose history is the source's through
        the input at event cursor `at` (a decimal string of 1 or more), its ID `id` as a
        creation's (the contract checks both: ConversationFork)."""
        mutation = Mutation(request, ("at", "id"), required=("at",))
        return DeviceCall("conversations.fork", mutation.args(conversation=conversation, **mutation.fields))


class ConversationView(SharedView):
    @doc("conversations.get")
    def get(self, request: Request, conversation: str) -> DeviceCall:
        no_query(request)
        return DeviceCall("conversations.get", {"conversation": conversation})


class ConversationEventsView(SharedView):
    """The plain read; with `stream=true` the gateway's ASGI application hands the request to the
    stream consumer (shared_api/streams/events.py) before it reaches Django."""

    @doc("conversations.events")
    def get(self, request: Request, conversation: str) -> DeviceCall:
        args = list_args(request, ("stream",), conversation=conversation)
        stream = request.query_params.get("stream", "false")
        if stream not in ("true", "false"):
            raise ServiceError(400, "bad_field", "stream must be true or false")
        if stream == "true":
            raise not_streamed()
        return DeviceCall("conversations.events", args)


class OperationEventsView(SharedView):
    """Always a stream (shared_api/streams/events.py); this view only answers where no stream consumer
    runs (it documents the route)."""

    @doc("operations.subscribe")
    def get(self, request: Request, operation: str) -> DeviceCall:
        typed("operations.subscribe", {"operation": operation})
        raise not_streamed()


def not_streamed() -> ServiceError:
    return ServiceError(406, "not_acceptable", "event streams are served by the gateway's ASGI application "
                                               "(manage.py serve), not by this Django entry point")


class InputsView(SharedView):
    @doc("conversations.input")
    def post(self, request: Request, conversation: str) -> DeviceCall:
        mutation = Mutation(request, INPUT_FIELDS, required=("text", "model"))
        return DeviceCall("conversations.input", mutation.args(conversation=conversation, **mutation.fields))


class MemoryListView(SharedView):
    @doc("memory.list")
    def get(self, request: Request, space: str) -> DeviceCall:
        return DeviceCall("memory.list", list_args(request, space=space))


class MemorySearchView(SharedView):
    @doc("memory.search")
    def get(self, request: Request, space: str) -> DeviceCall:
        """The rows of the space's memory most similar to query `q` (the device embeds it)."""
        no_query(request, allowed=("q", "limit"))
        q = request.query_params.get("q")
        if q is None:
            raise ServiceError(400, "bad_search_query", "query q is required")
        args: dict[str, object] = {"space": space, "q": q}
        limit = request.query_params.get("limit")
        if limit is not None:
            if not DIGITS.fullmatch(limit):
                raise ServiceError(400, "bad_limit", f"limit must be an integer 1..{MAX_SEARCH_RESULTS}")
            args["limit"] = int(limit)
        return DeviceCall("memory.search", args)


def offset_arg(request: Request, allowed: tuple[str, ...] = ()) -> int:
    """A byte-offset read's query parameter `offset` (default 0), beside the route's `allowed` others."""
    no_query(request, allowed=("offset", *allowed))
    offset = request.query_params.get("offset", "0")
    if not DIGITS_ANY.fullmatch(offset):
        raise ServiceError(400, "bad_offset", "offset must be a non-negative integer")
    return int(offset)


class MemoryView(SharedView):
    @doc("memory.get")
    def get(self, request: Request, memory: str) -> DeviceCall:
        """One memory object from `offset`; with `version`, that version: its current one, or an
        earlier one while the correction that replaced it is live (the device answers 409
        `stale_version` otherwise)."""
        args: dict[str, object] = {"memory": memory, "offset": offset_arg(request, ("version",))}
        version = request.query_params.get("version")
        if version is not None:
            args["version"] = decimal_counter(version, "version", positive=True)
        return DeviceCall("memory.get", args)


class PublicationsView(SharedView):
    @doc("publications.record")
    def post(self, request: Request, space: str) -> DeviceCall:
        mutation = Mutation(request, ("source", "source_version"), required=("source", "source_version"))
        return DeviceCall("publications.record", mutation.args(space=space, **mutation.fields))


class MemoryVersionsView(SharedView):
    @doc("memory.versions")
    def post(self, request: Request, memory: str) -> DeviceCall:
        """A correction: the object's next version, `text` its payload, while `version` is its
        current one (the contract checks both: MemoryVersion)."""
        mutation = Mutation(request, ("text", "version"), required=("text", "version"))
        return DeviceCall("memory.versions", mutation.args(memory=memory, **mutation.fields))


class MemoryDeletionView(SharedView):
    @doc("memory.delete")
    def post(self, request: Request, memory: str) -> DeviceCall:
        """Forget the object, with an optional `reason` its receipt keeps."""
        mutation = Mutation(request, ("reason",))
        return DeviceCall("memory.delete", mutation.args(memory=memory, **mutation.fields))


class ResultView(SharedView):
    @doc("operations.result")
    def get(self, request: Request, operation: str) -> DeviceCall:
        return DeviceCall("operations.result", {"operation": operation, "offset": offset_arg(request)})


class RawBytesParser(BaseParser):
    media_type = "*/*"

    # request.data is the body itself, bytes, where BaseParser promises a mapping
    def parse(self, stream: IO[bytes] | None, media_type: str | None = None,  # type: ignore[override]
              parser_context: Mapping[str, object] | None = None) -> bytes:
        data = stream.read(MAX_MEDIA_BYTES + 1) if stream is not None else b""
        if len(data) > MAX_MEDIA_BYTES:
            raise ServiceError(413, "media_too_large", f"a media source is at most {MAX_MEDIA_BYTES} bytes")
        return data


class MediaView(SharedView):
    """PUT /aotx/v1/media/{sha256}: upload a media source owned by the caller's participant.
    The type comes from Content-Type (image/* or audio/*); the bytes must hash to the path."""
    parser_classes = [RawBytesParser]
    body_limit = MAX_MEDIA_BYTES
    body_code = "media_too_large"

    @doc("media.put")
    def put(self, request: Request, sha256: str) -> DeviceCall:
        media_type = MEDIA_TYPE.fullmatch(request.content_type.split(";", 1)[0].strip())
        if media_type is None:  # (a type alone, "image", names no format: RFC 9110 wants type/subtype)
            raise ServiceError(415, "unsupported_media_type", "Content-Type must be image/* or audio/* with a subtype")
        data = request.data if isinstance(request.data, bytes) else b""
        return DeviceCall("media.put", {"sha256": sha256, "data": data, "type": media_type.group(1).lower()})


class OperationsView(SharedView):
    @doc("operations.list")
    def get(self, request: Request) -> DeviceCall:
        return DeviceCall("operations.list", list_args(request))


class OperationView(SharedView):
    @doc("operations.get")
    def get(self, request: Request, operation: str) -> DeviceCall:
        no_query(request)
        return DeviceCall("operations.get", {"operation": operation})


class RetirementsView(SharedView):
    @doc("retirements.record")
    def post(self, request: Request) -> DeviceCall:
        mutation = Mutation(request, ("retry_floor",), required=("retry_floor",))
        floor = decimal_counter(mutation.fields["retry_floor"], "retry_floor", positive=True)
        return DeviceCall("retirements.record", mutation.args(retry_floor=floor))


class CancellationsView(SharedView):
    @doc("cancellations.record")
    def post(self, request: Request) -> DeviceCall:
        mutation = Mutation(request, ("target_sequence",), required=("target_sequence",))
        target = decimal_counter(mutation.fields["target_sequence"], "target_sequence", positive=True)
        return DeviceCall("cancellations.record", mutation.args(target_sequence=target))
