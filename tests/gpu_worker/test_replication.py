"""Journal shipping to a standby (gpu_worker/replication/): a real primary device served on a
thread ships its journal over a Unix socket to a standby's Mirror on another thread; the standby's
journal is the primary's, byte for byte, and in sync replication no reply says "saved" before
the standby holds the transfer."""
import collections
import contextlib
import json
import os
import select
import shutil
import socket
import tempfile
import threading

import msgpack
import pytest

from bench.journal import registration_frame
from gpu_worker.contract.grantfile import Grants
from gpu_worker.contract.wire import LENGTH, FrameReader, decode_payload, encode_frame
from gpu_worker.device import Device
from gpu_worker.replication import DEAD_SECONDS, FAILOVER, read_frames
from gpu_worker.replication.primary import SAVED_STATE, Shipper
from gpu_worker.replication.follower import Follower as Applier
from gpu_worker.replication.marker import takeovers
from gpu_worker.replication.mirror import Mirror
from gpu_worker.replication.standby import Standby, StandbyRefused
from gpu_worker.storage import runtime_file_writer
from gpu_worker.storage.journal import list_segments, segment_name
from gpu_worker.storage.journal_lock import JournalLock
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.conftest import wait_for
from tests.gpu_worker.loop.test_server import LiveDevice, _exactly, call, gated_fold, register_all


class Primary(LiveDevice):
    """A LiveDevice whose server ships its journal (`sync` or not) on DIR/replication.sock."""

    def __init__(self, runtime, tmp_path, n_principals, sync, alone_after=None, fs=None, leadership=None,
                 dead_after=DEAD_SECONDS, address=None, tls=None):
        tmp_path.mkdir(parents=True, exist_ok=True)
        super().__init__(runtime, tmp_path, n_principals, fs=fs)
        self.sync, self.alone_after = sync, alone_after
        self.leadership, self.dead_after, self.tls = leadership, dead_after, tls
        # AF_UNIX paths are limited to ~107 bytes: the socket in a short directory
        self.address = address or os.path.join(tempfile.mkdtemp(prefix="aotx-repl-"), "replication.sock")
        self.shipper = None

    def start(self):
        self.shipper = Shipper(self.address, self.journal, self.runtime, sync=self.sync, alone_after=self.alone_after,
                               leadership=self.leadership, dead_after=self.dead_after, tls=self.tls)
        self.server_options = {"replica": self.shipper}
        return super().start()

    def stop(self):
        super().stop()
        self.shipper.close()
        shutil.rmtree(os.path.dirname(self.address), ignore_errors=True)

    def position(self):
        writer = self.device.committer.writer
        return writer.segment, writer.offset


class Follower:
    """A standby (Mirror + Standby) following `address` on a thread; `hot_grants`: a hot one, whose
    device applies the journal copy as it comes (boot --standby-of), with these grants."""

    def __init__(self, address, directory, runtime, hot_grants=None, dead_after=DEAD_SECONDS, tls=None):
        self.incarnation = RuntimeFile.open(runtime).incarnation
        self.device = self.applier = None
        if hot_grants is None:
            self.mirror = Mirror(directory, self.incarnation)
        else:
            os.makedirs(directory, exist_ok=True)
            lock = JournalLock(directory)
            self.device = Device(RuntimeFile.open(runtime), directory, Grants(hot_grants), following=True)
            self.mirror = Mirror(directory, self.incarnation, lock=lock, position=self.device.following.position)
            self.applier = Applier(self.device, self.mirror.position)
            self.applier.start()
        self.standby = Standby(address, self.mirror, runtime, self.applier, dead_after=dead_after, tls=tls)
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.standby.run()
        except BaseException as exc:  # a refusal ends run(): the test reads it
            self.error = exc

    def stop(self):
        self.standby.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.mirror.close()

    def take_over(self):
        """Stop following and serve (boot._standby's takeover, without a socket): the device."""
        self.standby.stop()
        self.thread.join(30)
        until = self.mirror.sync()
        assert self.applier.finish(until), self.applier.error
        self.mirror.close(keep_lock=True)
        self.device.take_over(self.mirror.lock, None, until)
        return self.device

    def applied(self):
        return self.device.following.position


def journal_bytes(directory):
    return {n: open(os.path.join(directory, segment_name(n)), "rb").read() for n in list_segments(directory, _fs())}


def _fs():
    from gpu_worker.storage.filelayer import OsFileLayer
    return OsFileLayer()


def caught_up(primary, follower):
    return follower.mirror.position == primary.position() and primary.shipper.acked_seq == primary.shipper.last_seq


def followed(primary, follower):
    """A hot standby holds the primary's whole journal and has applied it."""
    return caught_up(primary, follower) and follower.applied() == primary.position()


def save_alone(primary):
    """The primary's --standby-timeout passes now (with no standby streamed to): it saves alone
    once the journal says so."""
    primary.shipper.alone_after = 0.0
    primary.shipper._alone_due()
    wait_for(lambda: primary.shipper.alone, what="the primary to save alone")


def rendered_by(primary, replies):
    """receipts_of the serving primary, through its socket."""
    with primary.connect() as sock:
        return receipts_of(sock, replies)


def test_a_sync_standby_holds_every_saved_transfer_byte_for_byte(tiny_runtime, tmp_path):
    primary = Primary(tiny_runtime, tmp_path / "p", 64, sync=True).start()
    follower = Follower(primary.address, str(tmp_path / "s" / "journal"), tiny_runtime)
    try:
        replies = register_all(primary, primary.principals, 8)
        assert {r["status"] for r in replies.values()} == {202}
        # every reply said saved: the standby acknowledged each transfer before it went out
        held = journal_bytes(follower.mirror.directory)
        mine = journal_bytes(primary.journal)
        assert sorted(held) == sorted(mine)
        for n, data in held.items():
            assert mine[n].startswith(data)  # the standby holds a prefix; the primary's tail is unsaved
        wait_for(lambda: caught_up(primary, follower), what="the standby to hold the whole journal")
    finally:
        primary.stop()
        follower.stop()
    assert journal_bytes(follower.mirror.directory) == journal_bytes(primary.journal)
    assert follower.error is None


def test_without_its_standby_a_sync_primary_saves_locally_but_answers_nothing_until_one_holds_it(
        tiny_runtime, tmp_path):
    primary = Primary(tiny_runtime, tmp_path / "p", 1, sync=True).start()
    follower = None
    try:
        sock = primary.connect()
        durable = primary.device.committer.writer.durable_seq
        sock.sendall(primary.register_frame(primary.principals[0], 1))
        wait_for(lambda: primary.device.committer.writer.durable_seq > durable, what="the local fdatasync")
        assert select.select([sock], [], [], 0)[0] == []  # durable here, not on a standby: no reply
        assert primary.device.pipeline_state()["replication"]["standby"] is None
        follower = Follower(primary.address, str(tmp_path / "s" / "journal"), tiny_runtime)
        sock.settimeout(30)
        (n,) = LENGTH.unpack(_exactly(sock, 4))  # the reply comes once the standby caught up and acknowledged
        reply = decode_payload(_exactly(sock, n))
        assert reply["status"] == 202
        state = primary.device.pipeline_state()["replication"]
        assert state["standby"] is not None and state["role"] == "primary" and state["replication"] == "sync"
        sock.close()
    finally:
        primary.stop()
        if follower is not None:
            follower.stop()


def test_an_async_primary_answers_alone_and_a_late_standby_catches_up_from_the_files(tiny_runtime, tmp_path):
    primary = Primary(tiny_runtime, tmp_path / "p", 40, sync=False).start()
    follower = None
    try:
        first = register_all(primary, primary.principals[:20], 4)
        assert {r["status"] for r in first.values()} == {202}
        follower = Follower(primary.address, str(tmp_path / "s" / "journal"), tiny_runtime)
        wait_for(lambda: caught_up(primary, follower), what="the late standby to catch up")
        later = register_all(primary, primary.principals[20:], 4)
        assert {r["status"] for r in later.values()} == {202}
        wait_for(lambda: caught_up(primary, follower), what="the standby to follow")
    finally:
        primary.stop()
        if follower is not None:
            follower.stop()
    assert journal_bytes(follower.mirror.directory) == journal_bytes(primary.journal)


def test_a_standby_that_leaves_and_returns_catches_up_where_it_stopped(tiny_runtime, tmp_path):
    primary = Primary(tiny_runtime, tmp_path / "p", 30, sync=False).start()
    directory = str(tmp_path / "s" / "journal")
    try:
        follower = Follower(primary.address, directory, tiny_runtime)
        register_all(primary, primary.principals[:10], 2)
        wait_for(lambda: caught_up(primary, follower), what="the standby to follow")
        follower.stop()
        wait_for(lambda: primary.device.pipeline_state()["replication"]["standby"] is None,
                 what="the primary to see the standby leave")
        register_all(primary, primary.principals[10:], 2)  # while it is away
        follower = Follower(primary.address, directory, tiny_runtime)  # from its own journal's end
        wait_for(lambda: caught_up(primary, follower), what="the returning standby to catch up")
        state = primary.device.pipeline_state()["replication"]
        assert state["standbys"] == 2 and state["standby_losses"] == 1 and state["lag_transfers"] == 0
        assert state["lag_bytes"] == 0 and state["acked_position"] == list(primary.position())
    finally:
        primary.stop()
        follower.stop()
    assert journal_bytes(directory) == journal_bytes(primary.journal)


