"""The OpenAPI 3.1 description of /aotx/v1/shared (DESIGN §4), served at /aotx/v1/openapi.json.

One table, OPERATIONS, says for every route and method: its grant, request body, query and path
parameters, success response and every error status with the codes it carries. `doc(key)` turns
an entry into the view method's @extend_schema; `postprocess` (a SPECTACULAR postprocessing
hook) adds the hand-written component schemas below and the general description.

Each error response narrows the one error body `{"error": {"code", "message", ...}}` to the codes
listed for that status, and lists them in its description, so the schema, the schemathesis run
(tests/e2e/test_schemathesis.py) and tests/shared_api/test_openapi.py (which collects every
ServiceError code from the source) keep each other honest: a new error code or route
fails a test until it is documented here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, TypeVar

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema

from gpu_worker.contract import ids
from gpu_worker.contract.limits import DEFAULT_LIMIT, MAX_BODY_BYTES, MAX_LIMIT, MAX_MEDIA, MAX_MEDIA_BYTES
from gpu_worker.contract.vocabulary import (CAPABILITIES_SCHEMA, COMMANDS, CONTEXTS, MEDIA_TYPES, MEMORY_KINDS,
                                            MUTATION_SCHEMA, NOT_RETAINED, RETENTIONS,
                                            PERMISSIONS, QUOTAS, RATES, RECEIPT_SCHEMA, SCOPES, TERMINAL_STATUSES)

if TYPE_CHECKING:
    from drf_spectacular.openapi import AutoSchema

Schema = dict[str, Any]  # a JSON Schema / OpenAPI object
Spec = dict[str, Any]    # one OPERATIONS entry (_read, _mutation)
Errors = dict[int, tuple[str, ...]]  # status -> error codes
_F = TypeVar("_F", bound=Callable[..., Any])

# ---- patterns (the contract's shapes: gpu_worker/contract/ids.py) ----------------------------

HEX32 = ids.HEX32_PATTERN
COUNTER = f"^{ids.COUNTER_PATTERN}$"        # decimal string, no leading zeros, < 2**63
POSITIVE = f"^{ids.POSITIVE_PATTERN}$"      # a counter of at least 1
ID_PATTERNS = {prefix: f"^{pattern}$" for prefix, pattern in ids.ID_PATTERNS.items()}
SHA256 = "^[0-9a-f]{64}$"

def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def string(pattern: str, description: str | None = None) -> Schema:
    out: Schema = {"type": "string", "pattern": pattern}
    if description:
        out["description"] = description
    return out


def obj(properties: Schema, required: Iterable[str] | None = None, *, closed: bool = False,
        description: str | None = None) -> Schema:
    out: Schema = {"type": "object", "properties": properties,
           "required": list(properties) if required is None else list(required)}
    if closed:
        out["additionalProperties"] = False
    if description:
        out["description"] = description
    return out


def listing(item: str, description: str) -> Schema:
    return obj({"items": {"type": "array", "items": ref(item)},
                "next_cursor": nullable(ref("Counter"))},
               description=f"{description} `next_cursor` is null on the last page; pass it as `cursor`.")


def mutation_body(name: str, fields: Schema | None = None, required: Iterable[str] = (),
                  description: str = "") -> Schema:
    """A POST body: the mutation envelope plus the route's own fields, nothing else."""
    properties = {"schema": {"type": "string", "enum": [MUTATION_SCHEMA]},
                  "lineage": ref("Lineage"),
                  "operation_key": ref("OperationKey"),
                  "sequence": string(POSITIVE, "the participant's next sequence (GET /participant), "
                                               "or the original sequence for an exact retry")}
    properties.update(fields or {})
    return obj(properties, ("schema", "lineage", "operation_key", "sequence", *required), closed=True,
               description=f"{name}: the mutation envelope (schema, lineage, operation_key, sequence) "
                           f"{'plus ' + description if description else 'and nothing else'}. "
                           "Unknown fields, duplicate keys, invalid UTF-8 and non-JSON are refused with 400 "
                           "before the device sees the request.")


SSE_FRAMING = (
    "Server-sent events (text/event-stream). Each event has `id: <path>@<cursor>`, `event: <type>` and one "
    "`data:` line of JSON; a comment line every 15 s keeps the connection open. Conversation streams send "
    "`event` (an Event; cursor: its input order) as each input's admission is saved, after the ones the "
    "request's cursor has not seen, and `gap` ({gap, event_floor}; cursor: the last retired order it stands "
    "for) before the first event after retired orders: below the event floor (with or without a cursor) or a "
    "hole another member's retirement left; with `limit` the stream ends after that many `event` events (a "
    "`gap` is none), without it it runs "
    "until the client leaves. Operation streams send `output` ({offset, length, next_offset: counters, bytes "
    "(base64), text (null unless the span is complete UTF-8)}; cursor: next_offset) as the device saves each span, "
    "then one `terminal` ({operation, status, result, terminal}) and end. `Last-Event-ID` resumes from its cursor "
    "when the request gives none. A stream whose reader loses the right or the grant ends with `event: error` and the error "
    "body; so does one whose client reads slower than its events come (`stream_backlog`, once "
    "AOTX_STREAM_BACKLOG_BYTES, 1 MiB, of them wait in the gateway): resume it with `Last-Event-ID`. "
    "Disconnecting never cancels the operation.")

SAVE = obj({"source": {"type": "string", "enum": ["journal", "file"]},
            "file_incarnation": ref("Hex32"),
            "generation": ref("Counter"),
            "boot": ref("Counter"),
            "commit_digest": string("^[0-9a-f]{64}$", "hash chain over saved transfers"),
            "standby": nullable({"type": "boolean", "description": (
                "whether a standby held the transfer when it was saved (sync replication: true; saved alone, "
                "async or without a standby: false; null: not known, for a transfer a restart replayed)")})},
           description="where the save was acknowledged")

# what every byte-span read answers (operation results, memory payloads): gpu_worker/ops/lists.py byte_span
BYTE_SPAN = {
    "offset": ref("Counter"),
    "length": ref("Counter"),
    "next_offset": ref("Counter"),
    "bytes": {"type": "string", "contentEncoding": "base64"},
    "text": nullable({"type": "string"}),
}

