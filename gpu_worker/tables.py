"""The authoritative shared-state tables: fixed-capacity torch tensors on the device.

Rows are int64 columns named by the IntEnums below; 16-byte identifiers are stored as two
signed int64 halves. Host-side dicts in the device only index IDs to rows; every value a reply
shows is read back from these tensors. Capacities come from the runtime file's shared profile.
"""
from enum import IntEnum

import torch


class P(IntEnum):
    """participants columns"""
    STATE = 0          # 0 free, 1 registered
    NEXT_SEQUENCE = 1
    RETRY_FLOOR = 2
    PRINCIPAL_HI = 3
    PRINCIPAL_LO = 4
    REGISTERED_BY = 5  # receipt row of the registration


class R(IntEnum):
    """receipts columns"""
    STATE = 0          # 0 free, 1 live
    PARTICIPANT = 1    # participant row
    SEQUENCE = 2
    KIND = 3
    KEY_HI = 4
    KEY_LO = 5
    OP_HI = 6
    OP_LO = 7
    TARGET_HI = 8
    TARGET_LO = 9
    COMMAND_LEN = 10
    RESULT_LEN = 11
    TERMINAL = 12      # Terminal code, 0 while running
    ADM_TRANSFER = 13  # journal transfer seq of the admission, 0 while unsaved
    ADM_BOOT = 14
    ADM_GENERATION = 15
    ADM_SOURCE = 16    # Source code
    TERM_TRANSFER = 17
    TERM_BOOT = 18
    TERM_GENERATION = 19
    TERM_SOURCE = 20
    INPUT_TOKENS = 21
    OUTPUT_TOKENS = 22


class Terminal(IntEnum):
    NONE = 0
    SUCCEEDED = 1
    FAILED = 2
    CANCELLED = 3
    INTERRUPTED = 4
    DEADLINE_EXCEEDED = 5


class Source(IntEnum):
    NONE = 0
    JOURNAL = 1
    FILE = 2


def split16(b):
    """16 bytes -> two signed int64 halves (how identifiers live in int64 tensors)."""
    return int.from_bytes(b[:8], "little", signed=True), int.from_bytes(b[8:], "little", signed=True)


def join16(hi, lo):
    return hi.to_bytes(8, "little", signed=True) + lo.to_bytes(8, "little", signed=True)


class Tables:
    def __init__(self, capacities, device="cpu"):
        self.device = torch.device(device)
        self.capacities = dict(capacities)
        i64 = dict(dtype=torch.int64, device=self.device)
        u8 = dict(dtype=torch.uint8, device=self.device)
        n_rec = capacities["receipts"]
        self.participants = torch.zeros((capacities["participants"], len(P)), **i64)
        self.receipts = torch.zeros((n_rec, len(R)), **i64)
        # [row, 0] admission commit digest, [row, 1] terminal commit digest
        self.receipt_digests = torch.zeros((n_rec, 2, 32), **u8)
        self.command_bytes = torch.zeros((n_rec, capacities["command_bytes"]), **u8)
        self.result_bytes = torch.zeros((n_rec, capacities["result_bytes"]), **u8)

    def write_row(self, table, row, values):
        """values: {column: int}; one host->device copy per row."""
        current = table[row].tolist()
        for col, v in values.items():
            current[col] = v
        table[row] = torch.tensor(current, dtype=torch.int64, device=self.device)

    def row(self, table, row):
        return table[row].tolist()

    def put_bytes(self, table, row, data):
        if data:
            table[row, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)

    def get_bytes(self, table, row, length, offset=0):
        if length <= 0:
            return b""
        return bytes(table[row, offset : offset + length].cpu().numpy().tobytes())

    def put_digest(self, row, which, digest):
        self.receipt_digests[row, which] = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(self.device)

    def get_digest(self, row, which):
        return bytes(self.receipt_digests[row, which].cpu().numpy().tobytes())

    def usage(self):
        return {
            "participants": int((self.participants[:, P.STATE] != 0).sum()),
            "receipts": int((self.receipts[:, R.STATE] != 0).sum()),
        }
