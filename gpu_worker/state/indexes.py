"""Host-side indexes of the tables: IDs to rows, and the free rows of each table.

The tensors are the authority (gpu_worker/state/tables.py); everything here is derived from them
at boot (`rebuild`) and kept in step by the operations' apply functions. Every key and value an
admission adds is an int, bytes, str or a tuple of those, so nothing it adds for the life of the
device is tracked by the cyclic GC (docs/architecture.md, "The device's memory").
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..fixedmap import FixedMap, fixed_map
from ..participant_index import ParticipantIndex
from ..rowkeys import MAPS, ROW32, keyed, packed16, put_owned, sequence_keys
from .tables import TOMBSTONE, C, R, S, Tables, join16

__all__ = ["ParticipantIndex", "ReceiptIndex", "SpaceIndex", "MemberIndex", "ConversationIndex", "MediaSource",
           "take_free"]


def take_free(free: list[int], n: int) -> list[int]:
    """The rows n pop()s of a free list hand out, in that order (a replay's run of admissions)."""
    if n > len(free):
        raise IndexError("pop from empty list")
    start = len(free) - n
    rows = free[start:]
    del free[start:]
    rows.reverse()
    return rows


FEW = 16  # a catch-up of at most this many noted rows indexes them one by one (`_Deferring._catch_up`)


class _Deferring(abc.ABC):
    """An index that, while a device loads (`defer` .. `settle`), only notes the rows added, and
    indexes them from their table in whole-column passes (`_index`) when a lookup next needs them
    (`_catch_up`): replaying a journal of a million admissions spent more time inserting index
    entries one by one than on anything else (docs/performance.md, "Replay")."""

    __slots__ = ("_tables", "_pending")
    TABLE = ""  # the Tables attribute whose rows it indexes

    def __init__(self) -> None:
        self._tables: Tables | None = None  # while deferring: where the noted rows are read
        self._pending: list[int] = []  # rows added and not yet indexed (only while deferring)

    def defer(self, tables: Tables) -> None:
        """From now on rows added are noted, indexed at the next lookup or at `settle`."""
        self._tables = tables

    def noted(self, rows: list[int]) -> None:
        """Rows added while deferring, in one call (a replay's run of admissions): as `add` of each."""
        assert self._tables is not None, "rows are noted only while a load defers indexing"
        self._pending.extend(rows)

    @property
    def noting(self) -> list[int] | None:
        """While deferring, the list rows added are noted in, the same list for the whole load (a
        native writer appends to it as `add` would); None otherwise."""
        return self._pending if self._tables is not None else None

    def settle(self) -> None:
        """Index what was noted and index each row added at once again (the load is over)."""
        self._catch_up()
        self._tables = None

    def _catch_up(self) -> None:
        tables, pending = self._tables, self._pending.copy()
        assert tables is not None
        self._pending.clear()  # (the same list: a replay's native writer appends to it, `noting`)
        table = getattr(tables, self.TABLE)
        if len(pending) <= FEW and tables.device.type == "cpu":
            # a few rows, row by row: a mixed journal interleaves kinds, so most catch-ups (a
            # conversation's space looked up after the one created just before it, an output's
            # input after its admission) have one or two rows, where the passes' numpy calls
            # cost ten times what they save (docs/checkpoint.md, "Replaying a mixed journal")
            for row in pending:
                self._index_row(tables.row(table, row), row)
            return
        rows = np.array(pending, dtype=np.int64)
        if tables.device.type == "cpu":  # the table's own memory
            self._index(tables.array(table), rows, rows)
        else:  # only those rows, off the accelerator
            self._index(tables.take(table, rows), np.arange(len(rows)), rows)

    @abc.abstractmethod
    def _index(self, values: np.ndarray, at: np.ndarray, rows: np.ndarray) -> None:
        """Index rows `rows`, whose values are values[at], in one pass per index (each index's
        own: what `rebuild` does for the whole table, and `_catch_up` for the rows noted)."""

    @abc.abstractmethod
    def _index_row(self, values: list[int], row: int) -> None:
        """Index one row whose values are `values`: exactly what `_index` does for it."""


ROW_BITS = 32  # by_key's keys hold the participant row in 4 bytes
class ReceiptIndex(_Deferring):
    """Live receipt rows by participant row and sequence (`at`), by participant row and operation
    key (one 20-byte key, `key_in_use`) and by operation ID (`op_row`), in FixedMaps sized for the
    receipts table, built for a million receipts at boot from packed columns. Retired
    rows wait in `release_on_save` until the retirement that freed them is saved (SPEC: the
    persisted floor advances before a receipt slot is reused).

    While a device loads (`_Deferring`) only the sequence map is kept up to date: replaying a
    journal looks receipts up by sequence alone (an input's transfers, a cancellation, a
    retirement), so the key and ID maps are built for the rows still live when a lookup first needs
    them or at `settle` — a row a retirement freed meanwhile is never indexed in them at all."""

    __slots__ = ("by_sequence", "by_key", "by_op", "free", "release_on_save")
    TABLE = "receipts"

    def __init__(self, capacity: int) -> None:
        super().__init__()
        # (participant row, sequence) -> receipt row
        self.by_sequence: FixedMap[tuple[int, int]] = fixed_map(MAPS["receipts.by_sequence"][0], capacity)
        # operation key + participant row (ROW32) -> receipt row
        self.by_key: FixedMap[bytes] = fixed_map(MAPS["receipts.by_key"][0], capacity)
        self.by_op: FixedMap[bytes] = fixed_map(MAPS["receipts.by_op"][0], capacity)
        self.free: list[int] = []
        self.release_on_save: dict[int, list[int]] = {}  # transfer seq -> rows freed once it is saved

    def rebuild(self, tables: Tables) -> None:
        """From tables just loaded (the maps: DeviceState.rebuild_indexes)."""
        self.free = tables.unused_rows(tables.receipts)

    def noted(self, rows: list[int]) -> None:
        super().noted(rows)
        assert self._tables is not None
        at = np.array(rows, dtype=np.int64)
        self._index_sequences(self._tables.take(self._tables.receipts, at), np.arange(len(rows)), at)

    def _index_sequences(self, values: np.ndarray, at: np.ndarray, rows: np.ndarray) -> None:
        self.by_sequence.put_packed(sequence_keys(values, at), np.ascontiguousarray(rows, dtype=np.int64))

    def _index(self, values: np.ndarray, at: np.ndarray, rows: np.ndarray) -> None:
        # noted rows a retirement freed since are not live (a row freed and taken again is noted
        # twice: indexed as it is now, twice over, which changes nothing)
        live = values[at, R.STATE] != 0
        self._index_keys(values, at[live], rows[live])

    def _index_keys(self, values: np.ndarray, at: np.ndarray, rows: np.ndarray) -> None:
        rrows = np.ascontiguousarray(rows, dtype=np.int64)
        self.by_key.put_packed(keyed(values, at), rrows)
        self.by_op.put_packed(packed16(values, at, R.OP_HI), rrows)

    def _index_row(self, values: list[int], row: int) -> None:
        if values[R.STATE]:
            self.by_key[join16(values[R.KEY_HI], values[R.KEY_LO]) + ROW32.pack(values[R.PARTICIPANT])] = row
            self.by_op[join16(values[R.OP_HI], values[R.OP_LO])] = row

    def at(self, prow: int, sequence: int) -> int | None:
        """The receipt row of a participant's sequence, None when it has no live receipt."""
        return self.by_sequence.get((prow, sequence))

    def row_of(self, prow: int, sequence: int) -> int:
        """The receipt row of a live sequence (one of `DeviceState.live_sequences`)."""
        return self.by_sequence[(prow, sequence)]

    def op_row(self, op: bytes) -> int | None:
        """The receipt row of an operation ID (its 16 raw bytes), None when it is not live."""
        if self._pending:
            self._catch_up()
        return self.by_op.get(op)

    def key_in_use(self, prow: int, key: bytes) -> bool:
        """Whether a live receipt of this participant has this operation key."""
        if self._pending:
            self._catch_up()
        return key + ROW32.pack(prow) in self.by_key

    def add(self, rrow: int, prow: int, sequence: int, key: bytes, op: bytes) -> None:
        self.by_sequence[(prow, sequence)] = rrow
        if self._tables is not None:
            self._pending.append(rrow)
            return
        self.by_key[key + ROW32.pack(prow)] = rrow
        self.by_op[op] = rrow

    def retire(self, prow: int, sequences: range, tables: Tables) -> tuple[list[int], np.ndarray]:
        """Remove a participant's live receipts of `sequences` (each one's entries in the three
        maps) in one pass: their rows, in sequence order, and those rows' values. While a load
        defers, a row still waiting to be indexed has no key or ID entry yet (and gets none)."""
        keys = np.empty((len(sequences), 2), dtype="<i8")  # (participant row, sequence), packed
        keys[:, 0], keys[:, 1] = prow, np.arange(sequences.start, sequences.stop, dtype=np.int64)
        at = np.frombuffer(self.by_sequence.pop_packed(keys), dtype=np.int64)
        values = tables.take(tables.receipts, at)
        if self._tables is not None and not self.by_op:  # (a replay that has not built them yet: nothing to remove)
            return at.tolist(), values
        strict = self._tables is None  # (while deferring, a row not indexed yet has no entries)
        every = np.arange(len(at))
        self.by_key.pop_packed(keyed(values, every), strict)
        self.by_op.pop_packed(packed16(values, every, R.OP_HI), strict)
        return at.tolist(), values


class SpaceIndex(_Deferring):
    """Live space rows by (owner lineage, id): the lineage the space's ID carries, the owner's
    when it was created (`ParticipantIndex.lineage_at`). A replay's runs of creations are noted and
    indexed at the next lookup (`_Deferring`); every lookup goes through `row`, `get`, `has` or
    `pop`."""

    __slots__ = ("by_id", "free", "tombstones", "_participants")
    TABLE = "spaces"

    def __init__(self, participants: ParticipantIndex, capacity: int) -> None:
        super().__init__()
        self.by_id: FixedMap[tuple[bytes, bytes]] = fixed_map(MAPS["spaces.by_id"][0], capacity)  # (owner lineage, id)
        self.free: list[int] = []
        self.tombstones: set[int] = set()  # deleted rows live receipts still name (kinds/deletions.py)
        self._participants = participants

    def rebuild(self, tables: Tables) -> None:
        """From tables just loaded (the map: DeviceState.rebuild_indexes)."""
        self.free = tables.unused_rows(tables.spaces)
        self.tombstones = set(np.flatnonzero(tables.array(tables.spaces)[:, S.STATE] == TOMBSTONE).tolist())

    def _index(self, values: np.ndarray, at: np.ndarray, rows: np.ndarray) -> None:
        put_owned(self.by_id, self._participants, "spaces", values, at, rows)

    def _index_row(self, values: list[int], row: int) -> None:
        lineage = self._participants.lineage_at(values[S.OWNER], values[S.CREATED])
        self.by_id[(lineage, join16(values[S.ID_HI], values[S.ID_LO]))] = row

    def add(self, key: tuple[bytes, bytes], srow: int) -> None:
        """One space (a run's spaces are `noted`): indexed at once, loading or not, since a mixed
        journal looks a space up right after creating it (a conversation, a member row in it)."""
        self.by_id[key] = srow

    def get(self, key: tuple[bytes, bytes]) -> int | None:
        if self._pending:
            self._catch_up()
        return self.by_id.get(key)

    def row(self, key: tuple[bytes, bytes]) -> int:
        """The row of a space the journal or a check already found (KeyError: none)."""
        if self._pending:
            self._catch_up()
        return self.by_id[key]

    def has(self, key: tuple[bytes, bytes]) -> bool:
        if self._pending:
            self._catch_up()
        return key in self.by_id

    def pop(self, key: tuple[bytes, bytes]) -> int:
        if self._pending:
            self._catch_up()
        return self.by_id.pop(key)


class MemberIndex:
    __slots__ = ("rows", "free")

    def __init__(self, capacity: int) -> None:
        self.rows: FixedMap[tuple[int, int]] = fixed_map(MAPS["members.rows"][0], capacity)  # (space row, participant row)
        self.free: list[int] = []

    def rebuild(self, tables: Tables) -> None:
        """From tables just loaded (the map: DeviceState.rebuild_indexes)."""
        self.free = tables.unused_rows(tables.members)


class ConversationIndex:
    __slots__ = ("by_id", "free", "tombstones", "inputs")

    def __init__(self, capacity: int) -> None:
        # (creator lineage, id) -> conversation row
        self.by_id: FixedMap[tuple[bytes, bytes]] = fixed_map(MAPS["conversations.by_id"][0], capacity)
        self.free: list[int] = []
        self.tombstones: set[int] = set()  # deleted rows live receipts still name (kinds/deletions.py)
        # by conversation row, its input receipt rows in admission order (None: none), a list of the
        # table's capacity so that an input costs no map insert
        self.inputs: list[list[int] | None] = [None] * capacity

    def rebuild(self, tables: Tables, input_kind: int) -> None:
        """From tables just loaded (the map: DeviceState.rebuild_indexes)."""
        self.free = tables.unused_rows(tables.conversations)
        self.tombstones = set(np.flatnonzero(tables.array(tables.conversations)[:, C.STATE] == TOMBSTONE).tolist())
        receipts = tables.array(tables.receipts)
        inputs = np.flatnonzero((receipts[:, R.STATE] != 0) & (receipts[:, R.KIND] == input_kind))
        crows = receipts[inputs, R.TARGET]
        order = np.lexsort((receipts[inputs, R.CREATED], crows))  # by conversation, each in admission order
        inputs, crows = inputs[order], crows[order]
        firsts = np.flatnonzero(np.diff(crows, prepend=-1))  # where each conversation's inputs begin
        rows, bounds = inputs.tolist(), firsts.tolist() + [len(inputs)]
        for crow, first, end in zip(crows[firsts].tolist(), bounds, bounds[1:]):
            self.inputs[crow] = rows[first:end]

    def inputs_of(self, crow: int) -> Sequence[int]:
        """A conversation's input receipt rows, in admission order (not to be changed through)."""
        return self.inputs[crow] or ()

    def add_input(self, crow: int, rrow: int) -> None:
        rows = self.inputs[crow]
        if rows is None:
            self.inputs[crow] = [rrow]
        else:
            rows.append(rrow)


@dataclass
class MediaSource:
    """A media file under <journal>/media/ and the participant rows that own it. `missing`: its
    bytes are neither there nor in the runtime file (found at boot, kinds/media.recover_bytes)."""
    length: int
    type: str
    owners: set[int] = field(default_factory=set)
    missing: bool = False