SCHEMAS = {
    "Hex32": string(f"^{HEX32}$", "32 lowercase hexadecimal digits"),
    "Lineage": string(f"^{HEX32}$", "the participant's current lineage (GET /participant)"),
    "OperationKey": string(f"^{HEX32}$", "caller-chosen, nonzero, 32 lowercase hexadecimal digits"),
    "Counter": string(COUNTER, "a decimal string without leading zeros"),
    "ParticipantId": string(ID_PATTERNS["par"], "par-{32 hex}"),
    "SpaceId": string(ID_PATTERNS["spc"], "spc-{lineage}-{32 hex}"),
    "ConversationId": string(ID_PATTERNS["con"], "con-{lineage}-{32 hex}"),
    "OperationId": string(ID_PATTERNS["op"], "op-{lineage}-{32 hex}, assigned by the device"),
    "MemoryId": string(ID_PATTERNS["mem"], "mem-{lineage}-{32 hex}"),
    "ResourceId": {"anyOf": [ref("ParticipantId"), ref("SpaceId"), ref("ConversationId"),
                             ref("OperationId"), ref("MemoryId")]},
    "Permission": {"type": "string", "enum": list(PERMISSIONS)},
    "Binds": {"type": "string", "enum": ["always", "contention"],
              "description": "when a limit applies: always, or only while other principals are active (a "
                             "default shared among them by the engine or the gateway: alone, a principal may "
                             "use all of it; docs/grants.md, \"Shares under contention\")"},
    "Save": SAVE,
    "Receipt": obj({
        "schema": {"type": "string", "enum": [RECEIPT_SCHEMA]},
        "operation": ref("OperationId"),
        "participant": ref("ParticipantId"),
        "sequence": nullable(ref("Counter")),
        "operation_key": ref("Hex32"),
        "kind": string("^[a-z_.]+$", "participant.register, space.create, member.set, conversation.create, "
                                     "retirement, ..."),
        "target": ref("ResourceId"),
        "transport": obj({"accepted": {"type": "boolean"}}),
        "device": obj({"committed": {"type": "boolean"}}),
        "admission": obj({"saved": {"type": "boolean"}, "save": nullable(ref("Save"))}),
        "terminal": obj({"saved": {"type": "boolean"},
                         "status": {"enum": [*TERMINAL_STATUSES, None]},
                         "save": nullable(ref("Save"))}),
        "pending_bytes": ref("Counter"),
        "disk_error": nullable({"type": "string"}),
        "journal_hold": nullable(obj({"cause": {"enum": ["file_cap", "low_disk", "disk_full"]},
                                      "since_ns": ref("Counter"),
                                      "disk_error": nullable({"type": "string"})})),
        "result": obj({"length": ref("Counter"),
                       "input_tokens": nullable(ref("Counter")),
                       "output_tokens": nullable(ref("Counter")),
                       "finish": nullable({"type": "string"})}),
        "effective": obj({"model_digest": nullable(string("^[0-9a-f]{64}$")),
                          "page_limit": nullable(ref("Counter")),
                          "max_output_tokens": nullable(ref("Counter"))},
                         description="what the device accepted for an input, recorded with its admission apart "
                                     "from the caller's bytes: the model's digest, the page limit and the output "
                                     "limit (the caller's, or the default: min(256, pages x page_size / 2)); "
                                     "null for kinds that do not execute"),
        "memory": nullable(obj({
            "retention": nullable({"type": "string", "enum": list(RETENTIONS)}),
            "context": nullable({"type": "string", "enum": list(CONTEXTS)}),
            "retained": {"type": "array", "items": ref("MemoryId")},
            "not_retained": {"type": "array", "items": obj({
                "kind": {"type": "string", "enum": list(MEMORY_KINDS)},
                "reason": {"type": "string", "enum": list(NOT_RETAINED)}})}},
            description="An input's recorded retention mode (`interpret` only where the model has automatic "
                        "memory) and context rendering, the memory objects it retained, and what it did not "
                        "(with why); a publication's copy. Null for other kinds.")),
    }, description=f"{RECEIPT_SCHEMA}. `sequence` is null for a reader other than the owner. `target` is "
                   "the created or addressed resource. `pending_bytes` counts this operation's bytes not yet "
                   "saved. `journal_hold` is the device's current journal hold (null when none): new mutations "
                   "answer 429 while it lasts. `effective` is what the device accepted for an input (model "
                   "digest, page limit, output limit). More keys may be added."),
    "Participant": obj({
        "id": nullable(ref("ParticipantId")),
        "registered": {"type": "boolean"},
        "lineage": ref("Hex32"),
        "next_sequence": nullable(ref("Counter")),
        "retry_floor": nullable(ref("Counter")),
    }, description="An unregistered principal sees `id` null, `registered` false and the lineage it must "
                   "register under with `next_sequence` \"1\". Another participant's counters are null."),
    "Space": obj({
        "id": ref("SpaceId"),
        "scope": {"type": "string", "enum": list(SCOPES)},
        "owner": ref("ParticipantId"),
        "created_by_operation": ref("OperationId"),
        "rights": {"type": "array", "items": ref("Permission"), "uniqueItems": True,
                   "description": "the caller's effective rights (stored rights intersected with current grants)"},
    }),
    "Conversation": obj({
        "id": ref("ConversationId"),
        "space": ref("SpaceId"),
        "slot": ref("Counter"),
        "created_by_operation": ref("OperationId"),
    }),
    "Member": obj({
        "participant": ref("ParticipantId"),
        "permissions": {"type": "array", "items": ref("Permission"), "uniqueItems": True},
        "explicit": {"type": "boolean", "description": "false for the owner's implicit row"},
    }),
    "SpaceList": listing("Space", "Spaces the caller can see, in creation order."),
    "MemberList": listing("Member", "The owner (first page only, explicit false, one of its `limit` places), "
                                    "then explicit member rows."),
    "ConversationList": listing("Conversation", "Conversations of the space, in creation order."),
    "ReceiptList": listing("Receipt", "The caller's own live receipts, in sequence order."),
    "Capabilities": obj({
        "schema": {"type": "string", "enum": [CAPABILITIES_SCHEMA]},
        "schemas": obj({"mutation": {"type": "string", "enum": [MUTATION_SCHEMA]},
                        "receipt": {"type": "string", "enum": [RECEIPT_SCHEMA]}}),
        "models": {"type": "array", "items": obj({
            "name": {"type": "string"},
            "digest": string("^[0-9a-f]{64}$"),
            "media_types": {"type": "array", "items": {"type": "string"}},
            "automatic_memory": {"type": "boolean"}})},
        "embedding_model": nullable(obj({"name": {"type": "string"}, "digest": string("^[0-9a-f]{64}$")})),
        "limits": {"type": "object", "additionalProperties": ref("Counter"),
                   "required": ["participants", "spaces", "conversations", "members", "receipts",
                                "command_bytes", "result_bytes", "input_bytes", "media_link_bytes",
                                "media_rows", "max_output_tokens"],
                   "description": "capacities and bounds: `command_bytes` per receipt's canonical operation "
                                  "bytes (413 `command_too_large` past it), `max_output_tokens` the most an "
                                  "input may name (the page grant's tokens; an input's own bound is its "
                                  "`pages` x `page_size`)"},
        "defaults": obj({"max_output_tokens": ref("Counter"), "pages": ref("Counter")},
                        description="what an input that names none gets: `pages` the page grant; "
                                    "`max_output_tokens` 256 within half the input's page limit, "
                                    "min(256, pages x page_size / 2)"),
        "page_size": ref("Counter"),
        "page_grant": ref("Counter"),
        "grants": {"type": "array", "items": {"type": "string"}},
        "journal": obj({"hold": {"type": "boolean"},
                        "cause": nullable({"type": "string"}),
                        "since_ns": nullable(ref("Counter")),
                        "pending_bytes": ref("Counter"),
                        "disk_error": nullable({"type": "string"}),
                        "bytes": ref("Counter")}),
        "runtime": obj({"file_incarnation": ref("Hex32"), "generation": ref("Counter"), "boot": ref("Counter")}),
        "quotas": obj({name: obj({"limit": nullable(ref("Counter")), "default": {"type": "boolean"},
                                  "binds": ref("Binds"), "used": ref("Counter")}) for name in QUOTAS},
                      description="the caller's own quotas in force (`limit` null: unlimited; `default` true when "
                                  "the grant file leaves it out and the device's default applies: a quarter of "
                                  "each table, the whole device for what it runs) and what it holds now; "
                                  "`binds` says when the limit applies (docs/grants.md)"),
        "rates": obj({name: obj({"limit": nullable(ref("Counter")), "default": {"type": "boolean"},
                                 "binds": ref("Binds")}) for name in RATES},
                     description="the caller's own rates in force (`limit` null: unlimited; `default` true when "
                                 "the grant file leaves it out and the default rate applies), per second: "
                                 "requests and body bytes (the gateway refuses past them, 429 `rate_limited`, "
                                 "before it reads a body) and output tokens (the engine paces generation); "
                                 "docs/grants.md"),
    }),
    "Error": obj({"error": obj({
        "code": {"type": "string"},
        "message": {"type": "string"},
        "fields": {"type": "array", "items": {"type": "string"}},
        "lineage": ref("Hex32"),
        "next_sequence": ref("Counter"),
        "retry_floor": ref("Counter"),
        "sequence": ref("Counter"),
        "target_sequence": ref("Counter"),
        "cause": {"type": "string"},
        "disk_error": nullable({"type": "string"}),
        "pending_bytes": ref("Counter"),
        "quota": {"type": "string"},
        "limit": ref("Counter"),
        "used": ref("Counter"),
        "retry_after": string("^[0-9]+(\\.[0-9]+)?$", "seconds, a decimal string"),
    }, ("code", "message"))}, closed=True,
        description="The one error body. `code` is stable; `message` is one line for people (caller input it "
                    "echoes is escaped where no UTF-8 text can hold it: a lone surrogate reads `\\ud800`); "
                    "some codes add details (`fields`, `lineage`, `next_sequence`, `retry_floor`, `sequence`, "
                    "`target_sequence`; a journal hold adds `cause`, `disk_error`, `pending_bytes`; a quota or "
                    "rate adds `quota`, `limit`, and `used` or `retry_after`)."),
    "ParticipantRegisterRequest": mutation_body("Register the calling principal's participant"),
    "SpaceDeletionRequest": mutation_body("Delete the space in the path"),
    "ConversationDeletionRequest": mutation_body("Delete the conversation in the path"),
    "SpaceCreateRequest": mutation_body(
        "Create a space",
        {"id": ref("Hex32"),
         "scope": {"type": "string", "enum": list(SCOPES), "default": "private"}},
        description="`id` (32 hex; omitted: the operation key) and `scope` (default private)"),
    "MemberSetRequest": mutation_body(
        "Set a participant's explicit rights",
        {"participant": ref("ParticipantId"),
         "permissions": {"type": "array", "items": ref("Permission"), "uniqueItems": True, "maxItems": 3,
                         "description": "[] removes all explicit rights and leaves a zero-rights row"}},
        ("participant", "permissions"), "`participant` and `permissions`"),
    "ConversationCreateRequest": mutation_body(
        "Create a conversation", {"id": ref("Hex32")},
        description="`id` (32 hex; omitted: the operation key)"),
    "RetirementRequest": mutation_body(
        "Retire receipts below a new retry floor",
        {"retry_floor": string(POSITIVE, "every receipt below it must have a saved terminal result; "
                                         "at most this retirement's own sequence")},
        ("retry_floor",), "`retry_floor`"),
    "InputRequest": mutation_body(
        "Submit a conversation input",
        {"text": {"type": "string", "description": "may be empty only when media is present"},
         "model": {"type": "string", "description": "a model name or digest from /capabilities"},
         "max_output_tokens": {"type": "integer", "minimum": 1,
                               "description": "at most pages x page_size; omitted: min(256, pages x page_size / "
                                              "2), the prompt keeping the other half (the receipt's "
                                              "`effective.max_output_tokens`)"},
         "pages": {"type": "integer", "minimum": 1, "description": "page limit; default the page grant"},
         "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 0},
         "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1},
         "media": {"type": "array", "maxItems": MAX_MEDIA, "items": obj({
             "type": {"type": "string", "enum": list(MEDIA_TYPES)},
             "sha256": string(SHA256)}, ("type", "sha256"), closed=True)},
         "retention": {"type": "string", "enum": list(RETENTIONS), "default": "source",
                       "description": "mode 1 retains the source text; mode 2 (`interpret`) also retains the "
                                      "model's interpretation of the turn, where the model has automatic memory"},
         "context": {"type": "string", "enum": list(CONTEXTS),
                     "default": "compact",
                     "description": "how recalled memory enters the prompt: lease revision 3, 4, 5 or 2"}},
        ("text", "model"),
        "`text` and `model`, optionally `max_output_tokens`, `pages`, `temperature`, `top_p`, `media`, "
        "`retention`, `context`; the text and 73 bytes per media link fit 2048 UTF-8 bytes"),
    "PublicationRequest": mutation_body(
        "Publish a memory object into this space",
        {"source": ref("MemoryId"), "source_version": ref("Counter")},
        ("source", "source_version"), "`source` (a memory object the caller sees) and `source_version` (its "
                                      "current version)"),
    "MemoryRow": obj({
        "object": ref("MemoryId"),
        "version": ref("Counter"),
        "kind": {"type": "string", "enum": list(MEMORY_KINDS)},
        "scope": {"type": "string", "enum": list(SCOPES)},
        "published": {"type": "boolean"},
        "managed": {"type": "boolean"},
        "interpreted": {"type": "boolean", "description": "a turn's source whose interpretation was retained "
                                                         "later (which made it version 2)"},
        "owner": {"type": "string", "description": "the memory owner: `private-{32 hex}`, the room's space ID, "
                                                   "or `instance`"},
        "room": nullable(ref("SpaceId")),
        "byte_length": ref("Counter"),
        "source": ref("OperationId"),
        "actor": ref("ParticipantId"),
        "published_from": nullable(obj({"object": ref("MemoryId"), "version": ref("Counter")},
                                       description="the source object and the source version this copy was "
                                                   "published from")),
    }, description="A 128-byte memory metadata row as JSON (docs/memory.md), with a published copy's "
                   "provenance (`published_from`, kept beside the row; null for any other row). `version` "
                   "starts at 1 and changes when the object does (a turn's source when its interpretation "
                   "is retained)."),
    "MemoryList": listing("MemoryRow", "The memory of the space's owner, in write order."),
    "MemoryDetail": obj({
        "memory": ref("MemoryRow"),
        **BYTE_SPAN,
    }, description="One row and its exact payload bytes from `offset`; `text` is null unless the span is "
                   "complete UTF-8."),
    "Sha256": string(SHA256, "a media source's sha256: 64 lowercase hex"),
    "Media": obj({"sha256": string(SHA256), "length": ref("Counter"),
                  "type": {"type": "string", "enum": list(MEDIA_TYPES)}}),
    "Event": obj({
        "cursor": ref("Counter"),
        "operation": ref("OperationId"),
        "participant": ref("ParticipantId"),
        "sequence": nullable(ref("Counter")),
        "input": {"type": "object", "description": "the input's own fields as submitted (text, model, media, ...)"},
        "status": {"type": "string", "enum": ["admitted", "running", *TERMINAL_STATUSES]},
        "result": {"type": "object"},
        "admission": {"type": "object"},
        "terminal": {"type": "object"},
    }, description="One input of a conversation. `cursor` is its input order in the conversation (1, 2, ...; "
                   "kept after retirements); `sequence` is null for a reader other than its author; `result`, "
                   "`admission` and `terminal` are as in its receipt."),
    "EventList": obj({"items": {"type": "array", "items": ref("Event")},
                      "next_cursor": nullable(ref("Counter")),
                      "gap": {"type": "boolean"},
                      "event_floor": ref("Counter")},
                     description="Events after `cursor` (from order 1 without one) in input order. "
                                 "Retired inputs leave retired orders: `event_floor` is the first order still "
                                 "readable, and `gap` is true when the orders this page covers (after `cursor`, "
                                 "to its last item, or to the last order admitted when `next_cursor` is null) "
                                 "hold a retired one: a window starting below the floor, or a hole another "
                                 "member's retirement left."),
    "EventStream": obj({"id": {"type": "string", "description": "`<path>@<cursor>`"},
                        "event": {"type": "string", "enum": ["event", "gap", "output", "terminal", "error"]},
                        "data": {"type": "string", "contentMediaType": "application/json"}},
                       ("event", "data"), description=SSE_FRAMING),
    "Result": obj({
        "operation": ref("OperationId"),
        **BYTE_SPAN,
        "complete": {"type": "boolean"},
        "status": {"type": "string", "enum": ["admitted", "running", "succeeded", "failed", "cancelled",
                                               "interrupted", "deadline_exceeded"]},
        "finish": nullable({"type": "string"}),
        "input_tokens": nullable(ref("Counter")),
        "output_tokens": nullable(ref("Counter")),
    }, description="Exact saved result bytes from `offset`; `text` is null unless the span is complete UTF-8 "
                   "(nothing is ever replaced). Token counts and finish once the terminal result is saved."),
    "CancellationRequest": mutation_body(
        "Cancel the operation at a sequence",
        {"target_sequence": string(POSITIVE, "the exact sequence of the operation to cancel")},
        ("target_sequence",), "`target_sequence`"),
}