def test_the_standbys_journal_boots_a_device_with_every_saved_receipt(tiny_runtime, tmp_path):
    """The promotion path this far: the standby's journal and a copy of the runtime file boot a
    device that reads back every receipt a client saw, byte for byte."""
    primary = Primary(tiny_runtime, tmp_path / "p", 24, sync=True).start()
    follower = Follower(primary.address, str(tmp_path / "s" / "journal"), tiny_runtime)
    try:
        replies = register_all(primary, primary.principals, 4)
    finally:
        primary.stop()
        follower.stop()
    runtime = str(tmp_path / "s" / "copy.aotxccir")
    shutil.copyfile(tiny_runtime, runtime)
    device = Device(RuntimeFile.open(runtime), follower.mirror.directory, Grants(primary.grants), serve=False)
    try:
        for principal, reply in replies.items():
            [(_, msg)] = device.committer.run_sync(collections.deque([("c", {
                "v": 1, "id": 1, "op": "operations.list", "principal": principal.hex(), "args": {}})]))
            assert json.loads(msg.body)["items"] == [json.loads(reply["body"])]
    finally:
        device.close()


def listed(device, principal):
    """The principal's receipts as the device lists them (operations.list), parsed."""
    [(_, msg)] = device.committer.run_sync(collections.deque([("c", {
        "v": 1, "id": 1, "op": "operations.list", "principal": principal.hex(), "args": {}})]))
    return json.loads(msg.body)["items"]


def test_a_hot_standby_applies_the_journal_as_it_comes_and_takes_over_without_reading_it_again(
        tiny_runtime, tmp_path):
    """The hot standby's tables follow the copy as it is acknowledged (not at the takeover), and
    the device it becomes reads back every receipt a client saw saved, continues every lineage,
    and holds what a boot of the same journal with --takeover would. The takeover makes the
    runtime file's next generation (its failover component says whose): the receipts it saves
    carry it in their save fields, those saved before keep theirs."""
    primary = Primary(tiny_runtime, tmp_path / "p", 24, sync=True).start()
    (runtime,) = copies(tiny_runtime, tmp_path, "copy.aotxccir")
    before = RuntimeFile.open(runtime).generation
    follower = Follower(primary.address, str(tmp_path / "s" / "journal"), runtime, hot_grants=primary.grants)
    try:
        replies = register_all(primary, primary.principals[:20], 4)
        wait_for(lambda: followed(primary, follower), what="the standby to hold and apply the whole journal")
        applied = follower.device.recovered
        assert applied == primary.device.committer.writer.durable_seq  # every transfer, applied as it came
        lineages = {p: primary.device.state.participants.lineage_of(p) for p in primary.principals}
    finally:
        primary.stop()
    device = follower.take_over()
    try:
        assert device.recovered == applied  # nothing was left to read at the takeover
        for principal, reply in replies.items():
            assert listed(device, principal) == [json.loads(reply["body"])]
        assert {p: device.state.participants.lineage_of(p) for p in lineages} == lineages
        [failover] = device.state.failovers
        assert tuple(failover["position"]) == takeovers(follower.mirror.directory)[0]
        assert failover["file_generation"] == device.state.generation == RuntimeFile.open(runtime).generation \
            == before + 1
        with RuntimeFile.open(runtime) as copy:
            assert msgpack.unpackb(copy.bytes(FAILOVER)) == {**failover, "boot": device.state.boot}
        late = {p: registered(device, p) for p in primary.principals[20:]}
        assert {save_generation(body) for body in late.values()} == {before + 1}
        assert {save_generation(r["body"]) for r in replies.values()} == {before}
    finally:
        device.close()
    booted = Device(RuntimeFile.open(runtime), follower.mirror.directory, Grants(primary.grants))  # a restart
    try:
        for principal, reply in replies.items():
            assert listed(booted, principal) == [json.loads(reply["body"])]
        for principal, body in late.items():
            assert listed(booted, principal) == [json.loads(body)]
        assert booted.state.failovers == [failover] and booted.state.generation == before + 1
    finally:
        booted.close()


def registered(device, principal):
    """The receipt bytes of the principal's registration, admitted by `device` directly."""
    lineage = device.state.participants.lineage_of(principal).hex()
    [(_, got)] = device.committer.run_sync(collections.deque([("c", decode_payload(
        registration_frame(lineage, principal, 1)[LENGTH.size:]))]))
    assert got.status == 202, got
    return got.body


def save_generation(body):
    """The file generation a receipt's admission save fields name."""
    return int(json.loads(body)["admission"]["save"]["generation"])


def test_a_standby_of_another_runtime_file_is_refused(tiny_runtime, tmp_path):
    from gpu_worker.pack import pack_tiny
    other = str(tmp_path / "other.aotxccir")
    pack_tiny(other, shared=True)
    primary = Primary(tiny_runtime, tmp_path / "p", 1, sync=False).start()
    try:
        follower = Follower(primary.address, str(tmp_path / "s" / "journal"), other)
        follower.thread.join(30)
        assert isinstance(follower.error, StandbyRefused) and "incarnation" in str(follower.error)
        follower.mirror.close()
    finally:
        primary.stop()


def test_a_standby_holding_bytes_the_primary_never_wrote_is_refused(tiny_runtime, tmp_path):
    primary = Primary(tiny_runtime, tmp_path / "p", 4, sync=False).start()
    directory = str(tmp_path / "s" / "journal")
    try:
        follower = Follower(primary.address, directory, tiny_runtime)
        register_all(primary, primary.principals, 2)
        wait_for(lambda: caught_up(primary, follower), what="the standby to follow")
        follower.stop()
    finally:
        primary.stop()
    fresh = Primary(tiny_runtime, tmp_path / "q", 1, sync=False).start()  # another journal, the same file
    try:
        follower = Follower(fresh.address, directory, tiny_runtime)
        follower.thread.join(30)
        assert isinstance(follower.error, StandbyRefused) and "not a copy" in str(follower.error)
        follower.mirror.close()
    finally:
        fresh.stop()


def _kept(tiny_runtime, tmp_path, sync):
    """A standby's journal kept under `sync` or async replication, and a copy of the runtime file."""
    primary = Primary(tiny_runtime, tmp_path / "p", 3, sync=sync).start()
    follower = Follower(primary.address, str(tmp_path / "s" / "journal"), tiny_runtime)
    try:
        register_all(primary, primary.principals, 1)
        wait_for(lambda: caught_up(primary, follower), what="the standby to follow")
        lineages = {p: primary.device.state.participants.lineage_of(p) for p in primary.principals}
    finally:
        primary.stop()
        follower.stop()
    runtime = str(tmp_path / "s" / "copy.aotxccir")
    shutil.copyfile(tiny_runtime, runtime)
    return primary, follower.mirror.directory, runtime, lineages


def test_a_takeover_of_a_sync_standbys_journal_continues_the_line_of_history(tiny_runtime, tmp_path):
    from gpu_worker.recovery import DeviceBootError
    primary, directory, runtime, lineages = _kept(tiny_runtime, tmp_path, sync=True)
    with pytest.raises(DeviceBootError, match="restore requires fresh deployment grants"):
        Device(RuntimeFile.open(runtime), directory, Grants(primary.grants))  # without --takeover: a restore
    before = RuntimeFile.open(runtime).generation
    device = Device(RuntimeFile.open(runtime), directory, Grants(primary.grants), takeover=True)
    try:
        assert {p: device.state.participants.lineage_of(p) for p in lineages} == lineages
        [failover] = device.state.failovers  # an incident of the saved state
        assert (tuple(failover["position"]), failover["generation"], failover["boot"], failover["file_generation"]) \
            == (takeovers(directory)[0], None, device.state.boot, before + 1)
        assert device.state.generation == RuntimeFile.open(runtime).generation == before + 1
    finally:
        device.close()
    restarted = Device(RuntimeFile.open(runtime), directory, Grants(primary.grants))  # replayed from the journal
    try:
        assert restarted.state.failovers == [failover] and restarted.state.generation == before + 1
    finally:
        restarted.close()


def test_a_takeover_of_an_async_standbys_journal_is_refused(tiny_runtime, tmp_path):
    from gpu_worker.recovery import DeviceBootError
    primary, directory, runtime, _ = _kept(tiny_runtime, tmp_path, sync=False)
    with pytest.raises(DeviceBootError, match="kept async"):
        Device(RuntimeFile.open(runtime), directory, Grants(primary.grants), takeover=True)


