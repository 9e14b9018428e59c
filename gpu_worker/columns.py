"""The tables' columns (gpu_worker/state/tables.py): int64 columns numbered by the plain classes P,
S, M, C and R (plain ints, not IntEnums: on Python 3.11 an IntEnum member is slow to read and slower
as an index, and a busy device makes dozens of column accesses per request; docs/performance.md).
Nothing here imports torch: a boot reads them before it has imported it (recovery/preload.py)."""
from __future__ import annotations

LIVE = 1  # S.STATE, C.STATE of a live row
TOMBSTONE = 2  # S.STATE, C.STATE of a deleted row that live receipts still name (kinds/deletions.py)


class P:
    """participants columns"""
    STATE = 0          # 0 free, 1 registered
    NEXT_SEQUENCE = 1
    RETRY_FLOOR = 2
    PRINCIPAL_HI = 3
    PRINCIPAL_LO = 4
    REGISTERED_BY = 5  # receipt row of the registration


class S:
    """spaces columns"""
    STATE = 0          # 0 free, 1 live, 2 deleted (a tombstone receipts still name: kinds/deletions.py)
    OWNER = 1          # participant row of the creator
    SCOPE = 2          # Scope
    ID_HI = 3          # the 32-hex id after spc-{lineage}-
    ID_LO = 4
    CREATED = 5        # admission counter of the creating operation (list order and cursor)
    OP_HI = 6          # the creating operation
    OP_LO = 7
    MEMORY_TTL = 8     # seconds the rows retained in it live (0: for good; docs/memory.md "Expiry")


class M:
    """members columns: explicit rights rows"""
    STATE = 0
    SPACE = 1          # space row
    PARTICIPANT = 2    # participant row
    RIGHTS = 3         # Right bits; 0 is a zero-rights row
    CREATED = 4


class C:
    """conversations columns (the row is the conversation's execution slot)"""
    STATE = 0          # 0 free, 1 live, 2 deleted (a tombstone receipts still name: kinds/deletions.py)
    SPACE = 1
    CREATOR = 2        # participant row; its lineage is in the ID
    ID_HI = 3
    ID_LO = 4
    CREATED = 5
    OP_HI = 6
    OP_LO = 7
    INPUTS = 8         # inputs admitted to it so far: the last event order (SPEC: event cursors)
    HISTORY_LEN = 9    # bytes used in its row of the history table (kinds/history.py)


class R:
    """receipts columns"""
    STATE = 0          # 0 free, 1 live
    PARTICIPANT = 1    # participant row
    SEQUENCE = 2
    KIND = 3
    KEY_HI = 4
    KEY_LO = 5
    OP_HI = 6
    OP_LO = 7
    TARGET = 8         # row of the target in the table the kind names
    CREATED = 9        # admission counter
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
    FINISH = 23        # Finish code of an input's generation
    PAGE_LIMIT = 24    # effective page limit of an input (recorded apart from the caller bytes)
    MAX_OUTPUT = 25    # effective max_output_tokens of an input
    LEASE = 26         # journal transfer seq of the lease that started it, 0 before
    TARGET_OP_HI = 27  # a cancellation's target operation
    TARGET_OP_LO = 28
    ORDER = 29         # an input's event order in its conversation (1, 2, ...; kept after retirements)
    RETENTION = 30     # an input's retention mode as its lease recorded it (1, 2), 0 before
    REVISION = 31      # its lease's revision + 1, 0 before
    RETAINED = 32      # memory it retained: bit (1 << memory kind) per kind (memory/rows.py Kind)
    NOT_RETAINED = 33  # memory it did not: a Refused code per kind, 4 bits at (4 * memory kind)


def width(columns: type) -> int:
    """Number of columns of a column class."""
    return 1 + max(v for k, v in vars(columns).items() if k.isupper())


# the tables of int64 rows a checkpoint's state extent saves row by row (storage/checkpoint.py)
ROW_TABLES = ("participants", "spaces", "members", "conversations", "receipts")


def table_shapes(capacities: dict[str, int]) -> dict[str, tuple[tuple[int, int], str]]:
    """Each table's shape and dtype at these capacities, as the device makes it (the receipts'
    digests as one 64-byte row each), in the order recovery/preload.py and Tables take them."""
    n = capacities["receipts"]
    return {"participants": ((capacities["participants"], width(P)), "<i8"),
            "spaces": ((capacities["spaces"], width(S)), "<i8"),
            "members": ((capacities["members"], width(M)), "<i8"),
            "conversations": ((capacities["conversations"], width(C)), "<i8"),
            "receipts": ((n, width(R)), "<i8"),
            "receipt_digests": ((n, 64), "u1"),
            "command_bytes": ((n, capacities["command_bytes"]), "u1"),
            "result_bytes": ((n, capacities["result_bytes"]), "u1"),
            "history": ((capacities["conversations"], capacities["history_bytes"]), "u1")}