# ---- error codes: one line each; the statuses and routes are in OPERATIONS -------------------

CODES = {
    # 400
    "unknown_parameter": "a query parameter this route does not take",
    "bad_limit": f"`limit` is not an integer 1..{MAX_LIMIT}",
    "bad_id": "a path or body ID is malformed (prefix, 32 lowercase hex per part)",
    "bad_field": "a field or counter has the wrong type or value (envelope `schema`, lineage, zero operation "
                 "key, sequence 0 or with leading zeros, scope, id, permissions, cursor, counters)",
    "invalid_json": "the body is not JSON, not an object, or uses NaN/Infinity",
    "invalid_utf8": "the body is not valid UTF-8",
    "duplicate_key": "a JSON object repeats a key",
    "unknown_field": "a field this route does not take (listed in `fields`)",
    "missing_field": "a required field is absent (listed in `fields`)",
    "command_too_large": "the canonical operation bytes exceed the receipt's command capacity (`limits.command_bytes` "
                         "in /capabilities, 8192 by default)",
    "bad_principal": "gateway/device protocol fault: command without principal (not expected)",
    "unknown_command": "gateway/device protocol fault: the device does not know the command "
                       "(gateway and device versions differ)",
    "protocol_version": "gateway/device protocol fault: the device speaks another protocol version",
    "input_too_large": "the text and 73 bytes per media link exceed 2048 UTF-8 bytes",
    "too_many_media": f"more than {MAX_MEDIA} media references",
    "reserved_token": "the text contains a reserved media control token",
    "media_truncated": "an image media source is truncated or corrupt (its `sha256`)",
    "bad_offset": "`offset` is not an integer 0..the result length",
    "bad_last_event_id": "`Last-Event-ID` does not name an event of this stream (`<path>@<cursor>`)",
    "digest_mismatch": "the uploaded bytes do not hash to the sha256 in the path",
    "media_too_large": f"a media source is larger than {MAX_MEDIA_BYTES >> 20} MiB",
    # 401 / 403
    "unauthenticated": "no, malformed, unknown or revoked Bearer token (`WWW-Authenticate` is set)",
    "grant_missing": "the principal lacks the gateway action this route needs",
    "right_missing": "the space is visible but the participant lacks the right this route needs",
    # 404
    "not_found": "no route (e.g. an empty path parameter)",
    "participant_not_found": "no such registered participant",
    "space_not_found": "no such space, or not visible to the caller",
    "conversation_not_found": "no such conversation, or not visible to the caller",
    "memory_not_found": "no such memory object, or not visible to the caller (its owner's space is not readable)",
    "operation_not_found": "no such operation visible to the caller",
    "media_not_found": "a media reference names no source uploaded by this participant",
    # 409
    "stale_lineage": "`lineage` is not the participant's current lineage (the current one is in `lineage`)",
    "operation_changed": "this sequence was admitted with different canonical operation bytes",
    "future_sequence": "`sequence` is ahead of the next sequence (given in `next_sequence`)",
    "operation_key_in_use": "the operation key belongs to another live operation of this participant",
    "participant_not_registered": "register the participant first (POST /participant)",
    "already_registered": "the participant is already registered",
    "space_exists": "the space ID is taken",
    "owner_rights_fixed": "the owner's rights cannot be changed",
    "conversation_exists": "the conversation ID is taken",
    "retry_floor_not_advanced": "`retry_floor` does not advance the current floor (given in `retry_floor`)",
    "retry_floor_ahead": "`retry_floor` is above this retirement's own sequence",
    "unfinished_operations": "an operation below the floor has no saved terminal result (its `sequence`)",
    "not_cancellable": "the target operation already finished and cannot be cancelled",
    "already_finished": "the target input already ended",
    "model_not_available": "the requested model is not served (see /capabilities)",
    "model_lacks_media": "the requested model takes no media of that type",
    "images_exceed_page_limit": "the input's images (the model's `image_token_budget` each) and its output limit "
                                "exceed its page limit",
    "media_unavailable": "a media source is saved but its bytes were lost (a restore from a checkpoint that did not "
                         "carry them; its `sha256`): upload it again",
    "page_limit_exceeds_grant": "`pages` exceeds the runtime profile's page grant",
    "page_limit_exceeds_pool": "`pages` exceeds the KV page pool",
    "no_result": "the operation has no result bytes (it is not an input)",
    "space_not_empty": "the space still holds conversations; delete them first",
    "stale_version": "`source_version` (a publication) or `version` (a memory read) is not the memory object's "
                     "current version, given in `version`",
    "unsupported_kind": "the memory object is not retained text, which is what a publication copies",
    "conversation_busy": "the conversation has an unfinished input; cancel it or wait for its terminal result",
    "deadline_exceeded": "the input ran past its execution deadline",
    # 410
    "below_retry_floor": "the sequence is below the saved retry floor (given in `retry_floor`)",
    "operation_retired": "the operation was retired",
    # 413 / 415 / 429
    "body_too_large": f"the body exceeds {MAX_BODY_BYTES} bytes",
    "unsupported_media_type": "the body is not `application/json`",
    "media_too_many_pixels": "an image media source has more pixels than the limit (4096 x 4096), or is a "
                             "decompression bomb (its `sha256`)",
    "media_not_image": "an image media source's bytes are not an image (its `sha256`)",
    "journal_hold": "a journal hold pauses persistent admission (`cause`, `disk_error`, `pending_bytes`)",
    "quota_exceeded": "the caller's principal is at one of its quotas (`quota` names it; `limit`, `used`); "
                      "nothing changed. `Retry-After: 1`; a principal refused again within a second is answered "
                      "after 10 ms, then 20 ms, doubling to 1 s (the gateway's refusal backoff; a second without "
                      "a refusal starts it over)",
    "rate_limited": "the caller's principal sent faster than one of its rates allows (`quota` names it; `limit` "
                    "per second, `retry_after` seconds); refused from the headers, the body unread, nothing changed. "
                    "`Retry-After` (whole seconds) and `Retry-After-Ms` say when the next request can pass; refusals "
                    "that keep coming are answered later, as for `quota_exceeded`",
    # 503
    "device_unavailable": "the device is not reachable; nothing was admitted",
    "device_connection_lost": "the connection to the device broke after the request was sent: a mutation may "
                              "have been admitted, so retry it exactly (an exact retry answers its receipt)",
    "device_timeout": "the device did not answer in time; the mutation may have been admitted, "
                      "so retry it exactly",
    "gateway_misconfigured": "the gateway configuration cannot be read",
    "not_primary": "this device's leadership lease may have lapsed (another primary may hold it): it admits "
                   "nothing; send the mutation, exactly, to the current primary",
    "standby_unconfirmed": "the device's journal failed (disk full) after admitting the mutation and before its "
                           "standby confirmed it: retry it exactly (the exact retry answers its receipt)",
    "stream_backlog": "(the last `error` event of a stream) the client read slower than its events came: "
                      "more than AOTX_STREAM_BACKLOG_BYTES of them waited; resume with `Last-Event-ID`",
    "gateway_busy": "this gateway process has as many requests waiting on the device as it allows "
                    "(AOTX_DEVICE_WAITING); nothing was sent to the device: retry later",
    "bad_request": "the request is not valid HTTP as the gateway reads it (e.g. a Content-Length that is not a number)",
    "bad_query": "the query string has more parameters than the gateway reads",
    "body_incomplete": "the body did not arrive whole (broken chunked framing, fewer bytes than Content-Length, "
                       "or the connection ended first): nothing was done; send it again",
    "repeated_header": "`Authorization` or `Host` is sent more than once (a proxy may read the first, the gateway "
                       "would read the last): send it once",
    "bad_host": "the `Host` header names a host outside AOTX_ALLOWED_HOSTS (the same rule on every route)",
    # 507
    "receipt_table_full": "the receipt table is full; record a retirement to free receipts",
    "participant_capacity": "the participant table is full",
    "space_capacity": "the space table is full",
    "member_capacity": "the member table is full",
    "memory_full": "the memory table is full",
    "conversation_capacity": "the conversation table is full",
    "media_write_failed": "the device could not write the media source to its disk (the error is in `message`)",
}

