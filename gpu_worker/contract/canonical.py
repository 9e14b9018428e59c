"""Canonical operation bytes: RFC 8785 (JCS) bytes of {"method", "path", "body"} with the caller's
fields only (defaults the device applies are recorded separately). The gateway computes them; the
device stores them with the receipt and compares them byte for byte on every retry."""
from __future__ import annotations

from typing import Any, Mapping

import json

import rfc8785

MAX_EXACT_INT = 2 ** 53 - 1  # beyond it RFC 8785 (IEEE doubles) has no exact form: rfc8785 decides
_encoder = json.JSONEncoder(ensure_ascii=False, sort_keys=True, separators=(",", ":"), check_circular=False)
# the same encoder's C writer, made once (JSONEncoder.encode makes a new one on every call); it
# keeps nothing between calls, having no circularity markers
_c_make_encoder = getattr(json.encoder, "c_make_encoder", None)  # (CPython's _json; absent elsewhere)
_c_write = _c_make_encoder and _c_make_encoder(
    None, _encoder.default, json.encoder.encode_basestring, None, ":", ",", True, False, True)


def _dumps(doc: Mapping[str, object]) -> str:
    """json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)."""
    return "".join(_c_write(doc, 0)) if _c_write else _encoder.encode(doc)


class NotCanonical(ValueError):
    """A value RFC 8785 has no form for: infinities, integers beyond 2^53, lone surrogates."""


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether json.dumps(sort_keys, compact, ensure_ascii=False) writes exactly RFC 8785's bytes
    for this value: only objects with keys of the Basic Multilingual Plane (where UTF-16 code unit
    order, RFC 8785's key order, is code point order, Python's), arrays, strings, booleans, null
    and integers of at most 2^53 - 1 in magnitude. Its string escapes are RFC 8785's (backslash, quote,
    the short forms of b f n r t, other controls as lowercase u00xx, nothing else). Floats are left
    to rfc8785. (Loops, not all() over generators, and strings taken without a call: a mutation's
    body is mostly strings, and this runs on every one.)"""
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return True
    if kind is int:
        return -MAX_EXACT_INT <= value <= MAX_EXACT_INT
    if depth > 64:
        return False
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str or not (key.isascii() or max(key) < "\U00010000"):
                return False
            if type(item) is not str and not _plain(item, depth + 1):
                return False
        return True
    if kind is list:
        for item in value:
            if type(item) is not str and not _plain(item, depth + 1):
                return False
        return True
    return False


def operation_bytes(method: str, path: str, body: Mapping[str, object]) -> bytes:
    doc: dict[str, Any] = {"method": method, "path": path, "body": body}  # (rfc8785 takes its own JSON type)
    if _plain(doc):  # the common case, through json's C writer rather than rfc8785's pure-Python one
        try:
            return _dumps(doc).encode("utf-8")
        except UnicodeEncodeError:
            pass  # a lone surrogate: rfc8785 refuses it below
    try:
        return rfc8785.dumps(doc)
    except (rfc8785.CanonicalizationError, RecursionError) as exc:
        raise NotCanonical(str(exc)) from None
