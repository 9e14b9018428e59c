"""Which line of history a device's boot continues (docs/checkpoint.md, "Restart and restore";
docs/replication.md): a restart, a restore (fresh grants, new lineages) or a takeover of a sync
standby's journal (the failover generation of the runtime file), and a hot standby's following
of its journal copy until it takes over. `Succession` is the device's part that decides it
(gpu_worker/device.py holds it)."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol, TypedDict

import msgpack

from ..kinds.kind import Context
from ..storage import checkpoint, runtime_file, runtime_file_writer
from ..storage.filelayer import FileLayer
from ..storage.journal_lock import JournalLock
from ..storage.journal_reader import RecoveryResult, Tail
from ..storage.runtime_file import RuntimeFile
from . import DeviceBootError
from .checkpoints import Checkpoints
from .replay import Replay

if TYPE_CHECKING:
    from ..replication.lease import Leadership

log = logging.getLogger("gpu_worker.device")


class Failover(TypedDict):
    """A takeover's failover incident as its boot records it (docs/replication.md): where this
    primary's part of the journal begins, its leadership generation (etcd), the file's generation."""
    position: list[int]
    generation: int | None
    file_generation: int


class Succeeding(Context, Protocol):
    """What a boot's succession reads and sets of the device."""

    runtime: RuntimeFile
    runtime_fs: FileLayer
    lock: JournalLock
    leadership: Leadership | None
    takeover: bool
    took_over: bool
    following: Tail | None
    recovered: int
    boot_seconds: float

    @property
    def replay(self) -> Replay: ...

    @property
    def checkpoints(self) -> Checkpoints: ...

    def load(self) -> RecoveryResult: ...

    def start_journal(self, recovery: RecoveryResult, serve: bool) -> None: ...

    def loaded(self, recovery: RecoveryResult, started: float) -> None: ...


