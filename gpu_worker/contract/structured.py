"""Structured outputs' checks, shared by a chat's and a conversation input's `response_format`:
`{"type": "text"}` (free text), `{"type": "json_object"}` (any JSON object) or `{"type":
"json_schema", "schema": {...}}` (JSON valid under that schema; docs/api.md).

Both processes run them (the gateway before it sends, the device as the authority). A chat's
schema is compiled against the vocabulary on a helper thread before it starts, and its refusal
names what cannot be enforced. An input's refusal must come before its admission, on the device's
tick thread: `check_enforceable` validates the schema's keywords without the vocabulary (what
llguidance can enforce does not depend on it) and remembers each digest it has seen, so a
schema costs its validation once per process.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import rfc8785

from .errors import ServiceError
from .limits import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH

FORMATS = ("text", "json_object", "json_schema")
# what the model writes under a schema: no free whitespace (a small model can repeat it until its
# token limit) and the separators of Python's json.dumps
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CHECKED_SCHEMAS = 1024  # digests of enforceable schemas remembered
_checked: OrderedDict[str, None] = OrderedDict()
_lock = threading.Lock()  # the gateway's request threads check concurrently


def _depth_within(value: object, limit: int) -> bool:
    """Whether `value` nests at most `limit` objects and arrays deep (iterative: no recursion limit)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            if depth > limit:
                return False
            stack.extend((v, depth + 1) for v in children)
    return True


def check_schema(schema: object, field: str, code: str) -> None:
    """A schema's shape and size: an object (400), at most MAX_SCHEMA_BYTES as JSON (413), at
    most MAX_SCHEMA_DEPTH deep (400)."""
    if type(schema) is not dict:
        raise ServiceError(400, code, f"{field} must be a JSON schema object")
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise ServiceError(413, "schema_too_large", f"{field} exceeds {MAX_SCHEMA_BYTES} bytes as JSON")
    if not _depth_within(schema, MAX_SCHEMA_DEPTH):
        raise ServiceError(400, code, f"{field} nests deeper than {MAX_SCHEMA_DEPTH} levels")


def check_response_format(response_format: object, code: str = "invalid_response_format") -> None:
    if response_format is None:
        return
    if not isinstance(response_format, dict):
        raise ServiceError(400, code, "response_format must be an object")
    kind = response_format.get("type")
    if kind in ("text", "json_object") and len(response_format) == 1:
        return
    if kind != "json_schema" or set(response_format) != {"type", "schema"}:
        raise ServiceError(400, code, "response_format is {type: text | json_object} or {type: json_schema, schema}")
    check_schema(response_format["schema"], "response_format's schema", code)


def schema_of(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema an answer is held to (None: free text)."""
    if response_format is None or response_format["type"] == "text":
        return None
    schema: dict[str, Any] = response_format["schema"] if response_format["type"] == "json_schema" \
        else {"type": "object"}
    return schema


def digest(response_format: dict[str, Any]) -> str:
    """sha256 hex of the response_format's canonical JSON (RFC 8785): what a receipt records."""
    return hashlib.sha256(rfc8785.dumps(response_format)).hexdigest()


def grammar_text(schema: dict[str, Any]) -> str:
    """llguidance's grammar of a JSON schema."""
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)  # type: ignore[arg-type]


def check_enforceable(schema: dict[str, Any], field: str, code: str) -> None:
    """400 naming what llguidance cannot enforce in `schema` (a keyword it does not implement, a
    type it does not know), before anything is admitted."""
    key = hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).hexdigest()
    with _lock:
        if key in _checked:
            _checked.move_to_end(key)
            return
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(schema), None)
    if is_error or messages:
        raise ServiceError(400, code, f"{field} cannot be enforced: {'; '.join(messages) or 'invalid'}")
    with _lock:
        _checked[key] = None
        while len(_checked) > _CHECKED_SCHEMAS:
            _checked.popitem(last=False)