STATUS_TEXT = {
    400: "Bad request: refused before any state changed.",
    401: "Unauthenticated.",
    403: "Forbidden.",
    404: "Not found (also for resources the caller may not see).",
    409: "Conflict: nothing changed.",
    410: "Gone: below the retry floor.",
    413: "Payload too large.",
    415: "Unsupported media type.",
    429: "Journal hold (a file cap or low disk pauses persistent admission; reads, receipts and save "
         "status stay available; retry later) or a quota of the caller's principal (`quota_exceeded`, "
         "naming the quota: retire, delete or wait for running work to end), or a rate of the caller's principal "
         "(`rate_limited`: retry after `Retry-After`). The request changed no state.",
    503: "Device unavailable.",
    504: "Execution deadline exceeded.",
    507: "Insufficient storage: a fixed capacity of this runtime profile is used up; nothing changed.",
}

PROTOCOL_400 = ("bad_principal", "unknown_command", "protocol_version")
QUERY_400 = ("unknown_parameter",)
LIST_400 = ("unknown_parameter", "bad_limit", "bad_field")
ENVELOPE_400 = ("invalid_json", "invalid_utf8", "duplicate_key", "unknown_field", "missing_field", "bad_field")
SEQUENCE_409 = ("stale_lineage", "operation_changed", "future_sequence", "operation_key_in_use")
COMMON = {400: ("bad_request", "bad_query", "body_incomplete", "repeated_header", "bad_host"), 401: ("unauthenticated",), 403: ("grant_missing",), 429: ("rate_limited",),
          503: ("device_unavailable", "device_connection_lost", "device_timeout", "gateway_misconfigured",
                "gateway_busy")}

