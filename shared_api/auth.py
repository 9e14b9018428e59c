"""Bearer-token authentication and the per-route grant check."""
from rest_framework.authentication import BaseAuthentication

from .errors import ApiError
from .models import Principal


class AuthenticatedPrincipal:
    is_authenticated = True

    def __init__(self, principal):
        self.name = principal.name
        self.principal_id = principal.principal_id
        self.actions = principal.current_actions()


class BearerAuthentication(BaseAuthentication):
    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "unauthenticated", "Authorization must be 'Bearer <token>'")
        principal = Principal.for_token(token.strip())
        if principal is None:
            raise ApiError(401, "unauthenticated", "unknown or revoked token")
        return AuthenticatedPrincipal(principal), None

    def authenticate_header(self, request):
        return 'Bearer realm="aotx"'


def require_action(request, action):
    if action not in request.user.actions:
        raise ApiError(403, "grant_missing", f"this principal lacks the {action} action")
