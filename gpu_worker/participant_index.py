"""The participants' index (a part of the host indexes, gpu_worker/state/indexes.py): participant
rows by principal and by participant ID, their derived names and the lines of history they went
through. Nothing here imports torch: a boot's preload child derives the spaces' and conversations'
keys from it before the boot has imported torch (gpu_worker/recovery/preload.py)."""
from __future__ import annotations

import bisect

import numpy as np

from . import derived as ids
from .columns import P
from .contract.ids import participant_id
from .fixedmap import FixedMap, fixed_map
from .rowkeys import free_rows, join16


class ParticipantIndex:
    """Participant rows by principal and by participant ID, each row's derived names, and the
    lines of history (lineages) the state went through.

    A line of history starts at the first boot of a state and at every restore (docs/checkpoint.md,
    "Lineages after a restore"): `starts[i]` is the first admission counter of the i-th line and
    `nonces[i]` its random nonce. `lineage[prow]` is a participant's current lineage (what
    mutations must name); an ID made in an earlier line keeps that line's lineage for good
    (`lineage_at`, from the admission counter that made it)."""

    __slots__ = ("incarnation", "by_principal", "by_raw", "lineage", "lineage_hex", "raw", "public_id", "free",
                 "principal", "starts", "nonces", "nonce", "_unregistered", "_past")

    def __init__(self, incarnation: bytes, capacity: int) -> None:
        self.incarnation = incarnation
        self.by_principal: FixedMap[bytes] = fixed_map("b16", capacity)
        self.by_raw: FixedMap[bytes] = fixed_map("b16", capacity)   # participant raw id -> row
        # by row, each a list of the table's capacity (empty: no participant there), so that a
        # registration's names cost no map insert
        self.lineage: list[bytes] = [b""] * capacity
        self.lineage_hex: list[str] = [""] * capacity
        self.raw: list[bytes] = [b""] * capacity
        self.public_id: list[str] = [""] * capacity  # "par-…"
        self.principal: list[bytes] = [b""] * capacity  # row -> principal id
        self.free: list[int] = []
        self.starts: list[int] = []     # first admission counter of each line of history
        self.nonces: list[bytes] = []   # its nonce
        self.nonce: bytes | None = None  # the current line's (None: state from before nonces)
        self._unregistered: dict[bytes, bytes] = {}  # principal -> lineage, a pure function cached
        self._past: dict[tuple[int, int], bytes] = {}  # (row, line) -> an earlier line's lineage

    def rebuild(self, values: np.ndarray) -> None:
        """From the participants table (`values`, as numpy), once its lineages are loaded."""
        for prow, row in enumerate(values.tolist()):
            if row[P.STATE]:
                self.add(prow, join16(row[P.PRINCIPAL_HI], row[P.PRINCIPAL_LO]))
        self.free = free_rows(values)

    def add(self, prow: int, principal: bytes) -> None:
        raw = ids.participant(self.incarnation, principal)
        lineage = self._unregistered.pop(principal, None) or ids.lineage(self.incarnation, principal, self.nonce)
        self.by_principal[principal] = prow
        self.by_raw[raw] = prow
        self.principal[prow] = principal
        self.lineage[prow] = lineage
        self.lineage_hex[prow] = lineage.hex()
        self.raw[prow] = raw
        self.public_id[prow] = participant_id(raw)

    def load_lineages(self, lines: list[list[object]]) -> None:
        """The lines of history a checkpoint saved ([first counter, nonce] each), before any row is added."""
        for first, nonce in lines:
            if not (isinstance(first, int) and isinstance(nonce, bytes) and len(nonce) == 16):
                raise ValueError(f"state extent: lineage entry {[first, nonce]!r} is not [counter, 16 bytes]")
            self.starts.append(first)
            self.nonces.append(nonce)
        self.nonce = self.nonces[-1] if self.nonces else None

    def saved_lineages(self) -> list[list[object]]:
        return [[first, nonce] for first, nonce in zip(self.starts, self.nonces)]

    def start_lineage(self, first: int, nonce: bytes) -> None:
        """A new line of history from admission counter `first` on: every participant's current
        lineage changes (a mutation naming the old one answers 409 stale_lineage), while the IDs
        made before keep theirs (`lineage_at`)."""
        self.starts.append(first)
        self.nonces.append(nonce)
        self.nonce = nonce
        self._unregistered.clear()
        for prow, principal in enumerate(self.principal):
            if not principal:
                continue
            lineage = ids.lineage(self.incarnation, principal, nonce)
            self.lineage[prow] = lineage
            self.lineage_hex[prow] = lineage.hex()

    def nonce_at(self, counter: int) -> bytes | None:
        """The nonce of the line of history admission counter `counter` belongs to."""
        line = bisect.bisect_right(self.starts, counter)
        return self.nonces[line - 1] if line else None

    def lineage_at(self, prow: int, counter: int) -> bytes:
        """The lineage participant `prow` had when admission counter `counter` was issued: the one
        every ID that admission made (operation, space, conversation) carries."""
        starts = self.starts
        if not starts or counter >= starts[-1]:
            return self.lineage[prow]
        line = bisect.bisect_right(starts, counter)
        lineage = self._past.get((prow, line))
        if lineage is None:
            lineage = self._past[(prow, line)] = ids.lineage(self.incarnation, self.principal[prow],
                                                             self.nonces[line - 1] if line else None)
        return lineage

    def lineages_at(self, prows: np.ndarray, counters: np.ndarray) -> np.ndarray:
        """`lineage_at` of each (row, counter) pair, as rows of 16 bytes, for a whole table at boot:
        the current lineages gathered by row (each participant's read once), and only the pairs
        from an earlier line of history derived, once per participant and line."""
        prows = np.asarray(prows, dtype=np.int64)
        n = len(self.starts)
        lines = np.searchsorted(self.starts, counters, side="right") if n else np.zeros(len(prows), dtype=np.int64)
        present = np.zeros(len(self.lineage), dtype=bool)
        present[prows] = True
        rows = np.flatnonzero(present)
        current = np.zeros((len(self.lineage), 16), dtype=np.uint8)
        current[rows] = _packed_lineages([self.lineage[r] for r in rows.tolist()])
        out = np.take(current.view(np.uint64), prows, axis=0).view(np.uint8)  # (a gather of 8-byte words)
        past = np.flatnonzero(lines < n)  # (none without a line of history: every line is 0 = n)
        if len(past):  # (row, line) as one int; a line's first counter is in it (line 0: before any)
            keys = (prows[past] * (n + 1) + lines[past]).tolist()
            known = {}
            for key in set(keys):
                prow, line = divmod(key, n + 1)
                known[key] = self.lineage_at(prow, self.starts[line - 1] if line else -1)
            out[past] = _packed_lineages(list(map(known.__getitem__, keys)))
        return out

    def lineage_of(self, principal: bytes) -> bytes:
        """The lineage a principal registers (or registered) under."""
        prow = self.by_principal.get(principal)
        return self.lineage[prow] if prow is not None else self.unregistered_lineage(principal)

    def unregistered_lineage(self, principal: bytes) -> bytes:
        """The lineage a principal with no row yet registers under (cached until it registers)."""
        lineage = self._unregistered.get(principal)
        if lineage is None:
            lineage = self._unregistered[principal] = ids.lineage(self.incarnation, principal, self.nonce)
        return lineage


def _packed_lineages(lineages: list[bytes]) -> np.ndarray:
    """Lineages as rows of 16 bytes (ValueError: a row with none, which no live row has)."""
    joined = b"".join(lineages)
    if len(joined) != 16 * len(lineages):
        raise ValueError("a lineage of a row with no participant was asked for")
    return np.frombuffer(joined, dtype=np.uint8).reshape(-1, 16)
