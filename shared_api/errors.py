"""Every client-visible error is a ServiceError (the class both processes share,
gpu_worker/contract/errors.py), mapped to the one error body in one place:
{"error": {"code": "...", "message": "...", ...details}}."""
from __future__ import annotations

import json
from typing import Any

from django.core.exceptions import TooManyFieldsSent
from django.http import HttpRequest, HttpResponse
from rest_framework import exceptions
from rest_framework.response import Response

from gpu_worker.contract.errors import ServiceError

__all__ = ["ServiceError", "error_response", "exception_handler", "method_not_allowed", "not_found", "server_error"]

WWW_AUTHENTICATE = 'Bearer realm="aotx"'


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
                   **details: object) -> HttpResponse:
    response = HttpResponse(ServiceError(status, code, message, **details).body(), status=status,
                            content_type="application/json")
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def method_not_allowed(method: str, allowed: str = "GET, HEAD") -> HttpResponse:
    """405 in the one error body, with the methods the route takes in Allow."""
    return error_response(405, "method_not_allowed", f'Method "{method}" not allowed.', {"Allow": allowed})


def service_error_response(err: ServiceError) -> HttpResponse:
    headers = {"WWW-Authenticate": WWW_AUTHENTICATE} if err.status == 401 else None
    return error_response(err.status, err.code, err.message, headers, **err.details)


_DRF_CODES = {
    exceptions.NotAuthenticated: "unauthenticated",
    exceptions.AuthenticationFailed: "unauthenticated",
    exceptions.PermissionDenied: "grant_missing",
    exceptions.NotFound: "not_found",
    exceptions.MethodNotAllowed: "method_not_allowed",
    exceptions.UnsupportedMediaType: "unsupported_media_type",
    exceptions.NotAcceptable: "not_acceptable",
    exceptions.ParseError: "invalid_json",
}


def exception_handler(exc: Exception, context: dict[str, Any]) -> HttpResponse | Response | None:
    if isinstance(exc, ServiceError):
        return service_error_response(exc)
    if isinstance(exc, TooManyFieldsSent):  # (Django's, reading the query string)
        return error_response(400, "bad_query", "too many query parameters")
    if isinstance(exc, exceptions.APIException):
        headers = {}
        if isinstance(exc, (exceptions.NotAuthenticated, exceptions.AuthenticationFailed)):
            request = context.get("request")
            view = context.get("view")
            header = view.get_authenticate_header(request) if view and request else None
            if header:
                headers["WWW-Authenticate"] = header
                exc.status_code = 401
        code = next((c for cls, c in _DRF_CODES.items() if isinstance(exc, cls)), "bad_request")
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return error_response(exc.status_code, code, str(detail), headers)
    return None


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    return error_response(404, "not_found", f"no route {request.path}")


def server_error(request: HttpRequest) -> HttpResponse:
    return error_response(500, "internal_error", "internal error; see the gateway log")
