"""The committer's tick pipeline on a real journal, with a stand-in for the device: a batch is
answered only once every transfer it appended is saved, the same whether the I/O runs here or on
a tick I/O thread, and a command waiting for the queue to drain runs only then."""
import collections
import errno

from gpu_worker.storage.committer import Batch, Committer
from gpu_worker.storage.filelayer import OsFileLayer
from gpu_worker.storage.journal import TransferKind
from gpu_worker.storage.journal_reader import recover
from gpu_worker.storage.journal_writer import JournalWriter

INCARNATION = b"\7" * 16


class Owner:
    """Appends one 200-byte transfer (2 records) per command and answers with the command."""

    def __init__(self):
        self.committer = None
        self.saved_seqs = []
        self.refused = []

    def gather(self, inbox, batch):
        for _ in range(8):  # a tick's 16 records
            if not inbox:
                return
            conn, msg = inbox.popleft()
            seq = self.committer.writer.append(TransferKind.ADMISSION, bytes(200))
            batch.waiting.append((conn, msg["id"], 202, seq))

    def answer(self, batch):
        return batch.replies + [(conn, {"id": req_id, "seq": seq}) for conn, req_id, _, seq in batch.waiting]

    def saved(self, transfers):
        self.saved_seqs += [t.seq for t in transfers]

    def refuse_unsaved(self, err, batches):
        """As the device does: nothing unsaved survives; continue on what the journal holds."""
        self.refused.append(err.errno)
        self.committer.writer.close()
        self.committer.writer = new_writer(self.directory)
        return [(conn, {"id": req_id, "refused": True}) for batch in batches for conn, req_id, _, _ in batch.waiting]

    def read(self, msg):
        return {"id": msg["id"], "drained": self.committer.writer.queued_records == 0}

    def drained(self, conn, msg):
        return self.read(msg)


def new_writer(directory):
    return JournalWriter(directory, OsFileLayer(), INCARNATION, recover(directory, OsFileLayer(), INCARNATION))


def committer(tmp_path):
    owner = Owner()
    owner.directory = str(tmp_path / "journal")
    (tmp_path / "journal").mkdir()
    owner.committer = Committer(owner, new_writer(owner.directory))
    return owner, owner.committer


def inbox(n, first=1):
    return collections.deque(("c", {"id": i}) for i in range(first, first + n))


def test_run_here_every_batch_is_answered_after_its_saves_in_request_order(tmp_path):
    owner, c = committer(tmp_path)
    queue = inbox(20)
    replies = []
    while queue:
        replies += c.run_sync(queue)
    assert [msg["id"] for _, msg in replies] == list(range(1, 21))
    assert owner.saved_seqs == list(range(1, 21)) and c.writer.durable_seq == 20 and not c.batches
    c.writer.close()


class ScriptedSyncer:
    def __init__(self, results):
        self.results = collections.deque(results)
        self.requests = []

    def request(self, fd, data):
        self.requests.append(len(data))

    def result(self):
        return self.results.popleft()

    def fileno(self):
        return -1


def test_on_the_tick_thread_two_ticks_wait_and_nothing_is_answered_before_its_save(tmp_path):
    owner, c = committer(tmp_path)
    syncer = ScriptedSyncer([0, 0])
    c.attach(syncer)
    queue = inbox(24)
    assert c.tick(queue) == []               # 8 commands, 16 records: handed to the I/O thread
    assert c.tick(queue) == []               # a whole tick's worth waits: a second tick queued behind it
    assert c.writer.ticks_in_flight == 2 and syncer.requests == [8 * (2 * 32 + 200)] * 2 and len(queue) == 8
    assert c.gather_waits(len(queue)) is True  # the rest waits for the disk
    first = c.synced()
    assert [msg["id"] for _, msg in first] == list(range(1, 9)) and owner.saved_seqs == list(range(1, 9))
    second = c.synced()
    assert [msg["id"] for _, msg in second] == list(range(9, 17)) and c.writer.ticks_in_flight == 0
    c.writer.close()


