"""Bearer-token authentication, the one path every route takes (`aauthenticate`: the HTTP front
for the shared and OpenAI-compatible routes, once per request, and the event streams; DRF's authentication class names the scheme in the OpenAPI document), and the per-route action
check. The device checks
the same actions again against the grant file.

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
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db.models.signals import post_delete, post_save
from rest_framework.authentication import BaseAuthentication

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

    def clear(self, *args: Any, **kwargs: Any) -> None:
        """Forget every principal (also a signal receiver: any principal saved or deleted)."""
        self._entries.clear()
        self._grant_path = None
        self._checked = 0.0


PRINCIPALS = PrincipalCache()
post_save.connect(PRINCIPALS.clear, sender=Principal, dispatch_uid="aotx-principal-cache-save")
post_delete.connect(PRINCIPALS.clear, sender=Principal, dispatch_uid="aotx-principal-cache-delete")


def _bearer(header: str) -> str | None:
    """The token of an Authorization header; None when there is none; 401 when malformed."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ServiceError(401, "unauthenticated", "Authorization must be 'Bearer <token>'")
    return token.strip()


def _lookup(digest: str) -> AuthenticatedPrincipal:
    principal = Principal.for_digest(digest)
    if principal is None:
        raise ServiceError(401, "unauthenticated", "unknown or revoked token")
    return AuthenticatedPrincipal(principal)


def _cached(header: str) -> tuple[str | None, AuthenticatedPrincipal | None]:
    """(the token's digest, its principal when the cache knows it); (None, None) without a token;
    401 when malformed."""
    token = _bearer(header)
    if token is None:
        return None, None
    digest = hash_token(token)
    return digest, PRINCIPALS.get(digest)


def authenticate(header: str) -> AuthenticatedPrincipal | None:
    """The principal of an Authorization header; None when there is none; 401 for a malformed,
    unknown or revoked token. Blocking (the database on a cache miss)."""
    digest, user = _cached(header)
    if digest is None or user is not None:
        return user
    user = _lookup(digest)
    PRINCIPALS.put(digest, user)
    return user


async def aauthenticate(header: str) -> AuthenticatedPrincipal | None:
    """authenticate() from the event loop: the cache first, the database on a thread on a miss."""
    digest, user = _cached(header)
    if digest is None or user is not None:
        return user
    user = await sync_to_async(_lookup)(digest)
    PRINCIPALS.put(digest, user)
    return user


def require_action(user: Any, action: str) -> None:
    if action not in user.actions:
        raise ServiceError(403, "grant_missing", f"this principal lacks the {action} action")


class BearerAuthentication(BaseAuthentication):
    def authenticate(self, request: Any) -> tuple[AuthenticatedPrincipal, None] | None:
        user = authenticate(request.META.get("HTTP_AUTHORIZATION", ""))
        return (user, None) if user is not None else None

    def authenticate_header(self, request: Any) -> str:
        return WWW_AUTHENTICATE