PATH_PARAMETERS = {
    "participant": ("ParticipantId", "par-{32 hex}"),
    "space": ("SpaceId", "spc-{lineage}-{32 hex}"),
    "conversation": ("ConversationId", "con-{lineage}-{32 hex}"),
    "operation": ("OperationId", "op-{lineage}-{32 hex}"),
    "memory": ("MemoryId", "mem-{lineage}-{32 hex}"),
    "sha256": ("Sha256", "64 lowercase hex"),
}


OFFSET = ("offset", {"type": "integer", "minimum": 0}, "byte offset to start from (default 0)")  # byte-span reads


def _read(summary: str, success: str, errors: Errors | None = None, *, path: str | None = None,
          listing: bool = False, stream: str | None = None, description: str = "",
          query: tuple[tuple[str, Schema, str], ...] = ()) -> Spec:
    """A GET; `stream` "optional" (a `stream=true` query answers server-sent events) or "always";
    `query` its own query parameters (name, schema, description)."""
    errors = dict(errors or {})
    errors[400] = (*(LIST_400 if listing else QUERY_400), *errors.get(400, ()))
    if path:
        errors[400] = ("bad_id", *errors[400])
        errors[404] = (*errors.get(404, ()), "not_found")
    return {"method": "GET", "summary": summary, "success": {200: success},
            "errors": errors, "path": path, "listing": listing, "body": None, "description": description,
            "stream": stream, "query": query}


def _mutation(summary: str, body: str, errors: Errors | None = None, *, path: str | None = None,
              description: str = "") -> Spec:
    errors = dict(errors or {})
    errors[400] = (*ENVELOPE_400, *(("bad_id",) if path or body == "MemberSetRequest" else ()), *errors.get(400, ()))
    registered = () if body == "ParticipantRegisterRequest" else ("participant_not_registered",)
    errors[409] = (*SEQUENCE_409, *registered, *errors.get(409, ()))
    errors[410] = ("below_retry_floor", *errors.get(410, ()))
    errors[413] = ("body_too_large", "command_too_large", *errors.get(413, ()))
    errors[415] = ("unsupported_media_type", *errors.get(415, ()))
    # every mutation counts against the receipts quota but a retirement, which frees receipts
    errors[429] = ("journal_hold", *(() if body == "RetirementRequest" else ("quota_exceeded",)),
                   *errors.get(429, ()))
    errors[503] = ("standby_unconfirmed", "not_primary", *errors.get(503, ()))
    errors[507] = ("receipt_table_full", *errors.get(507, ()))
    if path:
        errors[404] = (*errors.get(404, ()), "not_found")
    return {"method": "POST", "summary": summary, "body": body, "errors": errors, "path": path,
            "listing": False, "description": description,
            "success": {202: "Receipt", 200: "Receipt"}}


