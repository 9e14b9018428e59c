"""Strict request parsing and canonical operation bytes.

Nothing malformed reaches the device: bodies must be UTF-8 JSON objects without duplicate
keys, NaN/Infinity, unknown fields or wrong types. The canonical operation bytes are RFC 8785
(JCS) bytes of {"method", "path", "body"} with the caller's fields only; defaults the device
applies are recorded separately."""
import json
import re

import rfc8785
from django.conf import settings
from rest_framework.parsers import BaseParser

from .errors import ApiError

MUTATION_SCHEMA = "aotx.shared.mutation.v1"
ENVELOPE = ("schema", "lineage", "operation_key", "sequence")
HEX32 = re.compile(r"[0-9a-f]{32}\Z")
DECIMAL = re.compile(r"(0|[1-9][0-9]{0,18})\Z")
MAX_SEQUENCE = (1 << 63) - 1


def _no_duplicates(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ApiError(400, "duplicate_key", f"duplicate key {key!r} in JSON object")
        obj[key] = value
    return obj


def _no_constant(name):
    raise ApiError(400, "invalid_json", f"{name} is not JSON")


def loads_strict(raw):
    if len(raw) > settings.AOTX_MAX_BODY_BYTES:
        raise ApiError(413, "body_too_large", f"body exceeds {settings.AOTX_MAX_BODY_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, "invalid_utf8", f"body is not valid UTF-8 at byte {exc.start}") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except ValueError as exc:
        raise ApiError(400, "invalid_json", f"body is not JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "invalid_json", "body nests too deeply") from None


class StrictJSONParser(BaseParser):
    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None):
        raw = stream.read() if stream is not None else b""
        return loads_strict(raw)


def decimal_counter(value, field):
    if not isinstance(value, str) or not DECIMAL.match(value) or int(value) > MAX_SEQUENCE:
        raise ApiError(400, "bad_field", f"{field} must be a decimal string without leading zeros")
    return int(value)


def hex32(value, field, *, nonzero=False):
    if not isinstance(value, str) or not HEX32.match(value):
        raise ApiError(400, "bad_field", f"{field} must be 32 lowercase hexadecimal digits")
    if nonzero and int(value, 16) == 0:
        raise ApiError(400, "bad_field", f"{field} must be nonzero")
    return value


RESOURCE_ID = {
    "par": re.compile(r"par-[0-9a-f]{32}\Z"),
    "spc": re.compile(r"spc-[0-9a-f]{32}-[0-9a-f]{32}\Z"),
    "con": re.compile(r"con-[0-9a-f]{32}-[0-9a-f]{32}\Z"),
    "op": re.compile(r"op-[0-9a-f]{32}-[0-9a-f]{32}\Z"),
    "mem": re.compile(r"mem-[0-9a-f]{32}-[0-9a-f]{32}\Z"),
}


def resource_id(value, prefix):
    """IDs are checked here so that a malformed one is a 400 and never reaches the device."""
    if not isinstance(value, str) or not RESOURCE_ID[prefix].match(value):
        shape = f"{prefix}-{{32 hex}}" if prefix == "par" else f"{prefix}-{{lineage}}-{{32 hex}}"
        raise ApiError(400, "bad_id", f"{value!r} is not a valid ID ({shape}, lowercase hex)")
    return value


class Mutation:
    """A parsed mutation: the envelope, the operation's own fields and its canonical bytes."""

    def __init__(self, request, fields=(), required=()):
        body = request.data
        if not isinstance(body, dict):
            raise ApiError(400, "invalid_json", "body must be a JSON object")
        allowed = set(ENVELOPE) | set(fields)
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise ApiError(400, "unknown_field", f"unknown field(s): {', '.join(unknown)}", fields=unknown)
        missing = [f for f in (*ENVELOPE, *required) if f not in body]
        if missing:
            raise ApiError(400, "missing_field", f"missing field(s): {', '.join(missing)}", fields=missing)
        if body["schema"] != MUTATION_SCHEMA:
            raise ApiError(400, "bad_field", f"schema must be {MUTATION_SCHEMA!r}")
        self.lineage = hex32(body["lineage"], "lineage")
        self.operation_key = hex32(body["operation_key"], "operation_key", nonzero=True)
        self.sequence = decimal_counter(body["sequence"], "sequence")
        if self.sequence == 0:
            raise ApiError(400, "bad_field", "sequence starts at 1")
        self.fields = {k: body[k] for k in fields if k in body}
        try:
            self.canonical = rfc8785.dumps({"method": request.method, "path": request.path, "body": body})
        except (rfc8785.CanonicalizationError, RecursionError) as exc:
            # RFC 8785 has no form for infinities, integers beyond 2^53 or lone surrogates
            raise ApiError(400, "bad_field", f"body has a value with no canonical JSON form: {exc}") from None

    def args(self, **extra):
        return {"lineage": self.lineage, "operation_key": self.operation_key, "sequence": self.sequence,
                "canonical": self.canonical, **extra}
