"""Gateway-side records: API principals and their gateway actions. Tokens are stored only as
SHA-256 digests (they are 256-bit random values, so a fast hash is enough); the token itself is
shown once, when it is issued. A revoked principal's token dies with the revocation: its digest
is replaced by one nobody holds, so reinstating it issues a new token (the old one is refused for
good). Quotas (docs/grants.md) are what the principal may hold at the device at once, and how
fast it may go (the rates): `quotas` holds those set for it, a number or None (unlimited); one it
leaves out has the default (a fair share, docs/grants.md "Defaults"). A row always has a principal ID, a token
digest and only valid actions (save() refuses anything else, and the database refuses empty IDs),
so every row can go into the grant file the device reads."""
from __future__ import annotations

import datetime
import hashlib
import secrets

from typing import Any

from django.db import models

from gpu_worker.contract.grantfile import LIMITS, quota_problem
from gpu_worker.contract.ids import HEX32
from gpu_worker.contract.vocabulary import ACTIONS, RATES

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
    quotas = models.JSONField(default=dict, blank=True)  # {name: limit, null: unlimited}; absent: the default
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
    def create(cls, name: str, actions: list[str],
               quotas: dict[str, int | None] | None = None) -> tuple[Principal, str]:
        """Returns (principal, token); the token is never stored."""
        principal = cls(name=name, actions=actions, quotas=quotas or {})
        token = principal.rotate_token()
        principal.save()
        return principal, token

    def rotate_token(self) -> str:
        """Issue a new token (the caller saves): the old one stops working, the principal ID and
        its grants stay. Returns the token, which only its digest outlives. A revoked principal
        gets a token only by being reinstated."""
        if not self.active:
            raise ValueError(f"principal {self.name!r} is revoked: reinstate it to issue a new token")
        token = new_token()
        self.token_hash = hash_token(token)
        return token

    def revoke(self) -> None:
        """No action until reinstated, and its token is dead for good (the caller saves)."""
        self.active = False

    def reinstate(self) -> str:
        """Active again with a NEW token (the caller saves and shows it once); the token it had
        before the revocation stays refused."""
        self.active = True
        return self.rotate_token()

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.active:  # whatever token it had is refused from now on, also once reinstated
            self.token_hash = hash_token(new_token())
        unknown = sorted(set(self.actions) - set(ACTIONS)) if isinstance(self.actions, list) else self.actions
        problem = quota_problem(self.quotas)
        if (unknown or problem or not self.name or not HEX32.match(self.principal_id)
                or len(self.token_hash) != 64):
            raise ValueError(f"principal {self.name!r} cannot be saved: it needs a name, a 32-hex principal ID, "
                             f"a token digest, actions among {', '.join(ACTIONS)} and quotas among "
                             f"{', '.join(LIMITS)}" + (f" ({problem})" if problem else ""))
        self.actions = sorted(set(self.actions))
        super().save(*args, **kwargs)

    @classmethod
    def for_token(cls, token: str) -> Principal | None:
        return cls.for_digest(hash_token(token))

    @classmethod
    def for_digest(cls, digest: str) -> Principal | None:
        try:  # one indexed lookup; .first() would add an ORDER BY
            return cls.objects.only("name", "principal_id", "actions", "quotas", "active").get(token_hash=digest,
                                                                                            active=True)
        except cls.DoesNotExist:
            return None

    def current_actions(self) -> frozenset[str]:
        return frozenset(self.actions) if self.active else frozenset()


DEFAULT = "default"  # parse_quotas' value for `NAME=default`: the setting goes, the default applies


def parse_quotas(values: list[str]) -> dict[str, int | None | str]:
    """`--quota name=N` options: {name: N}; {name: None} for `name=unlimited` (kept: unlimited is
    said explicitly, since a quota left out has the default); {name: DEFAULT} for `name=default`
    (the setting is removed). `apply_quotas` merges them into a principal's quotas."""
    out: dict[str, int | None | str] = {}
    for value in values:
        name, sep, limit = value.partition("=")
        name = name.strip()
        if not sep or name not in LIMITS:
            raise ValueError(f"--quota {value!r}: expected NAME=N with NAME among {', '.join(LIMITS)}")
        limit = limit.strip()
        if limit in ("unlimited", DEFAULT):
            out[name] = None if limit == "unlimited" else DEFAULT
            continue
        if not limit.isdigit() or quota_problem({name: int(limit)}):
            raise ValueError(f"--quota {value!r}: N must be an integer from {int(name in RATES)} to 2^63-1, "
                             "'unlimited' or 'default'")
        out[name] = int(limit)
    return out


