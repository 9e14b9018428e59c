"""The one client-visible error: an HTTP status, a stable code, a one-line message and optional
details, rendered as the one error body ``{"error": {"code", "message", ...details}}``.

The device raises it and sends `body()` in its reply; the gateway raises the same class for what
it refuses before the device sees a request, and maps it to a response in one place
(shared_api/errors.py).
"""
from __future__ import annotations

from .wire import dumps


class ServiceError(Exception):
    def __init__(self, status: int, code: str, message: str, **details: object) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details

    def document(self) -> dict[str, object]:
        return {"error": {"code": self.code, "message": self.message, **self.details}}

    def body(self) -> bytes:
        """The one error body as UTF-8 JSON. A message or detail that echoes the caller's input
        may hold what no UTF-8 text can (a lone surrogate, from a `\\ud800` escape in a JSON key):
        such code points are written as their escape (`\\ud800`, six characters), so a refusal is
        always a refusal and never an encoding failure (a 500)."""
        try:
            return dumps(self.document())
        except UnicodeEncodeError:
            return dumps(_encodable(self.document()))

    def __repr__(self) -> str:
        return f"ServiceError({self.status}, {self.code!r}, {self.message!r})"


def _encodable(value: object) -> object:
    """value with every string's unencodable code points (lone surrogates) replaced by their
    backslash escape, in keys and values alike."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encodable(v) for v in value]
    return value
