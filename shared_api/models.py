"""Gateway-side records: API principals and their gateway actions. Tokens are stored only as
SHA-256 digests (they are 256-bit random values, so a fast hash is enough); the token itself is
shown once, when it is issued. A row always has a principal ID, a token digest and only valid
actions (save() refuses anything else, and the database refuses empty IDs), so every row can go
into the grant file the device reads."""
from __future__ import annotations

import hashlib
import secrets

from typing import Any

from django.db import models

from gpu_worker.contract.ids import HEX32
from gpu_worker.contract.vocabulary import ACTIONS

TOKEN_PREFIX = "aotx_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_principal_id() -> str:
    return secrets.token_hex(16)


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


class Principal(models.Model):
    name = models.CharField(max_length=100, unique=True)
    principal_id = models.CharField(max_length=32, unique=True, editable=False, default=new_principal_id)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    actions = models.JSONField(default=list)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(condition=~models.Q(name=""), name="principal_name_not_empty"),
            models.CheckConstraint(condition=~models.Q(principal_id=""), name="principal_id_not_empty"),
            models.CheckConstraint(condition=~models.Q(token_hash=""), name="principal_token_not_empty"),
        ]

    def __str__(self) -> str:
        return self.name

    @classmethod
    def create(cls, name: str, actions: list[str]) -> tuple[Principal, str]:
        """Returns (principal, token); the token is never stored."""
        principal = cls(name=name, actions=actions)
        token = principal.rotate_token()
        principal.save()
        return principal, token

    def rotate_token(self) -> str:
        """Issue a new token (the caller saves): the old one stops working, the principal ID and
        its grants stay. Returns the token, which only its digest outlives."""
        token = new_token()
        self.token_hash = hash_token(token)
        return token

    def save(self, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(self.actions) - set(ACTIONS)) if isinstance(self.actions, list) else self.actions
        if unknown or not self.name or not HEX32.match(self.principal_id) or len(self.token_hash) != 64:
            raise ValueError(f"principal {self.name!r} cannot be saved: it needs a name, a 32-hex principal ID, "
                             f"a token digest and actions among {', '.join(ACTIONS)}")
        self.actions = sorted(set(self.actions))
        super().save(*args, **kwargs)

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
