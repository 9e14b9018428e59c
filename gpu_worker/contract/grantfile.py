"""The deployment grant file: which principals may do what (docs/grants.md). The gateway writes
it (`manage.py write_grants`, and every principal change); the device reads it at boot and
re-reads it when it changes. It names principals by their public id and never holds a credential.

One module owns the format for both sides: `parse` is what the device accepts, and `write`
checks its document with `parse` before anything reaches the disk, so a file the device cannot
read is never written.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping

from .ids import HEX32
from .vocabulary import ACTIONS, MAX_QUOTA, QUOTAS, RATES

SCHEMA = "aotx.grants.v1"
FILE_MODE = 0o640


class GrantFileError(Exception):
    pass


LIMITS = QUOTAS + RATES  # the names a principal's `quotas` object may hold


def quota_problem(quotas: Any) -> str | None:
    """Why a quota object is unusable (None when it is fine): {name among QUOTAS: integer
    0..2^63-1, name among RATES: integer 1..2^63-1}."""
    if not isinstance(quotas, dict):
        return "quotas must be an object"
    for name, value in quotas.items():
        if name not in LIMITS:
            return f"unknown quota {name!r}; known: {', '.join(LIMITS)}"
        least = 1 if name in RATES else 0
        if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= MAX_QUOTA:
            return f"quota {name} must be an integer from {least} to {MAX_QUOTA}"
    return None


def parse(doc: Any, path: str = "<grants>") -> tuple[dict[str, frozenset[str]], int]:
    """({principal id: actions}, written_at_ns) of a grant document, or GrantFileError."""
    principals, _, written = parse_with_quotas(doc, path)
    return principals, written


def parse_with_quotas(doc: Any, path: str = "<grants>") -> tuple[dict[str, frozenset[str]], dict[str, dict[str, int]],
                                                                int]:
    """({principal id: actions}, {principal id: quotas}, written_at_ns), or GrantFileError. A
    principal without `quotas` has none (every quota unlimited)."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise GrantFileError(f"grant file {path}: schema must be {SCHEMA!r}")
    written = doc.get("written_at_ns")
    if not isinstance(written, int) or isinstance(written, bool) or written <= 0:
        raise GrantFileError(f"grant file {path}: written_at_ns must be a positive integer")
    entries = doc.get("principals")
    if not isinstance(entries, dict):
        raise GrantFileError(f"grant file {path}: principals must be an object")
    principals = {}
    quotas: dict[str, dict[str, int]] = {}
    for pid, entry in entries.items():
        if not isinstance(pid, str) or not HEX32.match(pid) or not isinstance(entry, dict):
            raise GrantFileError(f"grant file {path}: bad principal entry {pid!r}")
        actions = entry.get("actions")
        if not isinstance(actions, list) or any(a not in ACTIONS for a in actions):
            raise GrantFileError(f"grant file {path}: principal {pid}: actions must be a subset of {list(ACTIONS)}")
        principals[pid] = frozenset(actions)
        limits = entry.get("quotas", {})
        problem = quota_problem(limits)
        if problem:
            raise GrantFileError(f"grant file {path}: principal {pid}: {problem}")
        if limits:
            quotas[pid] = dict(limits)
    return principals, quotas, written


def document(principals: Mapping[str, tuple[str, list[str]]], written_at_ns: int | None = None,
             quotas: Mapping[str, Mapping[str, int]] | None = None) -> dict[str, Any]:
    """A grant document from {principal id: (name, actions)} and {principal id: quotas} (a
    principal without quotas, or with none set, has no `quotas` key: unlimited)."""
    entries: dict[str, Any] = {}
    for pid, (name, actions) in principals.items():
        entry: dict[str, Any] = {"name": name, "actions": sorted(set(actions))}
        limits = (quotas or {}).get(pid)
        if limits:
            entry["quotas"] = dict(sorted(limits.items()))
        entries[pid] = entry
    return {"schema": SCHEMA, "written_at_ns": written_at_ns or time.time_ns(), "principals": entries}


def write(path: str, doc: dict[str, Any]) -> int:
    """Check doc as the device would, then replace the file atomically: a temporary file, fsynced,
    renamed over the old one, the directory fsynced (the device never reads a half-written file).
    Returns the number of principals written; GrantFileError writes nothing."""
    principals, _ = parse(doc, path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, sort_keys=True, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return len(principals)


class Grants:
    """The device's view of the grant file; reload() picks up a rewritten file (checked once per
    tick, by the file's inode, mtime and size)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self.principals: dict[str, frozenset[str]] = {}
        self.quotas: dict[str, dict[str, int]] = {}  # principal id -> its quotas (absent: unlimited)
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

    def quota(self, principal_id: str, name: str) -> int | None:
        """The principal's quota `name`, None when unlimited."""
        limits = self.quotas.get(principal_id)
        return None if limits is None else limits.get(name)
