"""Each device command's arguments as a declared type, imported by both processes
(docs/protocol.md, "Commands").

Both sides read a map with `parse`: the gateway the fields it parsed from a request (before it
sends anything), the device a frame's `args`. msgspec checks the types (an unknown field, a
wrong type or a missing field is a 400 naming where, `$.field`), and each type's `__post_init__`
checks the values that need no state (ID shapes, enumerations, ranges) with the precise code and
message a client of either process sees. So such a check is written once, here; what needs the
device's state (a row, a right, a quota, the served model) stays with the operation that reads
the state. The types of the OpenAI-compatible routes' commands are in chat.py, their base and
shared checks in args.py.

Optional arguments left out are left out of the frame too (omit_defaults), and read back as the
defaults written here; null is never a value (Args.before).
"""
from __future__ import annotations

import re
from typing import Any, Mapping, TypeVar

import msgspec

from . import ids, structured
from .args import Args, counter, decimal, hex32, integer, number_in, one_of, resource_id
from .chat import Chat, Embeddings
from .errors import ServiceError
from .limits import (DEFAULT_LIMIT, INPUT_BYTES, MAX_LIMIT, MAX_MEDIA, MAX_MEDIA_BYTES, MAX_REASON_BYTES,
                     MAX_MEMORY_TTL_SECONDS, MAX_SEARCH_RESULTS, MAX_STAFF_NAME, MEDIA_LINK_BYTES,
                     MEMORY_PAYLOAD_BYTES)
from .vocabulary import CONTEXTS, MEDIA_TYPES, PERMISSIONS, RETENTIONS, SCOPES
from .wire import LENGTH, MAX_FRAME, PROTOCOL_VERSION, ProtocolError

# Media control tokens of the model families this service may run: an input's text may not carry
# them (the device adds media links itself); refused before anything is retained.
RESERVED_TOKENS = ("<|image|>", "<|audio|>", "<image>", "<audio>", "<|media|>", "<|vision_start|>",
                   "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|audio_bos|>", "<|audio_eos|>",
                   "<start_of_image>", "<end_of_image>", "<|begin_of_image|>", "<|end_of_image|>")


# ---- commands without arguments, and pages ----------------------------------------------------------

class NoArgs(Args, kw_only=True, frozen=True):
    """ping, capabilities, participant.get, models.list, checkpoint."""


class Page(Args, kw_only=True, frozen=True):
    """A list read: after `cursor` (a row's creation counter, as the previous page gave it), at
    most `limit` items."""
    cursor: str | None = None
    limit: int = DEFAULT_LIMIT

    @classmethod
    def error_code(cls, field: str | None) -> str:
        return "bad_limit" if field == "limit" else super().error_code(field)

    def __post_init__(self) -> None:
        if type(self.limit) is not int or not 1 <= self.limit <= MAX_LIMIT:
            raise ServiceError(400, "bad_limit", f"limit must be an integer 1..{MAX_LIMIT}")
        if self.cursor is not None:
            decimal(self.cursor, "cursor")

    @property
    def after(self) -> int | None:
        return None if self.cursor is None else int(self.cursor)


class ParticipantRef(Args, kw_only=True, frozen=True):
    participant: str

    def __post_init__(self) -> None:
        resource_id(self.participant, "par")


class SpaceRef(Args, kw_only=True, frozen=True):
    space: str

    def __post_init__(self) -> None:
        resource_id(self.space, "spc")


class SpacePage(Page, kw_only=True, frozen=True):
    space: str

    def __post_init__(self) -> None:
        resource_id(self.space, "spc")
        super().__post_init__()


class MemorySearch(Args, kw_only=True, frozen=True):
    """memory.search: the rows of a space's memory most similar to `q` (recall's embedding and
    visibility), at most `limit` (1..MAX_SEARCH_RESULTS)."""
    space: str
    q: str
    limit: int = 10

    @classmethod
    def error_code(cls, field: str | None) -> str:
        return {"limit": "bad_limit", "q": "bad_search_query"}.get(field or "", super().error_code(field))

    def __post_init__(self) -> None:
        resource_id(self.space, "spc")
        if type(self.q) is not str or not self.q.strip():
            raise ServiceError(400, "bad_search_query", "q must be non-empty text")
        if len(self.q.encode("utf-8", "surrogatepass")) > INPUT_BYTES:
            raise ServiceError(400, "bad_search_query", f"q exceeds {INPUT_BYTES} UTF-8 bytes")
        if type(self.limit) is not int or not 1 <= self.limit <= MAX_SEARCH_RESULTS:
            raise ServiceError(400, "bad_limit", f"limit must be an integer 1..{MAX_SEARCH_RESULTS}")


