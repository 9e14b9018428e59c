"""Identifiers derived on the device from the file incarnation, never from secrets (their shapes
are the contract's: gpu_worker/contract/ids.py).

A participant ID is a pure function of (file incarnation, principal id). A lineage is a function
of (file incarnation, principal id, lineage nonce): the nonce is the random 16 bytes that start a
line of history — the first boot of a state, and every restore (docs/checkpoint.md, "Lineages
after a restore"); state written before lineage nonces existed has none (None), and its lineages
are (file incarnation, principal id) alone, as they always were. An unregistered principal
already sees the lineage it must register under.
The operator's principal (`operator`) is a function of the file incarnation alone.
Operation IDs come from the device's admission counter and the nonce of the lineage that counter
belongs to, so they differ from operation keys, replay to the same value, and an ID issued after
a restore point and lost with the journal's tail never equals one issued after the restore.
"""
from __future__ import annotations

import functools
import hashlib
from typing import Callable

_sha256 = hashlib.sha256


def _h(tag: bytes, data: bytes) -> bytes:
    """The first 16 bytes of SHA-256(tag || data)."""
    return _sha256(tag + data).digest()[:16]


def lineage(incarnation: bytes, principal: bytes, nonce: bytes | None = None) -> bytes:
    """A principal's lineage in the line of history `nonce` starts (None: state from before nonces)."""
    return _h(b"aotx/lineage\0", incarnation + principal + (nonce or b""))


def participant(incarnation: bytes, principal: bytes) -> bytes:
    return _h(b"aotx/participant\0", incarnation + principal)


@functools.lru_cache(maxsize=4)
def _pad(incarnation: bytes) -> int:
    return int.from_bytes(_h(b"aotx/operation-pad\0", incarnation)[:8], "little")


def operation(incarnation: bytes, counter: int, nonce: bytes | None = None) -> bytes:
    """8 bytes of masked admission counter + an 8-byte tag over the counter and its lineage nonce:
    the device can tell a retired operation ID it issued (410) from one it never issued, or one
    issued in a line of history a restore left behind (404), without keeping a list. The mask
    does not depend on the nonce, so the counter reads back before the nonce is known."""
    masked = (counter ^ _pad(incarnation)).to_bytes(8, "little")
    return masked + _h(b"aotx/operation\0", incarnation + counter.to_bytes(8, "little") + (nonce or b""))[:8]


def operation_counter(incarnation: bytes, raw: bytes,
                      nonce_at: Callable[[int], bytes | None] = lambda counter: None) -> int | None:
    """The admission counter of an operation ID this state's history issued, else None.
    nonce_at(counter): the lineage nonce that counter was issued under."""
    counter = int.from_bytes(raw[:8], "little") ^ _pad(incarnation)
    return counter if operation(incarnation, counter, nonce_at(counter)) == raw else None


@functools.lru_cache(maxsize=4)
def operator(incarnation: bytes) -> bytes:
    """The principal of the device's operator participant: the one the admin console's staff act
    through when they forget a memory object (memory/ops.py). No grant file names it, and the
    device refuses it as a command's principal (Device.principal), so only the device's own
    admissions carry it."""
    return _h(b"aotx/operator\0", incarnation)


@functools.lru_cache(maxsize=4)
def operator_hex(incarnation: bytes) -> str:
    return operator(incarnation).hex()


def memory_owner(incarnation: bytes, space: str) -> bytes:
    return _h(b"aotx/memory-owner\0", incarnation + space.encode())


def memory_object(incarnation: bytes, operation: bytes, kind: int) -> bytes:
    """A memory object's id: one per (writing operation, memory kind), so replay and the receipt
    that names it derive the same ID without a list."""
    return _h(b"aotx/memory\0", incarnation + operation + bytes([kind]))
