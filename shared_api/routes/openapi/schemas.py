"""The OpenAPI document's component schemas (the bodies every route reads and answers: receipts,
participants, spaces, conversations, members, events, memory, capabilities, errors, and each POST's
mutation body), built from the contract's patterns and vocabulary (gpu_worker/contract/ids.py,
vocabulary.py) with the small helpers below. The builder (__init__.py) adds SCHEMAS to the document;
the route table (operations.py) names them by key.
"""
from __future__ import annotations

from typing import Any, Iterable

from gpu_worker.contract import ids
from gpu_worker.contract.limits import MAX_MEDIA, MAX_MEMORY_TTL_SECONDS, MAX_REASON_BYTES, MEMORY_PAYLOAD_BYTES
from gpu_worker.contract.structured import FORMATS
from gpu_worker.contract.vocabulary import (CAPABILITIES_SCHEMA, CONTEXTS, MEDIA_TYPES, MEMORY_KINDS, MUTATION_SCHEMA,
                                            NOT_RETAINED, PERMISSIONS, QUOTAS, RATES, RECEIPT_SCHEMA, RETENTIONS,
                                            SCOPES, TERMINAL_STATUSES)

Schema = dict[str, Any]  # a JSON Schema / OpenAPI object

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

# what every byte-span read answers (operation results, memory payloads): gpu_worker/kinds/lists.py byte_span
BYTE_SPAN = {
    "offset": ref("Counter"),
    "length": ref("Counter"),
    "next_offset": ref("Counter"),
    "bytes": {"type": "string", "contentEncoding": "base64"},
    "text": nullable({"type": "string"}),
}

