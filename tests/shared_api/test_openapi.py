"""The OpenAPI document at /aotx/v1/openapi.json cannot drift from the code: every route and
method is in it and nothing else, every operation documents its errors with the one error body,
and every error code the gateway or the device raises is documented for its status."""
import json
import re
from pathlib import Path

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from drf_spectacular.views import SpectacularAPIView
from rest_framework.views import APIView

from shared_api import errors as api_errors
from shared_api.routes.openapi import codes, markdown, operations
from shared_api.routes import urls as shared_urls

ROOT = Path(__file__).resolve().parents[2]
BASE = "/aotx/v1/shared"
METHODS = ("get", "post", "put", "patch", "delete")
ERROR_REF = "#/components/schemas/Error"
# statuses that belong to no single operation; documented once in info.description
GENERAL_STATUSES = {405, 406, 408, 431, 500}
# device codes no shared route can return, with the reason
NOT_ROUTED = {
    ("507", "checkpoint_failed"): "answer to the ops-only `checkpoint` device command (Celery), never a route",
    ("507", "audit_export_failed"): "answer to the ops-only `audit.export` device command (Celery), never a route",
}


@pytest.fixture(scope="module")
def schema():
    response = Client().get("/aotx/v1/openapi.json", HTTP_ACCEPT="application/json")
    assert response.status_code == 200, response.content[:500]
    assert response["Cache-Control"] == "no-store"
    return json.loads(response.content)


def _template(route):
    return re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)


def _api_routes(patterns, prefix="/"):
    """(path template, APIView class) of every DRF view the root URLconf routes."""
    for p in patterns:
        if isinstance(p, URLResolver):
            yield from _api_routes(p.url_patterns, prefix + str(p.pattern))
        elif isinstance(p, URLPattern):
            cls = getattr(p.callback, "cls", None) or getattr(p.callback, "view_class", None)
            if cls and issubclass(cls, APIView) and not issubclass(cls, SpectacularAPIView):
                yield _template(prefix + str(p.pattern)), cls


def _methods(cls):
    return {m for m in METHODS if callable(getattr(cls, m, None))}


def _operations(schema):
    for path, item in schema["paths"].items():
        for method, op in item.items():
            if method in METHODS:
                yield path, method, op


def _resolve(schema, node):
    while "$ref" in node:
        node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _response_schema(response):
    """A response's JSON schema; a stream's (text/event-stream only) is its EventStream."""
    content = response["content"]
    return content["application/json" if "application/json" in content else "text/event-stream"]["schema"]


def _documented_codes(response):
    return re.findall(r"^- `([a-z0-9_]+)`", response.get("description", ""), re.M)


def test_the_json_url_serves_json_and_needs_no_token(schema):
    response = Client().get("/aotx/v1/openapi.json", HTTP_ACCEPT="application/json",
                            HTTP_AUTHORIZATION="Bearer not-a-token")
    assert response.status_code == 200 and json.loads(response.content)["openapi"].startswith("3.1")


def test_the_json_url_serves_json_by_default():
    response = Client().get("/aotx/v1/openapi.json")
    assert response["Content-Type"].startswith("application/") and json.loads(response.content)


def test_every_route_and_method_is_documented_and_nothing_else(schema):
    routes = dict(_api_routes(get_resolver().url_patterns))
    shared = {f"{BASE}/{_template(str(p.pattern))}" for p in shared_urls.urlpatterns}
    assert shared <= set(routes), "every shared_api/routes/urls.py route is a DRF view under the base path"
    assert set(schema["paths"]) == set(routes)
    for path, cls in routes.items():
        documented = {m for m in schema["paths"][path] if m in METHODS}
        assert documented == _methods(cls), path
    ids = [op["operationId"] for _, _, op in _operations(schema)]
    assert len(ids) == len(set(ids)) == len(operations.OPERATIONS)