def test_with_a_standby_timeout_a_sync_primary_saves_alone_until_a_standby_has_caught_up(tiny_runtime, tmp_path):
    primary = Primary(tiny_runtime, tmp_path / "p", 20, sync=True, alone_after=0.2).start()
    follower = None
    try:
        alone = register_all(primary, primary.principals[:10], 2)  # answered once the timeout passed
        assert {r["status"] for r in alone.values()} == {202}
        assert primary.device.pipeline_state()["replication"]["alone"] is True
        follower = Follower(primary.address, str(tmp_path / "s" / "journal"), tiny_runtime)
        wait_for(lambda: primary.device.pipeline_state()["replication"]["alone"] is False,
                 what="the standby to catch up and the primary to wait for it again")
        register_all(primary, primary.principals[10:], 2)
        held = journal_bytes(follower.mirror.directory)
        for n, data in journal_bytes(primary.journal).items():
            assert data.startswith(held[n])
        assert len(b"".join(held.values())) > 0
        wait_for(lambda: caught_up(primary, follower), what="the standby to hold the whole journal")
    finally:
        primary.stop()
        if follower is not None:
            follower.stop()


def test_a_full_disk_on_the_primary_cuts_the_standbys_copy_too(tmp_path):
    """ENOSPC on the primary: it rebuilds from what is durable there and refuses the unsaved
    admissions; the standby, which may hold bytes of the failed tick, cuts its copy back, and
    the transfers written after carry the same numbers with other bytes. The standby ends with
    the primary's journal, byte for byte, and every receipt answered saved."""
    from gpu_worker.pack import pack_tiny
    from gpu_worker.storage.filelayer import FaultyFileLayer
    runtime = str(tmp_path / "faults.aotxccir")
    pack_tiny(runtime, shared=True, runtime_profile={"min_free_disk_bytes": 1})  # only ENOSPC holds
    fs = FaultyFileLayer()
    primary = Primary(runtime, tmp_path / "p", 300, sync=True, fs=fs).start()
    # hot: a cut before what its tables hold builds them again
    follower = Follower(primary.address, str(tmp_path / "s" / "journal"), runtime, hot_grants=primary.grants)
    try:
        fs.space = 30_000  # some registrations fit; then the disk is "full"
        replies = register_all(primary, primary.principals, 8)
        assert primary.shipper.cuts > 0
        fs.space = None
        refused = [p for p, r in replies.items() if r["status"] == 429][:5]
        late = register_all(primary, refused, 2)
        assert {r["status"] for r in late.values()} == {202}  # the hold ended once space came back; a refusal
        # changed nothing (a 409 already_registered here would say a refused registration was kept)
        wait_for(lambda: followed(primary, follower), what="the standby to follow")
    finally:
        primary.stop()
    assert journal_bytes(follower.mirror.directory) == journal_bytes(primary.journal)
    statuses = collections.Counter(r["status"] for r in replies.values())
    assert statuses[202] > 0 and statuses[429] > 0 and set(statuses) <= {202, 429, 503}, statuses
    device = follower.take_over()  # its tables hold what the primary kept, whatever it applied before a cut
    try:
        for principal, r in {**replies, **late}.items():
            kept = listed(device, principal)
            if r["status"] == 503:  # durable but unconfirmed: kept, and an exact retry would answer it
                assert json.loads(r["body"])["error"]["code"] == "standby_unconfirmed" and len(kept) == 1
            elif r["status"] == 202:
                assert kept == [json.loads(r["body"])]
            elif principal not in late:  # refused, changed nothing
                assert kept == []
    finally:
        device.close()


def test_an_old_primary_rejoins_as_a_standby_cut_back_to_the_takeover_point(tiny_runtime, tmp_path):
    """The old primary's journal holds a tail its standby never held (it went on alone); the
    standby took over and wrote other transfers with the same numbers after that point. The old
    primary, following the new one, is cut back to the takeover point and then holds the new
    primary's journal, byte for byte. Its copy of the runtime file, a generation behind the
    takeover's, adopts the failover component (the journal kept, not sent again: no catch-up), and
    its tables the generation the new primary's receipts carry."""
    old = Primary(tiny_runtime, tmp_path / "p", 12, sync=True).start()
    follower = Follower(old.address, str(tmp_path / "s" / "journal"), tiny_runtime)
    try:
        register_all(old, old.principals[:4], 2)
        wait_for(lambda: caught_up(old, follower), what="the standby to follow")
    finally:
        old.stop()
        follower.stop()
    alone = Primary(tiny_runtime, tmp_path / "p", 0, sync=False)  # the old primary goes on alone: a tail
    alone.principals = old.principals
    alone.start()
    try:
        assert {r["status"] for r in register_all(alone, old.principals[4:8], 2).values()} == {202}
    finally:
        alone.stop()
    runtime, old_copy = copies(tiny_runtime, tmp_path, "copy.aotxccir", "old.aotxccir")
    generation = RuntimeFile.open(runtime).generation
    shutil.copyfile(old.grants, str(tmp_path / "s" / "grants.json"))
    new = Primary(runtime, tmp_path / "s", 0, sync=True)
    new.principals, new.device_options = old.principals, {"takeover": True}
    new.start()
    # hot: its tables, loaded with the tail, are built again once the journal is cut back
    rejoined = Follower(new.address, old.journal, old_copy, hot_grants=old.grants)
    try:
        replies = register_all(new, old.principals[8:], 2)  # the same transfer numbers as the old tail, other bytes
        [point] = takeovers(new.journal)  # where the new primary's part of the journal begins
        assert point < (new.device.committer.writer.segment, new.device.committer.writer.offset)
        wait_for(lambda: (caught_up(new, rejoined) and rejoined.applied() == new.position()) or rejoined.error,
                 what="the old primary to be cut back, catch up and apply it")
        assert rejoined.error is None and rejoined.applier.refollowed == 1
        assert new.shipper.catch_ups == 0  # (adopted: its journal was cut back, not emptied and sent again)
        assert saved_state(old_copy) == saved_state(runtime) and saved_state(runtime)[0] == generation + 1
        assert rejoined.device.state.generation == generation + 1  # (the takeover's BOOT transfer, applied)
        assert {save_generation(r["body"]) for r in replies.values()} == {generation + 1}
        saved = {p: listed(new.device, p) for p in old.principals}
    finally:
        new.stop()
    assert journal_bytes(old.journal) == journal_bytes(new.journal)
    device = rejoined.take_over()  # the old primary's machine, primary again: what the new one saved, not its own tail
    try:
        assert {p: listed(device, p) for p in old.principals} == saved
        assert all(saved[p] == [json.loads(r["body"])] for p, r in replies.items())
        assert not any(saved[p] for p in old.principals[4:8])  # the tail it held alone is gone
        assert device.state.generation == RuntimeFile.open(old_copy).generation == generation + 2
    finally:
        device.close()


def test_a_checkpoint_keeps_the_failovers(tiny_runtime, tmp_path):
    primary, directory, runtime, _ = _kept(tiny_runtime, tmp_path, sync=True)
    device = Device(RuntimeFile.open(runtime), directory, Grants(primary.grants), takeover=True)
    try:
        failovers = list(device.state.failovers)
        assert len(failovers) == 1 and device.checkpoint() is not None  # the BOOT transfers are folded
    finally:
        device.close()
    restarted = Device(RuntimeFile.open(runtime), directory, Grants(primary.grants))
    try:
        assert restarted.recovered <= 2 and restarted.state.failovers == failovers
    finally:
        restarted.close()


def receipts_of(device_or_sock, replies):
    """{principal: the receipt bytes the device renders now} for each registration in `replies`."""
    out = {}
    for principal, reply in replies.items():
        msg = {"v": 1, "id": 1, "op": "operations.get", "principal": principal.hex(),
               "args": {"operation": json.loads(reply["body"])["operation"]}}
        if isinstance(device_or_sock, Device):
            [(_, answer)] = device_or_sock.committer.run_sync(collections.deque([("c", msg)]))
            got = {"status": answer.status, "body": answer.body}
        else:
            got = call(device_or_sock, encode_frame(msg))
        assert got["status"] == 200, got
        out[principal] = got["body"]
    return out


def receipts_after_restart(runtime, primary, replies):
    """receipts_of a device booted on the stopped primary's runtime file and journal (a restart)."""
    with contextlib.closing(Device(RuntimeFile.open(runtime), primary.journal, Grants(primary.grants))) as device:
        return receipts_of(device, replies)


