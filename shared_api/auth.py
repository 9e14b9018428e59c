"""Bearer-token authentication, the one path every route takes (DRF's authentication class for
the shared routes, `authenticate_request` for the OpenAI-compatible views), and the per-route
action check. The device checks the same actions again against the grant file."""
from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest
from rest_framework.authentication import BaseAuthentication

from .errors import WWW_AUTHENTICATE, ServiceError
from .models import Principal


class AuthenticatedPrincipal:
    is_authenticated = True

    def __init__(self, principal: Principal) -> None:
        self.name = principal.name
        self.principal_id = principal.principal_id
        self.actions = principal.current_actions()


def authenticate(header: str) -> AuthenticatedPrincipal | None:
    """The principal of an Authorization header; None when there is none; 401 for a malformed,
    unknown or revoked token."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ServiceError(401, "unauthenticated", "Authorization must be 'Bearer <token>'")
    principal = Principal.for_token(token.strip())
    if principal is None:
        raise ServiceError(401, "unauthenticated", "unknown or revoked token")
    return AuthenticatedPrincipal(principal)


def require_action(user: Any, action: str) -> None:
    if action not in user.actions:
        raise ServiceError(403, "grant_missing", f"this principal lacks the {action} action")


async def authenticate_request(request: HttpRequest, action: str) -> AuthenticatedPrincipal:
    """For async views outside DRF: the authenticated principal holding `action`, or 401/403."""
    user = await sync_to_async(authenticate)(request.headers.get("Authorization", ""))
    if user is None:
        raise ServiceError(401, "unauthenticated", "Authorization must be 'Bearer <token>'")
    require_action(user, action)
    return user


class BearerAuthentication(BaseAuthentication):
    def authenticate(self, request: Any) -> tuple[AuthenticatedPrincipal, None] | None:
        user = authenticate(request.META.get("HTTP_AUTHORIZATION", ""))
        return (user, None) if user is not None else None

    def authenticate_header(self, request: Any) -> str:
        return WWW_AUTHENTICATE
