"""The deployment grant file: which principals may do what (docs/grants.md). The gateway writes
it (`manage.py write_grants`, and every principal change); the device reads it at boot and
re-reads it when it changes. It names principals by their public id and never holds a credential.

One module owns the format for both sides: `parse` is what the device accepts, and `write`
checks its document with `parse` before anything reaches the disk, so a file the device cannot
read is never written.

A principal's `quotas` object says, per quota or rate name, an integer limit or `null`
(unlimited); a name left out gets the default (a fair share: the rates' are DEFAULT_RATES, the
table quotas' the device computes from its runtime's capacities, kinds/quotas.py). That is schema
v2. A v1 file (written before defaults existed, where a name left out meant unlimited and null
was not allowed) is still read as it was meant: every name it leaves out is unlimited. The
gateway writes v2 only, so its next write (any principal change, `write_grants`, `make run`'s
start) brings the defaults to the principals that set nothing.
"""
from __future__ import annotations

import json
import os
import time
from typing import Mapping

from ..storage.filelayer import FileLayer, OsFileLayer
from .ids import HEX32
from .vocabulary import ACTIONS, DEFAULT_RATES, MAX_QUOTA, QUOTAS, RATES

SCHEMA = "aotx.grants.v2"
SCHEMA_V1 = "aotx.grants.v1"  # read only: a name left out is unlimited there (no defaults yet)
FILE_MODE = 0o640


class GrantFileError(Exception):
    pass


LIMITS = QUOTAS + RATES  # the names a principal's `quotas` object may hold


def quota_problem(quotas: object, unlimited: bool = True) -> str | None:
    """Why a quota object is unusable (None when it is fine): {name among QUOTAS: integer
    0..2^63-1 or null, name among RATES: integer 1..2^63-1 or null}; null (unlimited) only where
    `unlimited` (not in a v1 file)."""
    if not isinstance(quotas, dict):
        return "quotas must be an object"
    for name, value in quotas.items():
        if name not in LIMITS:
            return f"unknown quota {name!r}; known: {', '.join(LIMITS)}"
        if value is None and unlimited:
            continue
        least = 1 if name in RATES else 0
        if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= MAX_QUOTA:
            return f"quota {name} must be an integer from {least} to {MAX_QUOTA}" + (" or null (unlimited)"
                                                                                       if unlimited else "")
    return None


def parse(doc: object, path: str = "<grants>") -> tuple[dict[str, frozenset[str]], int]:
    """({principal id: actions}, written_at_ns) of a grant document, or GrantFileError."""
    principals, _, written = parse_with_quotas(doc, path)
    return principals, written


def parse_with_quotas(doc: object, path: str = "<grants>") -> tuple[dict[str, frozenset[str]],
                                                                dict[str, dict[str, int | None]], int]:
    """({principal id: actions}, {principal id: {name: limit, None: unlimited}}, written_at_ns), or
    GrantFileError. A name a principal's quotas leave out is not in its dict: it has the default.
    A v1 document is given in those terms: every name it leaves out is None (unlimited), as it
    meant when it was written."""
    if not isinstance(doc, dict) or doc.get("schema") not in (SCHEMA, SCHEMA_V1):
        raise GrantFileError(f"grant file {path}: schema must be {SCHEMA!r} (or the older {SCHEMA_V1!r})")
    v1 = doc["schema"] == SCHEMA_V1
    written = doc.get("written_at_ns")
    if not isinstance(written, int) or isinstance(written, bool) or written <= 0:
        raise GrantFileError(f"grant file {path}: written_at_ns must be a positive integer")
    entries = doc.get("principals")
    if not isinstance(entries, dict):
        raise GrantFileError(f"grant file {path}: principals must be an object")
    principals = {}
    quotas: dict[str, dict[str, int | None]] = {}
    for pid, entry in entries.items():
        if not isinstance(pid, str) or not HEX32.match(pid) or not isinstance(entry, dict):
            raise GrantFileError(f"grant file {path}: bad principal entry {pid!r}")
        actions = entry.get("actions")
        if not isinstance(actions, list) or any(a not in ACTIONS for a in actions):
            raise GrantFileError(f"grant file {path}: principal {pid}: actions must be a subset of {list(ACTIONS)}")
        principals[pid] = frozenset(actions)
        limits = entry.get("quotas", {})
        problem = quota_problem(limits, unlimited=not v1)
        if problem:
            raise GrantFileError(f"grant file {path}: principal {pid}: {problem}")
        if v1:
            limits = {name: limits.get(name) for name in LIMITS}
        if limits:
            quotas[pid] = dict(limits)
    return principals, quotas, written