def apply_quotas(current: dict[str, int | None], changes: dict[str, int | None | str]) -> dict[str, int | None]:
    """A principal's quotas after `--quota` changes (parse_quotas): each set to its number or to
    None (unlimited); one changed to DEFAULT removed (it then has the default)."""
    merged: dict[str, int | None | str] = {**current, **changes}
    return {name: value for name, value in merged.items() if not isinstance(value, str)}


def describe_quotas(quotas: dict[str, int | None]) -> str:
    """A principal's quotas for people: `name=N` or `name=unlimited` for those set, and "defaults"
    for the rest (the principal list, the admin's list)."""
    set_ = [f"{name}={'unlimited' if limit is None else limit}" for name, limit in sorted(quotas.items())]
    if not set_:
        return "defaults"
    return ", ".join(set_ + (["defaults for the rest"] if len(set_) < len(LIMITS) else []))


def parse_actions(text: str) -> list[str]:
    actions = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in actions if a not in ACTIONS]
    if unknown:
        raise ValueError(f"unknown action(s) {', '.join(unknown)}; known: {', '.join(ACTIONS)}")
    return actions


def ns_datetime(ns: int | str | None) -> datetime.datetime | None:
    """A device timestamp (nanoseconds since the epoch; a number, or a decimal string as the API
    writes counters) as an aware datetime."""
    if ns is None:
        return None
    return datetime.datetime.fromtimestamp(int(ns) / 1e9, tz=datetime.timezone.utc)


class CapacitySample(models.Model):
    """The device's usage at one moment, from its `ping` (the Celery task `sample_capacity`, once
    a minute): what the admin's capacity dashboard draws. The tick counters (`saved_transfers`,
    `fdatasyncs`, `fdatasync_seconds`) are cumulative since the device's `boot`; a rate is the
    difference between two samples of the same boot. Fields the device does not report are null
    (`usage` and `capacities` hold whichever tables it reports, `memory` too once it does)."""
    taken_at = models.DateTimeField(db_index=True)
    boot = models.BigIntegerField()
    usage = models.JSONField(default=dict)        # {table: rows in use}
    capacities = models.JSONField(default=dict)   # {table or byte area: capacity}
    kv = models.JSONField(null=True, blank=True)  # {"pages", "owned", "pending", "running", "waiting"} or null
    executions_queued = models.IntegerField(null=True, blank=True)
    executions_running = models.IntegerField(null=True, blank=True)
    journal_bytes = models.BigIntegerField()
    runtime_file_bytes = models.BigIntegerField(null=True, blank=True)
    saved_transfers = models.BigIntegerField(null=True, blank=True)
    fdatasyncs = models.BigIntegerField(null=True, blank=True)
    fdatasync_seconds = models.FloatField(null=True, blank=True)
    subscriptions = models.IntegerField(null=True, blank=True)
    hold = models.BooleanField(default=False)

    class Meta:
        ordering = ["taken_at"]

    def __str__(self) -> str:
        return f"capacity sample {self.taken_at.isoformat()}"


class HoldIncident(models.Model):
    """A journal hold incident as the device journals it (start, end, cause, pending bytes),
    recorded by the Celery task `detect_holds`; kept here for as long as the database lives,
    beyond the device's own last MAX_INCIDENTS and across runtime files."""
    since_ns = models.BigIntegerField(unique=True)
    ended_ns = models.BigIntegerField(null=True, blank=True)
    cause = models.CharField(max_length=32)
    disk_error = models.TextField(null=True, blank=True)
    pending_bytes = models.BigIntegerField(null=True, blank=True)
    recorded_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-since_ns"]

    def __str__(self) -> str:
        return f"journal hold {self.cause} since {self.since_ns}"

    @property
    def since(self) -> datetime.datetime | None:
        return ns_datetime(self.since_ns)

    @property
    def ended(self) -> datetime.datetime | None:
        return ns_datetime(self.ended_ns)
