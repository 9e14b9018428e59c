"""The error codes the OpenAPI document and docs/api.md explain, one line each (CODES), what each
status means (STATUS_TEXT), and the groups of codes that many routes share; which statuses and codes
each route answers is the route table's (operations.py). tests/shared_api/test_openapi.py collects
every ServiceError code from the source and fails for one that is not here.
"""
from __future__ import annotations

from gpu_worker.contract.limits import MAX_BODY_BYTES, MAX_LIMIT, MAX_MEDIA, MAX_MEDIA_BYTES, MEMORY_PAYLOAD_BYTES

CODES = {
    # 400
    "unknown_parameter": "a query parameter this route does not take",
    "engine_unavailable": "the device runs no embedding model (a memory search and a correction need one)",
    "bad_search_query": "query `q` is missing, blank, or over 2048 UTF-8 bytes",
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
    "schema_too_large": "a `response_format` schema exceeds `limits.schema_bytes` as JSON",
    "input_too_large": "the text and 73 bytes per media link exceed 2048 UTF-8 bytes",
    "too_many_media": f"more than {MAX_MEDIA} media references",
    "reserved_token": "the text contains a reserved media control token or one of the model's control tokens",
    "text_too_large": f"a correction's `text` exceeds {MEMORY_PAYLOAD_BYTES} UTF-8 bytes (a memory object's payload)",
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
    "stale_version": "`source_version` (a publication) or `version` (a correction) is not the memory object's "
                     "current version, or `version` (a memory read) is neither that nor one a live correction "
                     "replaced; the current one is given in `version`",
    "unsupported_kind": "the memory object is not retained text, which is what a publication copies and a "
                        "correction replaces",
    "conversation_busy": "the conversation has an unfinished input (for a fork, one through `at`); cancel it or "
                         "wait for its terminal result",
    "fork_point_past_end": "`at` is past the source conversation's last input (its count is given in `inputs`)",
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
COMMON = {400: ("bad_request", "bad_query", "body_incomplete", "repeated_header", "bad_host"), 401: ("unauthenticated",),
          403: ("grant_missing",), 429: ("rate_limited",),
          503: ("device_unavailable", "device_connection_lost", "device_timeout", "gateway_misconfigured",
                "gateway_busy")}
