"""The OpenAPI 3.1 description of /aotx/v1/shared (DESIGN §4), served at /aotx/v1/openapi.json.

One table, OPERATIONS (operations.py), says for every route and method: its grant, request body,
query and path parameters, success response and every error status with the codes it carries
(codes.py). `doc(key)` here turns an entry into the view method's @extend_schema; `postprocess` (a
SPECTACULAR postprocessing hook) adds the hand-written component schemas (schemas.py) and the general
description. docs/api.md is rendered from the same table (markdown.py).

Each error response narrows the one error body `{"error": {"code", "message", ...}}` to the codes
listed for that status, and lists them in its description, so the schema, the schemathesis run
(tests/e2e/test_schemathesis.py) and tests/shared_api/test_openapi.py (which collects every
ServiceError code from the source) keep each other honest: a new error code or route
fails a test until it is documented here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema

from gpu_worker.contract import ids
from gpu_worker.contract.limits import DEFAULT_LIMIT, MAX_LIMIT

from .codes import CODES, STATUS_TEXT
from .operations import OPERATIONS, PATH_PARAMETERS, Spec, operation_errors
from .schemas import SCHEMAS, Schema, ref

if TYPE_CHECKING:
    from drf_spectacular.openapi import AutoSchema

_F = TypeVar("_F", bound=Callable[..., Any])


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
registration, spaces, conversations and their forks, retirements, cancellations, memory corrections and
memory deletions need `shared_write`; members need `shared_manage`. The device intersects current grants
with stored membership on every admission and read.

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

Structured outputs: an input's `response_format` (`{"type": "json_object"}` or `{"type": "json_schema",
"schema": {...}}`) holds its answer to JSON (of the schema) token by token; a result that finishes `stop` is
valid JSON of it, one cut short finishes `length`. The field is part of the input's body, so of its
canonical bytes (a retry must send the same schema) and of the journaled admission; a schema's object keys
are canonical there, sorted, and the answer writes an object's properties in that order. The receipt's
`effective.response_format_digest` is the sha256 of the field's canonical JSON (RFC 8785), null without one.
A schema keyword the device cannot enforce (`uniqueItems`, `not`, `if`/`then`, an unknown `type`) is
400 `bad_field` naming it, before anything is admitted; a schema nested deeper than 32 levels likewise.

Every error has the one body `{"error": {"code": "...", "message": "...", ...details}}`; each response
below lists its codes. Outside any single route: 405 `method_not_allowed` (a method the route does not
have), 406 `not_acceptable` (an `Accept` header that excludes `application/json`), 408 `body_timeout`
(the body stalled longer than its timeout), 431 `headers_too_large` (the request line and headers
exceed the gateway's bound), 500 `internal_error` (a gateway bug; see the gateway log),
500 `embedding_failed` (a memory search's query or a correction's text the device could not embed). A connection
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