def test_a_checkpoint_on_the_primary_reaches_the_standbys_copy_and_a_takeover_renders_the_same_receipts(
        tiny_runtime, tmp_path):
    """The primary checkpoints while a hot standby follows: the standby's copy of the runtime file
    gets the same components (the same generation), the journal segments the checkpoint folded
    go there too, and its tables fold where the primary's did, so after a takeover every receipt
    — those folded ("source": "file", the new generation) and those after — reads back byte for
    byte as the primary rendered it. A standby restarted on its trimmed journal, and one started
    on an empty journal with a copy of the file as it is now, are taken back; the new primary
    checkpoints on."""
    mine, copy = str(tmp_path / "p.aotxccir"), str(tmp_path / "s.aotxccir")
    shutil.copyfile(tiny_runtime, mine)  # (checkpoints write it: not the shared fixture)
    shutil.copyfile(tiny_runtime, copy)
    before = RuntimeFile.open(mine).generation
    primary = Primary(mine, tmp_path / "p", 24, sync=True).start()
    directory = str(tmp_path / "s" / "journal")
    follower = Follower(primary.address, directory, copy, hot_grants=primary.grants)
    try:
        replies = register_all(primary, primary.principals[:12], 4)
        with primary.connect() as sock:
            done = call(sock, encode_frame({"v": 1, "id": 1, "op": "checkpoint", "principal": None, "args": {}}))
        assert done["status"] == 200 and json.loads(done["body"])["generation"] == before + 1, done
        replies.update(register_all(primary, primary.principals[12:], 4))
        wait_for(lambda: followed(primary, follower), what="the standby to follow past the checkpoint")
        assert RuntimeFile.open(copy).generation == before + 1
        assert list_segments(directory, _fs()) == [1, 2]  # (the primary's: [2]; the last folded one stays)
        follower.stop()
        fresh_copy = str(tmp_path / "fresh.aotxccir")
        shutil.copyfile(mine, fresh_copy)  # a new standby: the file as it is now, an empty journal
        fresh = Follower(primary.address, str(tmp_path / "f" / "journal"), fresh_copy, hot_grants=primary.grants)
        wait_for(lambda: followed(primary, fresh), what="a new standby to catch up from the checkpoint")
        fresh.stop()
        follower = Follower(primary.address, directory, copy, hot_grants=primary.grants)  # restarted
        wait_for(lambda: followed(primary, follower), what="the restarted standby to catch up")
        rendered = rendered_by(primary, replies)
    finally:
        primary.stop()
    assert any(b'"source":"file"' in body for body in rendered.values())
    device = follower.take_over()
    try:
        assert receipts_of(device, replies) == rendered
        assert device.state.generation == before + 2  # the takeover's (a failover generation)
        assert device.checkpoint()["generation"] == before + 3  # its copy goes on from the primary's generation
    finally:
        device.close()


def test_a_copy_ahead_by_a_failover_component_only_folds_nothing_at_a_takeover(tiny_runtime, tmp_path):
    """A hot standby whose copy adopted a newer primary's failover generation while its journal
    does not hold that primary's BOOT transfer yet (the link broke between them) takes over with
    every receipt as the primary rendered it: saved in the journal, not folded into the file as a
    copy ahead by a checkpoint is (the test above); the takeover makes the generation after."""
    mine, copy = copies(tiny_runtime, tmp_path, "p.aotxccir", "s.aotxccir")
    primary = Primary(mine, tmp_path / "p", 6, sync=True).start()
    follower = Follower(primary.address, str(tmp_path / "s" / "journal"), copy, hot_grants=primary.grants)
    try:
        replies = register_all(primary, primary.principals, 2)
        wait_for(lambda: followed(primary, follower), what="the standby to follow")
        rendered = rendered_by(primary, replies)
    finally:
        primary.stop()
    generation = RuntimeFile.open(copy).generation
    runtime_file_writer.append(copy, [(FAILOVER, "bytes", msgpack.packb({"file_generation": generation + 1}))],
                        generation=generation + 1)  # (as Standby._adopt appends it)
    device = follower.take_over()
    try:
        assert all(b'"source":"journal"' in body for body in rendered.values())
        assert receipts_of(device, replies) == rendered
        assert device.state.generation == generation + 2
    finally:
        device.close()


def held_registrations(primary, principals):
    """A socket per principal with its registration sent, once every one is durable on the
    primary (not yet answered: a sync primary waits for its standby)."""
    durable = primary.device.committer.writer.durable_seq
    socks = []
    for i, principal in enumerate(principals):
        sock = primary.connect()
        sock.sendall(primary.register_frame(principal, i + 1))
        socks.append(sock)
    wait_for(lambda: primary.device.committer.writer.durable_seq >= durable + len(principals),
             what="the registrations to be durable here")
    return socks


def answered(sock):
    (n,) = LENGTH.unpack(_exactly(sock, 4))
    return decode_payload(_exactly(sock, n))


def test_a_checkpoint_on_a_sync_primary_waits_for_its_standby_and_a_restart_renders_every_receipt_saved(
        tiny_runtime, tmp_path):
    """A checkpoint folds saved state only. On a sync primary with no standby, admissions durable
    here are not saved yet: a checkpoint then waits (its state would hold their receipts unsaved,
    and a device loading it would never mark them saved: their transfers are folded). A standby
    connects: the admissions are answered saved, the checkpoint runs, and the primary restarted
    from its file renders every receipt as the primary did, saved, byte for byte."""
    mine, copy = copies(tiny_runtime, tmp_path, "p.aotxccir", "s.aotxccir")  # (the checkpoint writes both)
    before = RuntimeFile.open(mine).generation
    primary = Primary(mine, tmp_path / "p", 4, sync=True).start()
    follower = None
    try:
        socks = held_registrations(primary, primary.principals)
        asked = primary.connect()
        asked.sendall(encode_frame({"v": 1, "id": 9, "op": "checkpoint", "principal": None, "args": {}}))
        wait_for(lambda: primary.device.committer.drain_waiters == 1 or select.select([asked], [], [], 0)[0],
                 what="the checkpoint to wait, or be answered")
        assert select.select([asked] + socks, [], [], 0)[0] == []  # nothing is saved: no reply, no checkpoint
        assert RuntimeFile.open(mine).generation == before
        follower = Follower(primary.address, str(tmp_path / "s" / "journal"), copy)
        replies = {p: answered(sock) for p, sock in zip(primary.principals, socks)}
        assert {r["status"] for r in replies.values()} == {202}
        done = answered(asked)
        assert done["status"] == 200 and json.loads(done["body"])["generation"] == before + 1, done
        rendered = rendered_by(primary, replies)
        for sock in socks + [asked]:
            sock.close()
    finally:
        primary.stop()
        if follower is not None:
            follower.stop()
    assert all(json.loads(body)["admission"]["save"]["source"] == "file" for body in rendered.values())
    assert receipts_after_restart(mine, primary, replies) == rendered


def test_a_fenced_sync_primary_answers_its_waiting_checkpoint_not_primary(tiny_runtime, tmp_path):
    """A checkpoint waiting for the standby on a primary whose leadership lease may have lapsed
    never runs there: 503 `not_primary`, with the admissions it waited behind."""
    from gpu_worker.replication.lease import Etcd, Leadership
    from tests.gpu_worker.test_leadership import KEY, Clock
    (mine,) = copies(tiny_runtime, tmp_path, "p.aotxccir")
    before = RuntimeFile.open(mine).generation
    primary = Primary(mine, tmp_path / "p", 1, sync=True).start()
    try:
        clock = Clock()
        leadership = Leadership(Etcd(["http://127.0.0.1:9"]), KEY, ttl=3, clock=clock)  # (never asked)
        leadership.trusted_until = clock.now + 10
        primary.device.leadership = leadership
        [held] = held_registrations(primary, primary.principals)
        with held, primary.connect() as asked:
            asked.sendall(encode_frame({"v": 1, "id": 9, "op": "checkpoint", "principal": None, "args": {}}))
            wait_for(lambda: primary.device.committer.drain_waiters == 1, what="the checkpoint to wait")
            clock.now += 10  # the lease may have lapsed
            for sock in (held, asked):
                got = answered(sock)
                assert got["status"] == 503 and json.loads(got["body"])["error"]["code"] == "not_primary", got
        assert primary.device.committer.drain_waiters == 0 and RuntimeFile.open(mine).generation == before
    finally:
        primary.stop()


def test_a_sync_primary_under_load_checkpoints_by_itself_and_every_copy_renders_its_receipts(tmp_path):
    """Past checkpoint_journal_bytes under a closed-loop load, something is always waiting for the
    standby's acknowledgement: the automatic checkpoint waits for it (gathering pauses) instead of
    folding unsaved receipts, and runs. After, the primary restarted from its file and the standby
    taking over render every receipt as the primary did."""
    from gpu_worker.pack import pack_tiny
    runtime = str(tmp_path / "auto.aotxccir")
    pack_tiny(runtime, shared=True, journal_limits={"checkpoint_journal_bytes": 20_000})  # (~60 registrations)
    (copy,) = copies(runtime, tmp_path, "s.aotxccir")
    before = RuntimeFile.open(runtime).generation
    primary = Primary(runtime, tmp_path / "p", 1000, sync=True).start()
    follower = Follower(primary.address, str(tmp_path / "s" / "journal"), copy, hot_grants=primary.grants)
    try:
        replies = register_all(primary, primary.principals, 8)
        assert {r["status"] for r in replies.values()} == {202}
        wait_for(lambda: primary.device.journal_bytes < 20_000, what="the last automatic checkpoint")
        assert primary.device.state.generation > before  # (folded beside the ticks while the clients went on)
        wait_for(lambda: followed(primary, follower), what="the standby to follow")
        rendered = rendered_by(primary, replies)
    finally:
        primary.stop()
    assert all(json.loads(body)["admission"]["saved"] for body in rendered.values())
    device = follower.take_over()
    try:
        assert receipts_of(device, replies) == rendered
    finally:
        device.close()
    assert receipts_after_restart(runtime, primary, replies) == rendered


