"""Canonical operation bytes: RFC 8785 (JCS) bytes of {"method", "path", "body"} with the caller's
fields only (defaults the device applies are recorded separately). The gateway computes them; the
device stores them with the receipt and compares them byte for byte on every retry."""
from __future__ import annotations

from typing import Any

import rfc8785


class NotCanonical(ValueError):
    """A value RFC 8785 has no form for: infinities, integers beyond 2^53, lone surrogates."""


def operation_bytes(method: str, path: str, body: dict[str, Any]) -> bytes:
    try:
        return rfc8785.dumps({"method": method, "path": path, "body": body})
    except (rfc8785.CanonicalizationError, RecursionError) as exc:
        raise NotCanonical(str(exc)) from None