# a time to live for memory rows (a space's, an input's): docs/memory.md "Expiry"
def memory_ttl(whose: str, omitted: str) -> Schema:
    return {"type": "integer", "minimum": 1, "maximum": MAX_MEMORY_TTL_SECONDS,
            "description": f"seconds (a JSON integer 1..{MAX_MEMORY_TTL_SECONDS}, else 400 bad_field): {whose} "
                           f"expire this long after each is written, by the device's clock; omitted: {omitted}"}


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
                          "max_output_tokens": nullable(ref("Counter")),
                          "response_format_digest": nullable(string("^[0-9a-f]{64}$"))},
                         description="what the device accepted for an input, recorded with its admission apart "
                                     "from the caller's bytes: the model's digest, the page limit and the output "
                                     "limit (the caller's, or the default: min(256, pages x page_size / 2)), and "
                                     "the sha256 of its response_format's canonical JSON (RFC 8785; null without "
                                     "one); null for kinds that do not execute"),
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
        "memory_owner": {"type": "string", "description": "whose memory its rows are: `private-<32 hex>` (a "
                                                          "private space's own), the room's space ID, or `instance`"},
        "memory_ttl_seconds": nullable(string(POSITIVE, "the time to live, in seconds, of the rows retained or "
                                                        "published in it (a decimal string; null: they never "
                                                        "expire); set at its creation, never changed")),
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
            "automatic_memory": {"type": "boolean"},
            "response_formats": {"type": "array", "items": {"type": "string", "enum": list(FORMATS)},
                                 "description": "what an input's `response_format` (and a chat's) may name"}})},
        "embedding_model": nullable(obj({"name": {"type": "string"}, "digest": string("^[0-9a-f]{64}$")})),
        "limits": {"type": "object", "additionalProperties": ref("Counter"),
                   "required": ["participants", "spaces", "conversations", "members", "receipts",
                                "command_bytes", "result_bytes", "input_bytes", "media_link_bytes",
                                "media_rows", "max_output_tokens", "schema_bytes", "schema_depth"],
                   "description": "capacities and bounds: `command_bytes` per receipt's canonical operation "
                                  "bytes (413 `command_too_large` past it), `max_output_tokens` the most an "
                                  "input may name (the page grant's tokens; an input's own bound is its "
                                  "`pages` x `page_size`), `schema_bytes` and `schema_depth` a response_format "
                                  "schema's JSON size and nesting (a chat's tools too)"},
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
         "scope": {"type": "string", "enum": list(SCOPES), "default": "private"},
         "memory_ttl_seconds": memory_ttl("the rows retained or published in the space", "they never do")},
        description="`id` (32 hex; omitted: the operation key), `scope` (default private) and "
                    "`memory_ttl_seconds` (omitted: its memory never expires)"),
    "MemberSetRequest": mutation_body(
        "Set a participant's explicit rights",
        {"participant": ref("ParticipantId"),
         "permissions": {"type": "array", "items": ref("Permission"), "uniqueItems": True, "maxItems": 3,
                         "description": "[] removes all explicit rights and leaves a zero-rights row"}},
        ("participant", "permissions"), "`participant` and `permissions`"),
    "ConversationCreateRequest": mutation_body(
        "Create a conversation", {"id": ref("Hex32")},
        description="`id` (32 hex; omitted: the operation key)"),
    "ConversationForkRequest": mutation_body(
        "Fork the conversation in the path",
        {"at": string(POSITIVE, "the event cursor of the source's input the fork's history ends with "
                                "(1..its last input)"),
         "id": ref("Hex32")},
        ("at",), "`at` (an event cursor) and optionally `id` (32 hex; omitted: the operation key)"),
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
                     "description": "how recalled memory enters the prompt: lease revision 3, 4, 5 or 2"},
         "response_format": {"type": "object", "description": "{type: text}, {type: json_object} or {type: "
                             "json_schema, schema}: the result bytes are then JSON (of the schema), held to it "
                             "token by token; a schema keyword that cannot be enforced is refused (400 "
                             "bad_field, naming it) before admission"},
         "memory_ttl_seconds": memory_ttl("the memory rows this input retains",
                                          "its space's time to live, if it has one")},
        ("text", "model"),
        "`text` and `model`, optionally `max_output_tokens`, `pages`, `temperature`, `top_p`, `media`, "
        "`retention`, `context`, `response_format`, `memory_ttl_seconds`; the text and 73 bytes per media link "
        "fit 2048 UTF-8 bytes"),
    "PublicationRequest": mutation_body(
        "Publish a memory object into this space",
        {"source": ref("MemoryId"), "source_version": ref("Counter")},
        ("source", "source_version"), "`source` (a memory object the caller sees) and `source_version` (its "
                                      "current version)"),
    "MemoryVersionRequest": mutation_body(
        "Correct the memory object in the path",
        {"text": {"type": "string", "minLength": 1,
                  "description": f"the object's new payload: at most {MEMORY_PAYLOAD_BYTES} UTF-8 bytes, without "
                                 "a reserved media control token or a model's control token"},
         "version": string(POSITIVE, "the object's current version")},
        ("text", "version"), "`text` (the new payload) and `version` (the object's current version)"),
    "MemoryDeletionRequest": mutation_body(
        "Forget the memory object in the path",
        {"reason": {"type": "string", "description": f"kept in the receipt; at most {MAX_REASON_BYTES} UTF-8 bytes"}},
        description="optionally `reason`"),
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
        "expires_at_ns": nullable(string(POSITIVE, "when the row expires: wall-clock nanoseconds since the Unix "
                                                   "epoch by the device's clock, a decimal string, fixed when it "
                                                   "was written (its input's or its space's time to live); null: "
                                                   "never")),
    }, description="A 128-byte memory metadata row as JSON (docs/memory.md), with a published copy's "
                   "provenance (`published_from`, kept beside the row; null for any other row) and when it "
                   "expires (`expires_at_ns`, null for a row that does not; from then on no read, search or "
                   "recall returns it). `version` starts at 1 and changes when the object does (a turn's "
                   "source when its interpretation is retained, a correction)."),
    "MemoryList": listing("MemoryRow", "The memory of the space's owner, in write order."),
    "MemorySearchResult": obj({
        "items": {"type": "array", "items": obj({"memory": ref("MemoryRow"),
                                                  "score": {"type": "number", "minimum": -1, "maximum": 1}})}},
        description="The most similar rows first; `score` is the cosine similarity of the row's embedding "
                    "and the query's (a JSON number, rounded to 6 places)."),
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