def test_every_operation_documents_auth_errors_and_the_error_body(schema):
    scheme = schema["components"]["securitySchemes"]["bearerAuth"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    for path, method, op in _operations(schema):
        where = f"{method.upper()} {path}"
        assert op["security"] == [{"bearerAuth": []}], where
        responses = op["responses"]
        statuses = {int(s) for s in responses}
        assert {401, 403, 503} <= statuses, where
        assert responses["401"]["headers"]["WWW-Authenticate"]["required"] is True, where
        for status, response in responses.items():
            body = _response_schema(response)
            if int(status) < 400:
                content = response["content"]
                if "text/event-stream" in content:  # server-sent events, framed as EventStream says
                    assert content["text/event-stream"]["schema"] == {"$ref": "#/components/schemas/EventStream"}
                if "application/json" in content:
                    assert "$ref" in body and _resolve(schema, body)["type"] == "object", where
                continue
            refs = [body] if "$ref" in body else body["allOf"][:1]
            assert refs == [{"$ref": ERROR_REF}], (where, status)
            enum = body["allOf"][1]["properties"]["error"]["properties"]["code"]["enum"] if "allOf" in body else []
            assert enum == _documented_codes(response) and enum, (where, status, "codes listed and enforced")
        params = {(p["in"], p["name"]): p for p in op.get("parameters", [])}
        for name in re.findall(r"{(\w+)}", path):
            param = params[("path", name)]
            assert param["required"] and _resolve(schema, param["schema"])["pattern"].startswith("^"), where
            assert 404 in statuses and "bad_id" in _documented_codes(responses["400"]), where
        if method == "get":
            assert {s for s in statuses if s < 400} == {200}, where
            listing = _resolve(schema, _response_schema(responses["200"]))
            if "next_cursor" in listing.get("properties", {}):
                assert {("query", "cursor"), ("query", "limit")} <= set(params), where
                assert {"bad_limit", "bad_field"} <= set(_documented_codes(responses["400"])), where
            elif "application/json" not in responses["200"]["content"]:  # always a stream
                assert {name for loc, name in params if loc == "query"} == {"offset"}, where
            else:  # a plain read: exactly the query parameters its table entry names (byte offset, version)
                named = {name for name, _, _ in operations.OPERATIONS[op["operationId"].replace("_", ".")]["query"]}
                assert {name for loc, name in params if loc == "query"} == named, where
        elif method == "put":  # a media upload: not a mutation with a receipt
            assert {200, 201, 400, 409, 413, 415, 429} <= statuses and "requestBody" not in op, where
        else:
            assert {200, 202, 400, 409, 410, 413, 415, 429, 507} <= statuses, where
            for status in ("200", "202"):
                assert _response_schema(responses[status]) == {"$ref": "#/components/schemas/Receipt"}, where
            assert responses["202"]["headers"]["Location"]["required"] is True, where
            request = op["requestBody"]
            assert request["required"] is True and list(request["content"]) == ["application/json"], where
            body = _resolve(schema, request["content"]["application/json"]["schema"])
            assert body["additionalProperties"] is False, where
            assert {"schema", "lineage", "operation_key", "sequence"} <= set(body["required"]), where
            assert _resolve(schema, body["properties"]["lineage"])["pattern"] == "^[0-9a-f]{32}$", where
            assert _resolve(schema, body["properties"]["operation_key"])["pattern"] == "^[0-9a-f]{32}$", where
            assert re.fullmatch(body["properties"]["sequence"]["pattern"].strip("^$"), "12"), where


# The OpenAI-compatible routes (/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models)
# follow OpenAI's API reference and error shape, not this document: their modules are not scanned.
OPENAI_COMPATIBLE = {"gpu_worker/contract/chat.py", "gpu_worker/kinds/chat.py", "gpu_worker/kinds/embeddings.py",
                     "shared_api/openai/views.py", "shared_api/openai/fields.py"}
SOURCES = [path for path in (*sorted((ROOT / "gpu_worker").rglob("*.py")), *sorted((ROOT / "shared_api").rglob("*.py")))
           if path.relative_to(ROOT).as_posix() not in OPENAI_COMPATIBLE and "engine" not in path.parts]
RAISED = re.compile(r"\b(?:ServiceError|error_response)\(\s*(\d{3}),\s*\"([a-z0-9_]+)\"")


def raised_codes():
    """(status, code) of every literal error in the gateway and device source, plus the codes
    shared_api/errors.py gives DRF's own exceptions."""
    found = {}
    for path in SOURCES:
        for status, code in RAISED.findall(path.read_text(encoding="utf-8")):
            found.setdefault((status, code), path.relative_to(ROOT).as_posix())
    for cls, code in api_errors._DRF_CODES.items():
        found.setdefault((str(cls.status_code), code), "shared_api/errors.py _DRF_CODES")
    return found


def test_the_collector_sees_the_known_codes():
    found = raised_codes()
    for pair in [("409", "stale_lineage"), ("404", "space_not_found"), ("400", "bad_id"), ("503", "device_timeout"),
                 ("507", "receipt_table_full"), ("415", "unsupported_media_type"), ("410", "below_retry_floor")]:
        assert pair in found, pair
    assert len(found) > 40


def test_every_raised_error_code_is_documented_for_its_status(schema):
    by_status = {}
    for _, _, op in _operations(schema):
        for status, response in op["responses"].items():
            by_status.setdefault(status, set()).update(_documented_codes(response))
    general = schema["info"]["description"]
    missing = []
    for (status, code), where in sorted(raised_codes().items()):
        if (status, code) in NOT_ROUTED:
            continue
        if int(status) in GENERAL_STATUSES:
            if not re.search(rf"\b{status} `{code}`", general):
                missing.append(f"{status} {code} ({where}): not in info.description")
        elif code not in by_status.get(status, ()):
            missing.append(f"{status} {code} ({where}): no operation documents it")
    assert not missing, ("undocumented error codes; add them to shared_api/routes/openapi/ (codes.py, operations.py):\n"
                         + "\n".join(missing))


def test_every_documented_code_is_explained_once():
    used = {code for key in operations.OPERATIONS for listed in operations.operation_errors(key).values()
            for code in listed}
    assert used <= set(codes.CODES)
    assert set(codes.CODES) - used == set(), "CODES lists a code no operation documents"


def test_docs_api_md_is_rendered_from_the_schema_table(schema):
    by_id = {op["operationId"]: (method.upper(), path) for path, method, op in _operations(schema)}
    for key, spec in operations.OPERATIONS.items():
        assert by_id[key.replace(".", "_")] == (spec["method"], operations.full_path(key)), key
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert text == markdown.render_markdown(), "docs/api.md is stale; regenerate it (command at its top)"
