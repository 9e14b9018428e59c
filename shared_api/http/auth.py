"""Bearer-token authentication and the per-route action check: `admit`, the one path every
route takes (the HTTP front for the shared and OpenAI-compatible routes, once per request, and the
event streams), with one 401 body (`unauthenticated`); DRF's authentication class hands the shared
routes' views the principal `admit` found (and names the scheme in the OpenAPI document). The
device checks the same actions again against the grant file.

Principals are looked up by their token's SHA-256 in the gateway database once and then kept in
a per-process cache (PRINCIPALS), so that a request on the event loop costs no database round
trip and no thread. The cache forgets everything when a principal is saved or deleted in this
process (signals), when the grant file changes (every principal change through the admin or
`manage.py principal --config` rewrites it: a stat() at most every GRANT_FILE_CHECK seconds sees
that from any process),
and each entry after AOTX_PRINCIPAL_CACHE_SECONDS; unknown tokens are never cached."""
from __future__ import annotations

import os
import time
from collections import OrderedDict

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db.models.signals import post_delete, post_save
from rest_framework.authentication import BaseAuthentication
from rest_framework.request import Request

from gpu_worker.contract.vocabulary import DEFAULT_RATES

from .. import config
from ..errors import WWW_AUTHENTICATE, ServiceError
from ..models import Principal, hash_token


class AuthenticatedPrincipal:
    is_authenticated = True

    def __init__(self, principal: Principal) -> None:
        self.name = principal.name
        self.principal_id = principal.principal_id
        self.actions = principal.current_actions()
        # {rate name: limit per second} in force (shared_api/http/rates.py): its grant's, the default
        # (DEFAULT_RATES) for one it leaves out, none for one it sets to null (unlimited)
        self.rates = effective_rates(principal.quotas or {})
        # the rates among them at their default: those bind only while another principal is active
        self.shared_rates = frozenset(DEFAULT_RATES) - set(principal.quotas or {})


def effective_rates(quotas: dict[str, int | None]) -> dict[str, int]:
    """{rate name: limit per second} of a principal's quotas object: each rate it sets, the
    default for each it leaves out, and no entry for one it sets to None (unlimited)."""
    rates = {}
    for name, default in DEFAULT_RATES.items():
        limit = quotas.get(name, default)
        if limit is not None:
            rates[name] = limit
    return rates


GRANT_FILE_CHECK = 0.05  # seconds between two looks at the grant file


class PrincipalCache:
    """token digest -> AuthenticatedPrincipal, bounded (least recently used goes first)."""

    MAX_ENTRIES = 10_000

    def __init__(self) -> None:
        self._entries: OrderedDict[str, tuple[float, AuthenticatedPrincipal]] = OrderedDict()
        self._grant_file: tuple[int, int, int] | None = None
        self._grant_path: str | None = None
        self._checked = 0.0

    def _grant_file_state(self) -> tuple[int, int, int] | None:
        if self._grant_path is None:
            try:
                self._grant_path = config.load(settings.AOTX_GATEWAY_CONFIG)["grants_file"]
            except config.ConfigError:
                return None
        try:
            st = os.stat(self._grant_path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def get(self, digest: str) -> AuthenticatedPrincipal | None:
        now = time.monotonic()
        if now - self._checked >= GRANT_FILE_CHECK:
            self._checked = now
            state = self._grant_file_state()
            if state != self._grant_file:
                self._entries.clear()
                self._grant_file = state
                return None
        found = self._entries.get(digest)
        if found is None:
            return None
        if now - found[0] > settings.AOTX_PRINCIPAL_CACHE_SECONDS:
            del self._entries[digest]
            return None
        self._entries.move_to_end(digest)
        return found[1]

    def put(self, digest: str, user: AuthenticatedPrincipal) -> None:
        self._entries[digest] = (time.monotonic(), user)
        if len(self._entries) > self.MAX_ENTRIES:
            self._entries.popitem(last=False)

    def clear(self, *args: object, **kwargs: object) -> None:
        """Forget every principal (also a signal receiver: any principal saved or deleted)."""
        self._entries.clear()
        self._grant_path = None
        self._checked = 0.0


PRINCIPALS = PrincipalCache()
post_save.connect(PRINCIPALS.clear, sender=Principal, dispatch_uid="aotx-principal-cache-save")
post_delete.connect(PRINCIPALS.clear, sender=Principal, dispatch_uid="aotx-principal-cache-delete")


UNAUTHENTICATED = "a valid token is required: send 'Authorization: Bearer <token>'"


def unauthenticated() -> ServiceError:
    """The one 401 of every route: no token, a malformed header, an unknown or a revoked token
    alike (the answer does not tell a guesser which)."""
    return ServiceError(401, "unauthenticated", UNAUTHENTICATED)


def _digest(header: str) -> str:
    """The SHA-256 of an Authorization header's Bearer token; 401 without one."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthenticated()
    return hash_token(token.strip())


def _lookup(digest: str) -> AuthenticatedPrincipal:
    principal = Principal.for_digest(digest)
    if principal is None:
        raise unauthenticated()
    return AuthenticatedPrincipal(principal)


async def admit(header: str, action: str) -> AuthenticatedPrincipal:
    """The one check every route makes of its caller, from the event loop: the principal of an
    Authorization header (the cache first, the database on a thread on a miss), 401 without a
    valid token; then its action, 403 `grant_missing` without it."""
    digest = _digest(header)
    user = PRINCIPALS.get(digest)
    if user is None:
        user = await sync_to_async(_lookup)(digest)
        PRINCIPALS.put(digest, user)
    require_action(user, action)
    return user


def require_action(user: AuthenticatedPrincipal, action: str) -> None:
    if action not in user.actions:
        raise ServiceError(403, "grant_missing", f"this principal lacks the {action} action")


ADMITTED = "aotx.admitted"  # the request scope's key for the principal the front admitted (`admit`)


def admitted_principal(request: Request) -> AuthenticatedPrincipal | None:
    """The principal the front admitted for this request, None for a request it did not pass."""
    scope = getattr(request, "scope", None)  # (Django's ASGIRequest's, through DRF's Request)
    admitted = scope.get(ADMITTED) if isinstance(scope, dict) else None
    return admitted if isinstance(admitted, AuthenticatedPrincipal) else None


class BearerAuthentication(BaseAuthentication):
    """DRF's authentication of the shared routes: the principal the front admitted from this
    request's headers before it read the body (the request scope's ADMITTED), so that a request
    is authenticated once, by `admit`. A shared view runs only under the front
    (SharedView.initial)."""

    def authenticate(self, request: Request) -> tuple[AuthenticatedPrincipal, None] | None:
        admitted = admitted_principal(request)
        return (admitted, None) if admitted is not None else None

    def authenticate_header(self, request: Request) -> str:
        return WWW_AUTHENTICATE
