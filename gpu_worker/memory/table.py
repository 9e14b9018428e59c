"""The memory table (docs/memory.md): fixed-capacity tensors on the tables' device.

    rows        (capacity, 128) uint8    the 128-byte metadata rows (memory/rows.py), zeros when free
    owners      (capacity,) int64        the owner number: 0 free, else `owner_number` of its owner
    order       (capacity,) int64        the memory counter when it was written (list order, cursors)
    payload     (capacity, payload) u8   the exact payload bytes (byte length in the row)
    embeddings  (capacity, dim) float32  the row's embedding, L2-normalised (what recall scores)
    provenance  (capacity, 40) uint8     a published copy's source object and version
                                         (memory/rows.Provenance), zeros for any other row
    expires     (capacity,) int64        when the row expires (wall-clock ns), 0: never
                                         (docs/memory.md "Expiry")

Owner numbers: every row is numbered by the space it was retained or published in, its space
row + 1: for a private space or a room that number is its memory owner; instance spaces share
the instance's memory, and the number is what fences each of its rows to the readers of the
space it came from (memory/shared.py, docs/memory.md "Owners and visibility"). `legacy_instance`
(`spaces capacity + 1`) numbers the instance rows of a checkpoint written before that fence,
which did not say which instance space each came from. A row is allocated, changed (a source
whose interpretation is retained: `change`) and freed only by journaled changes (a retention, a
publication, a space deletion) as they are applied, live and at replay in the same order, from
the lowest free row, so a replay fills the same rows with the same values.
"""
from __future__ import annotations

import heapq
import time
from typing import Any

import numpy as np
import torch

from .rows import NO_PROVENANCE, PROVENANCE, ROW, Forgotten, MemoryRow, Provenance
from ..fixedmap import FixedMap, fixed_map
from ..packing import put_packed

# a metadata row's object ID and byte length, where ROW packs them (memory/rows.py)
_BYTE_LENGTH = np.dtype({"names": ["length"], "formats": ["<u4"], "offsets": [44], "itemsize": ROW.size})
assert ROW.unpack(bytes(44) + (7).to_bytes(4, "little") + bytes(ROW.size - 48))[6] == 7
assert ROW.unpack(bytes(16) + b"o" * 16 + bytes(ROW.size - 32))[1] == b"o" * 16


def now() -> int:
    """The device's wall clock, ns: what a row's expiry is written from and read against (tests
    move it)."""
    return time.time_ns()


