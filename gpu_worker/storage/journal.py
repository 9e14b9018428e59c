"""The journal's format: transfers split into type 37 / class A records, in numbered segment files.

docs/journal.md describes the byte layout and the reader's rules; this module holds that layout —
the record and segment headers, the transfer kinds, the commit digest chain, the segment files' names
— and the errors that name a damaged journal. Payloads are opaque bytes here; their meaning belongs
to the device. Writing the records is journal_writer.py, reading them back journal_reader.py, and the
one device per journal journal_lock.py.
"""

from __future__ import annotations

import hashlib
import re
import struct
from enum import IntEnum
from typing import NamedTuple

from gpu_worker.storage.filelayer import FileLayer

TYPE_SHARED = 37
CLASS_A = 0x41
MAX_DATA = 160
PART_HEADER_SIZE = 32

SEGMENT_MAGIC = b"AOTXJNL1"
SEGMENT_VERSION = 1
# magic 0, version 8, header_size 10, segment_no 12, file_incarnation 16.
SEGMENT_HEADER = struct.Struct("<8sHHI16s")
SEGMENT_HEADER_SIZE = SEGMENT_HEADER.size
# type 0, class 1, kind 2, part_index 4, part_count 6, data_length 8, reserved 10,
# transfer_length 12, transfer_seq 16, checksum 24, reserved 28.
PART_HEADER = struct.Struct("<BBHHHHHIQII")
CHECKSUM_OFFSET = 24
assert SEGMENT_HEADER.size == 32 and PART_HEADER.size == PART_HEADER_SIZE

ZERO_DIGEST = bytes(32)

_KIND_SEQ = struct.Struct("<HQ")
_SEGMENT_NAME = re.compile(r"(\d{8,})\.journal")


class TransferKind(IntEnum):
    BOOT = 1
    ADMISSION = 2
    LEASE = 3
    OUTPUT = 4
    COMPLETION = 5
    RETIREMENT = 6
    CHECKPOINT = 7
    MEDIA = 8
    HOLD = 9
    MEMORY = 10
    REPLICATION = 11
    EXPIRY = 12


KIND_OF = {k.value: k for k in TransferKind}  # kind by value: a dict lookup, cheaper than an IntEnum call


class JournalError(Exception):
    pass


class JournalCorrupt(JournalError):
    def __init__(self, file: str, offset: int, reason: str):
        super().__init__(f"journal damaged: {file}: offset {offset}: {reason}")
        self.file = file
        self.offset = offset
        self.reason = reason


def segment_name(segment_no: int) -> str:
    return "%08d.journal" % segment_no


# a folded segment on its way out (storage/checkpoint.py `trim`): no segment by its name, removed
# by a boot that finds one a stop left (recovery/fold.py `clear`)
TRIMMED = ".trimmed-"


def record_count(payload_len: int) -> int:
    return (payload_len + MAX_DATA - 1) // MAX_DATA or 1


def encode_segment_header(segment_no: int, incarnation: bytes) -> bytes:
    return SEGMENT_HEADER.pack(
        SEGMENT_MAGIC, SEGMENT_VERSION, SEGMENT_HEADER_SIZE, segment_no, incarnation
    )


def chain_digest(previous: bytes, kind: int, transfer_seq: int, payload: bytes) -> bytes:
    h = hashlib.sha256(previous)
    h.update(_KIND_SEQ.pack(kind, transfer_seq))  # kind u16 LE, then transfer_seq u64 LE
    h.update(payload)
    return h.digest()


class Transfer(NamedTuple):
    """One transfer as recovery reads it (a tuple: the native reader makes a million of them)."""
    kind: TransferKind
    seq: int
    payload: bytes
    digest: bytes
    segment: int
    offset: int


def list_segments(directory: str, fs: FileLayer) -> list[int]:
    if not fs.exists(directory):
        return []
    numbers = []
    for name in fs.listdir(directory):
        match = _SEGMENT_NAME.fullmatch(name)
        if match and segment_name(int(match.group(1))) == name:
            numbers.append(int(match.group(1)))
    return sorted(numbers)