def test_media_sources_reach_the_standby_before_their_owner_is_saved(tiny_runtime, tmp_path):
    """An upload's bytes go down the link before the MEDIA transfer that gives them an owner: once
    the upload is answered saved (sync), the standby holds the file. A source uploaded while no
    standby was connected (the primary saved alone) is sent when one connects. The standby that
    takes over has every source, none missing."""
    import hashlib
    copy = str(tmp_path / "s.aotxccir")
    shutil.copyfile(tiny_runtime, copy)
    primary = Primary(tiny_runtime, tmp_path / "p", 1, sync=True, alone_after=0.2).start()
    directory = str(tmp_path / "s" / "journal")
    follower = Follower(primary.address, directory, copy, hot_grants=primary.grants)
    sources = [os.urandom(3 << 20) for _ in range(2)]  # (more than one piece each)
    shas = [hashlib.sha256(data).hexdigest() for data in sources]
    principal = primary.principals[0]

    def upload(data, sha):
        with primary.connect() as sock:
            got = call(sock, encode_frame({"v": 1, "id": 1, "op": "media.put", "principal": principal.hex(),
                                           "args": {"sha256": sha, "data": data, "type": "image"}}))
        assert got["status"] == 201, got

    try:
        register_all(primary, [principal], 1)
        upload(sources[0], shas[0])
        with open(os.path.join(directory, "media", shas[0]), "rb") as f:  # at once: saved means held there
            assert f.read() == sources[0]
        follower.stop()
        upload(sources[1], shas[1])  # no standby: saved here alone after 0.2 s
        assert not os.path.exists(os.path.join(directory, "media", shas[1]))
        follower = Follower(primary.address, directory, copy, hot_grants=primary.grants)
        wait_for(lambda: followed(primary, follower), what="the standby to catch up")
    finally:
        primary.stop()
    for sha, data in zip(shas, sources):
        with open(os.path.join(directory, "media", sha), "rb") as f:
            assert f.read() == data
    device = follower.take_over()
    try:
        assert sorted(device.state.media) == sorted(shas)
        assert not any(source.missing for source in device.state.media.values())
    finally:
        device.close()


def checkpoint(primary):
    with primary.connect() as sock:
        done = call(sock, encode_frame({"v": 1, "id": 1, "op": "checkpoint", "principal": None, "args": {}}))
    assert done["status"] == 200, done
    return json.loads(done["body"])["generation"]


def copies(runtime, tmp_path, *names):
    """Copies of the runtime file (the same incarnation) at tmp_path/NAME each: files checkpoints
    and catch-ups write, not the shared fixture."""
    paths = [str(tmp_path / name) for name in names]
    for path in paths:
        shutil.copyfile(runtime, path)
    return paths


def saved_state(path):
    """{name: SHA-256} of the components checkpoints and takeovers write, and the file's generation."""
    with RuntimeFile.open(path) as f:
        return f.generation, {n: c.sha256 for n, c in f.components.items() if n.startswith(SAVED_STATE)}


def test_a_standby_behind_the_primarys_checkpoints_catches_up_from_its_file(tiny_runtime, tmp_path):
    """A hot standby stops; the primary checkpoints twice (its journal loses the segments the
    standby stopped in); the standby comes back with its copy of the runtime file two generations
    behind and its old journal: the primary sends the saved state its copy lacks, the copy comes
    out at the primary's generation with the same components, the journal copy begins again at
    the primary's oldest segment (byte for byte the primary's), the tables are built again, and
    after a takeover every receipt reads back as the primary rendered it. A new standby made from
    the file as packed (generation 1) and an empty journal catches up the same way."""
    from gpu_worker.replication.marker import read_mark
    mine, copy, packed = copies(tiny_runtime, tmp_path, "p.aotxccir", "s.aotxccir", "n.aotxccir")
    primary = Primary(mine, tmp_path / "p", 36, sync=True).start()
    directory = str(tmp_path / "s" / "journal")
    follower = Follower(primary.address, directory, copy, hot_grants=primary.grants)
    try:
        replies = register_all(primary, primary.principals[:12], 4)
        wait_for(lambda: caught_up(primary, follower), what="the standby to follow")
        follower.stop()
        stopped_in = list_segments(directory, _fs())
        generation = RuntimeFile.open(copy).generation
        for part in (primary.principals[12:24], primary.principals[24:]):  # (saved alone: no standby needed)
            save_alone(primary)
            replies.update(register_all(primary, part, 4))
            generation = checkpoint(primary)
        assert generation == RuntimeFile.open(copy).generation + 2
        assert min(list_segments(primary.journal, _fs())) > max(stopped_in)  # its segments are gone there
        follower = Follower(primary.address, directory, copy, hot_grants=primary.grants)
        wait_for(lambda: followed(primary, follower), what="the standby to catch up from the primary's file")
        assert saved_state(copy) == saved_state(mine)
        assert journal_bytes(directory) == journal_bytes(primary.journal)
        assert read_mark(directory) == "sync" and follower.applier.refollowed == 1
        fresh = Follower(primary.address, str(tmp_path / "n" / "journal"), packed, hot_grants=primary.grants)
        follower.stop()
        wait_for(lambda: followed(primary, fresh), what="a standby from the packed file to catch up")
        assert saved_state(packed) == saved_state(mine)
        assert journal_bytes(fresh.mirror.directory) == journal_bytes(primary.journal)
        rendered = rendered_by(primary, replies)
    finally:
        primary.stop()
    device = fresh.take_over()
    try:
        assert receipts_of(device, replies) == rendered
        assert device.checkpoint()["generation"] == generation + 2  # its copy goes on from the takeover's
    finally:
        device.close()


def test_a_standby_whose_copy_holds_another_profile_or_a_later_generation_is_refused(tiny_runtime, tmp_path):
    """A catch-up replaces saved state only: a copy whose profile differs is refused (its device
    was built from it), and so is a copy past the primary's generation (it may hold a checkpoint
    of a tail the primary never had); neither copy is changed."""
    from gpu_worker.storage import runtime_file_writer
    mine, other, ahead = copies(tiny_runtime, tmp_path, "p.aotxccir", "o.aotxccir", "a.aotxccir")
    profile = RuntimeFile.open(other).json("runtime_profile")
    runtime_file_writer.append(other, [("runtime_profile", "json", {**profile, "min_free_disk_bytes": 1})])
    for _ in range(3):
        runtime_file_writer.append(ahead, [("state/unrelated", "bytes", b"x")])
    primary = Primary(mine, tmp_path / "p", 4, sync=False).start()
    try:
        register_all(primary, primary.principals, 2)
        checkpoint(primary)
        checkpoint(primary)
        for path, why in ((other, "another model or profile"), (ahead, "past this primary's")):
            before = saved_state(path)
            follower = Follower(primary.address, path + ".journal", path)
            follower.thread.join(30)
            assert isinstance(follower.error, StandbyRefused) and why in str(follower.error), follower.error
            follower.mirror.close()
            assert saved_state(path) == before
    finally:
        primary.stop()


def test_a_catch_up_cut_short_refuses_a_takeover_and_is_done_again_on_the_next_link(tiny_runtime, tmp_path,
                                                                                    monkeypatch):
    """The catch-up's append to the copy fails (a full disk, here injected) after the journal copy
    was emptied: the journal says "catch-up", so a takeover of it is refused (it is not whole);
    the standby connects again, catches up, and follows: the marker says sync again. Nothing
    counts as acknowledged by the standby before its catch-up."""
    from gpu_worker.recovery import DeviceBootError
    from gpu_worker.replication import standby as standby_module
    from gpu_worker.replication.marker import read_mark
    mine, copy = copies(tiny_runtime, tmp_path, "p.aotxccir", "s.aotxccir")
    real_append, failing, release = standby_module.runtime_file_writer.append, threading.Event(), threading.Event()

    def append(path, components, **options):
        if "generation" in options and not failing.is_set():  # (the catch-up's, the first time)
            failing.set()
            release.wait(30)
            raise OSError(28, "No space left on device (injected)")
        return real_append(path, components, **options)

    monkeypatch.setattr(standby_module.runtime_file_writer, "append", append)
    primary = Primary(mine, tmp_path / "p", 8, sync=True).start()
    directory = str(tmp_path / "s" / "journal")
    try:
        save_alone(primary)  # (saved here alone until a standby has caught up)
        replies = register_all(primary, primary.principals, 2)
        checkpoint(primary)
        follower = Follower(primary.address, directory, copy, hot_grants=primary.grants)
        assert failing.wait(30)
        assert read_mark(directory) == "catch-up" and list_segments(directory, _fs()) == []
        state = primary.device.pipeline_state()["replication"]
        assert state["acked_seq"] == 0 and state["catching_up"] and state["catch_ups"] == 1
        kept = str(tmp_path / "kept")  # (the standby holds its journal's lock: a copy of it, as it is now)
        shutil.copytree(directory, kept)
        with pytest.raises(DeviceBootError, match="stopped while it caught up"):
            Device(RuntimeFile.open(copy), kept, Grants(primary.grants), takeover=True)
        release.set()
        wait_for(lambda: followed(primary, follower), what="the standby to catch up on its next link")
        assert read_mark(directory) == "sync" and saved_state(copy) == saved_state(mine)
        state = primary.device.pipeline_state()["replication"]
        assert not state["catching_up"] and state["catch_ups"] == 2
        rendered = rendered_by(primary, replies)
    finally:
        release.set()
        primary.stop()
    device = follower.take_over()
    try:
        assert receipts_of(device, replies) == rendered
    finally:
        device.close()


