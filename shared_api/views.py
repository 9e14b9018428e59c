"""The shared routes (DESIGN §4). Views are thin: check the gateway action, parse strictly,
call the device, pass its bytes through. The device re-checks grants and membership."""
import re

from rest_framework.parsers import BaseParser
from rest_framework.views import APIView

from .auth import require_action
from .device_client import device_response
from .errors import ApiError
from .openapi import doc
from .strict import Mutation, decimal_counter, hex32, resource_id

MAX_LIMIT = 200
DIGITS = re.compile(r"[0-9]{1,4}")  # ASCII digits only: str.isdigit() also accepts "²" and "٣"
DIGITS_ANY = re.compile(r"[0-9]{1,18}")
SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_MEDIA_BYTES = 8 << 20
INPUT_FIELDS = ("text", "model", "max_output_tokens", "pages", "temperature", "top_p", "media")
SCOPES = ("private", "room", "instance")
PERMISSIONS = ("read", "write", "manage")


def list_args(request, **extra):
    args = dict(extra)
    cursor = request.query_params.get("cursor")
    if cursor is not None:
        decimal_counter(cursor, "cursor")
        args["cursor"] = cursor
    limit = request.query_params.get("limit")
    if limit is not None:
        if not DIGITS.fullmatch(limit) or not 1 <= int(limit) <= MAX_LIMIT:
            raise ApiError(400, "bad_limit", f"limit must be an integer 1..{MAX_LIMIT}")
        args["limit"] = int(limit)
    no_query(request, allowed=("cursor", "limit"))
    return args


def no_query(request, allowed=()):
    unknown = sorted(set(request.query_params) - set(allowed))
    if unknown:
        raise ApiError(400, "unknown_parameter", f"unknown query parameter(s): {', '.join(unknown)}")


class SharedView(APIView):
    """GET needs shared_read; POST needs the view's write_action."""
    write_action = "shared_write"

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        require_action(request, "shared_read" if request.method in ("GET", "HEAD") else self.write_action)


class CapabilitiesView(SharedView):
    @doc("capabilities.get")
    def get(self, request):
        no_query(request)
        return device_response("capabilities", request)


class ParticipantView(SharedView):
    @doc("participant.get")
    def get(self, request):
        no_query(request)
        return device_response("participant.get", request)

    @doc("participant.register")
    def post(self, request):
        return device_response("participant.register", request, Mutation(request).args())


class OtherParticipantView(SharedView):
    @doc("participants.get")
    def get(self, request, participant):
        no_query(request)
        return device_response("participants.get", request, {"participant": resource_id(participant, "par")})


class SpacesView(SharedView):
    @doc("spaces.list")
    def get(self, request):
        return device_response("spaces.list", request, list_args(request))

    @doc("spaces.create")
    def post(self, request):
        mutation = Mutation(request, ("id", "scope"))
        fields = mutation.fields
        if "id" in fields:
            hex32(fields["id"], "id")
        if fields.get("scope", "private") not in SCOPES:
            raise ApiError(400, "bad_field", "scope must be private, room or instance")
        return device_response("spaces.create", request, mutation.args(**fields))


class SpaceView(SharedView):
    @doc("spaces.get")
    def get(self, request, space):
        no_query(request)
        return device_response("spaces.get", request, {"space": resource_id(space, "spc")})


class MembersView(SharedView):
    write_action = "shared_manage"

    @doc("members.list")
    def get(self, request, space):
        return device_response("members.list", request, list_args(request, space=resource_id(space, "spc")))

    @doc("members.set")
    def post(self, request, space):
        mutation = Mutation(request, ("participant", "permissions"), required=("participant", "permissions"))
        fields = mutation.fields
        resource_id(fields["participant"], "par")
        permissions = fields["permissions"]
        if (not isinstance(permissions, list) or any(p not in PERMISSIONS for p in permissions)
                or len(set(permissions)) != len(permissions)):
            raise ApiError(400, "bad_field", "permissions must be an array of distinct values of read, write, manage")
        return device_response("members.set", request,
                               mutation.args(space=resource_id(space, "spc"), **fields))


class ConversationsView(SharedView):
    @doc("conversations.list")
    def get(self, request, space):
        return device_response("conversations.list", request,
                               list_args(request, space=resource_id(space, "spc")))

    @doc("conversations.create")
    def post(self, request, space):
        mutation = Mutation(request, ("id",))
        if "id" in mutation.fields:
            hex32(mutation.fields["id"], "id")
        return device_response("conversations.create", request,
                               mutation.args(space=resource_id(space, "spc"), **mutation.fields))


