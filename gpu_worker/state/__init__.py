"""What is true on the device: the tables (fixed-capacity tensors), their host-side indexes and
free rows, the counters a checkpoint saves, the memory table (memory/table.py) and the media
sources. `DeviceState` is the whole of it; the operations (gpu_worker/kinds/) read and change it,
and replay rebuilds it from the runtime file's checkpoint plus the journal."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..fixedmap import FixedMap, fixed_map
from ..memory.table import MemoryTable
from ..rowkeys import MAPS, build_maps
from .indexes import (ROW_BITS, ConversationIndex, MediaSource, MemberIndex, ParticipantIndex,
                      ReceiptIndex, SpaceIndex)
from ..contract.limits import MEMORY_PAYLOAD_BYTES
from .holds import Incident
from .tables import ALONE, HELD, P, Source, Tables

__all__ = ["DeviceState", "MediaSource"]


class DeviceState:
    def __init__(self, capacities: dict[str, int], device: str, incarnation: bytes, generation: int,
                 embedding_dim: int = 384, tables: dict[str, np.ndarray] | None = None) -> None:
        """`tables`: the tables' memory, filled already (recovery/preload.py); None: zeros."""
        if capacities["participants"] > 1 << ROW_BITS:  # the receipt index keys rows in 32 bits
            raise ValueError(f"{capacities['participants']} participants: at most {1 << ROW_BITS}")
        self.capacities = capacities
        self.incarnation = incarnation
        self.tables = Tables(capacities, device, tables)
        self.memory = MemoryTable(capacities["memory"], MEMORY_PAYLOAD_BYTES, embedding_dim, capacities["spaces"],
                                  self.tables.device)
        self.admissions = 0           # admission counter: operation IDs and creation order
        self.boot = 0
        self.last_boot_ns = 0
        self.generation = generation  # the runtime file's superblock generation
        self.save_generation = generation  # the generation save fields report
        # whether a standby holds each transfer saved from now on, as the journal says (a boot saves
        # alone; REPLICATION transfers mark a sync standby's transfers, and saving alone again):
        # what a replayed transfer's save fields say (`replay_source`); None: not known (a journal
        # written before the journal said so)
        self.replicated: bool | None = None
        self.checkpoint_seq = 0       # the last transfer the runtime file's checkpoint holds
        self.checkpoint_digest = bytes(32)
        self.participants = ParticipantIndex(incarnation, capacities["participants"])
        self.receipts = ReceiptIndex(capacities["receipts"])
        self.spaces = SpaceIndex(self.participants, capacities["spaces"])
        self.members = MemberIndex(capacities["members"])
        self.conversations = ConversationIndex(capacities["conversations"])
        self.media: dict[str, MediaSource] = {}  # sha256 hex -> source
        self.hold_incidents: list[Incident] = []  # journal holds, oldest first (state/holds.py)
        # takeovers of this journal by a standby (boot --takeover), oldest first: {boot, at_ns,
        # position, generation (the etcd leadership's, or None)}
        self.failovers: list[dict[str, Any]] = []

    @property
    def replay_source(self) -> int:
        """The source of a replayed transfer's save fields: the journal, and whether a standby held it."""
        return int(Source.JOURNAL) | (0 if self.replicated is None else HELD if self.replicated else ALONE)

    def rebuild_indexes(self, input_kind: int, media: dict[str, Any] | None = None, *, empty: bool = False,
                        built: dict[str, FixedMap[Any]] | None = None) -> None:
        """Indexes derived from the tensors (empty, or just loaded from a checkpoint), and the
        checkpoint's media sources ({sha256: [length, type, [participant raw ids]]}). `empty`: the
        tables were just made and nothing was loaded into them (a journal with no checkpoint):
        every row is free and there is nothing to index, so no column of a million rows is
        scanned. `built`: the maps of IDs to rows (rowkeys.MAPS), built from these tables already (a
        boot's preload child: recovery/preload.py)."""
        t = self.tables
        if empty:
            for index, table in ((self.participants, t.participants), (self.receipts, t.receipts),
                                 (self.spaces, t.spaces), (self.members, t.members),
                                 (self.conversations, t.conversations)):
                index.free = t.unused_rows(table, fresh=True)
            if built is not None:  # (empty maps whose pages are backed already)
                self._adopt(built)
            self.media = {}
            return
        self.participants.rebuild(t.array(t.participants))
        maps = built
        if maps is None:
            maps = {name: fixed_map(layout, t.capacities[table]) for name, (layout, table) in MAPS.items()}
            build_maps(maps, {name: t.array(getattr(t, name))
                              for name in ("receipts", "spaces", "members", "conversations")}, self.participants)
        self._adopt(maps)
        self.receipts.rebuild(t)
        self.spaces.rebuild(t)
        self.members.rebuild(t)
        self.conversations.rebuild(t, input_kind)
        by_raw = self.participants.by_raw
        self.media = {sha: MediaSource(length, kind, {by_raw[p] for p in owners})
                      for sha, (length, kind, owners) in (media or {}).items()}

    def _adopt(self, maps: dict[str, FixedMap[Any]]) -> None:
        """The indexes' maps of IDs to rows (rowkeys.MAPS' names) from `maps`."""
        receipts = self.receipts
        receipts.by_sequence, receipts.by_key, receipts.by_op = (maps["receipts.by_sequence"], maps["receipts.by_key"],
                                                                 maps["receipts.by_op"])
        self.spaces.by_id, self.members.rows = maps["spaces.by_id"], maps["members.rows"]
        self.conversations.by_id = maps["conversations.by_id"]

    def live_sequences(self, prow: int) -> range:
        """The sequences of a participant's live receipts, ascending: every sequence from the retry
        floor up, since sequences are admitted one after another and a retirement frees exactly
        those below its floor (a range, so the device keeps no list per participant)."""
        row = self.tables.row(self.tables.participants, prow)
        return range(row[P.RETRY_FLOOR], row[P.NEXT_SEQUENCE])
