"""The route table: OPERATIONS says for every route and method, keyed by the device command it calls,
its grant (read from COMMANDS), request body, query and path parameters, success response and every
error status with the codes it carries (`operation_errors` adds the ones every route shares); ROUTES
gives each one's path. The builder (__init__.py) turns an entry into its view method's
@extend_schema, and markdown.py renders docs/api.md from the same table.
"""
from __future__ import annotations

from typing import Any

from gpu_worker.contract.limits import MAX_MEMORY_TTL_SECONDS, MAX_SEARCH_RESULTS
from gpu_worker.contract.vocabulary import COMMANDS

from .codes import COMMON, ENVELOPE_400, LIST_400, PROTOCOL_400, QUERY_400, SEQUENCE_409
from .schemas import Schema, ref

Spec = dict[str, Any]    # one OPERATIONS entry (_read, _mutation)
Errors = dict[int, tuple[str, ...]]  # status -> error codes

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
                    f"and never changes. `memory_ttl_seconds` (seconds, 1..{MAX_MEMORY_TTL_SECONDS}: 3660 days) "
                    "makes the rows retained or published in the space expire that long after each is written, by "
                    "the device's clock (the row's `expires_at_ns`; an input's own `memory_ttl_seconds` wins for "
                    "its rows): from then on no read, list, search or recall returns it, and the device forgets "
                    "it as a deletion would. It never changes; the space shows it."),
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
    "conversations.fork": _mutation(
        "Fork a conversation", "ConversationForkRequest",
        {403: ("right_missing",), 404: ("conversation_not_found",),
         409: ("fork_point_past_end", "conversation_busy", "conversation_exists"), 507: ("conversation_capacity",)},
        path="conversation",
        description="Needs the read right on the source conversation's space (404 otherwise) and the write right "
                    "there, where the fork is made. A new conversation in the source's space (its ID as a "
                    "creation's: `id`, else the operation key; the receipt's `target`) whose history is the "
                    "source's through the input at event cursor `at`, made at admission from the source as it "
                    "is then: its retired turns and its succeeded inputs through `at`, with their authors, within "
                    "the history row's bound. The fork's event orders go on from `at`: its event reads show "
                    "1..`at` as a gap (retired turns) and its first input is `at + 1`. Later inputs of either "
                    "never appear in the other; both share the space's memory. 409 `fork_point_past_end` for an "
                    "`at` past the source's last input (its count in `inputs`), 409 `conversation_busy` while an "
                    "input through `at` is unfinished. The fork counts against its creator's `conversations` "
                    "quota."),
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
         413: ("media_too_many_pixels", "schema_too_large"), 415: ("media_not_image",)},
        path="conversation",
        description="Needs the write right on the conversation's space. Runs the model once the admission is "
                    "saved; the receipt's terminal result is saved when generation ends. Earlier turns of the "
                    "conversation form the context, as far as the page limit allows. The memory rows it retains "
                    "expire `memory_ttl_seconds` after they are written, by the device's clock (omitted: its "
                    "space's time to live, if any)."),
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
    "memory.search": _read(
        "Search a space's memory", "MemorySearchResult",
        {400: ("bad_search_query", "bad_limit"), 403: ("right_missing",), 404: ("space_not_found",),
         429: ("quota_exceeded",), 503: ("engine_unavailable",)},
        path="space",
        query=(("q", {"type": "string"}, "the text to search for (required; at most 2048 UTF-8 bytes)"),
               ("limit", {"type": "integer", "minimum": 1, "maximum": MAX_SEARCH_RESULTS, "default": 10},
                "rows to answer, at most")),
        description="The rows of the space's memory most similar to `q`, best first, with their cosine "
                    "similarity (`score`, -1..1): recall's embedding and visibility (the rows the caller may "
                    "read now, grants intersected with membership), without recall's floor. The query is "
                    "embedded off the device's tick and counts against the `chats` quota meanwhile."),
    "memory.get": _read(
        "One memory object", "MemoryDetail",
        {400: ("bad_offset", "bad_field"), 404: ("memory_not_found",), 409: ("stale_version",)}, path="memory",
        query=(OFFSET,
               ("version", ref("Counter"), "answer this version: the object's current one, or an earlier one "
                                           "while the correction that replaced it is live (else 409 "
                                           "`stale_version`, with the current one in `version`)")),
        description="Its row and exact payload bytes from query `offset` (bytes, default 0); with query "
                    "`version`, that version's: the current one, or an earlier one while the correction that "
                    "replaced it is live (its receipt not retired). 404 for an object the caller "
                    "may not read now: its space unreadable, or an instance row retained or published in an "
                    "instance space the caller may not read."),
    "publications.record": _mutation(
        "Publish a memory object", "PublicationRequest",
        {403: ("right_missing",), 404: ("space_not_found", "memory_not_found"),
         409: ("stale_version", "unsupported_kind"), 507: ("memory_full",)}, path="space",
        description="Needs the manage right on this (destination) space and a source memory object the caller "
                    "sees, at its current version. The copy is a new object of this space's memory owner "
                    "(`published` true; the receipt's `target`) whose row shows its source object and version "
                    "(`published_from`) to this space's readers; the original keeps its scope. The copy "
                    "expires with this space's time to live (`memory_ttl_seconds`), if it has one."),
    "memory.versions": _mutation(
        "Correct a memory object", "MemoryVersionRequest",
        {400: ("reserved_token", "text_too_large"), 403: ("right_missing",), 404: ("memory_not_found",),
         409: ("stale_version", "unsupported_kind"), 503: ("engine_unavailable",)}, path="memory",
        description="Needs the write right on the space the object was retained or published in (the manage "
                    "right for an object another participant wrote), and `version`, its current version. Only "
                    "retained text (a source, an interpretation, their published copies) is corrected. The "
                    "object keeps its ID and row and moves to the next version, `text` its payload; recall, "
                    "search and reads use it from then on. The text is embedded before admission, off the "
                    "device's tick, counting against the `chats` quota meanwhile (503 `engine_unavailable` "
                    "where the device runs no embedding model). The version it replaced stays readable "
                    "(`GET /memory/{mem}?version=V`) until the correction's receipt is retired, and counts "
                    "against the corrector's `memory_rows` quota until then. The receipt's `target` is the "
                    "object."),
    "memory.delete": _mutation(
        "Forget a memory object", "MemoryDeletionRequest",
        {403: ("right_missing",), 404: ("memory_not_found",)}, path="memory",
        description="Needs the write right on the space the object was retained or published in (the manage "
                    "right for an object another participant wrote); any kind of object may be forgotten. It "
                    "is gone at once: `GET /memory/{mem}` answers 404 `memory_not_found`, and lists, search and "
                    "recall never return it. The versions its live corrections keep and those corrections' "
                    "texts go with it, and for a retained source the text of the input it came from; its bytes "
                    "leave the runtime file and the journal at the next checkpoint. Another object made from it "
                    "(an interpretation of the same turn, a published copy) stays until its own deletion. The "
                    "receipt keeps the optional `reason`; its `target` is the object."),
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


def operation_errors(key: str) -> Errors:
    """{status: (codes...)} for one operation, the common ones included."""
    spec = OPERATIONS[key]
    errors = {status: tuple(codes) for status, codes in COMMON.items()}
    for status, codes in spec["errors"].items():
        merged = errors.get(status, ()) + tuple(codes)
        errors[status] = tuple(dict.fromkeys(merged + (PROTOCOL_400 if status == 400 else ())))
    return dict(sorted(errors.items()))


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
    "conversations.fork": "/conversations/{conversation}/forks",
    "media.put": "/aotx/v1/media/{sha256}", "conversations.input": "/conversations/{conversation}/inputs", "operations.result": "/operations/{operation}/result",
    "memory.list": "/spaces/{space}/memory", "memory.search": "/spaces/{space}/memory/search",
    "memory.get": "/memory/{memory}",
    "publications.record": "/spaces/{space}/publications",
    "memory.versions": "/memory/{memory}/versions", "memory.delete": "/memory/{memory}/deletion",
    "conversations.events": "/conversations/{conversation}/events", "operations.subscribe": "/operations/{operation}/events",
}
