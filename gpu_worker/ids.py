"""Identifiers of SPEC.md "Resources": derived from the file incarnation, never from secrets.

A principal's lineage and participant ID are pure functions of (file incarnation, principal
id), so an unregistered principal already sees the lineage it must register under.
Operation IDs come from the device's admission counter, so they differ from operation keys,
are unique for the life of the file, and replay to the same value.
"""
import functools
import hashlib
import re

_sha256 = hashlib.sha256
HEX32 = re.compile(r"[0-9a-f]{32}\Z")
OPERATION_ID = re.compile(r"op-([0-9a-f]{32})-([0-9a-f]{32})\Z")


def _h(tag, data):
    """The first 16 bytes of SHA-256(tag || data)."""
    return _sha256(tag + data).digest()[:16]


def lineage(incarnation, principal):
    return _h(b"aotx/lineage\0", incarnation + principal)


def participant(incarnation, principal):
    return _h(b"aotx/participant\0", incarnation + principal)


@functools.lru_cache(maxsize=4)
def _pad(incarnation):
    return int.from_bytes(_h(b"aotx/operation-pad\0", incarnation)[:8], "little")


def operation(incarnation, counter):
    """8 bytes of masked admission counter + an 8-byte tag: the device can tell a retired
    operation ID it issued (410) from one it never issued (404) without keeping a list."""
    masked = (counter ^ _pad(incarnation)).to_bytes(8, "little")
    return masked + _h(b"aotx/operation\0", incarnation + counter.to_bytes(8, "little"))[:8]


def operation_counter(incarnation, raw):
    """The admission counter of an operation ID this file issued, else None."""
    counter = int.from_bytes(raw[:8], "little") ^ _pad(incarnation)
    return counter if operation(incarnation, counter) == raw else None


def memory_owner(incarnation, space):
    return _h(b"aotx/memory-owner\0", incarnation + space.encode())


SPACE_ID = re.compile(r"spc-([0-9a-f]{32})-([0-9a-f]{32})\Z")
CONVERSATION_ID = re.compile(r"con-([0-9a-f]{32})-([0-9a-f]{32})\Z")
PARTICIPANT_ID = re.compile(r"par-([0-9a-f]{32})\Z")


def space_id(lineage_raw, raw):
    return f"spc-{lineage_raw.hex()}-{raw.hex()}"


def conversation_id(lineage_raw, raw):
    return f"con-{lineage_raw.hex()}-{raw.hex()}"


def participant_id(raw):
    return "par-" + raw.hex()


def operation_id(lineage_raw, raw):
    return f"op-{lineage_raw.hex()}-{raw.hex()}"
