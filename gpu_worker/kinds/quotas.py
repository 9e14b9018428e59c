"""Per-principal quotas (docs/grants.md): what one principal may hold at the device at once, read
from the grant file beside its actions. The device is the authority: every check runs at
admission, on the tick thread, before any row, receipt or transfer changes, and a principal over
a quota gets 429 `quota_exceeded` naming it (`quota`, `limit`, `used`) with nothing changed.

A quota the grant file does not set has its default (`defaults`). The table quotas default to a
quarter (DEFAULT_SHARE) of what the runtime holds in all, so that a principal created without quotas
(`manage.py principal create`) cannot take every receipt, space, conversation or memory row from the
others: three quarters of each stay for them. What a principal runs (its chats, its inputs' and
chats' KV pages) defaults to the whole device: those shares bind under contention only, in the
engine (engine/shares.py, docs/grants.md "Shares under contention"), so a principal alone may use
every page while others are given their share as soon as they have work. One set in the grant file
binds always; one set to null is unlimited (the tables' capacities and the receipt reserve for
registrations still bound it). The gateway does not know the runtime, so the device computes the
defaults from its own capacities, and capabilities shows each limit in force, whether it is the
default, and when it binds (`CONTENTION`).

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
                 copies) and the earlier versions its live corrections keep; an input over it
                 still runs, and its receipt says what was not retained
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..contract.errors import ServiceError
from ..contract.limits import MAX_MEDIA_BYTES
from ..contract.vocabulary import DEFAULT_RATES, QUOTAS, RATES
from ..state.tables import C, R, S, Terminal
from .kind import Caller, Kind, Tables

_MEMORY_VERSION = int(Kind.MEMORY_VERSION)


QUOTA_EXCEEDED = 429
DEFAULT_SHARE = 4  # a principal's default quota is 1/DEFAULT_SHARE of the runtime's whole


# the defaults that bind under contention only: the engine shares them among the active principals
CONTENTION = frozenset({"chats", "kv_pages"})


def defaults(capacities: dict[str, int], runtime_profile: dict[str, Any], journal_file_cap: int) -> dict[str, int]:
    """The quotas of a principal whose grant leaves them out.

      receipts, spaces, conversations  a quarter of the table's capacity (at least one row, so that
      memory_rows                      a tiny table does not make a default principal useless)
      queued_inputs                    a quarter of the receipt table: a queued input holds a
                                       receipt and waits unleased, costing no page
      media_bytes                      a quarter of journal_file_cap_bytes: the runtime sizes no
                                       media store, and its sources live in the journal directory,
                                       which the operator sized by that cap (at least one source
                                       of the largest size, MAX_MEDIA_BYTES)
      kv_pages                         the whole KV pool         } under contention the engine
      chats                            one per page of the pool  } shares them (CONTENTION)
    """
    share = DEFAULT_SHARE
    receipts = max(1, capacities["receipts"] // share)
    return {"receipts": receipts, "spaces": max(1, capacities["spaces"] // share),
            "conversations": max(1, capacities["conversations"] // share),
            "media_bytes": max(MAX_MEDIA_BYTES, journal_file_cap // share),
            "chats": runtime_profile["kv_pages"], "queued_inputs": receipts,
            "kv_pages": runtime_profile["kv_pages"],
            "memory_rows": max(1, capacities["memory"] // share)}


def binds(name: str, default: bool) -> str:
    """When a limit in force applies: "always", or "contention" (a default shared among the active
    principals, by the engine or the gateway's rates: alone, a principal may use all of it)."""
    return "contention" if default and (name in CONTENTION or name in RATES) else "always"


def _receipts(d: Tables, principal: bytes, prow: int | None) -> int:
    return 0 if prow is None else len(d.state.live_sequences(prow))


def _spaces(d: Tables, principal: bytes, prow: int | None) -> int:
    if prow is None:
        return 0
    t = d.state.tables.spaces
    return int(((t[:, S.STATE] == 1) & (t[:, S.OWNER] == prow)).sum())


def _conversations(d: Tables, principal: bytes, prow: int | None) -> int:
    if prow is None:
        return 0
    t = d.state.tables.conversations
    return int(((t[:, C.STATE] == 1) & (t[:, C.CREATOR] == prow)).sum())


def _media_bytes(d: Caller, principal: bytes, prow: int | None) -> int:
    if prow is None:
        return 0
    return sum(s.length for s in d.state.media.values() if prow in s.owners) + d.usage.media_in_flight[prow]


def _chats(d: Caller, principal: bytes, prow: int | None) -> int:
    return len(d.chat_pages(principal)) + d.usage.chats_tokenizing[principal]


def _unfinished(d: Caller) -> dict[int, dict[int, int]]:
    """{participant row: {receipt row: page limit}} of the inputs without a terminal result."""
    kept = d.usage.unfinished
    if kept is not None and kept[0] is d.state:
        return kept[1]
    t = d.state.tables.receipts
    mask = (t[:, R.STATE] == 1) & (t[:, R.KIND] == int(Kind.INPUT)) & (t[:, R.TERMINAL] == int(Terminal.NONE))
    found: dict[int, dict[int, int]] = {}
    for rrow in torch.nonzero(mask).flatten().tolist():
        found.setdefault(int(t[rrow, R.PARTICIPANT]), {})[rrow] = int(t[rrow, R.PAGE_LIMIT])
    d.usage.unfinished = (d.state, found)
    return found


def input_admitted(d: Caller, prow: int, rrow: int, pages: int) -> None:
    """An input's admission is applied (live or at replay): it counts as unfinished."""
    kept = d.usage.unfinished
    if kept is not None and kept[0] is d.state:  # (otherwise the next count scans the table)
        kept[1].setdefault(prow, {})[rrow] = pages


def input_finished(d: Caller, prow: int, rrow: int) -> None:
    """An input's terminal result is applied (live or at replay): it no longer counts."""
    kept = d.usage.unfinished
    if kept is not None and kept[0] is d.state:
        mine = kept[1].get(prow)
        if mine is not None:
            mine.pop(rrow, None)
            if not mine:
                del kept[1][prow]


def _unfinished_inputs(d: Caller, prow: int | None) -> tuple[int, int]:
    """(count, page limits) of the participant's inputs without a terminal result."""
    mine = _unfinished(d).get(prow) if prow is not None else None
    return (len(mine), sum(mine.values())) if mine else (0, 0)


def _queued_inputs(d: Caller, principal: bytes, prow: int | None) -> int:
    return _unfinished_inputs(d, prow)[0]


def _kv_pages(d: Caller, principal: bytes, prow: int | None) -> int:
    return _unfinished_inputs(d, prow)[1] + sum(d.chat_pages(principal))


def _memory_rows(d: Tables, principal: bytes, prow: int | None) -> int:
    if prow is None:
        return 0
    # the rows it wrote, and the versions its live corrections keep (kinds/memory_versions.py)
    receipts = d.state.tables.receipts
    kept = int(((receipts[:, R.STATE] == 1) & (receipts[:, R.KIND] == _MEMORY_VERSION)
                & (receipts[:, R.PARTICIPANT] == prow)).sum())
    return d.state.memory.written_by(d.state.participants.raw[prow]) + kept


COUNTS: dict[str, Callable[[Caller, bytes, "int | None"], int]] = {
    "receipts": _receipts, "spaces": _spaces, "conversations": _conversations, "media_bytes": _media_bytes,
    "chats": _chats, "queued_inputs": _queued_inputs, "kv_pages": _kv_pages,
    "memory_rows": _memory_rows,
}
assert tuple(COUNTS) == QUOTAS


def _memory_table_rows(d: Tables) -> int:
    return d.state.memory.used()


def _table_rows(table: str) -> Callable[[Tables], int]:
    def rows(d: Tables) -> int:
        index = getattr(d.state, table)
        return d.state.capacities[table] - len(index.free)
    return rows


# Rows of the whole table in use (live or waiting for their receipts' retirement): never fewer
# than one principal's count, and cheap, so a principal whose limit the whole table's use does not
# reach is not counted row by row (the defaults give every principal a limit; a full count of a
# large table is a scan at every admission).
AT_MOST: dict[str, Callable[[Tables], int]] = {
    "receipts": _table_rows("receipts"), "spaces": _table_rows("spaces"), "conversations": _table_rows("conversations"),
    "memory_rows": _memory_table_rows,
}


def limit(d: Caller, principal: bytes, name: str) -> tuple[int | None, bool]:
    """(the principal's limit `name` in force, None: unlimited; whether it is the default): the
    grant file's setting, else the default (`defaults` for a table quota, DEFAULT_RATES for a rate)."""
    found, value = d.grants.setting(principal.hex(), name)
    if found:
        return value, False
    if name in DEFAULT_RATES:
        return DEFAULT_RATES[name], True
    return d.quota_defaults()[name], True


def allows(d: Caller, principal: bytes, prow: int | None, name: str, adding: int = 1) -> bool:
    """Whether `adding` more of `name` stays within the principal's quota (no refusal). A default
    that binds under contention never refuses: the engine shares it (what one request needs past the
    whole pool is refused by the pool's own check)."""
    most, default = limit(d, principal, name)
    if most is None or (default and name in CONTENTION):
        return True
    bound = AT_MOST.get(name)
    if bound is not None and bound(d) + adding <= most:
        return True
    return COUNTS[name](d, principal, prow) + adding <= most


def check(d: Caller, principal: bytes, prow: int | None, name: str, adding: int = 1) -> None:
    """Refuse (429 quota_exceeded) when `adding` more of `name` would pass the principal's quota;
    nothing is counted when it is unlimited, a default that binds under contention (`allows`), or
    when the whole table's use is within it."""
    most, default = limit(d, principal, name)
    if most is None or (default and name in CONTENTION):
        return
    bound = AT_MOST.get(name)
    if bound is not None and bound(d) + adding <= most:
        return
    used = COUNTS[name](d, principal, prow)
    if used + adding > most:
        said = " (the default: docs/grants.md)" if default else ""
        raise ServiceError(QUOTA_EXCEEDED, "quota_exceeded",
                           f"the {name} quota of this principal is {most}{said} and {used} are in use; "
                           f"this needs {adding} more", quota=name, limit=str(most), used=str(used))


def view(d: Caller, principal: bytes, prow: int | None) -> dict[str, dict[str, str | bool | None]]:
    """Capabilities: every quota's limit in force (null: unlimited), whether it is the default
    (the grant leaves it out), when it binds (`binds`), and current use; numbers as decimal strings."""
    out: dict[str, dict[str, str | bool | None]] = {}
    for name, count in COUNTS.items():
        most, default = limit(d, principal, name)
        out[name] = {"limit": None if most is None else str(most), "default": default,
                     "binds": binds(name, default), "used": str(count(d, principal, prow))}
    return out


def rates_view(d: Caller, principal: bytes) -> dict[str, dict[str, str | bool | None]]:
    """Capabilities: the principal's rates in force (null: unlimited) and whether each is the
    default, as decimal strings. The gateway enforces requests and body bytes from the same
    grant file and defaults (shared_api/http/rates.py), the engine output tokens (engine/pacing.py);
    admission here does not count them."""
    out: dict[str, dict[str, str | bool | None]] = {}
    for name in RATES:
        most, default = limit(d, principal, name)
        out[name] = {"limit": None if most is None else str(most), "default": default, "binds": binds(name, default)}
    return out