def test_while_a_tick_is_on_the_disk_commands_wait_and_are_gathered_together_when_it_ends(tmp_path):
    owner, c = committer(tmp_path)
    gathers = []
    gather = owner.gather
    owner.gather = lambda queue, batch: (gathers.append(len(queue)), gather(queue, batch))
    syncer = ScriptedSyncer([0, 0])
    c.attach(syncer)
    queue = inbox(1)
    c.tick(queue)                            # the device was idle: gathered at once, on the disk
    assert gathers == [1] and c.writer.ticks_in_flight == 1
    for i in range(2, 6):                    # four more arrive one by one while it is there
        queue.append(("c", {"id": i}))
        assert c.gather_waits(len(queue)) is True and c.tick(queue) == []
    assert gathers == [1] and len(queue) == 4 and c.writer.untaken_records == 0
    assert [msg["id"] for _, msg in c.synced()] == [1]
    assert c.gather_waits(len(queue)) is False
    c.tick(queue)                            # one gather for the four, one tick on the disk
    assert gathers == [1, 4] and not queue and syncer.requests == [2 * 32 + 200, 4 * (2 * 32 + 200)]
    assert [msg["id"] for _, msg in c.synced()] == [2, 3, 4, 5]
    c.writer.close()


def test_a_failed_tick_ends_the_one_behind_it_and_enospc_refuses_both_batches(tmp_path):
    owner, c = committer(tmp_path)
    c.attach(ScriptedSyncer([errno.ENOSPC, errno.ECANCELED]))
    queue = inbox(24)
    c.tick(queue)
    c.tick(queue)  # (a whole tick's worth waits: queued behind the first)
    replies = c.synced()
    assert owner.refused == [errno.ENOSPC] and all(msg["refused"] for _, msg in replies) and len(replies) == 16
    assert owner.saved_seqs == [] and not c.batches and c.writer.ticks_in_flight == 0
    assert c.writer.next_seq == 1  # the refused transfers are gone with their batches
    c.writer.close()


def test_a_command_waiting_for_the_queue_to_drain_runs_only_once_it_is_empty(tmp_path):
    owner, c = committer(tmp_path)
    syncer = ScriptedSyncer([0])
    c.attach(syncer)
    c.tick(inbox(3))
    c.when_drained("ops", {"id": 99})
    assert c.gather_waits(16) is True        # nothing is gathered while it waits
    replies = c.synced()
    assert replies[-1] == ("ops", {"id": 99, "drained": True})
    assert c.gather_waits(0) is False
    c.writer.close()


def test_records_appended_between_ticks_reach_the_disk_although_gathering_waits_for_them(tmp_path):
    """Issue 35's stall: transfers appended between ticks (helper threads' results) pass a whole
    tick's worth while nothing is on the disk. Gathering then waits for the disk, and only a tick
    can start the disk: io_waits says so, and tick() moves the pipeline without gathering."""
    owner, c = committer(tmp_path)
    syncer = ScriptedSyncer([0, 0])
    c.attach(syncer)
    for _ in range(8):                       # 16 records, appended outside any tick
        c.writer.append(TransferKind.MEMORY, bytes(200))
    queue = inbox(1)
    assert c.gather_waits(len(queue)) is True and c.io_waits() is True
    assert c.tick(queue) == [] and syncer.requests == [8 * (2 * 32 + 200)] and len(queue) == 1
    assert c.io_waits() is False             # on the disk: its end (synced) moves the pipeline next
    c.synced()
    assert c.gather_waits(len(queue)) is False
    c.tick(queue)
    assert [msg["id"] for _, msg in c.synced()] == [1]
    c.writer.close()


def test_a_drain_waiter_behind_records_appended_between_ticks_is_answered(tmp_path):
    """A checkpoint waiting for the queue to drain keeps gathering waiting; records appended
    between ticks behind it must still be sent to the disk by the next tick, then it runs."""
    owner, c = committer(tmp_path)
    c.attach(ScriptedSyncer([0]))
    c.writer.append(TransferKind.MEMORY, bytes(200))
    c.when_drained("ops", {"id": 99})
    assert c.gather_waits(0) is True and c.io_waits() is True
    assert c.tick(collections.deque()) == [] and c.writer.ticks_in_flight == 1
    assert c.synced() == [("ops", {"id": 99, "drained": True})]
    c.writer.close()