class ConversationView(SharedView):
    @doc("conversations.get")
    def get(self, request, conversation):
        no_query(request)
        return device_response("conversations.get", request, {"conversation": resource_id(conversation, "con")})


def _integer(fields, name):
    value = fields.get(name)
    if value is not None and (type(value) is not int):  # bool is an int subclass; floats are refused
        raise ApiError(400, "bad_field", f"{name} must be a JSON integer")


def _number(fields, name):
    value = fields.get(name)
    if value is not None and (type(value) not in (int, float)):
        raise ApiError(400, "bad_field", f"{name} must be a JSON number")


class InputsView(SharedView):
    @doc("conversations.input")
    def post(self, request, conversation):
        mutation = Mutation(request, INPUT_FIELDS, required=("text", "model"))
        fields = mutation.fields
        if not isinstance(fields["text"], str) or not isinstance(fields["model"], str):
            raise ApiError(400, "bad_field", "text and model must be strings")
        for name in ("max_output_tokens", "pages"):
            _integer(fields, name)
        for name in ("temperature", "top_p"):
            _number(fields, name)
        media = fields.get("media", [])
        if (not isinstance(media, list) or len(media) > 8
                or any(not isinstance(m, dict) or set(m) != {"type", "sha256"} or m["type"] not in ("image", "audio")
                       or not isinstance(m["sha256"], str) or not SHA256.fullmatch(m["sha256"]) for m in media)):
            raise ApiError(400, "bad_field", "media must be at most 8 rows of {type: image|audio, sha256: 64 "
                                             "lowercase hex}")
        return device_response("conversations.input", request,
                               mutation.args(conversation=resource_id(conversation, "con"), **fields))


class ResultView(SharedView):
    @doc("operations.result")
    def get(self, request, operation):
        no_query(request, allowed=("offset",))
        offset = request.query_params.get("offset", "0")
        if not DIGITS_ANY.fullmatch(offset):
            raise ApiError(400, "bad_offset", "offset must be a non-negative integer")
        return device_response("operations.result", request,
                               {"operation": resource_id(operation, "op"), "offset": int(offset)})


class RawBytesParser(BaseParser):
    media_type = "*/*"

    def parse(self, stream, media_type=None, parser_context=None):
        data = stream.read(MAX_MEDIA_BYTES + 1) if stream is not None else b""
        if len(data) > MAX_MEDIA_BYTES:
            raise ApiError(413, "media_too_large", f"a media source is at most {MAX_MEDIA_BYTES} bytes")
        return data


class MediaView(SharedView):
    """PUT /aotx/v1/media/{sha256}: upload a media source owned by the caller's participant.
    The type comes from Content-Type (image/* or audio/*); the bytes must hash to the path."""
    parser_classes = [RawBytesParser]

    @doc("media.put")
    def put(self, request, sha256):
        if not SHA256.fullmatch(sha256):
            raise ApiError(400, "bad_id", "the path must be the 64 lowercase hex sha256 of the bytes")
        kind = request.content_type.split("/", 1)[0]
        if kind not in ("image", "audio"):
            raise ApiError(415, "unsupported_media_type", "Content-Type must be image/* or audio/*")
        data = request.data if isinstance(request.data, bytes) else b""
        return device_response("media.put", request, {"sha256": sha256, "data": data, "type": kind})


class OperationsView(SharedView):
    @doc("operations.list")
    def get(self, request):
        return device_response("operations.list", request, list_args(request))


class OperationView(SharedView):
    @doc("operations.get")
    def get(self, request, operation):
        no_query(request)
        return device_response("operations.get", request, {"operation": resource_id(operation, "op")})


class RetirementsView(SharedView):
    @doc("retirements.record")
    def post(self, request):
        mutation = Mutation(request, ("retry_floor",), required=("retry_floor",))
        floor = decimal_counter(mutation.fields["retry_floor"], "retry_floor")
        return device_response("retirements.record", request, mutation.args(retry_floor=floor))


class CancellationsView(SharedView):
    @doc("cancellations.record")
    def post(self, request):
        mutation = Mutation(request, ("target_sequence",), required=("target_sequence",))
        target = decimal_counter(mutation.fields["target_sequence"], "target_sequence")
        return device_response("cancellations.record", request, mutation.args(target_sequence=target))