def test_a_standby_whose_journal_ends_before_the_primarys_segments_begins_it_again(tiny_runtime, tmp_path):
    """A copy of the runtime file as it is now, beside a journal the standby kept from long before
    (it ends two segments and more before the primary's oldest): the journal cannot go on where
    the primary's begins, so it is emptied and begins again there (nothing is appended to the copy,
    which is the primary's); the journal copy is the primary's byte for byte."""
    mine, copy = copies(tiny_runtime, tmp_path, "p.aotxccir", "s.aotxccir")
    primary = Primary(mine, tmp_path / "p", 12, sync=False).start()
    directory = str(tmp_path / "s" / "journal")
    try:
        follower = Follower(primary.address, directory, copy)
        register_all(primary, primary.principals[:4], 2)
        wait_for(lambda: caught_up(primary, follower), what="the standby to follow")
        follower.stop()
        for part in (primary.principals[4:8], primary.principals[8:]):
            register_all(primary, part, 2)
            checkpoint(primary)
        assert max(list_segments(directory, _fs())) < min(list_segments(primary.journal, _fs())) - 1
        shutil.copyfile(mine, copy)  # the file as it is now, the old journal
        generation = RuntimeFile.open(copy).generation
        follower = Follower(primary.address, directory, copy)
        wait_for(lambda: caught_up(primary, follower), what="the standby to begin its journal again")
        assert journal_bytes(directory) == journal_bytes(primary.journal)
        assert RuntimeFile.open(copy).generation == generation and saved_state(copy) == saved_state(mine)
    finally:
        primary.stop()
        follower.stop()


def test_a_catch_up_whose_link_breaks_halfway_is_sent_whole_again(tiny_runtime, tmp_path, monkeypatch):
    """The link breaks after the first piece of a catch-up came (that piece kept): the next link's
    catch-up sends every component again from its first byte, and the standby takes it whole
    (the half-received pieces of the broken link are dropped, not added to)."""
    from gpu_worker.replication import standby as standby_module
    real_piece, broke = standby_module.Standby._piece, []

    def piece(self, frame):
        real_piece(self, frame)
        if frame.catchup is not None and not broke:
            broke.append(frame.component)
            raise OSError("the link broke (injected)")

    monkeypatch.setattr(standby_module.Standby, "_piece", piece)
    mine, copy = copies(tiny_runtime, tmp_path, "p.aotxccir", "s.aotxccir")
    primary = Primary(mine, tmp_path / "p", 6, sync=False).start()
    try:
        register_all(primary, primary.principals, 2)
        checkpoint(primary)
        follower = Follower(primary.address, str(tmp_path / "s" / "journal"), copy)
        wait_for(lambda: caught_up(primary, follower), what="the standby to catch up on its next link")
        assert broke and saved_state(copy) == saved_state(mine)
    finally:
        primary.stop()
        follower.stop()


def test_a_standby_from_the_packed_file_catches_up_with_the_media_a_checkpoint_holds(tiny_runtime, tmp_path):
    """A media source uploaded and folded by a checkpoint (its `media/<sha256>` component) before
    a new standby, made from the file as packed, connects: the catch-up puts the component in the
    standby's copy, the link puts the file in its journal's media/, and the device that takes over
    has the source, not missing."""
    import hashlib
    mine, copy = copies(tiny_runtime, tmp_path, "p.aotxccir", "s.aotxccir")
    primary = Primary(mine, tmp_path / "p", 1, sync=True).start()
    data = os.urandom(3 << 20)  # (more than one piece)
    sha = hashlib.sha256(data).hexdigest()
    principal = primary.principals[0]
    try:
        save_alone(primary)  # (saved here alone until a standby has caught up)
        register_all(primary, [principal], 1)
        with primary.connect() as sock:
            got = call(sock, encode_frame({"v": 1, "id": 1, "op": "media.put", "principal": principal.hex(),
                                           "args": {"sha256": sha, "data": data, "type": "image"}}))
        assert got["status"] == 201, got
        checkpoint(primary)
        assert RuntimeFile.open(mine).has(f"media/{sha}")
        follower = Follower(primary.address, str(tmp_path / "s" / "journal"), copy, hot_grants=primary.grants)
        wait_for(lambda: followed(primary, follower), what="a standby from the packed file to catch up")
        assert saved_state(copy) == saved_state(mine) and bytes(RuntimeFile.open(copy).bytes(f"media/{sha}")) == data
        with open(os.path.join(follower.mirror.directory, "media", sha), "rb") as f:
            assert f.read() == data
    finally:
        primary.stop()
    device = follower.take_over()
    try:
        assert list(device.state.media) == [sha] and not device.state.media[sha].missing
    finally:
        device.close()


# ---- issue 52: in sync only once it holds what was saved; saving alone recorded first; the
# leadership generation on every frame; a dead link noticed; the bytes handed to the disk; a
# standby whose disk fails stops --------------------------------------------------------------------

class FakeLeadership:
    """What a Shipper asks of its etcd Leadership: the generation, and the sync key's writes
    (`records`); recording "no standby" fails until `allow` is set (etcd unreachable)."""

    def __init__(self, generation=7):
        self.generation = generation
        self.records = []
        self.allow = threading.Event()

    def fenced(self):
        return None

    def record_sync(self, member):
        self.records.append(member)
        if member is None and not self.allow.is_set():
            from gpu_worker.replication.lease import LeadershipError
            raise LeadershipError("etcd unreachable")


def test_a_standby_is_in_sync_only_once_it_holds_what_the_primary_had_saved(tiny_runtime, tmp_path, monkeypatch):
    """(1) The standby wrote "sync" into DIR/standby as the replication frame arrived, before the
    backlog it lacked: a replacement with an empty journal was promotable while it held nothing."""
    from gpu_worker.replication.marker import read_mark
    primary = Primary(tiny_runtime, tmp_path / "p", 12, sync=True, alone_after=0).start()  # saves alone at once
    follower = None
    try:
        assert {r["status"] for r in register_all(primary, primary.principals, 2).values()} == {202}
        directory = str(tmp_path / "s" / "journal")
        arrived, gate = threading.Event(), threading.Event()
        write = Mirror.write

        def held_back(self, *args):
            arrived.set()
            assert gate.wait(30)
            return write(self, *args)
        monkeypatch.setattr(Mirror, "write", held_back)
        follower = Follower(primary.address, directory, tiny_runtime)
        assert arrived.wait(30)  # the replication frame came, then the first of what it lacks
        assert read_mark(directory) == "catching-up" and not follower.standby.in_sync.is_set()
        assert not primary.shipper.state()["in_sync"]
        gate.set()
        wait_for(lambda: read_mark(directory) == "sync" and primary.shipper.state()["in_sync"]
                 and caught_up(primary, follower), what="the standby to be in sync")
    finally:
        primary.stop()
        if follower is not None:
            follower.stop()


def test_a_takeover_of_a_catching_up_journal_is_refused(tiny_runtime, tmp_path):
    from gpu_worker.recovery import DeviceBootError
    from gpu_worker.replication.marker import write_marker
    primary = Primary(tiny_runtime, tmp_path / "p", 4, sync=True).start()
    follower = Follower(primary.address, str(tmp_path / "s" / "journal"), tiny_runtime)
    try:
        register_all(primary, primary.principals, 2)
        wait_for(lambda: caught_up(primary, follower), what="the standby to follow")
    finally:
        primary.stop()
        follower.stop()
    directory = follower.mirror.directory
    doc = json.loads(open(os.path.join(directory, "standby")).read())
    write_marker(directory, {**doc, "replication": "catching-up"})
    shutil.copy(primary.grants, tmp_path / "grants.json")
    with pytest.raises(DeviceBootError, match="had not yet acknowledged everything"):
        Device(RuntimeFile.open(tiny_runtime), directory, Grants(str(tmp_path / "grants.json")), takeover=True)