class Succession:
    """A boot's place in the line of history, and a hot standby's following."""

    def __init__(self, device: Succeeding) -> None:
        self.d = device

    def check_fresh_grants(self) -> bool:
        """SPEC: restore requires fresh deployment grants. A restart (this runtime file on its own
        journal directory, storage/owner.py) needs none, as long as the grant file is not older
        than the one its last boot accepted; a restore (any other journal directory, or a copy of
        the file) needs a grant file written after the file's last boot. Then the journal's owner
        marker names this file and this boot (docs/checkpoint.md, "Restart and restore").

        Whether this boot starts a new line of history (True): the first boot of a state, and
        every restore — the journal it continues may have lost a tail whose operation IDs and
        sequences clients hold, so every participant gets a new lineage (docs/checkpoint.md,
        "Lineages after a restore"); and a restart after a boot that started a line but stopped
        before recording it (the marker counts one line more than the saved state)."""
        from ..storage import owner  # imported here: this method is the one owner of the rule

        d = self.d
        state, grants, directory = d.state, d.grants, d.journal_dir
        if d.takeover:
            from ..replication.marker import read_mark
            kept = read_mark(directory)
            if kept == "catch-up":  # (replication/standby.py, Standby._catch_up)
                raise DeviceBootError(
                    f"--takeover: {directory} is a standby's journal stopped while it caught up to its primary's "
                    "checkpoint (its journal or its copy of the runtime file is not whole): follow the primary "
                    "again (--standby-of) to finish the catch-up")
            if kept == "catching-up":  # (replication/standby.py, Standby._linked)
                raise DeviceBootError(
                    f"--takeover: {directory} is a standby's journal that had not yet acknowledged everything its "
                    "primary had saved when it connected (or was cut back since): it may lack saved transfers. "
                    "Follow the primary again (--standby-of) until it is in sync, or boot it as a restore "
                    "(without --takeover, with a fresh grant file)")
            if kept != "sync":
                raise DeviceBootError(
                    f"--takeover needs a journal a standby kept in sync replication; {directory} was kept "
                    f"{kept or 'by no standby'}: a failover from it may have lost saved transfers, so boot it "
                    "as a restore (without --takeover, with a fresh grant file: every participant gets a new "
                    "lineage)")
            d.took_over = True
        marker = owner.read(directory)
        lines = len(state.participants.starts)
        new_lineage = not state.last_boot_ns  # a state never booted: its first line
        if state.last_boot_ns:  # booted before: a restart or a restore
            why = owner.why_not_own(marker, directory, d.incarnation_hex, d.runtime.inode, state.boot)
            if why is None:
                assert isinstance(marker, owner.Owner)  # why_not_own: only a marker can be own
                if grants.written_at_ns < marker.grants_written_at_ns:
                    raise DeviceBootError(
                        f"grant file {grants.path} is older than the one this device accepted at its last boot "
                        f"(written_at_ns {grants.written_at_ns} < {marker.grants_written_at_ns}); run "
                        "`python manage.py write_grants --config gateway.json`, then boot again")
                new_lineage = marker.lineages > lines
            elif d.takeover:  # a sync standby holds every saved transfer: nothing a client saw is lost
                log.info("takeover: journal %s continues the primary's line of history (%s)", directory, why)
            elif grants.written_at_ns <= state.last_boot_ns:
                raise DeviceBootError(
                    f"restore requires fresh deployment grants: {why}, so this boot is a restore, and "
                    f"{grants.path} was written before this runtime file's last boot; run "
                    "`python manage.py write_grants --config gateway.json`, then boot again")
            else:
                new_lineage = True
        owner.write(directory, owner.Owner(d.incarnation_hex, d.runtime.inode, state.boot + 1,
                                           grants.written_at_ns, lines + new_lineage), d.fs)
        return new_lineage

    def failover_generation(self, failover: Failover, at_ns: int) -> None:
        """A takeover makes the runtime file's next generation, `failover["file_generation"]`, the
        one every receipt it saves carries in its save fields (SPEC: they identify the file
        generation): the file gets the failover component (replication FAILOVER: the failover
        incident this boot records, msgpack) in place of the last one. A rejoining old primary's
        copy differs from this file in that component only, and adopts it without its journal
        being sent again (docs/replication.md, "Failover generations")."""
        from ..replication import FAILOVER
        d = self.d
        incident = msgpack.packb({"boot": d.state.boot + 1, "at_ns": at_ns, **failover})
        generation = runtime_file_writer.append(d.runtime.path, [(FAILOVER, "bytes", incident)], fs=d.runtime_fs,
                                         generation=failover["file_generation"])
        d.runtime = runtime_file.RuntimeFile.open(d.runtime.path, verify=False)
        d.state.generation = generation
        log.info("takeover: runtime file %s is at generation %d (the failover's)", d.runtime.path, generation)

    def follow(self, until: tuple[int, int]) -> int:
        """Apply the transfers the journal copy gained before `until` (its durable end): how many."""
        d = self.d
        assert d.following is not None
        transfers = d.following.read(until)
        for transfer in transfers:
            d.replay.transfer(transfer)
        d.recovered += len(transfers)
        return len(transfers)

    def refollow(self) -> None:
        """Build the state from the runtime file's newest generation (a checkpoint or a catch-up
        from the link may have advanced the copy) and the journal as it is now, and follow it from
        there: a hot standby's start, again when its copy was cut back before what was applied (a
        rewind to a takeover point, a failed tick on the primary), and after a catch-up."""
        started = time.perf_counter()
        d = self.d
        d.runtime = runtime_file.RuntimeFile.open(d.runtime.path, verify=False)
        recovery = d.load()
        d.following = Tail(d.journal_dir, d.runtime.incarnation, recovery)
        d.loaded(recovery, started)

    def take_over(self, lock: JournalLock, leadership: Leadership | None, until: tuple[int, int]) -> None:
        """This hot standby becomes the primary's successor: it applies what its journal copy holds
        before `until` and boots as `boot --takeover` would (the same checks, the same boot
        transfer), without reading the journal again. `lock` is the journal's, handed over by the
        standby's Mirror (closed by now); `leadership` the etcd lease taken for this boot, if any."""
        started = time.perf_counter()
        d = self.d
        tail = d.following
        assert tail is not None
        applied = self.follow(until)
        d.lock, d.leadership, d.takeover, d.following = lock, leadership, True, None
        d.runtime = runtime_file.RuntimeFile.open(d.runtime.path, verify=False)  # the link may have advanced it
        # a checkpoint whose CHECKPOINT transfer did not follow in time (a copy ahead of the state by
        # a failover component only folded nothing: checkpoint.folded_generation)
        folded = checkpoint.folded_generation(d.runtime)
        if folded > d.state.generation:
            d.checkpoints.folded(folded, tail.next_seq - 1, tail.last_digest)
        segment, offset = tail.position
        d.start_journal(RecoveryResult([], tail.next_seq, tail.last_digest, segment, offset, None, tail.durable_bytes),
                    True)
        d.boot_seconds = time.perf_counter() - started
        log.info("takeover: %d transfers applied at the end of following, %d in all; serving after %.3fs",
                 applied, d.recovered, d.boot_seconds)
