"""Strict request parsing and canonical operation bytes.

Nothing malformed reaches the device: bodies must be UTF-8 JSON objects without duplicate
keys, NaN/Infinity, unknown fields or wrong types. The canonical operation bytes are RFC 8785
(JCS) bytes of {"method", "path", "body"} with the caller's fields only; defaults the device
applies are recorded separately (gpu_worker/contract/canonical.py)."""
from __future__ import annotations

import json
from typing import IO, Any, Mapping, NoReturn

from rest_framework.parsers import BaseParser

from gpu_worker.contract import ids
from gpu_worker.contract.canonical import NotCanonical, operation_bytes
from gpu_worker.contract.limits import MAX_BODY_BYTES
from gpu_worker.contract.vocabulary import ENVELOPE, MUTATION_SCHEMA
from gpu_worker.contract.wire import JSON

from ..errors import ServiceError


def _no_duplicates(pairs: list[tuple[str, JSON]]) -> dict[str, JSON]:
    obj = dict(pairs)
    if len(obj) != len(pairs):  # (one pass in C for the common case; the loop only names the key)
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ServiceError(400, "duplicate_key", f"duplicate key {key!r} in JSON object")
            seen.add(key)
    return obj


def _no_constant(name: str) -> NoReturn:
    raise ServiceError(400, "invalid_json", f"{name} is not JSON")


# one decoder for every body (json.loads with hooks builds a new one per call)
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_no_constant)


def loads_strict(raw: bytes) -> JSON:
    if len(raw) > MAX_BODY_BYTES:
        raise ServiceError(413, "body_too_large", f"body exceeds {MAX_BODY_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ServiceError(400, "invalid_utf8", f"body is not valid UTF-8 at byte {exc.start}") from None
    if text.startswith("\ufeff"):  # (as json.loads refuses it)
        raise ServiceError(400, "invalid_json", "body is not JSON: it starts with a byte order mark")
    try:
        return _DECODER.decode(text)
    except ValueError as exc:
        raise ServiceError(400, "invalid_json", f"body is not JSON: {exc}") from None
    except RecursionError:
        raise ServiceError(400, "invalid_json", "body nests too deeply") from None


class StrictJSONParser(BaseParser):
    media_type = "application/json"

    # request.data is the body's JSON value (a route refuses what is not an object), where BaseParser
    # promises a mapping
    def parse(self, stream: IO[bytes] | None, media_type: str | None = None,  # type: ignore[override]
              parser_context: Mapping[str, object] | None = None) -> JSON:
        raw = stream.read() if stream is not None else b""
        return loads_strict(raw)


def decimal_counter(value: object, field: str, *, positive: bool = False) -> int:
    if not isinstance(value, str) or not ids.COUNTER.match(value) or int(value) > ids.MAX_COUNTER:
        raise ServiceError(400, "bad_field", f"{field} must be a decimal string without leading zeros")
    if positive and value == "0":
        raise ServiceError(400, "bad_field", f"{field} starts at 1")
    return int(value)


_SHAPES: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[frozenset[str], frozenset[str], tuple[str, ...]]] = {}


def _shape(fields: tuple[str, ...], required: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str], tuple[str, ...]]:
    """A route's allowed fields, its required ones, and those in the order a refusal names them
    (made once per route: every mutation asks)."""
    key = (fields, required)
    found = _SHAPES.get(key)
    if found is None:
        needed = (*ENVELOPE, *required)
        found = _SHAPES[key] = (frozenset((*ENVELOPE, *fields)), frozenset(needed), needed)
    return found


class Mutation:
    """A parsed mutation: the envelope, the operation's own fields and its canonical bytes. The
    fields' values are checked by the command's declared type (views.DeviceCall); what is checked
    here is the body's shape and what only the HTTP form has (the schema, decimal strings)."""

    def __init__(self, request: Any, fields: tuple[str, ...] = (), required: tuple[str, ...] = ()) -> None:
        body = request.data
        if not isinstance(body, dict):
            raise ServiceError(400, "invalid_json", "body must be a JSON object")
        allowed, needed, in_order = _shape(fields, required)
        keys = body.keys()
        if not keys <= allowed:
            unknown = sorted(keys - allowed)
            raise ServiceError(400, "unknown_field", f"unknown field(s): {', '.join(unknown)}", fields=unknown)
        if not keys >= needed:
            missing = [f for f in in_order if f not in body]
            raise ServiceError(400, "missing_field", f"missing field(s): {', '.join(missing)}", fields=missing)
        if body["schema"] != MUTATION_SCHEMA:
            raise ServiceError(400, "bad_field", f"schema must be {MUTATION_SCHEMA!r}")
        self.lineage = body["lineage"]
        self.operation_key = body["operation_key"]
        self.sequence = decimal_counter(body["sequence"], "sequence", positive=True)
        self.fields = {k: body[k] for k in fields if k in body}
        try:
            self.canonical = operation_bytes(request.method, request.path, body)
        except NotCanonical as exc:
            raise ServiceError(400, "bad_field", f"body has a value with no canonical JSON form: {exc}") from None

    def args(self, **extra: object) -> dict[str, object]:
        return {"lineage": self.lineage, "operation_key": self.operation_key, "sequence": self.sequence,
                "canonical": self.canonical, **extra}