def test_what_a_standby_held_before_a_restart_stays_held_when_the_primary_then_saves_alone(tmp_path):
    """The REPLICATION transfer of a primary that saves alone after a restart said "alone from
    transfer 1" (no standby had acknowledged anything in this boot): a replay marked what the
    standby had held before the restart alone, unlike the live tables; a checkpoint, which folds a
    replayed state beside the ticks, turned those receipts' "standby": true into false."""
    from gpu_worker.pack import pack_tiny
    runtime = str(tmp_path / "own.aotxccir")
    pack_tiny(runtime, shared=True)
    (copy,) = copies(runtime, tmp_path, "s.aotxccir")
    primary = Primary(runtime, tmp_path / "p", 8, sync=True).start()
    follower = Follower(primary.address, str(tmp_path / "s" / "journal"), copy)
    try:
        held = register_all(primary, primary.principals[:4], 2)
        wait_for(lambda: caught_up(primary, follower), what="the standby to follow")
    finally:
        follower.stop()
        primary.stop()
    primary.address = os.path.join(tempfile.mkdtemp(prefix="aotx-repl-"), "replication.sock")  # (stop removed it)
    primary.start()
    try:
        save_alone(primary)
        alone = register_all(primary, primary.principals[4:], 2)
        with primary.connect() as sock:
            live = receipts_of(sock, {**held, **alone})
    finally:
        primary.stop()
    standby = {p: json.loads(body)["admission"]["save"]["standby"] for p, body in live.items()}
    assert {standby[p] for p in held} == {True} and {standby[p] for p in alone} == {False}
    assert receipts_after_restart(runtime, primary, {**held, **alone}) == live


def test_a_primary_saves_alone_only_once_etcd_records_that_no_standby_may_take_over(tiny_runtime, tmp_path):
    """(2) With --standby-timeout the primary saved alone after S seconds while its standby, still
    marked sync, could take over and lose it. The sync key is cleared first now."""
    leadership = FakeLeadership()
    primary = Primary(tiny_runtime, tmp_path / "p", 2, sync=True, alone_after=0.1, leadership=leadership).start()
    follower = None
    try:
        sock = primary.connect()
        sock.sendall(primary.register_frame(primary.principals[0], 1))
        wait_for(lambda: leadership.records.count(None) >= 2, what="the primary to try to record it saves alone")
        assert select.select([sock], [], [], 0)[0] == [] and not primary.shipper.alone  # it holds meanwhile
        leadership.allow.set()  # etcd answers: the sync key names no standby
        sock.settimeout(30)
        (n,) = LENGTH.unpack(_exactly(sock, 4))
        assert decode_payload(_exactly(sock, n))["status"] == 202 and primary.shipper.alone
        sock.close()
        follower = Follower(primary.address, str(tmp_path / "s" / "journal"), tiny_runtime)
        wait_for(lambda: leadership.records[-1] == follower.standby.member and not primary.shipper.alone,
                 what="the standby in sync to be named in the sync key")
    finally:
        primary.stop()
        if follower is not None:
            follower.stop()


