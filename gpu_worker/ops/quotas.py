"""Per-principal quotas (docs/grants.md): what one principal may hold at the device at once, read
from the grant file beside its actions. The device is the authority: every check runs at
admission, on the tick thread, before any row, receipt or transfer changes, and a principal over
a quota gets 429 `quota_exceeded` naming it (`quota`, `limit`, `used`) with nothing changed.
A quota the grant file does not set is unlimited (the tables' capacities and the receipt reserve
for registrations still bound it).

What each counts, for the caller's participant:

  receipts       live receipts (admitted, not yet retired); a retirement is never refused by it
  spaces         live spaces it owns (deleting one gives it back)
  conversations  live conversations it created (deleting one gives it back)
  media_bytes    bytes of the media sources it owns, and of its uploads not yet saved
  chats          its chat completions running or being tokenized
  queued_inputs  its inputs admitted and not yet finished (queued or running)
  kv_pages       the page limits of those inputs and of its running chats (each reserves its
                 whole page limit in the shared KV pool)
  memory_rows    live memory rows it wrote (retained from its inputs, or its publications'
                 copies); an input over it still runs, and its receipt says what was not retained
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Callable

from ..contract.errors import ServiceError
from ..contract.vocabulary import QUOTAS, RATES
from ..state.tables import C, R, S, Terminal
from .kind import Kind

if TYPE_CHECKING:
    from ..device import Device

QUOTA_EXCEEDED = 429


class Usage:
    """Host-side counts the tables cannot give: uploads between their check and their saved
    owner, chats between their check and their end. Both live on the tick thread."""

    def __init__(self) -> None:
        self.media_in_flight: Counter[int] = Counter()  # participant row -> bytes of unsaved uploads
        self.chats_tokenizing: Counter[bytes] = Counter()  # principal -> chats not yet handed to the engine

    def chat_prepared(self, principal: bytes) -> None:
        """A chat's prompt is tokenized (or an embedding request done): it stops counting here."""
        self.chats_tokenizing[principal] -= 1
        if self.chats_tokenizing[principal] <= 0:
            del self.chats_tokenizing[principal]


def _receipts(d: Device, principal: bytes, prow: int | None) -> int:
    return 0 if prow is None else len(d.state.live_sequences(prow))


def _spaces(d: Device, principal: bytes, prow: int | None) -> int:
    if prow is None:
        return 0
    t = d.state.tables.spaces
    return int(((t[:, S.STATE] == 1) & (t[:, S.OWNER] == prow)).sum())


def _conversations(d: Device, principal: bytes, prow: int | None) -> int:
    if prow is None:
        return 0
    t = d.state.tables.conversations
    return int(((t[:, C.STATE] == 1) & (t[:, C.CREATOR] == prow)).sum())


def _media_bytes(d: Device, principal: bytes, prow: int | None) -> int:
    if prow is None:
        return 0
    return sum(s.length for s in d.state.media.values() if prow in s.owners) + d.usage.media_in_flight[prow]


def _chat_subscriptions(d: Device, principal: bytes) -> list[int]:
    """The page limits of the principal's running chats."""
    return [sub.data["pages"] for sub in d.subscriptions.all() if sub.topic[0] == "chat" and sub.principal == principal]


def _chats(d: Device, principal: bytes, prow: int | None) -> int:
    return len(_chat_subscriptions(d, principal)) + d.usage.chats_tokenizing[principal]


def _unfinished_inputs(d: Device, prow: int | None) -> tuple[int, int]:
    """(count, page limits) of the participant's inputs without a terminal result."""
    if prow is None:
        return 0, 0
    t = d.state.tables.receipts
    mask = ((t[:, R.STATE] == 1) & (t[:, R.PARTICIPANT] == prow) & (t[:, R.KIND] == int(Kind.INPUT))
            & (t[:, R.TERMINAL] == int(Terminal.NONE)))
    return int(mask.sum()), int(t[mask, R.PAGE_LIMIT].sum())


def _queued_inputs(d: Device, principal: bytes, prow: int | None) -> int:
    return _unfinished_inputs(d, prow)[0]


def _kv_pages(d: Device, principal: bytes, prow: int | None) -> int:
    return _unfinished_inputs(d, prow)[1] + sum(_chat_subscriptions(d, principal))


def _memory_rows(d: Device, principal: bytes, prow: int | None) -> int:
    if prow is None:
        return 0
    return d.state.memory.written_by(d.state.participants.raw[prow])


COUNTS: dict[str, Callable[[Device, bytes, "int | None"], int]] = {
    "receipts": _receipts, "spaces": _spaces, "conversations": _conversations, "media_bytes": _media_bytes,
    "chats": _chats, "queued_inputs": _queued_inputs, "kv_pages": _kv_pages,
    "memory_rows": _memory_rows,
}
assert tuple(COUNTS) == QUOTAS


def allows(d: Device, principal: bytes, prow: int | None, name: str, adding: int = 1) -> bool:
    """Whether `adding` more of `name` stays within the principal's quota (no refusal)."""
    limit = d.grants.quota(principal.hex(), name)
    return limit is None or COUNTS[name](d, principal, prow) + adding <= limit


def check(d: Device, principal: bytes, prow: int | None, name: str, adding: int = 1) -> None:
    """Refuse (429 quota_exceeded) when `adding` more of `name` would pass the principal's quota;
    nothing is counted when the quota is unset."""
    limit = d.grants.quota(principal.hex(), name)
    if limit is None:
        return
    used = COUNTS[name](d, principal, prow)
    if used + adding > limit:
        raise ServiceError(QUOTA_EXCEEDED, "quota_exceeded",
                           f"the {name} quota of this principal is {limit} and {used} are in use; "
                           f"this needs {adding} more", quota=name, limit=str(limit), used=str(used))


def view(d: Device, principal: bytes, prow: int | None) -> dict[str, dict[str, str | None]]:
    """Capabilities: every quota's limit (null: unlimited) and current use, as decimal strings."""
    pid = principal.hex()
    return {name: {"limit": None if (limit := d.grants.quota(pid, name)) is None else str(limit),
                   "used": str(count(d, principal, prow))}
            for name, count in COUNTS.items()}


def rates_view(d: Device, principal: bytes) -> dict[str, dict[str, str | None]]:
    """Capabilities: the principal's rates (null: unlimited), as decimal strings. The gateway
    enforces requests and body bytes (shared_api/rates.py), the engine output tokens
    (engine/pacing.py); admission here does not count them."""
    pid = principal.hex()
    return {name: {"limit": None if (limit := d.grants.quota(pid, name)) is None else str(limit)} for name in RATES}
