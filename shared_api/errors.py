"""Every client-visible error is an ApiError mapped to the one error body, in one place:
{"error": {"code": "...", "message": "...", ...details}}."""
import json

from django.http import HttpResponse
from rest_framework import exceptions


class ApiError(Exception):
    def __init__(self, status, code, message, **details):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details


def error_response(status, code, message, headers=None, **details):
    body = json.dumps({"error": {"code": code, "message": message, **details}}, sort_keys=True,
                      separators=(",", ":"))
    response = HttpResponse(body, status=status, content_type="application/json")
    for name, value in (headers or {}).items():
        response[name] = value
    return response


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


def exception_handler(exc, context):
    if isinstance(exc, ApiError):
        headers = {"WWW-Authenticate": 'Bearer realm="aotx"'} if exc.status == 401 else None
        return error_response(exc.status, exc.code, exc.message, headers, **exc.details)
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


def not_found(request, exception=None):
    return error_response(404, "not_found", f"no route {request.path}")


def server_error(request):
    return error_response(500, "internal_error", "internal error; see the gateway log")