class ConversationRef(Args, kw_only=True, frozen=True):
    conversation: str

    def __post_init__(self) -> None:
        resource_id(self.conversation, "con")


class ConversationPage(Page, kw_only=True, frozen=True):
    conversation: str

    def __post_init__(self) -> None:
        resource_id(self.conversation, "con")
        super().__post_init__()


class ConversationSubscribe(Args, kw_only=True, frozen=True):
    """conversations.subscribe: events after `cursor` (an event's order), then live ones."""
    conversation: str
    cursor: str | None = None

    def __post_init__(self) -> None:
        resource_id(self.conversation, "con")
        if self.cursor is not None:
            decimal(self.cursor, "cursor")


class OperationRef(Args, kw_only=True, frozen=True):
    operation: str

    def __post_init__(self) -> None:
        resource_id(self.operation, "op")


class OperationBytes(OperationRef, kw_only=True, frozen=True):
    """A byte-span read of an operation's result from `offset` (the device bounds it by the length)."""
    offset: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _offset(self.offset)


def _offset(offset: object) -> None:
    if type(offset) is not int or not 0 <= offset <= ids.MAX_COUNTER:
        raise ServiceError(400, "bad_offset", "offset must be a non-negative integer")


class MemoryRead(Args, kw_only=True, frozen=True):
    """memory.get: a memory object from `offset`; with `version`, only while that is its version."""
    memory: str
    offset: int = 0
    version: int | None = None

    def __post_init__(self) -> None:
        resource_id(self.memory, "mem")
        _offset(self.offset)
        if self.version is not None:
            counter(self.version, "version", least=1)


class ReceiptFilter(Page, kw_only=True, frozen=True):
    """ops.receipts: every live receipt, filtered (the ops console's receipts page)."""
    participant: str | None = None
    kind: str | None = None
    status: str | None = None
    saved: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.participant is not None:
            resource_id(self.participant, "par")
        if self.saved is not None:
            one_of(self.saved, "saved", ("unsaved", "admission", "terminal"))


class StaffForget(Args, kw_only=True, frozen=True):
    """ops.memory.forget: the console's staff forget a memory object (memory/ops.py), by the
    device's operator participant, with a required `reason` and the console user's name
    (`staff`), both kept in the receipt's command bytes."""
    memory: str
    reason: str
    staff: str

    def __post_init__(self) -> None:
        resource_id(self.memory, "mem")
        if (type(self.reason) is not str or not self.reason.strip()
                or len(self.reason.encode("utf-8", "surrogatepass")) > MAX_REASON_BYTES):
            raise ServiceError(400, "bad_field", f"reason must be a non-empty string of at most {MAX_REASON_BYTES} "
                                                 "UTF-8 bytes")
        if type(self.staff) is not str or not self.staff.strip() or len(self.staff) > MAX_STAFF_NAME:
            raise ServiceError(400, "bad_field", f"staff must be the console user's name, 1..{MAX_STAFF_NAME} "
                                                 "characters")


class SubscriptionClose(Args, kw_only=True, frozen=True):
    """subscriptions.close: the request ID of a stream this connection opened."""
    id: int


class AuditExport(Args, kw_only=True, frozen=True):
    """audit.export: the file the device writes the audit prefix to (absolute, its own directory)."""
    path: str


class MediaPut(Args, kw_only=True, frozen=True):
    """media.put: a media source's bytes, its sha256 and its type."""
    sha256: str
    data: bytes
    type: str

    def __post_init__(self) -> None:
        if not ids.SHA256.match(self.sha256):
            raise ServiceError(400, "bad_id", "the path must be the 64 lowercase hex sha256 of the bytes")
        if self.type not in MEDIA_TYPES:
            raise ServiceError(415, "unsupported_media_type", "Content-Type must be image/* or audio/*")
        if len(self.data) > MAX_MEDIA_BYTES:
            raise ServiceError(413, "media_too_large", f"a media source is at most {MAX_MEDIA_BYTES} bytes")


