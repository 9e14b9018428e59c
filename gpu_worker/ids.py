"""Identifiers of SPEC.md "Resources": derived from the file incarnation, never from secrets.

A principal's lineage and participant ID are pure functions of (file incarnation, principal
id), so an unregistered principal already sees the lineage it must register under.
Operation IDs come from the device's admission counter, so they differ from operation keys,
are unique for the life of the file, and replay to the same value.
"""
import hashlib
import re

HEX32 = re.compile(r"[0-9a-f]{32}\Z")
OPERATION_ID = re.compile(r"op-([0-9a-f]{32})-([0-9a-f]{32})\Z")


def _h(tag, *parts):
    h = hashlib.sha256(tag)
    for p in parts:
        h.update(p)
    return h.digest()[:16]


def lineage(incarnation, principal):
    return _h(b"aotx/lineage\0", incarnation, principal)


def participant(incarnation, principal):
    return _h(b"aotx/participant\0", incarnation, principal)


def operation(incarnation, counter):
    return _h(b"aotx/operation\0", incarnation, counter.to_bytes(8, "little"))


def participant_id(raw):
    return "par-" + raw.hex()


def operation_id(lineage_raw, raw):
    return f"op-{lineage_raw.hex()}-{raw.hex()}"
