"""The one client-visible error: an HTTP status, a stable code, a one-line message and optional
details, rendered as the one error body ``{"error": {"code", "message", ...details}}``.

The device raises it and sends `body()` in its reply; the gateway raises the same class for what
it refuses before the device sees a request, and maps it to a response in one place
(shared_api/errors.py).
"""
from __future__ import annotations

from typing import Any

from .wire import dumps


class ServiceError(Exception):
    def __init__(self, status: int, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details

    def document(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, **self.details}}

    def body(self) -> bytes:
        return dumps(self.document())

    def __repr__(self) -> str:
        return f"ServiceError({self.status}, {self.code!r}, {self.message!r})"