# ---- mutations ---------------------------------------------------------------------------------

_HEX32 = ids.HEX32.match
_ZERO32 = "0" * 32


class Mutation(Args, kw_only=True, frozen=True):
    """A mutation's envelope (SPEC "Mutations"): the participant's lineage, the operation key, the
    sequence and the canonical operation bytes its receipt keeps."""
    lineage: str
    operation_key: str
    sequence: int
    canonical: bytes

    def __post_init__(self) -> None:
        # every admission parses one: the common case in one expression (the types are msgspec's),
        # the named refusal from the checks below
        key = self.operation_key
        if _HEX32(self.lineage) and _HEX32(key) and key != _ZERO32 and 1 <= self.sequence <= ids.MAX_COUNTER:
            return
        hex32(self.lineage, "lineage")
        hex32(key, "operation_key", nonzero=True)
        counter(self.sequence, "sequence", least=1)


class NewSpace(Mutation, kw_only=True, frozen=True):
    id: str | None = None
    scope: str = "private"
    memory_ttl_seconds: int | None = None  # the rows retained in it expire this long after (docs/memory.md)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.id is not None:
            hex32(self.id, "id")
        if self.scope not in SCOPES:
            raise ServiceError(400, "bad_field", "scope must be private, room or instance")
        integer(self.memory_ttl_seconds, "memory_ttl_seconds", 1, MAX_MEMORY_TTL_SECONDS)


class MemberSet(Mutation, kw_only=True, frozen=True):
    space: str
    participant: str
    permissions: list[str]

    def __post_init__(self) -> None:
        super().__post_init__()
        resource_id(self.participant, "par")
        permissions = self.permissions
        if (type(permissions) is not list or any(p not in PERMISSIONS for p in permissions)
                or len(set(permissions)) != len(permissions)):
            raise ServiceError(400, "bad_field", "permissions must be an array of distinct values of read, write, "
                                                 "manage")
        resource_id(self.space, "spc")


class NewConversation(Mutation, kw_only=True, frozen=True):
    space: str
    id: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.id is not None:
            hex32(self.id, "id")
        resource_id(self.space, "spc")


class Retirement(Mutation, kw_only=True, frozen=True):
    retry_floor: int

    def __post_init__(self) -> None:
        super().__post_init__()
        counter(self.retry_floor, "retry_floor", least=1)


class Cancellation(Mutation, kw_only=True, frozen=True):
    target_sequence: int

    def __post_init__(self) -> None:
        super().__post_init__()
        counter(self.target_sequence, "target_sequence", least=1)


class SpaceDeletion(Mutation, kw_only=True, frozen=True):
    space: str

    def __post_init__(self) -> None:
        super().__post_init__()
        resource_id(self.space, "spc")


class ConversationDeletion(Mutation, kw_only=True, frozen=True):
    conversation: str

    def __post_init__(self) -> None:
        super().__post_init__()
        resource_id(self.conversation, "con")


class Publication(Mutation, kw_only=True, frozen=True):
    space: str
    source: str
    source_version: str

    def __post_init__(self) -> None:
        super().__post_init__()
        resource_id(self.source, "mem")
        decimal(self.source_version, "source_version", what="a decimal string (the row's version)")
        resource_id(self.space, "spc")


def no_reserved_tokens(text: str) -> None:
    """400 `reserved_token` for a text holding a family's media control token (an input's, a
    correction's: both reach a prompt)."""
    reserved = [token for token in RESERVED_TOKENS if token in text]
    if reserved:
        raise ServiceError(400, "reserved_token", f"text contains the reserved media control token {reserved[0]}")


class ConversationFork(Mutation, kw_only=True, frozen=True):
    """conversations.fork: a new conversation in the source's space whose history is the
    source's through the input at event cursor `at` (kinds/forks.py); `id` as for a creation."""
    conversation: str
    at: str
    id: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        resource_id(self.conversation, "con")
        decimal(self.at, "at", least=1, what="an event cursor: a decimal string of 1 or more")
        if self.id is not None:
            hex32(self.id, "id")