OPERATIONS = {  # keyed by the device command each route calls
    "capabilities": _read(
        "Capabilities", "Capabilities",
        description="Schema versions, models (name, digest, media types, automatic memory), limits, page grant, "
                    "the caller's grants, its quotas and rates in force — each with whether it is the default "
                    "(what a principal gets for one its grant leaves out) and when it binds: `always`, or "
                    "`contention` for the defaults shared among the active principals (KV pages, chats and "
                    "the rates: alone, a principal may use the whole device) — with the "
                    "quotas' current use (docs/grants.md), and the journal hold state."),
    "participant.get": _read(
        "The caller's own participant", "Participant",
        description="Registered or not; gives the lineage and next sequence every mutation needs."),
    "participant.register": _mutation(
        "Register the caller's participant", "ParticipantRegisterRequest",
        {409: ("already_registered",), 507: ("participant_capacity",)}),
    "participants.get": _read(
        "Another participant", "Participant", {404: ("participant_not_found",)}, path="participant",
        description="Its sequence counters are null unless it is the caller's own."),
    "spaces.list": _read("Spaces visible to the caller", "SpaceList", listing=True),
    "spaces.create": _mutation(
        "Create a space", "SpaceCreateRequest",
        {409: ("space_exists",), 507: ("space_capacity",)},
        description="An omitted `id` uses the operation key; `scope` is private (default), room or instance "
                    "and never changes."),
    "spaces.delete": _mutation(
        "Delete a space", "SpaceDeletionRequest",
        {403: ("right_missing",), 404: ("space_not_found",), 409: ("space_not_empty",)}, path="space",
        description="Needs the manage right on the space, which must hold no conversation. Its ID stops "
                    "resolving, its member rows are freed and it stops counting against the owner's spaces "
                    "quota at once; its table row comes back once the receipts that name it are retired."),
    "spaces.get": _read(
        "One space", "Space", {403: ("right_missing",), 404: ("space_not_found",)}, path="space"),
    "members.list": _read(
        "Members of a space", "MemberList", {403: ("right_missing",), 404: ("space_not_found",)},
        path="space", listing=True,
        description="The owner first (its implicit row takes one of the first page's `limit` places), then the "
                    "explicit rows in creation order."),
    "members.set": _mutation(
        "Set a member's explicit rights", "MemberSetRequest",
        {403: ("right_missing",), 404: ("space_not_found", "participant_not_found"),
         409: ("owner_rights_fixed",), 507: ("member_capacity",)},
        path="space",
        description="Needs the manage right on the space. `permissions: []` leaves a zero-rights row, which also "
                    "blocks implicit instance access."),
    "conversations.list": _read(
        "Conversations of a space", "ConversationList", {403: ("right_missing",), 404: ("space_not_found",)},
        path="space", listing=True),
    "conversations.create": _mutation(
        "Create a conversation in a space", "ConversationCreateRequest",
        {403: ("right_missing",), 404: ("space_not_found",), 409: ("conversation_exists",),
         507: ("conversation_capacity",)},
        path="space", description="Needs the write right on the space. An omitted `id` uses the operation key."),
    "conversations.delete": _mutation(
        "Delete a conversation", "ConversationDeletionRequest",
        {403: ("right_missing",), 404: ("conversation_not_found",), 409: ("conversation_busy",)},
        path="conversation",
        description="Needs the manage right on the conversation's space; none of its inputs may be unfinished. "
                    "Its ID stops resolving, its event streams end and it stops counting against its creator's "
                    "conversations quota at once; its table row comes back once the receipts that name it are "
                    "retired. Its receipts stay readable by the participants who made them."),
    "conversations.get": _read(
        "One conversation", "Conversation", {403: ("right_missing",), 404: ("conversation_not_found",)},
        path="conversation"),
    "operations.list": _read("The caller's own receipts", "ReceiptList", listing=True),
    "operations.get": _read(
        "One receipt", "Receipt", {404: ("operation_not_found",), 410: ("operation_retired",)},
        path="operation",
        description="The owner's receipt, or (with read right on its target space) another participant's, "
                    "with null `sequence`."),
    "retirements.record": _mutation(
        "Retire receipts below a new retry floor", "RetirementRequest",
        {409: ("retry_floor_not_advanced", "retry_floor_ahead", "unfinished_operations")},
        description="Every receipt below `retry_floor` must have a saved terminal result; the floor is saved "
                    "before any receipt slot is reused."),
    "conversations.input": _mutation(
        "Submit an input to a conversation", "InputRequest",
        {400: ("input_too_large", "too_many_media", "reserved_token", "media_truncated"), 403: ("right_missing",),
         404: ("conversation_not_found", "media_not_found"),
         409: ("model_not_available", "model_lacks_media", "media_unavailable", "page_limit_exceeds_grant",
               "page_limit_exceeds_pool", "images_exceed_page_limit"),
         413: ("media_too_many_pixels",), 415: ("media_not_image",)},
        path="conversation",
        description="Needs the write right on the conversation's space. Runs the model once the admission is "
                    "saved; the receipt's terminal result is saved when generation ends. Earlier turns of the "
                    "conversation form the context, as far as the page limit allows."),
    "conversations.events": _read(
        "Events of a conversation", "EventList",
        {400: ("bad_last_event_id",), 403: ("right_missing",), 404: ("conversation_not_found",),
         503: ("stream_backlog",)},
        path="conversation", listing=True, stream="optional",
        description="One event per input of the conversation, in input order, for every reader of its space. "
                    "`stream=true` answers server-sent events instead (`Last-Event-ID` resumes); there `limit` "
                    "ends the stream after that many events, and without it the stream runs on."),
    "operations.subscribe": _read(
        "Output and end of an operation, as a stream", "EventStream",
        {400: ("bad_offset", "bad_last_event_id"), 403: ("right_missing",), 404: ("operation_not_found",),
         410: ("operation_retired",), 503: ("stream_backlog",), 504: ("deadline_exceeded",)},
        path="operation", stream="always",
        description="Always server-sent events: the saved output from `offset` (bytes; default 0, or "
                    "`Last-Event-ID`), each span as it is saved, then the terminal event. Readers of the "
                    "conversation's space may follow another member's input; its submitter too only while it "
                    "may read that space (403 `right_missing` after it was removed from the room: the output "
                    "is made from the room; a stream already open ends with that error). An input past its "
                    "execution deadline answers 504, as its result read does (a stream already open ends with "
                    "an `error` event carrying that 504 body)."),
    "memory.list": _read(
        "Memory of a space", "MemoryList", {403: ("right_missing",), 404: ("space_not_found",)},
        path="space", listing=True,
        description="The rows of the space's memory owner (a private space's own, a room's, or the instance's), "
                    "in write order; readable during a journal hold. An instance space lists the instance's rows "
                    "retained or published in the instance spaces the caller may read now."),
    "memory.get": _read(
        "One memory object", "MemoryDetail",
        {400: ("bad_offset", "bad_field"), 404: ("memory_not_found",), 409: ("stale_version",)}, path="memory",
        query=(OFFSET,
               ("version", ref("Counter"), "answer only while this is the object's current version (else 409 "
                                           "`stale_version`, with the current one in `version`)")),
        description="Its row and exact payload bytes from query `offset` (bytes, default 0); with query "
                    "`version`, only while that is the object's current version. 404 for an object the caller "
                    "may not read now: its space unreadable, or an instance row retained or published in an "
                    "instance space the caller may not read."),
    "publications.record": _mutation(
        "Publish a memory object", "PublicationRequest",
        {403: ("right_missing",), 404: ("space_not_found", "memory_not_found"),
         409: ("stale_version", "unsupported_kind"), 507: ("memory_full",)}, path="space",
        description="Needs the manage right on this (destination) space and a source memory object the caller "
                    "sees, at its current version. The copy is a new object of this space's memory owner "
                    "(`published` true; the receipt's `target`) whose row shows its source object and version "
                    "(`published_from`) to this space's readers; the original keeps its scope."),
    "operations.result": _read(
        "Result bytes of an input", "Result",
        {400: ("bad_offset",), 403: ("right_missing",), 404: ("operation_not_found",), 409: ("no_result",),
         410: ("operation_retired",), 504: ("deadline_exceeded",)},
        path="operation", query=(OFFSET,),
        description="Query `offset` (bytes, default 0). Readers of the conversation's space may read another "
                    "member's result; its submitter too only while it may read that space (SPEC: current "
                    "grants intersect with stored membership on each read; the result is made from the room: "
                    "403 `right_missing` once it was removed, while its receipt stays readable). An input past "
                    "its execution deadline answers 504."),
    "media.put": {
        "method": "PUT", "summary": "Upload a media source", "body": None,
        "path": "sha256", "listing": False, "success": {200: "Media", 201: "Media"},
        "errors": {400: ("bad_id", "bad_field", "digest_mismatch"), 404: ("not_found",),
                   409: ("participant_not_registered",),
                   413: ("media_too_large",), 415: ("unsupported_media_type",),
                   429: ("journal_hold", "quota_exceeded"),
                   507: ("media_write_failed",)},
        "description": "The raw bytes with Content-Type image/* or audio/*; they must hash to the path's sha256. "
                       "The source is owned by the caller's participant (201 new owner, 200 already owned); "
                       "inputs may reference it in `media`."},
    "cancellations.record": _mutation(
        "Cancel the operation at a sequence", "CancellationRequest",
        {404: ("operation_not_found",), 409: ("not_cancellable", "already_finished")},
        description="Cancellation cannot undo committed memory; disconnecting never cancels. An input still "
                    "waiting for its conversation's turn is cancelled before it runs. Admitted during a "
                    "`file_cap` or `low_disk` journal hold (it ends output that would still be journaled); "
                    "429 while the disk is full, when every unfinished input is stopped already."),
}