def test_a_standby_never_follows_an_older_leadership_and_a_primary_never_streams_to_a_newer_ones_standby(
        tiny_runtime, tmp_path):
    """(4) A standby accepted frames from any primary: a fenced old primary could still feed it."""
    from gpu_worker.replication.marker import write_marker
    primary = Primary(tiny_runtime, tmp_path / "p", 1, sync=True, leadership=FakeLeadership(3)).start()
    try:
        with socket.socket(socket.AF_UNIX) as sock:  # a standby that followed generation 5 says hello
            sock.connect(primary.address)
            sock.sendall(encode_frame({"hello": 1, "incarnation": RuntimeFile.open(tiny_runtime).incarnation,
                                       "generation": 1, "components": {}, "segment": 0, "offset": 0,
                                       "digest": b"\0" * 32, "member": "m" * 32, "leader": 5}))
            sock.settimeout(10)
            (n,) = LENGTH.unpack(_exactly(sock, 4))
            answer = decode_payload(_exactly(sock, n))
        assert answer["again"] is True and "generation 5, newer than this primary's 3" in answer["refused"]
    finally:
        primary.stop()
    # the standby's side: a primary of generation 3 streaming to a copy that followed 5
    directory = str(tmp_path / "s2" / "journal")
    os.makedirs(directory)
    write_marker(directory, {"replication": "sync", "leader": 5, "member": "a" * 32, "takeovers": []})
    address = os.path.join(tempfile.mkdtemp(prefix="aotx-old-"), "old.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(1)
    follower = Follower(address, directory, tiny_runtime)
    try:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            frames = read_frames(conn, FrameReader())
            assert frames[0]["leader"] == 5
            conn.sendall(encode_frame({"replication": "sync", "cut": 0, "takeovers": [], "sync_at": [0, 0], "g": 3}))
            assert conn.recv(1 << 16) == b""  # it hangs up without an acknowledgement
        assert follower.standby.acks == 0 and json.loads(open(os.path.join(directory, "standby")).read())["leader"] == 5
    finally:
        follower.stop()
        listener.close()


class Blackhole:
    """A Unix-socket proxy between a standby and its primary that can stop forwarding both ways
    without closing anything (a silent partition), and forward again."""

    def __init__(self, target):
        self.target = target
        self.address = os.path.join(tempfile.mkdtemp(prefix="aotx-hole-"), "hole.sock")
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(self.address)
        self.listener.listen(4)
        self.open = threading.Event()
        self.open.set()
        self.pairs = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open.is_set():
                self.pairs.append((client, None))  # accepted, never answered: as a partition does
                continue
            server = socket.socket(socket.AF_UNIX)
            server.connect(self.target)
            self.pairs.append((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a, b):
        try:
            while data := a.recv(1 << 16):
                self.open.wait()  # a silent partition: bytes stop, nothing closes
                b.sendall(data)
        except OSError:
            pass

    def close(self):
        self.open.set()
        self.listener.close()
        for pair in self.pairs:
            for sock in pair:
                if sock is not None:
                    sock.close()


def test_a_silent_partition_is_noticed_within_the_link_timeout_and_the_standby_comes_back(tiny_runtime, tmp_path):
    """(5) No heartbeat, no timeout: both ends blocked for as long as TCP took to give up; a
    standby that connected again was refused "already connected" and exited."""
    primary = Primary(tiny_runtime, tmp_path / "p", 8, sync=True, dead_after=0.6).start()
    hole = Blackhole(primary.address)
    follower = Follower(hole.address, str(tmp_path / "s" / "journal"), tiny_runtime, dead_after=0.6)
    try:
        assert {r["status"] for r in register_all(primary, primary.principals[:4], 2).values()} == {202}
        hole.open.clear()  # the partition: no byte crosses, no connection ends
        wait_for(lambda: primary.shipper.state()["standby"] is None and not follower.standby.connected.is_set(),
                 10, what="both ends to notice the dead link")
        hole.open.set()  # healed: the standby connects again, and is taken
        assert {r["status"] for r in register_all(primary, primary.principals[4:], 2).values()} == {202}
        assert follower.error is None
    finally:
        primary.stop()
        follower.stop()
        hole.close()


def test_a_hello_is_checked_against_the_bytes_handed_to_the_disk_not_only_the_file(tiny_runtime, tmp_path):
    """(6) A tick still being written on a slow disk may already be acknowledged by the standby: its
    hello holds more of the segment than the file, which must not count as "not a copy"."""
    import hashlib
    from gpu_worker.replication.copies import not_a_copy, not_handed
    from gpu_worker.replication.primary_link import Link
    primary = Primary(tiny_runtime, tmp_path / "p", 2, sync=False).start()
    a, b = socket.socketpair()
    try:
        register_all(primary, primary.principals, 1)
        segment = primary.position()[0]
        data = open(os.path.join(primary.journal, segment_name(segment)), "rb").read()
        in_flight = b"the next tick, on its way to the disk"
        end = len(data) + len(in_flight)
        journal = primary.shipper.journal_dir
        link = Link(primary.shipper, a, (segment, end))
        assert not_a_copy(journal, link, segment, end, hashlib.sha256(data + in_flight).digest()) is None
        assert link.check is not None  # the rest is checked on the tick thread, with the ticks in flight
        assert not_handed(journal, link.check, segment, [(len(data), in_flight)]) is None
        other = Link(primary.shipper, b, (segment, end))
        not_a_copy(journal, other, segment, end, hashlib.sha256(data + b"x" * len(in_flight)).digest())
        assert "differ" in not_handed(journal, other.check, segment, [(len(data), in_flight)])
        assert "handed" in not_handed(journal, other.check, segment, [])  # more than was handed: not a copy
    finally:
        a.close()
        b.close()
        primary.stop()


def test_a_standby_whose_fdatasync_fails_stops_and_acknowledges_nothing_more(tiny_runtime, tmp_path, monkeypatch):
    """(7) An fsync error was retried as a link error, and a later fdatasync could succeed and
    acknowledge bytes the kernel had dropped."""
    import errno
    from gpu_worker.replication.mirror import StandbyDiskError
    primary = Primary(tiny_runtime, tmp_path / "p", 4, sync=True).start()
    follower = Follower(primary.address, str(tmp_path / "s" / "journal"), tiny_runtime)
    try:
        register_all(primary, primary.principals[:2], 1)
        wait_for(lambda: caught_up(primary, follower), what="the standby to follow")
        directory = os.path.realpath(follower.mirror.directory)
        real = os.fdatasync

        def failing(fd):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(directory):
                raise OSError(errno.EIO, "Input/output error")
            return real(fd)
        monkeypatch.setattr(os, "fdatasync", failing)
        acks = follower.standby.acks
        sock = primary.connect()
        sock.sendall(primary.register_frame(primary.principals[2], 1))
        wait_for(lambda: isinstance(follower.error, StandbyDiskError), what="the standby to stop on its disk error")
        assert follower.standby.acks == acks and "fdatasync failed" in str(follower.error)
        assert select.select([sock], [], [], 0)[0] == []  # never answered saved
        sock.close()
    finally:
        monkeypatch.undo()
        primary.stop()
        follower.thread.join(30)
        follower.mirror.close()


def test_receipts_say_whether_a_standby_held_them_and_a_restart_and_a_takeover_say_the_same(
        tiny_runtime, tmp_path):
    """(2) Receipts say in their save fields whether a standby held the transfer: saved alone
    (--standby-timeout) "standby": false, held by the sync standby true. The journal says when the
    primary began and stopped saving alone (REPLICATION transfers), so a restart's replay and the
    standby that takes over render every receipt byte for byte as it was given."""
    primary = Primary(tiny_runtime, tmp_path / "p", 12, sync=True, alone_after=0).start()
    follower = None
    try:
        wait_for(lambda: primary.shipper.alone, what="the primary to save alone")
        alone = register_all(primary, primary.principals[:6], 2)
        follower = Follower(primary.address, str(tmp_path / "s" / "journal"), tiny_runtime,
                            hot_grants=primary.grants)
        wait_for(lambda: followed(primary, follower) and not primary.shipper.alone, what="the standby in sync")
        held = register_all(primary, primary.principals[6:], 2)
        wait_for(lambda: followed(primary, follower), what="the standby to apply everything")
        rendered = rendered_by(primary, {**alone, **held})
    finally:
        primary.stop()
    try:
        saves = {p: json.loads(body)["admission"]["save"]["standby"] for p, body in rendered.items()}
        assert {saves[p] for p in alone} == {False} and {saves[p] for p in held} == {True}
        assert receipts_after_restart(tiny_runtime, primary, {**alone, **held}) == rendered
        device = follower.take_over()
        assert receipts_of(device, {**alone, **held}) == rendered
    finally:
        follower.device.close()
        follower.mirror.close()


def test_a_link_between_machines_is_tls_with_a_certificate_on_both_sides(tiny_runtime, tmp_path):
    """(8) The replication link was clear text without authentication. Over TCP it is TLS 1.3 now,
    each side's certificate signed by the cluster's CA: a standby without one gets nothing."""
    from gpu_worker.replication import tls
    from tests.conftest import free_port
    tls.make(str(tmp_path / "certs"), ["a", "b"])
    tls.make(str(tmp_path / "other"), ["x"])  # another cluster's CA
    primary = Primary(tiny_runtime, tmp_path / "p", 8, sync=True, address=f"127.0.0.1:{free_port()}",
                      tls=tls.context(str(tmp_path / "certs" / "a"), True)).start()
    stranger = Follower(primary.address, str(tmp_path / "x" / "journal"), tiny_runtime,
                        tls=tls.context(str(tmp_path / "other" / "x"), False))
    follower = None
    try:
        with socket.create_connection(("127.0.0.1", int(primary.address.rsplit(":", 1)[1])), timeout=10) as clear:
            clear.sendall(encode_frame({"hello": 1}))  # in clear: no answer but the end of the connection
            assert clear.recv(1 << 16)[:1] in (b"", b"\x15")  # (nothing, or a TLS alert)
        wait_for(lambda: stranger.standby.failures >= 2, what="the stranger's links to fail")
        assert not stranger.standby.connected.is_set() and stranger.standby.acks == 0
        stranger.stop()
        follower = Follower(primary.address, str(tmp_path / "b" / "journal"), tiny_runtime,
                            tls=tls.context(str(tmp_path / "certs" / "b"), False))
        assert {r["status"] for r in register_all(primary, primary.principals, 2).values()} == {202}
        wait_for(lambda: caught_up(primary, follower), what="the standby to follow over TLS")
    finally:
        primary.stop()
        if follower is not None:
            follower.stop()
    assert journal_bytes(follower.mirror.directory) == journal_bytes(primary.journal)


def test_boot_refuses_a_link_over_tcp_without_tls(tiny_runtime, tmp_path):
    from gpu_worker.recovery import boot
    code = boot.main(["--ccir", tiny_runtime, "--journal", str(tmp_path / "j"), "--service-grants",
                      str(tmp_path / "g.json"), "--replicate", "127.0.0.1:7001"])
    assert code == 2


def test_a_checkpoint_beside_the_ticks_reads_the_same_on_a_hot_standby_that_follows_or_catches_up(tmp_path,
                                                                                                monkeypatch):
    """Registrations saved while a checkpoint folds beside the ticks keep the save fields they were
    given (the generation before the checkpoint's), those after carry the new one: on the primary,
    and on the device a hot standby becomes, whether it followed the checkpoint through or caught
    up from the primary's file after it."""
    from gpu_worker.pack import pack_tiny
    runtime = str(tmp_path / "own.aotxccir")
    pack_tiny(runtime, shared=True)
    through, behind = copies(runtime, tmp_path, "through.aotxccir", "behind.aotxccir")
    primary = Primary(runtime, tmp_path / "p", 30, sync=True).start()
    followed_through = Follower(primary.address, str(tmp_path / "t" / "journal"), through, hot_grants=primary.grants)
    started, gate = gated_fold(monkeypatch)
    try:
        replies = register_all(primary, primary.principals[:10], 2)
        wait_for(lambda: followed(primary, followed_through), what="the standby to follow")
        asked = primary.connect()
        asked.sendall(encode_frame({"v": 1, "id": 1, "op": "checkpoint", "principal": None, "args": {}}))
        assert started.wait(60)
        during = register_all(primary, primary.principals[10:20], 2)
        gate.set()
        assert answered(asked)["status"] == 200
        asked.close()
        after = register_all(primary, primary.principals[20:], 2)
        replies.update(during)
        replies.update(after)
        generations = {p: json.loads(r["body"])["admission"]["save"]["generation"] for p, r in replies.items()}
        assert {generations[p] for p in during} == {"1"} and {generations[p] for p in after} == {"2"}
        wait_for(lambda: followed(primary, followed_through), what="the standby to follow")
        with primary.connect() as sock:
            rendered = receipts_of(sock, replies)
        device = followed_through.take_over()  # (the primary streams to one standby at a time)
        try:
            assert receipts_of(device, replies) == rendered
        finally:
            device.close()
        caught_up_later = Follower(primary.address, str(tmp_path / "b" / "journal"), behind,
                                   hot_grants=primary.grants)
        wait_for(lambda: followed(primary, caught_up_later), what="the late standby to catch up")
    finally:
        primary.stop()
    device = caught_up_later.take_over()
    try:
        assert receipts_of(device, replies) == rendered
    finally:
        device.close()


def test_an_admission_appended_before_a_checkpoints_end_and_saved_after_it_keeps_the_generation_before(
        tmp_path, monkeypatch):
    """A sync primary's registrations durable here, waiting for a standby, while a checkpoint
    folding beside the ticks ends: their saves came after the checkpoint's end but their transfers
    before its CHECKPOINT transfer, so a replay gives them the generation before. The live tables
    gave them the new one (the generation switched when the checkpoint ended, not when its
    CHECKPOINT transfer was saved): a restart read them otherwise than their clients were told."""
    from gpu_worker.pack import pack_tiny
    runtime = str(tmp_path / "own.aotxccir")
    pack_tiny(runtime, shared=True)
    first, second = copies(runtime, tmp_path, "first.aotxccir", "second.aotxccir")
    primary = Primary(runtime, tmp_path / "p", 20, sync=True).start()
    follower = Follower(primary.address, str(tmp_path / "s1" / "journal"), first)
    started, gate = gated_fold(monkeypatch)
    try:
        replies = register_all(primary, primary.principals[:8], 2)
        wait_for(lambda: caught_up(primary, follower), what="the standby to follow")
        asked = primary.connect()
        asked.sendall(encode_frame({"v": 1, "id": 1, "op": "checkpoint", "principal": None, "args": {}}))
        assert started.wait(60)
        follower.stop()  # the registrations below wait for a standby
        waiting = primary.principals[8:12]
        socks = held_registrations(primary, waiting)
        gate.set()
        assert answered(asked)["status"] == 200
        asked.close()
        follower = Follower(primary.address, str(tmp_path / "s2" / "journal"), second)
        for principal, sock in zip(waiting, socks):
            replies[principal] = answered(sock)
            sock.close()
        replies.update(register_all(primary, primary.principals[12:], 2))
        generations = {p: json.loads(r["body"])["admission"]["save"]["generation"] for p, r in replies.items()}
        assert {generations[p] for p in waiting} == {"1"} and {generations[p] for p in primary.principals[12:]} == {"2"}
        with primary.connect() as sock:
            rendered = receipts_of(sock, replies)
    finally:
        follower.stop()
        primary.stop()
    assert receipts_after_restart(runtime, primary, replies) == rendered
