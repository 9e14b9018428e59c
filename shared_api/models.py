"""Gateway-side records: API principals and their gateway actions. Tokens are stored only as
SHA-256 digests (they are 256-bit random values, so a fast hash is enough); the token itself is
shown once, at creation."""
from __future__ import annotations

import hashlib
import secrets

from django.db import models

from gpu_worker.contract.vocabulary import ACTIONS

TOKEN_PREFIX = "aotx_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Principal(models.Model):
    name = models.CharField(max_length=100, unique=True)
    principal_id = models.CharField(max_length=32, unique=True, editable=False)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    actions = models.JSONField(default=list)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @classmethod
    def create(cls, name: str, actions: list[str]) -> tuple[Principal, str]:
        """Returns (principal, token); the token is never stored."""
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        principal = cls.objects.create(name=name, principal_id=secrets.token_hex(16),
                                       token_hash=hash_token(token), actions=sorted(set(actions)))
        return principal, token

    def rotate_token(self) -> str:
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        self.token_hash = hash_token(token)
        return token

    @classmethod
    def for_token(cls, token: str) -> Principal | None:
        try:  # one indexed lookup; .first() would add an ORDER BY
            return cls.objects.only("name", "principal_id", "actions", "active").get(
                token_hash=hash_token(token), active=True)
        except cls.DoesNotExist:
            return None

    def current_actions(self) -> frozenset[str]:
        return frozenset(self.actions) if self.active else frozenset()


def parse_actions(text: str) -> list[str]:
    actions = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in actions if a not in ACTIONS]
    if unknown:
        raise ValueError(f"unknown action(s) {', '.join(unknown)}; known: {', '.join(ACTIONS)}")
    return actions