for _command, _spec in OPERATIONS.items():
    _spec["grant"] = COMMANDS[_command].action  # the gateway action, as the device checks it


def error_schema(codes: Sequence[str]) -> Schema:
    if not codes:
        return ref("Error")
    return {"allOf": [ref("Error"),
                      {"properties": {"error": {"properties": {"code": {"type": "string", "enum": list(codes)}}}}}]}


def error_description(status: int, codes: Sequence[str]) -> str:
    lines = [STATUS_TEXT[status]]
    if codes:
        lines.append("Codes:")
        lines.extend(f"- `{code}`: {CODES[code]}" for code in codes)
    return "\n".join(lines)


def operation_errors(key: str) -> Errors:
    """{status: (codes...)} for one operation, the common ones included."""
    spec = OPERATIONS[key]
    errors = {status: tuple(codes) for status, codes in COMMON.items()}
    for status, codes in spec["errors"].items():
        merged = errors.get(status, ()) + tuple(codes)
        errors[status] = tuple(dict.fromkeys(merged + (PROTOCOL_400 if status == 400 else ())))
    return dict(sorted(errors.items()))


def _parameters(spec: Spec) -> list[OpenApiParameter]:
    params = []
    if spec["path"]:
        name = spec["path"]
        component, shape = PATH_PARAMETERS[name]
        params.append(OpenApiParameter(name, ref(component), OpenApiParameter.PATH, required=True,
                                       description=f"{shape}, lowercase hex; anything else is 400 `bad_id`"))
    if spec["listing"]:
        params.append(OpenApiParameter("cursor", ref("Counter"), OpenApiParameter.QUERY, required=False,
                                       description="`next_cursor` of the previous page"))
        params.append(OpenApiParameter("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
                                       OpenApiParameter.QUERY, required=False,
                                       description=f"page size, 1..{MAX_LIMIT} (default {DEFAULT_LIMIT})"))
    for name, schema, text in spec.get("query", ()):
        params.append(OpenApiParameter(name, schema, OpenApiParameter.QUERY, required=False, description=text))
    if spec.get("stream") == "optional":
        params.append(OpenApiParameter("stream", {"type": "boolean", "default": False}, OpenApiParameter.QUERY,
                                       required=False, description="true: server-sent events (see EventStream)"))
    if spec.get("stream") == "always":
        params.append(OpenApiParameter("offset", {"type": "integer", "minimum": 0}, OpenApiParameter.QUERY,
                                       required=False, description="byte offset to start from (default 0)"))
    if spec.get("stream"):
        params.append(OpenApiParameter("Last-Event-ID", {"type": "string"}, OpenApiParameter.HEADER, required=False,
                                       description="`<path>@<cursor>` of the last event seen: resumes after it "
                                                   "when the query gives no cursor or offset"))
    if spec["method"] == "POST":
        location = {"type": "string", "pattern": f"^/aotx/v1/shared/operations/{ids.ID_PATTERNS['op']}$"}
        params.append(OpenApiParameter("Location", location, OpenApiParameter.HEADER, response=[202], required=True,
                                       description="the new receipt"))
    params.append(OpenApiParameter("WWW-Authenticate", {"type": "string"}, OpenApiParameter.HEADER,
                                   response=[401], required=True, description='`Bearer realm="aotx"`'))
    return params


def doc(key: str) -> Callable[[_F], _F]:
    """@extend_schema for the view method that implements OPERATIONS[key]; the method is marked with
    its device command, whose gateway action SharedView checks before anything else."""
    spec = OPERATIONS[key]
    responses: dict[int, OpenApiResponse] = {}
    for status, component in spec["success"].items():
        text = {200: {"GET": "OK.", "PUT": "Already owned by the caller: nothing changed."}.get(
                    spec["method"], "Exact retry: the same receipt as the original."),
                201: "Saved: the caller's participant now owns this source.",
                202: "New operation admitted and saved: its receipt (`Location` names it)."}[status]
        responses[status] = OpenApiResponse(response=ref(component), description=text)
    for status, codes in operation_errors(key).items():
        responses[status] = OpenApiResponse(response=error_schema(codes), description=error_description(status, codes))
    description = " ".join(filter(None, [spec["description"], f"Needs the `{spec['grant']}` gateway action."]))
    schema = extend_schema(
        operation_id=key.replace(".", "_"),
        summary=spec["summary"],
        description=description,
        tags=[key.split(".")[0]],
        parameters=_parameters(spec),
        request={"application/json": ref(spec["body"])} if spec["body"] else None,
        responses=responses,
    )

    def mark(method: _F) -> _F:
        method = schema(method)
        method.command = key  # type: ignore[attr-defined]  # SharedView reads it off the view method
        return method
    return mark


class BearerScheme(OpenApiAuthenticationExtension):
    target_class = "shared_api.http.auth.BearerAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: AutoSchema) -> Schema:
        return {"type": "http", "scheme": "bearer",
                "description": "A principal's token (`manage.py principal create`, shown once)."}


GENERAL = """\
Persistent shared conversations. Base path `/aotx/v1/shared`.

Every route needs `Authorization: Bearer <token>` (401 with `WWW-Authenticate` otherwise) and every
response carries `Cache-Control: no-store`. GET needs the `shared_read` gateway action; participant
registration, spaces, conversations, retirements and cancellations need `shared_write`; members need
`shared_manage`. The device intersects current grants with stored membership on every admission and read.

Every POST is a mutation: `{"schema": "aotx.shared.mutation.v1", "lineage", "operation_key", "sequence"}`
plus the route's own fields. A new operation answers 202 with its receipt and `Location`; an exact retry
(same sequence, same canonical bytes) answers 200 with the same receipt; changed input, a future sequence
or a stale lineage 409; below the retry floor 410; a journal hold 429; a full fixed capacity 507.
IDs are `par-{32hex}`, `spc-|con-|op-|mem-{lineage}-{32hex}`, lowercase.

Counters are decimal strings: every integer a response reports — sequences, cursors and event floors,
byte counts, offsets and lengths, token counts, limits, defaults, quotas and their use, slots, versions,
nanosecond timestamps — is a JSON string of decimal digits without leading zeros (`"0"`, `"8192"`), never
a JSON number, in receipts, reads, lists, events, streams, capabilities and error details alike (a JSON
number is not exact past 2^53 in every client). JSON numbers appear only where the caller sent them:
an input's `max_output_tokens`, `pages`, `temperature` and `top_p` are JSON numbers in its body, and an
event's `input` echoes the fields as submitted. The OpenAI-compatible routes (`/v1/...`) keep OpenAI's
types.

Defaults the device applies are recorded apart from the caller's bytes (the receipt's `effective`): an
input without `pages` gets the page grant, and without `max_output_tokens` min(256, pages × page_size / 2)
(the device cannot count the prompt's tokens at admission, so the prompt keeps the other half of the
page limit; `/capabilities` gives `defaults`, `page_size` and the real maximum in `limits`).

Every error has the one body `{"error": {"code": "...", "message": "...", ...details}}`; each response
below lists its codes. Outside any single route: 405 `method_not_allowed` (a method the route does not
have), 406 `not_acceptable` (an `Accept` header that excludes `application/json`), 408 `body_timeout`
(the body stalled longer than its timeout), 431 `headers_too_large` (the request line and headers
exceed the gateway's bound), 500 `internal_error` (a gateway bug; see the gateway log). A connection
whose request line and headers take longer than the server's header timeout is closed unanswered;
a head past the server's read buffer is answered 431 with no body, and so are the other requests
the server (granian) refuses before the application sees them: a request line it cannot parse (400),
a URI past its buffer (414), both with empty bodies. On every route, a `Host` outside
AOTX_ALLOWED_HOSTS is 400 `bad_host` and an `Authorization` or `Host` sent twice 400
`repeated_header`; a body that does not arrive whole (broken chunked framing, fewer bytes than its
`Content-Length`, the connection ended first) is 400 `body_incomplete` and nothing is done. A body over
the route's limit is refused 413 from its `Content-Length` (or as soon as a chunked body passes it),
and a request without a valid token 401, before the body is read; the connection is then closed."""