class MemoryTable:
    def __init__(self, capacity: int, payload_bytes: int, dim: int, spaces: int, device: torch.device) -> None:
        self.capacity, self.payload_bytes, self.dim = capacity, payload_bytes, dim
        # owner numbers run 1..spaces for spaces, then the instance rows of an earlier checkpoint
        self.legacy_instance = spaces + 1
        self.rows = torch.zeros((capacity, ROW.size), dtype=torch.uint8, device=device)
        self.owners = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.order = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.payload = torch.zeros((capacity, payload_bytes), dtype=torch.uint8, device=device)
        self.embeddings = torch.zeros((capacity, dim), dtype=torch.float32, device=device)
        self.provenance = torch.zeros((capacity, PROVENANCE.size), dtype=torch.uint8, device=device)
        self.expires = torch.zeros(capacity, dtype=torch.int64, device=device)
        # what a row is written through: on the CPU numpy views of the same memory (a row written
        # through them costs a fraction of torch's indexed assignments, six of which were most of
        # replaying a MEMORY transfer), else the tensors themselves
        self._host = self.rows.device.type == "cpu"
        tensors = (self.rows, self.owners, self.order, self.payload, self.embeddings, self.provenance, self.expires)
        self._writable: tuple[Any, ...] = tuple(t.numpy() for t in tensors) if self._host else tensors
        self.soonest = 0  # the earliest expiry of a live row (0: none), so a tick asks no tensor when none is due
        self.counter = 0                      # rows written so far (order of the next)
        self.free: list[int] = list(range(capacity))  # a heap: the lowest free row first
        self.by_id: FixedMap[bytes] = fixed_map("b16", capacity)  # object id (16 bytes) -> row (gpu_worker/fixedmap.py)
        self.pending: dict[int, int] = {}     # row -> owner number: written, invisible until saved
        # objects forgotten since the last checkpoint: what it must still erase (memory/forgetting.py)
        self.forgotten: list[Forgotten] = []
        self.forgotten_media: list[str] = []  # media sources forgotten with them (sha256): their files go too

    # ---- writes (journaled changes only) --------------------------------------------------

    def write(self, row: MemoryRow, owner: int, payload: bytes, embedding: torch.Tensor | np.ndarray,
              visible: bool = True, provenance: Provenance | None = None, expires: int = 0) -> int:
        """Store a new object in the lowest free row (the caller checked there is one). A row
        written by an unsaved transfer stays invisible (owner 0) until `reveal`: recall and reads
        see saved memory only, while the row is already taken, so allocation follows the journal
        order live and at replay alike."""
        slot = heapq.heappop(self.free)
        self.counter += 1
        rows, owners, order, payloads, embeddings, provenances, _ = self._writable
        rows[slot] = self._bytes(row.pack())
        if provenance is not None:
            provenances[slot] = self._bytes(provenance.pack())
        if payload:  # the bytes past it are never read: byte_length bounds every read
            payloads[slot, :len(payload)] = self._bytes(payload)
        if isinstance(embedding, np.ndarray):  # (a saved transfer's float32 values: no tensor on the CPU)
            embeddings[slot] = embedding if self._host else torch.from_numpy(embedding.copy()).to(embeddings.device)
        else:
            embedding = embedding.detach().to(self.embeddings.device, torch.float32)
            embeddings[slot] = embedding.numpy() if self._host else embedding
        order[slot] = self.counter
        if expires:
            self._expires(slot, expires)
        if visible:
            owners[slot] = owner
        else:
            self.pending[slot] = owner
        self.by_id[row.object] = slot
        return slot

    def write_run(self, items: list[tuple[MemoryRow, int, bytes, bytes, int]]) -> list[int]:
        """`write` of several new objects, visible, at replay on the CPU, each (row, owner, payload,
        float32 embedding bytes of the table's dimension, expiry): the same rows taken in the same
        order, each column written once for all of them (pipeline/retention.py
        `replay_memory_run`). Their slots."""
        assert self._host and len(items) <= len(self.free)
        n = len(items)
        slots = [heapq.heappop(self.free) for _ in range(n)]
        at = np.array(slots, dtype=np.int64)
        rows, owners, order, _, embeddings, _, _ = self._writable
        rows[at] = np.frombuffer(b"".join(row.pack() for row, *_ in items), dtype=np.uint8).reshape(n, -1)
        put_packed(self.payload, at, np.array([len(item[2]) for item in items], dtype=np.int64),
                   b"".join(item[2] for item in items))
        embeddings[at] = np.frombuffer(b"".join(item[3] for item in items), dtype="<f4").reshape(n, self.dim)
        order[at] = np.arange(self.counter + 1, self.counter + n + 1)
        self.counter += n
        owners[at] = [item[1] for item in items]
        for slot, (row, _, _, _, expires) in zip(slots, items):
            if expires:
                self._expires(slot, expires)
            self.by_id[row.object] = slot
        return slots

    def _expires(self, slot: int, expires: int) -> None:
        """A new row's expiry (ns), and the table's soonest."""
        self._writable[6][slot] = expires
        self.soonest = expires if not self.soonest else min(self.soonest, expires)

    def _bytes(self, data: bytes) -> Any:
        """Bytes as what a uint8 row of `_writable` takes."""
        if self._host:
            return np.frombuffer(data, dtype=np.uint8)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.rows.device)

    def _put_row(self, slot: int, row: MemoryRow) -> None:
        self._writable[0][slot] = self._bytes(row.pack())

    def change(self, slot: int, row: MemoryRow) -> None:
        """An object's row at its next version (the caller made it with MemoryRow.bumped): the
        same object, payload and embedding, in the same row."""
        assert row.object == self.row(slot).object and row.version == self.row(slot).version + 1
        self._put_row(slot, row)

    def rewrite(self, slot: int, row: MemoryRow, payload: bytes, embedding: torch.Tensor) -> None:
        """An object's next version with a new payload and embedding (a correction): the same
        object in the same row, the bytes of the version before zeroed, not only overwritten."""
        assert row.object == self.row(slot).object and row.version == self.row(slot).version + 1
        self._put_row(slot, row)
        self.payload[slot].zero_()
        if payload:
            self._writable[3][slot, :len(payload)] = self._bytes(payload)
        self.embeddings[slot] = embedding.to(self.embeddings.device, torch.float32)

    def reveal(self, slot: int, obj: bytes) -> bool:
        """The transfer that wrote object `obj` in a pending row is saved: it becomes visible
        (False when its space was deleted meanwhile and the row released, or reused)."""
        if self.by_id.get(obj) != slot:
            return False
        owner = self.pending.pop(slot, None)
        if owner is None:
            return False
        self.owners[slot] = owner
        return True

    def release_owner(self, owner: int) -> None:
        """Free every row of an owner, pending ones too."""
        slots = torch.nonzero(self.owners == owner).flatten().tolist()
        slots += [slot for slot, o in self.pending.items() if o == owner]
        self.release(slots)

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            self.pending.pop(slot, None)
            self.by_id.pop(self.row(slot).object, None)
            self.rows[slot].zero_()
            self.provenance[slot].zero_()
            self.payload[slot].zero_()  # (a forgotten object's bytes are gone, not only unreachable)
            self.embeddings[slot].zero_()
            self.owners[slot] = 0
            self.order[slot] = 0
            self.expires[slot] = 0
            heapq.heappush(self.free, slot)

    # ---- reads ------------------------------------------------------------------------------

    def current_owners(self, now: int) -> torch.Tensor:
        """`owners` with the rows expired at `now` (wall-clock ns) as free: what every read and
        recall sees, from the moment a row expires until the device's EXPIRY transfer frees it
        (memory/expiry.py)."""
        if not self.soonest or now < self.soonest:
            return self.owners
        return torch.where((self.expires > 0) & (self.expires <= now), 0, self.owners)

    def expired(self, now: int, most: int) -> list[int]:
        """Up to `most` live rows expired at `now`, the earliest first."""
        due = torch.nonzero((self.expires > 0) & (self.expires <= now) & (self.owners != 0)).flatten()
        return due[torch.argsort(self.expires[due])][:most].tolist()

    def find_soonest(self) -> None:
        """The earliest expiry of a row, asked of the tensor (after rows were freed or loaded): a
        freed row's is zero, so every one set is a live or a pending row's."""
        due = self.expires[self.expires > 0]
        self.soonest = int(due.min()) if due.numel() else 0

    @property
    def free_rows(self) -> int:
        return len(self.free)

    def row(self, slot: int) -> MemoryRow:
        return MemoryRow.unpack(self.rows[slot].cpu().numpy().tobytes())

    def provenance_of(self, slot: int) -> Provenance | None:
        """A published copy's source object and version (None for any other row)."""
        return Provenance.unpack(self.provenance[slot].cpu().numpy().tobytes())

    def payload_of(self, slot: int, offset: int = 0, length: int | None = None) -> bytes:
        size = self.row(slot).byte_length
        end = size if length is None else min(size, offset + length)
        if offset >= end:
            return b""
        return self.payload[slot, offset:end].cpu().numpy().tobytes()

    def written_by(self, actor: bytes) -> int:
        """Live rows whose actor is this participant (raw id): its memory_rows quota use."""
        actors = self.rows[:, 112:128]
        mine = (actors == torch.frombuffer(bytearray(actor), dtype=torch.uint8).to(actors.device)).all(dim=1)
        return int((mine & (self.owners != 0)).sum())

    def used(self) -> int:
        return self.capacity - len(self.free)

    # ---- checkpoint ---------------------------------------------------------------------------

    def encode(self) -> dict[str, Any]:
        live = torch.nonzero(self.owners != 0).flatten()
        lengths = [self.row(s).byte_length for s in live.tolist()]
        payload = b"".join(self.payload[s, :n].cpu().numpy().tobytes() for s, n in zip(live.tolist(), lengths))
        return {"slots": live.cpu().numpy().astype("<i8").tobytes(),
                "rows": self.rows[live].cpu().numpy().tobytes(),
                "owners": self.owners[live].cpu().numpy().astype("<i8").tobytes(),
                "order": self.order[live].cpu().numpy().astype("<i8").tobytes(),
                "payload": payload,
                "embeddings": self.embeddings[live].cpu().numpy().astype("<f4").tobytes(),
                "provenance": self.provenance[live].cpu().numpy().tobytes(),
                "expires": self.expires[live].cpu().numpy().astype("<i8").tobytes(),
                "counter": self.counter}

    def load(self, saved: dict[str, Any]) -> None:
        slots = np.frombuffer(saved["slots"], dtype="<i8")
        n = len(slots)
        if n:
            if n > self.capacity or int(slots.max()) >= self.capacity:
                raise ValueError(f"state extent: {n} memory rows do not fit this profile's memory capacity "
                                 f"of {self.capacity}")
            index = torch.from_numpy(slots.copy()).to(self.rows.device)
            device = self.rows.device
            self.rows[index] = torch.from_numpy(np.frombuffer(saved["rows"], np.uint8).copy()).view(n, ROW.size).to(
                device)
            self.owners[index] = torch.from_numpy(np.frombuffer(saved["owners"], "<i8").copy()).to(device)
            self.order[index] = torch.from_numpy(np.frombuffer(saved["order"], "<i8").copy()).to(device)
            embeddings = np.frombuffer(saved["embeddings"], "<f4")
            if embeddings.size != n * self.dim:
                raise ValueError(f"state extent: memory embeddings are not {self.dim}-dimensional")
            self.embeddings[index] = torch.from_numpy(embeddings.copy()).view(n, self.dim).to(device)
            # a checkpoint from before provenance was kept has none: its copies show null
            provenance = saved.get("provenance", NO_PROVENANCE * n)
            if len(provenance) != n * PROVENANCE.size:
                raise ValueError(f"state extent: memory provenance is not {PROVENANCE.size} bytes a row")
            self.provenance[index] = torch.from_numpy(np.frombuffer(provenance, np.uint8).copy()).view(
                n, PROVENANCE.size).to(device)
            expires = saved.get("expires")  # (a checkpoint from before expiry: none expires)
            if expires is not None:
                self.expires[index] = torch.from_numpy(np.frombuffer(expires, "<i8").copy()).to(device)
            lengths = np.frombuffer(saved["rows"], dtype=_BYTE_LENGTH)["length"]  # (each row's, in its bytes)
            put_packed(self.payload, slots, lengths, saved["payload"])  # (one payload after another)
        self.counter = saved["counter"]
        self.rebuild()

    def rebuild(self) -> None:
        owners = self.owners.cpu().numpy()
        live = np.flatnonzero(owners)
        self.free = np.flatnonzero(owners == 0).tolist()  # (ascending: a heap already)
        objects = np.ascontiguousarray(self.rows[torch.from_numpy(live).to(self.rows.device)].cpu().numpy()[:, 16:32])
        self.by_id.clear()
        self.by_id.put_packed(objects, live.astype(np.int64))  # each row's object ID
        self.pending = {}
        self.find_soonest()