class MemoryVersion(Mutation, kw_only=True, frozen=True):
    """memory.versions: a memory object's next version, its payload replaced by `text`, while
    `version` (a decimal string) is still its current one (kinds/memory_versions.py)."""
    memory: str
    text: str
    version: str

    def __post_init__(self) -> None:
        super().__post_init__()
        resource_id(self.memory, "mem")
        decimal(self.version, "version", least=1, what="a decimal string (the row's current version)")
        if type(self.text) is not str or not self.text:
            raise ServiceError(400, "bad_field", "text must be a non-empty string")
        no_reserved_tokens(self.text)
        size = len(self.text.encode("utf-8", "surrogatepass"))
        if size > MEMORY_PAYLOAD_BYTES:
            raise ServiceError(400, "text_too_large", f"text takes {size} bytes; a memory object holds at most "
                                                      f"{MEMORY_PAYLOAD_BYTES}")


class MemoryDeletion(Mutation, kw_only=True, frozen=True):
    """memory.delete: forget a memory object (kinds/memory_deletions.py), with the reason its
    receipt keeps."""
    memory: str
    reason: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        resource_id(self.memory, "mem")
        if self.reason is not None and (type(self.reason) is not str
                                        or len(self.reason.encode("utf-8", "surrogatepass")) > MAX_REASON_BYTES):
            raise ServiceError(400, "bad_field", f"reason must be a string of at most {MAX_REASON_BYTES} UTF-8 bytes")


class MediaRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One media row of an input: an uploaded source by its sha256."""
    type: str
    sha256: str


class Input(Mutation, kw_only=True, frozen=True):
    """conversations.input (SPEC "Conversation input"); the defaults the device applies: the
    model's page grant for `pages`, the profile's for `max_output_tokens`, temperature 0, top_p 1,
    retention "source", context "compact"."""
    conversation: str
    text: str
    model: str
    max_output_tokens: int | None = None
    pages: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    media: list[MediaRef] = []
    retention: str = "source"
    context: str = "compact"
    # structured outputs (contract/structured.py): the result bytes are JSON of this schema
    response_format: dict[str, Any] | None = None
    memory_ttl_seconds: int | None = None  # the rows it retains expire this long after (else its space's)

    @classmethod
    def before(cls, raw: dict[str, object]) -> None:
        super().before(raw)
        media = raw.get("media")
        if type(media) is list and len(media) > MAX_MEDIA:  # counted first: the rows are not read
            raise ServiceError(400, "too_many_media", f"media holds {len(media)} references; at most {MAX_MEDIA}")

    def __post_init__(self) -> None:
        super().__post_init__()
        if type(self.text) is not str or type(self.model) is not str:
            raise ServiceError(400, "bad_field", "text and model must be strings")
        integer(self.max_output_tokens, "max_output_tokens", 1, ids.MAX_COUNTER)
        integer(self.pages, "pages", 1, ids.MAX_COUNTER)
        integer(self.memory_ttl_seconds, "memory_ttl_seconds", 1, MAX_MEMORY_TTL_SECONDS)
        number_in(self.temperature, "temperature", 0, 2)
        number_in(self.top_p, "top_p", 0, 1, open_low=True)
        one_of(self.retention, "retention", RETENTIONS)
        one_of(self.context, "context", CONTEXTS)
        media = self.media
        if len(media) > MAX_MEDIA:
            raise ServiceError(400, "too_many_media", f"media holds {len(media)} references; at most {MAX_MEDIA}")
        if type(media) is not list or any(type(m) is not MediaRef or m.type not in MEDIA_TYPES
                                          or type(m.sha256) is not str or not ids.SHA256.match(m.sha256)
                                          for m in media):
            raise ServiceError(400, "bad_field", "media must be an array of rows {type: image|audio, sha256: 64 "
                                                 "lowercase hex}")
        if not self.text and not media:
            raise ServiceError(400, "bad_field", "text can be empty only when media is present")
        no_reserved_tokens(self.text)
        size = len(self.text.encode("utf-8", "surrogatepass")) + MEDIA_LINK_BYTES * len(media)
        if size > INPUT_BYTES:
            raise ServiceError(400, "input_too_large", f"text and media links take {size} bytes; the limit is "
                                                       f"{INPUT_BYTES} ({MEDIA_LINK_BYTES} per media link)")
        resource_id(self.conversation, "con")
        structured.check_response_format(self.response_format, "bad_field")
        schema = structured.schema_of(self.response_format)
        if schema is not None:
            structured.check_enforceable(schema, "response_format's schema", "bad_field")


# ---- reading a frame's arguments ----------------------------------------------------------------------

A = TypeVar("A", bound=Args)


def parse(kind: type[A], raw: object) -> A:
    """A frame's `args` map as the command's type, every check above made; a ServiceError
    otherwise (msgspec's own type errors are 400 `bad_field`, naming the field). The gateway
    builds a route's arguments the same way, from the JSON values it parsed, so a request the
    device would refuse is refused before it is sent, with the same error."""
    if type(raw) is dict:
        kind.before(raw)
    try:
        # (bytes pass as bytes: a string is refused, never read as base64)
        return msgspec.convert({} if raw is None else raw, kind, strict=True, builtin_types=(bytes,))
    except msgspec.ValidationError as exc:
        text = str(exc)
        named = _FIELD.search(text)
        raise ServiceError(400, kind.error_code(next(filter(None, named.groups())) if named else None), text) from None


# where msgspec's message names the field: "... - at `$.temperature`", "... required field `model`"
_FIELD = re.compile(r"at `\$\.(\w+)|required field `(\w+)`")


# Each command's arguments type (tests/gpu_worker/contract/test_commands.py checks it against the
# vocabulary's commands).
TYPES: dict[str, type[Args]] = {
    "ping": NoArgs, "checkpoint": NoArgs, "ops.receipts": ReceiptFilter, "ops.receipt": OperationRef,
    "ops.result": OperationBytes, "ops.command": OperationRef, "ops.memory": SpacePage,
    "ops.memory.forget": StaffForget, "audit.export": AuditExport,
    "capabilities": NoArgs, "participant.get": NoArgs, "participants.get": ParticipantRef, "spaces.list": Page,
    "spaces.get": SpaceRef, "members.list": SpacePage, "conversations.list": SpacePage,
    "conversations.get": ConversationRef, "conversations.events": ConversationPage, "operations.list": Page,
    "operations.get": OperationRef, "operations.result": OperationBytes, "memory.list": SpacePage,
    "memory.get": MemoryRead, "memory.search": MemorySearch, "models.list": NoArgs,
    "chat.completions": Chat, "embeddings": Embeddings, "media.put": MediaPut,
    "conversations.subscribe": ConversationSubscribe, "operations.subscribe": OperationBytes,
    "subscriptions.close": SubscriptionClose,
    "participant.register": Mutation, "spaces.create": NewSpace, "members.set": MemberSet,
    "conversations.create": NewConversation, "retirements.record": Retirement, "conversations.input": Input,
    "cancellations.record": Cancellation, "spaces.delete": SpaceDeletion, "conversations.delete": ConversationDeletion,
    "publications.record": Publication, "memory.versions": MemoryVersion, "memory.delete": MemoryDeletion,
    "conversations.fork": ConversationFork,
}


_REQUESTS = msgspec.msgpack.Encoder()


def typed(op: str, args: Args | Mapping[str, object] | None) -> Args:
    """A command's arguments as its declared type: a map is checked as that type, so no client
    sends what the device would refuse as malformed (a ServiceError, before anything is sent)."""
    if isinstance(args, Args):
        return args
    kind = TYPES.get(op)
    if kind is None:
        raise ProtocolError(f"unknown device command {op!r}")
    return parse(kind, args)


def request(req_id: int, op: str, principal: str | None,
            args: Args | Mapping[str, object] | None = None) -> bytes:
    """The frame of one request, its arguments as the command's declared type (`typed`)."""
    args = typed(op, args)
    payload = _REQUESTS.encode({"v": PROTOCOL_VERSION, "id": req_id, "op": op, "principal": principal, "args": args})
    if len(payload) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return LENGTH.pack(len(payload)) + payload