def postprocess(result: Schema, generator: Any, request: Any, public: bool) -> Schema:
    """SPECTACULAR postprocessing hook: components, description, required POST bodies."""
    components = result.setdefault("components", {})
    components.setdefault("schemas", {}).update(SCHEMAS)
    result.setdefault("info", {})["description"] = GENERAL
    for item in result.get("paths", {}).values():
        body = item.get("post", {}).get("requestBody")
        if body is not None:
            body["required"] = True
        get = item.get("get", {})
        stream = OPERATIONS.get(get.get("operationId", "").replace("_", "."), {}).get("stream")
        if stream:  # server-sent events: the body is text/event-stream, described by EventStream
            ok = get["responses"]["200"]
            content = ok.setdefault("content", {})
            if stream == "always":
                content.pop("application/json", None)
            content["text/event-stream"] = {"schema": ref("EventStream")}
    return result


# ---- docs/api.md is rendered from the same table (tests/shared_api/test_openapi.py compares) ----

def full_path(key: str) -> str:
    """ROUTES holds paths under the base, or absolute ones (media uploads live outside it)."""
    path = ROUTES[key]
    return path if path.startswith("/aotx/") else "/aotx/v1/shared" + path


ROUTES = {  # OPERATIONS key -> path under the base (the views' URLconf; the test checks it matches)
    "capabilities": "/capabilities", "participant.get": "/participant", "participant.register": "/participant",
    "participants.get": "/participants/{participant}", "spaces.list": "/spaces", "spaces.create": "/spaces",
    "spaces.get": "/spaces/{space}", "members.list": "/spaces/{space}/members",
    "members.set": "/spaces/{space}/members", "conversations.list": "/spaces/{space}/conversations",
    "conversations.create": "/spaces/{space}/conversations", "conversations.get": "/conversations/{conversation}",
    "operations.list": "/operations", "operations.get": "/operations/{operation}",
    "retirements.record": "/retirements", "cancellations.record": "/cancellations",
    "spaces.delete": "/spaces/{space}/deletion", "conversations.delete": "/conversations/{conversation}/deletion",
    "media.put": "/aotx/v1/media/{sha256}", "conversations.input": "/conversations/{conversation}/inputs", "operations.result": "/operations/{operation}/result",
    "memory.list": "/spaces/{space}/memory", "memory.get": "/memory/{memory}",
    "publications.record": "/spaces/{space}/publications",
    "conversations.events": "/conversations/{conversation}/events", "operations.subscribe": "/operations/{operation}/events",
}


def _field_text(schema: Schema) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        target = SCHEMAS[name]
        if "enum" in target:
            return _field_text(target)
        return f"{name} `{target['pattern']}`" if "pattern" in target else name
    if "enum" in schema:
        text = " \\| ".join(f'`"{v}"`' for v in schema["enum"])
        return text + (f" (default `\"{schema['default']}\"`)" if "default" in schema else "")
    if schema.get("type") == "array":
        return f"array of {_field_text(schema['items'])}"
    return f"`{schema['pattern']}`" if "pattern" in schema else schema.get("type", "")


def render_markdown() -> str:
    """docs/api.md: a short reference rendered from OPERATIONS, SCHEMAS and CODES."""
    out = ["# AOTX Shared API reference", "",
           "<!-- Rendered from shared_api/routes/openapi.py (the same table as /aotx/v1/openapi.json). Regenerate with",
           "     .venv/bin/python -c 'import django, os; os.environ[\"DJANGO_SETTINGS_MODULE\"] = "
           "\"aotx_site.settings\"; django.setup(); from shared_api.routes.openapi import render_markdown as r; "
           "open(\"docs/api.md\", \"w\").write(r())'",
           "     tests/shared_api/test_openapi.py fails when this file and the schema differ. -->", "",
           "The machine-readable contract is `GET /aotx/v1/openapi.json` (OpenAPI 3.1, no token needed).", "",
           GENERAL, "", "## Routes", "",
           "| method | path | gateway action | body | success |", "|---|---|---|---|---|"]
    for key, spec in OPERATIONS.items():
        success = " · ".join(f"{s} {c}" for s, c in sorted(spec["success"].items(), reverse=True))
        out.append(f"| {spec['method']} | `{full_path(key)}` | `{spec['grant']}` | "
                   f"{spec['body'] or '-'} | {success} |")
    out += ["", "List reads take `cursor` (a counter: the previous page's `next_cursor`) and `limit` "
                f"(1..{MAX_LIMIT}, default {DEFAULT_LIMIT}) and answer `{{\"items\": [...], \"next_cursor\": ... | null}}`. "
                "Path IDs that do not match their pattern are 400 `bad_id`; any other query parameter is 400 "
                "`unknown_parameter`.", ""]
    for key, spec in OPERATIONS.items():
        out += [f"## {spec['method']} {ROUTES[key]}", "", f"{spec['summary']}. "
                + " ".join(filter(None, [spec["description"], f"Needs `{spec['grant']}`."])), ""]
        if spec["body"]:
            body = SCHEMAS[spec["body"]]
            out.append("Body fields (besides `schema`, `lineage`, `operation_key`, `sequence`):" if len(
                body["properties"]) > 4 else "Body: the mutation envelope only.")
            for name, field in list(body["properties"].items())[4:]:
                need = "required" if name in body["required"] else "optional"
                out.append(f"- `{name}` ({need}): {_field_text(field)}"
                           + (f" — {field['description']}" if field.get("description") else ""))
            out.append("")
        out.append("Errors: " + "; ".join(
            f"{status} " + (", ".join(f"`{c}`" for c in codes) or "-")
            for status, codes in operation_errors(key).items()))
        out.append("")
    out += ["## Error codes", "", "| status | code | meaning |", "|---|---|---|"]
    statuses: dict[str, set[int]] = {}
    for key in OPERATIONS:
        for status, codes in operation_errors(key).items():
            for code in codes:
                statuses.setdefault(code, set()).add(status)
    for code in sorted(CODES, key=lambda c: (min(statuses[c]), c)):
        listed = ", ".join(str(s) for s in sorted(statuses[code]))
        out.append(f"| {listed} | `{code}` | {CODES[code].replace('|', '/')} |")
    out += ["", "## Components", ""]
    for name in ("Receipt", "Participant", "Space", "Conversation", "Member", "Capabilities", "Error"):
        schema = SCHEMAS[name]
        keys = ", ".join(f"`{k}`" for k in schema["properties"])
        out.append(f"- **{name}**: {keys}." + (f" {schema['description']}" if schema.get("description") else ""))
    return "\n".join(out) + "\n"