def document(principals: Mapping[str, tuple[str, list[str]]], written_at_ns: int | None = None,
             quotas: Mapping[str, Mapping[str, int | None]] | None = None) -> dict[str, object]:
    """A grant document (v2) from {principal id: (name, actions)} and {principal id: {name: limit,
    None: unlimited}} (a principal without quotas, or with none set, has no `quotas` key: every
    quota and rate its default)."""
    entries: dict[str, object] = {}
    for pid, (name, actions) in principals.items():
        entry: dict[str, object] = {"name": name, "actions": sorted(set(actions))}
        limits = (quotas or {}).get(pid)
        if limits:
            entry["quotas"] = dict(sorted(limits.items()))
        entries[pid] = entry
    return {"schema": SCHEMA, "written_at_ns": written_at_ns or time.time_ns(), "principals": entries}


def write(path: str, doc: dict[str, object], fs: FileLayer | None = None) -> int:
    """Check doc as the device would, then replace the file atomically through the file layer (a
    temporary file, fsynced, renamed over the old one, the directory fsynced:
    `FileLayer.write_atomically`; the device never reads a half-written file). Returns the number
    of principals written; GrantFileError writes nothing."""
    principals, _ = parse(doc, path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data = json.dumps(doc, sort_keys=True, indent=1).encode("utf-8")
    (fs or OsFileLayer()).write_atomically(path, data, mode=FILE_MODE, tmp=f"{path}.tmp.{os.getpid()}")
    return len(principals)


class Grants:
    """The device's view of the grant file; reload() picks up a rewritten file (checked once per
    tick, by the file's inode, mtime and size)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self.principals: dict[str, frozenset[str]] = {}
        # principal id -> its quotas and rates as set ({name: limit, None: unlimited}; a name
        # absent has the default)
        self.quotas: dict[str, dict[str, int | None]] = {}
        self.written_at_ns = 0
        self.reload(force=True)

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise GrantFileError(f"grant file {self.path}: {exc.strerror}") from None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def reload(self, force: bool = False) -> bool:
        stamp = self._stat()
        if not force and stamp == self._stamp:
            return False
        try:
            with open(self.path, "rb") as f:
                doc = json.loads(f.read().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise GrantFileError(f"grant file {self.path} is not valid JSON: {exc}") from None
        self.principals, self.quotas, self.written_at_ns = parse_with_quotas(doc, self.path)
        self._stamp = stamp
        return True

    def actions(self, principal_id: str) -> frozenset[str]:
        return self.principals.get(principal_id, frozenset())

    def allows(self, principal_id: str, action: str) -> bool:
        return action in self.principals.get(principal_id, ())

    def setting(self, principal_id: str, name: str) -> tuple[bool, int | None]:
        """(set, limit): whether the principal's grant sets quota or rate `name`, and its limit
        then (None: unlimited). Not set: the default applies (`quota` for a rate; the device's
        kinds/quotas.py for a table quota, whose default depends on the runtime)."""
        limits = self.quotas.get(principal_id)
        if limits is None or name not in limits:
            return False, None
        return True, limits[name]

    def quota(self, principal_id: str, name: str) -> int | None:
        """The principal's rate `name` in force, None when unlimited: its setting, else the default
        (DEFAULT_RATES). Rates only: a table quota's default needs the runtime's capacities."""
        if name not in DEFAULT_RATES:
            raise ValueError(f"{name} is not a rate; a table quota's limit is kinds/quotas.limit's")
        found, limit = self.setting(principal_id, name)
        return limit if found else DEFAULT_RATES[name]
