"""The deployment grant file: which principals may do what. Written by the gateway
(`manage.py write_grants`), read by the device. It names principals by their public id and
never holds a credential. See docs/grants.md.
"""
import json
import os
import re

SCHEMA = "aotx.grants.v1"
ACTIONS = ("shared_read", "shared_write", "shared_manage", "chat")
_HEX32 = re.compile(r"[0-9a-f]{32}\Z")


class GrantFileError(Exception):
    pass


class Grants:
    """The loaded grant file; reload() picks up a rewritten file (checked once per tick)."""

    def __init__(self, path):
        self.path = path
        self._stamp = None
        self.principals = {}
        self.written_at_ns = 0
        self.reload(force=True)

    def _stat(self):
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise GrantFileError(f"grant file {self.path}: {exc.strerror}") from None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def reload(self, force=False):
        stamp = self._stat()
        if not force and stamp == self._stamp:
            return False
        try:
            with open(self.path, "rb") as f:
                doc = json.loads(f.read().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise GrantFileError(f"grant file {self.path} is not valid JSON: {exc}") from None
        self.principals, self.written_at_ns = parse(doc, self.path)
        self._stamp = stamp
        return True

    def actions(self, principal_id):
        return self.principals.get(principal_id, frozenset())

    def allows(self, principal_id, action):
        return action in self.principals.get(principal_id, ())


def parse(doc, path="<grants>"):
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise GrantFileError(f"grant file {path}: schema must be {SCHEMA!r}")
    written = doc.get("written_at_ns")
    if not isinstance(written, int) or written <= 0:
        raise GrantFileError(f"grant file {path}: written_at_ns must be a positive integer")
    entries = doc.get("principals")
    if not isinstance(entries, dict):
        raise GrantFileError(f"grant file {path}: principals must be an object")
    principals = {}
    for pid, entry in entries.items():
        if not _HEX32.match(pid) or not isinstance(entry, dict):
            raise GrantFileError(f"grant file {path}: bad principal entry {pid!r}")
        actions = entry.get("actions")
        if not isinstance(actions, list) or any(a not in ACTIONS for a in actions):
            raise GrantFileError(f"grant file {path}: principal {pid}: actions must be a subset of {list(ACTIONS)}")
        principals[pid] = frozenset(actions)
    return principals, written
