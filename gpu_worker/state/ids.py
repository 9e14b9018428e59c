"""Identifiers derived on the device from the file incarnation, never from secrets (their shapes
are the contract's: gpu_worker/contract/ids.py).

A principal's lineage and participant ID are pure functions of (file incarnation, principal
id), so an unregistered principal already sees the lineage it must register under.
Operation IDs come from the device's admission counter, so they differ from operation keys,
are unique for the life of the file, and replay to the same value.
"""
from __future__ import annotations

import functools
import hashlib

_sha256 = hashlib.sha256


def _h(tag: bytes, data: bytes) -> bytes:
    """The first 16 bytes of SHA-256(tag || data)."""
    return _sha256(tag + data).digest()[:16]


def lineage(incarnation: bytes, principal: bytes) -> bytes:
    return _h(b"aotx/lineage\0", incarnation + principal)


def participant(incarnation: bytes, principal: bytes) -> bytes:
    return _h(b"aotx/participant\0", incarnation + principal)


@functools.lru_cache(maxsize=4)
def _pad(incarnation: bytes) -> int:
    return int.from_bytes(_h(b"aotx/operation-pad\0", incarnation)[:8], "little")


def operation(incarnation: bytes, counter: int) -> bytes:
    """8 bytes of masked admission counter + an 8-byte tag: the device can tell a retired
    operation ID it issued (410) from one it never issued (404) without keeping a list."""
    masked = (counter ^ _pad(incarnation)).to_bytes(8, "little")
    return masked + _h(b"aotx/operation\0", incarnation + counter.to_bytes(8, "little"))[:8]


def operation_counter(incarnation: bytes, raw: bytes) -> int | None:
    """The admission counter of an operation ID this file issued, else None."""
    counter = int.from_bytes(raw[:8], "little") ^ _pad(incarnation)
    return counter if operation(incarnation, counter) == raw else None


def memory_owner(incarnation: bytes, space: str) -> bytes:
    return _h(b"aotx/memory-owner\0", incarnation + space.encode())


def memory_object(incarnation: bytes, operation: bytes, kind: int) -> bytes:
    """A memory object's id: one per (writing operation, memory kind), so replay and the receipt
    that names it derive the same ID without a list."""
    return _h(b"aotx/memory\0", incarnation + operation + bytes([kind]))
