"""The tick loop (server.py) with its native socket and tick I/O threads, run for real on a
thread: pipelined ticks, checkpoints under load, a full disk, backpressure, bad frames."""
import collections
import errno
import json
import os
import secrets
import select
import socket
import threading
import time

import pytest

from bench.journal import registration_frame
from gpu_worker.device import Device
from gpu_worker.storage.filelayer import FaultyFileLayer, OsFileLayer
from gpu_worker.contract.grantfile import Grants
from gpu_worker.pack import pack_tiny
from gpu_worker.contract.wire import LENGTH, decode_payload, encode_frame
from gpu_worker.storage.journal import list_segments
from gpu_worker.storage.runtime_file import RuntimeFile
from gpu_worker.loop import server as server_module
from gpu_worker import native
from gpu_worker.loop.server import Server
from tests.conftest import ALL, wait_for, write_grants


class LiveDevice:
    """A Device served by a real Server on a thread; clients talk to DIR/service.sock."""

    def __init__(self, runtime, tmp_path, n_principals, fs=None, **server_options):
        self.runtime, self.tmp_path, self.fs = runtime, tmp_path, fs
        self.server_options = server_options
        self.device_options: dict = {}  # Device keywords (a takeover)
        self.principals = [secrets.token_bytes(16) for _ in range(n_principals)]
        self.grants = str(tmp_path / "grants.json")
        self.journal = str(tmp_path / "journal")
        self.device = self.server = self.thread = None

    def start(self):
        if not os.path.exists(self.grants):  # a restart keeps the grant file it booted with
            write_grants(self.grants, {p.hex(): ALL for p in self.principals})
        self.device = Device(RuntimeFile.open(self.runtime), self.journal, Grants(self.grants),
                             fs=self.fs or OsFileLayer(), **self.device_options)
        self.server = Server(self.device, os.path.join(self.journal, "service.sock"), **self.server_options)
        self.device.deliver = self.server.deliver  # as boot does: helper threads answer through the loop
        ready = threading.Event()
        self.thread = threading.Thread(target=self.server.run, kwargs={"on_ready": ready.set}, daemon=True)
        self.thread.start()
        assert ready.wait(30)
        return self

    def stop(self):
        self.server.stop()
        self.thread.join(30)
        self.device.close()
        assert self.server.failure is None

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(self.server.socket_path)
        s.settimeout(30)
        return s

    def register_frame(self, principal, req_id):
        return registration_frame(self.device.state.participants.lineage_of(principal).hex(), principal, req_id)


def call(sock, frame):
    sock.sendall(frame)
    (n,) = LENGTH.unpack(_exactly(sock, 4))
    return decode_payload(_exactly(sock, n))


def _exactly(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "device closed the connection"
        data += chunk
    return data


def register_all(live, principals, clients, replies=None):
    """Closed-loop clients registering `principals`; returns {principal: reply} (`replies`, when
    given, filled in as the replies come)."""
    replies = {} if replies is None else replies
    queue, lock = collections.deque(principals), threading.Lock()

    def client():
        sock = live.connect()
        with sock:
            while True:
                with lock:
                    if not queue:
                        return
                    principal = queue.popleft()
                replies[principal] = call(sock, live.register_frame(principal, len(replies) + 1))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return replies


def registered_after_restart(live):
    """{principal: receipt} of every participant the journal holds, read by a fresh device."""
    device = Device(RuntimeFile.open(live.runtime), live.journal, Grants(live.grants))
    try:
        out = {}
        for principal in live.principals:
            inbox = collections.deque([("c", {"v": 1, "id": 1, "op": "operations.list", "principal": principal.hex(),
                                               "args": {}})])
            [(_, msg)] = device.committer.run_sync(inbox)
            items = json.loads(msg.body)["items"]
            if items:
                out[principal] = items
        return out
    finally:
        device.close()


def test_concurrent_registrations_are_saved_before_their_replies(tiny_runtime, tmp_path):
    live = LiveDevice(tiny_runtime, tmp_path, 200).start()
    try:
        replies = register_all(live, live.principals, 16)
    finally:
        live.stop()
    assert {r["status"] for r in replies.values()} == {202}
    saved = registered_after_restart(live)  # a restart: the same grant file
    assert set(saved) == set(live.principals)
    for principal, reply in replies.items():
        assert saved[principal] == [json.loads(reply["body"])]  # byte-identical after the restart


def test_a_slow_media_write_runs_off_the_tick_thread_and_others_are_served_meanwhile(tiny_runtime, tmp_path,
                                                                                     monkeypatch):
    """An upload's hashing and writing (proportional to its size) never holds the tick thread:
    while one is stuck on the disk, another client registers and reads."""
    import hashlib

    from gpu_worker.kinds import media
    release, started, threads = threading.Event(), threading.Event(), []
    store = media._store

    def slow_store(*args):
        threads.append(threading.current_thread().name)
        started.set()
        assert release.wait(30)
        return store(*args)
    monkeypatch.setattr(media, "_store", slow_store)
    live = LiveDevice(tiny_runtime, tmp_path, 2).start()
    try:
        uploader, other = live.principals
        with live.connect() as a, live.connect() as b:
            assert call(a, live.register_frame(uploader, 1))["status"] == 202
            data = b"\x89PNG" * 100
            a.sendall(encode_frame({"v": 1, "id": 2, "op": "media.put", "principal": uploader.hex(),
                                    "args": {"sha256": hashlib.sha256(data).hexdigest(), "data": data,
                                             "type": "image"}}))
            assert started.wait(30)
            assert call(b, live.register_frame(other, 3))["status"] == 202  # served while the upload waits
            release.set()
            (n,) = LENGTH.unpack(_exactly(a, 4))
            assert decode_payload(_exactly(a, n))["status"] == 201
    finally:
        release.set()
        live.stop()
    assert threads == ["aotx-off-tick"]


def test_records_queued_between_ticks_reach_the_disk_even_past_a_whole_tick(tiny_runtime, tmp_path):
    """The stall of issue 35: helper-thread results that append journal transfers (a memory row with
    its embedding is ~10 records) arrive together while no tick is on the disk. Once a whole
    tick's worth (16 records) waits, gathering waits for the disk; the loop must still send those
    records there, or nothing ever wakes it again and every command behind them (here a
    registration) waits for good."""
    live = LiveDevice(tiny_runtime, tmp_path, 1).start()
    device = live.device

    def hold(event):  # a ~1,400-byte HOLD transfer: 10 records, replayable
        return lambda: device._journal_hold({"event": event, "cause": "low_disk", "since_ns": 1,
                                             "disk_error": "x" * 1400, "ended_ns": None if event == "start" else 2})
    try:
        done = threading.Event()
        live.server.deliver([(("thread", hold("start")), None, b"", None, None),
                             (("thread", hold("end")), None, b"", None, None),
                             (("thread", done.set), None, b"", None, None)])
        assert done.wait(30)
        with live.connect() as sock:
            reply = call(sock, live.register_frame(live.principals[0], 1))
        assert reply["status"] == 202
    finally:
        live.stop()
    restarted = Device(RuntimeFile.open(live.runtime), live.journal, Grants(live.grants))
    try:
        assert [i["disk_error"] for i in restarted.state.hold_incidents[-1:]] == ["x" * 1400]  # saved
    finally:
        restarted.close()


def test_a_checkpoint_command_under_load_folds_only_saved_state(tmp_path):
    runtime = str(tmp_path / "own.aotxccir")  # a checkpoint writes into the runtime file: not the shared one
    pack_tiny(runtime, shared=True)
    live = LiveDevice(runtime, tmp_path, 300).start()
    try:
        replies = {}  # filled in as the load's replies come: the checkpoint goes in once 20 are saved
        load = threading.Thread(target=register_all, args=(live, live.principals, 8, replies))
        load.start()
        wait_for(lambda: len(replies) >= 20 or not load.is_alive(), 120, what="20 registrations answered")
        with live.connect() as sock:
            answer = call(sock, encode_frame({"v": 1, "id": 1, "op": "checkpoint", "principal": None, "args": {}}))
        load.join(120)
        assert not load.is_alive()
    finally:
        live.stop()
    assert answer["status"] == 200, answer
    result = json.loads(answer["body"])
    assert result["generation"] == 2 and result["folded"] >= 20
    assert {r["status"] for r in replies.values()} == {202}
    assert set(registered_after_restart(live)) == set(live.principals)


def listed(sock, principals):
    """{principal: its operations.list items} as the device renders them now."""
    out = {}
    for principal in principals:
        got = call(sock, encode_frame({"v": 1, "id": 1, "op": "operations.list", "principal": principal.hex(),
                                       "args": {}}))
        out[principal] = json.loads(got["body"])["items"]
    return out


def gated_fold(monkeypatch):
    """gpu_worker.recovery.fold.run held until the returned gate is set: (started, gate)."""
    from gpu_worker.recovery import fold
    started, gate, real = threading.Event(), threading.Event(), fold.run

    def run(*args, **kwargs):
        started.set()
        assert gate.wait(120)
        return real(*args, **kwargs)
    monkeypatch.setattr(fold, "run", run)
    return started, gate


def test_a_checkpoint_folds_beside_the_ticks_while_admissions_go_on(tmp_path, monkeypatch):
    """SPEC: a checkpoint pauses no one. The fold runs in another process from the segments before
    its fold point; registrations sent while it runs are saved and answered before it ends, stay in
    the journal after it (their save fields say so), and every receipt reads the same after a
    restart. Before, the checkpoint ran on the tick thread: nothing was admitted meanwhile. The
    receipts it saved are marked a slice of rows at a time, between ticks (before, the whole table
    at once: 171 ms at 1.85M rows), and the checkpoint answers once all are. The fold's output is
    freed on a helper thread (fold.Memory.free): freed where the tick thread dropped its last view,
    it held the tick loop 0.39 s at 1M transfers."""
    from gpu_worker.recovery import checkpoints as checkpoints_module
    from gpu_worker.recovery import fold
    from gpu_worker.state.tables import Tables
    runtime = str(tmp_path / "own.aotxccir")
    pack_tiny(runtime, shared=True)
    live = LiveDevice(runtime, tmp_path, 40).start()
    started, gate = gated_fold(monkeypatch)
    monkeypatch.setattr(checkpoints_module, "MARK_ROWS", 16)
    marked, real_mark = [], Tables.mark_folded

    wakes, real_woken = [0], Server._woken

    def mark_folded(self, generation, through_seq=None, rows=slice(None)):
        marked.append((len(range(*rows.indices(self.receipts.shape[0]))), wakes[0]))
        return real_mark(self, generation, through_seq, rows)

    def woken(self):
        wakes[0] += 1
        return real_woken(self)
    freed, done, real_free = [], threading.Event(), fold.Memory.free

    def free(self):
        real_free(self)
        freed.append(threading.current_thread().name)
        done.set()
    monkeypatch.setattr(Tables, "mark_folded", mark_folded)
    monkeypatch.setattr(Server, "_woken", woken)
    monkeypatch.setattr(fold.Memory, "free", free)
    first, during = live.principals[:10], live.principals[10:]
    try:
        assert {r["status"] for r in register_all(live, first, 2).values()} == {202}
        asked = live.connect()
        asked.sendall(encode_frame({"v": 1, "id": 7, "op": "checkpoint", "principal": None, "args": {}}))
        assert started.wait(60)
        folded_segment = live.device.committer.writer.segment - 1
        assert {r["status"] for r in register_all(live, during, 4).values()} == {202}  # saved while it folds
        assert select.select([asked], [], [], 0)[0] == []  # the checkpoint has not answered yet
        gate.set()
        (n,) = LENGTH.unpack(_exactly(asked, 4))
        answer = decode_payload(_exactly(asked, n))
        asked.close()
        assert answer["status"] == 200, answer
        result = json.loads(answer["body"])
        assert result["generation"] == 2 and result["folded"] >= len(first)
        rows = live.device.state.tables.receipts.shape[0]
        sizes = [n for n, _ in marked]
        assert max(sizes) == 16 and sum(sizes) == rows and len(sizes) == -(-rows // 16), marked
        # each slice in a wake of the loop of its own: ticks and reads go on between them
        assert len({wake for _, wake in marked}) == len(marked), marked
        assert min(list_segments(live.journal, OsFileLayer())) > folded_segment
        assert not [n for n in os.listdir(live.journal) if n.startswith(".fold-")]
        assert done.wait(60)
        assert freed == ["aotx-off-tick"], freed
        with live.connect() as sock:
            before = listed(sock, live.principals)
    finally:
        live.stop()
    saves = {p: {item["admission"]["save"]["source"] for item in before[p]} for p in live.principals}
    assert all(saves[p] == {"file"} for p in first) and all(saves[p] == {"journal"} for p in during), saves
    restarted = LiveDevice(runtime, tmp_path, 0)
    restarted.principals, restarted.grants = live.principals, live.grants
    restarted.start()
    try:
        with restarted.connect() as sock:
            assert listed(sock, live.principals) == before
    finally:
        restarted.stop()


def test_a_checkpoint_that_fails_beside_the_ticks_loses_nothing_and_the_next_one_folds(tmp_path, monkeypatch):
    """The runtime file's append fails (a full disk): 507 checkpoint_failed, the segments stay, a
    restart has every registration; the next checkpoint folds them all."""
    from gpu_worker.storage import checkpoint as checkpoint_module
    runtime = str(tmp_path / "own.aotxccir")
    pack_tiny(runtime, shared=True)
    live = LiveDevice(runtime, tmp_path, 20).start()
    real_append, failing = checkpoint_module.runtime_file_writer.append, [True]

    def append(*args, **kwargs):
        if failing[0]:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real_append(*args, **kwargs)
    monkeypatch.setattr(checkpoint_module.runtime_file_writer, "append", append)
    frame = encode_frame({"v": 1, "id": 1, "op": "checkpoint", "principal": None, "args": {}})
    try:
        assert {r["status"] for r in register_all(live, live.principals[:10], 2).values()} == {202}
        with live.connect() as sock:
            got = call(sock, frame)
        assert got["status"] == 507 and json.loads(got["body"])["error"]["code"] == "checkpoint_failed", got
        assert RuntimeFile.open(runtime).generation == 1 and live.device.state.generation == 1
        assert {r["status"] for r in register_all(live, live.principals[10:], 2).values()} == {202}
    finally:
        live.stop()
    assert set(registered_after_restart(live)) == set(live.principals)
    failing[0] = False
    live.start()
    try:
        with live.connect() as sock:
            got = call(sock, frame)
        assert got["status"] == 200 and json.loads(got["body"])["folded"] >= 20, got
    finally:
        live.stop()
    assert set(registered_after_restart(live)) == set(live.principals)


def test_a_folds_output_is_freed_by_the_thread_that_frees_it():
    """fold.Memory.free punches the output's pages out of its memfd (and so out of every mapping
    of it) and closes it: the mapping reads zeros and the file holds no page, so the last view's
    unmapping, wherever it happens, has nothing left to free."""
    import mmap
    from gpu_worker.recovery import fold
    size = 1 << 20
    fd = os.memfd_create("fold-output")
    os.write(fd, b"x" * size)
    mapped, probe = mmap.mmap(fd, size, access=mmap.ACCESS_READ), os.dup(fd)
    try:
        memory = fold.Memory(fd, size, mapped)
        assert os.fstat(probe).st_blocks * 512 >= size and mapped[:4] == b"xxxx"
        memory.free()
        assert memory.fd == -1 and memory.mapping is None and os.fstat(probe).st_blocks == 0
        assert mapped[:4] == bytes(4) and mapped[size - 4:] == bytes(4)
        memory.free()  # (once is enough: nothing more to do)
    finally:
        mapped.close()
        os.close(probe)


def test_a_boot_clears_what_a_fold_cut_short_left(tmp_path):
    """A stop while a fold ran leaves its links beside the journal (gpu_worker/fold.py): the next
    boot removes them and recovers everything from the segments."""
    from gpu_worker.recovery import fold
    runtime = str(tmp_path / "own.aotxccir")
    pack_tiny(runtime, shared=True)
    live = LiveDevice(runtime, tmp_path, 6).start()
    try:
        register_all(live, live.principals, 2)
        writer = live.device.committer.writer
    finally:
        live.stop()
    work = fold.prepare(live.journal, writer.segment, OsFileLayer())
    assert os.listdir(work)
    assert set(registered_after_restart(live)) == set(live.principals)
    assert not os.path.exists(work)


def test_a_full_disk_refuses_the_unsaved_ticks_and_keeps_every_saved_one(tmp_path):
    runtime = str(tmp_path / "faults.aotxccir")
    pack_tiny(runtime, shared=True, runtime_profile={"min_free_disk_bytes": 1})  # only ENOSPC holds
    fs = FaultyFileLayer()
    live = LiveDevice(runtime, tmp_path, 400, fs=fs).start()
    try:
        fs.space = 40_000  # about 100 registrations fit; the rest of the disk is "full"
        replies = register_all(live, live.principals, 8)
    finally:
        live.stop()
    statuses = collections.Counter(r["status"] for r in replies.values())
    assert set(statuses) == {202, 429} and statuses[202] > 0, statuses
    refused = [json.loads(r["body"])["error"]["code"] for r in replies.values() if r["status"] == 429]
    assert set(refused) == {"journal_hold"}
    fs.space = None
    saved = registered_after_restart(live)
    assert set(saved) == {p for p, r in replies.items() if r["status"] == 202}  # nothing refused was kept


def test_a_client_that_does_not_read_gets_backpressure_and_every_reply_in_order(tiny_runtime, tmp_path,
                                                                                 monkeypatch):
    """Replies beyond the socket buffer wait in the connection's queue for EPOLLOUT, in order; past
    HIGH_WATER the device stops reading that connection (the client's sends block) and keeps serving
    the others."""
    monkeypatch.setattr(server_module, "HIGH_WATER", 256 << 10)
    live = LiveDevice(tiny_runtime, tmp_path, 2).start()
    slow_principal, other = live.principals
    n = 10_000
    try:
        slow = live.connect()
        frames = b"".join(encode_frame({"v": 1, "id": i, "op": "capabilities", "principal": slow_principal.hex(),
                                        "args": {}}) for i in range(1, n + 1))
        sender = threading.Thread(target=slow.sendall, args=(frames,))
        sender.start()

        def queued():  # bytes of replies waiting for the slow client (0 before its connection is known)
            conns = list(live.server._conns.values())
            return live.server.io.pending(conns[0].id) if conns else 0
        # the device answers until the slow client's queue passes HIGH_WATER, then stops reading it
        wait_for(lambda: queued() > 256 << 10, 60, what="the slow client's queue past HIGH_WATER")
        [conn] = [c for c in live.server._conns.values()]
        assert sender.is_alive()  # its sends block: the device stopped reading it
        assert 256 << 10 < live.server.io.pending(conn.id) < 2 << 20
        with live.connect() as sock:  # another client is served meanwhile
            answer = call(sock, live.register_frame(other, 1))
        assert answer["status"] == 202
        ids_seen, size = [], 0
        while len(ids_seen) < n:
            (length,) = LENGTH.unpack(_exactly(slow, 4))
            msg = decode_payload(_exactly(slow, length))
            assert msg["status"] == 200
            ids_seen.append(msg["id"])
            size += 4 + length
        sender.join(30)
        slow.close()
    finally:
        live.stop()
    assert ids_seen == list(range(1, n + 1))
    assert size > 8 << 20  # far more than a socket buffer or HIGH_WATER holds


def test_out_of_descriptors_pauses_accepting_and_then_serves(tiny_runtime, tmp_path, monkeypatch, caplog):
    """accept() failing (EMFILE) must not spin the loop on the still-waiting connection: the device
    stops accepting for ACCEPT_PAUSE, keeps serving, then accepts again."""
    monkeypatch.setattr(server_module, "ACCEPT_PAUSE", 0.3)
    live = LiveDevice(tiny_runtime, tmp_path, 1).start()
    try:
        capabilities = encode_frame({"v": 1, "id": 2, "op": "capabilities", "principal": live.principals[0].hex(),
                                     "args": {}})
        with live.connect() as served:
            assert call(served, capabilities)["status"] == 200  # accepted before the failures
            live.server.io.fail_accepts(3, errno.EMFILE)
            started = time.monotonic()
            with live.connect() as sock:
                answer = call(sock, live.register_frame(live.principals[0], 1))
            waited = time.monotonic() - started
            assert call(served, capabilities)["status"] == 200  # served throughout
    finally:
        live.stop()
    assert answer["status"] == 202
    warnings = [r for r in caplog.records if "pausing new connections for 0.3 s: [Errno 24]" in r.getMessage()]
    assert len(warnings) == 3
    # three whole pauses, one after the other, before the accept that served it (from the client's
    # side: the log records' times are when the tick thread took the warnings, which a busy machine
    # may do for two of them at once)
    assert waited >= 0.9


def test_a_frame_that_is_not_a_request_closes_only_its_connection(tiny_runtime, tmp_path, caplog):
    live = LiveDevice(tiny_runtime, tmp_path, 1).start()
    try:
        with live.connect() as good, live.connect() as bad:
            bad.sendall(LENGTH.pack(3) + b"\x81\xa1\xff")   # a map whose key is not UTF-8
            assert bad.recv(1) == b""                      # closed, nothing answered
            with live.connect() as huge:
                huge.sendall(LENGTH.pack((1 << 24) + 1))    # longer than MAX_FRAME: refused at once
                assert huge.recv(1) == b""
            with live.connect() as named:  # a request whose id a reply could not carry (Reply.id)
                named.sendall(encode_frame({"v": 1, "id": "one", "op": "ping", "principal": None, "args": {}}))
                assert named.recv(1) == b""
            assert call(good, live.register_frame(live.principals[0], 1))["status"] == 202
    finally:
        live.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert any("closing connection: frame is not msgpack" in m for m in messages)
    assert any("closing connection: a request's id is str, not an integer" in m for m in messages)
    assert any(f"closing connection: frame of {(1 << 24) + 1} bytes exceeds {1 << 24}" in m for m in messages)


class _HeldSyncer:
    """Stands in for the tick I/O thread so a test decides when a tick's I/O 'completes'."""

    def __init__(self):
        self.requests = 0

    def request(self, fd, data):
        self.requests += 1

    def result(self):
        return 0


class _RecordingIO:
    """Stands in for the native socket loop: keeps the replies sent to each connection."""

    def __init__(self):
        self.sent = collections.defaultdict(list)

    def send(self, items):
        for conn_id, data, count in items:
            frames = native.load("sockio").split([data], 1 << 24)
            assert len(frames) == count
            self.sent[conn_id] += [decode_payload(f) for f in frames]


def test_a_deferred_read_never_sees_a_batch_gathered_behind_it(tiny_runtime, tmp_path):
    """A read that waits for the saves before it is answered from saved state only: the loop does
    not gather (and apply) the next batch while a batch in flight still holds such a read."""
    live = LiveDevice(tiny_runtime, tmp_path, 2)
    write_grants(live.grants, {p.hex(): ALL for p in live.principals})
    device = Device(RuntimeFile.open(tiny_runtime), live.journal, Grants(live.grants))
    live.device = device
    server = Server(device, os.path.join(live.journal, "service.sock"))
    server.committer.attach(_HeldSyncer())
    server.io = _RecordingIO()
    first, second = live.principals
    conn = server_module.Connection(2)
    try:
        def request(req_id, op, principal, frame=None):
            msg = decode_payload(frame[4:]) if frame else {"v": 1, "id": req_id, "op": op,
                                                           "principal": principal.hex(), "args": {}}
            server.submit(conn, msg)

        request(1, None, None, live.register_frame(first, 1))           # something unsaved ...
        request(2, "participant.get", second)                           # ... so this read waits
        server._tick()                                                  # batch 1 in flight
        request(3, None, None, live.register_frame(second, 3))          # registers `second`
        server._tick()
        server._synced()                                                # batch 1 saved and answered
        while server.inbox or server.committer.batches:
            server._tick()
            server._synced()
        replies = {msg["id"]: msg for msg in server.io.sent[conn.id]}
    finally:
        device.close()
    assert replies[1]["status"] == 202 and replies[3]["status"] == 202
    assert json.loads(replies[2]["body"])["registered"] is False  # not the unsaved registration behind it


class _ScriptedSyncer:
    """Stands in for the tick I/O thread: records the ticks handed to it and answers with the
    given errnos, oldest first, when the test calls _synced (nothing reaches the disk)."""

    def __init__(self, results):
        self.results = list(results)
        self.requests = []

    def request(self, fd, data):
        self.requests.append(len(data))

    def result(self):
        return self.results.pop(0)


@pytest.mark.parametrize("first", [0, errno.ENOSPC])
def test_a_whole_tick_waits_behind_the_one_in_flight_and_a_failure_ends_both(tmp_path, first):
    """The loop hands a second, whole tick to the I/O thread while the first runs (so the disk
    starts it at once); when the first fails, the second was never run: both ticks' admissions are
    refused (ENOSPC) and the cancelled result is taken, leaving nothing in flight."""
    runtime = str(tmp_path / "two.aotxccir")
    pack_tiny(runtime, shared=True, runtime_profile={"min_free_disk_bytes": 1})
    live = LiveDevice(runtime, tmp_path, 24)
    write_grants(live.grants, {p.hex(): ALL for p in live.principals})
    device = Device(RuntimeFile.open(runtime), live.journal, Grants(live.grants))
    live.device = device
    server = Server(device, os.path.join(live.journal, "service.sock"))
    syncer = _ScriptedSyncer([first, errno.ECANCELED if first else 0])
    server.committer.attach(syncer)
    server.io = _RecordingIO()
    conn = server_module.Connection(2)
    try:
        for i, principal in enumerate(live.principals, 1):
            server.submit(conn, decode_payload(live.register_frame(principal, i)[4:]))
        server._tick()
        assert len(syncer.requests) == 1   # the first tick: 8 registrations, 16 records
        server._tick()
        assert len(syncer.requests) == 2   # 16 wait, a whole tick's worth: a second tick, queued behind it
        assert device.committer.writer.ticks_in_flight == 2 and len(server.inbox) == 8  # the rest waits
        server._synced()
        if not first:
            server._synced()
        replies = {msg["id"]: msg for msg in server.io.sent[conn.id]}
        assert not syncer.results and device.committer.writer.ticks_in_flight == 0 and server.failure is None
    finally:
        device.close()
    statuses = collections.Counter(r["status"] for r in replies.values())
    assert statuses == ({202: 16} if not first else {429: 16})


def test_the_watchdog_reports_a_stalled_pipeline_with_its_state_and_every_threads_stack(
        tiny_runtime, tmp_path, monkeypatch, caplog):
    """The lost wake-up of issue 35 put back on purpose (the loop never sends records queued between
    ticks to the disk): a registration then waits with no progress. The watchdog logs the pipeline's
    state and every thread's stack, Python and native, and the device's ping (answered as it arrives,
    not behind the stalled tick) says it is stalled."""
    from gpu_worker.storage.committer import Committer
    live = LiveDevice(tiny_runtime, tmp_path, 1, stall_seconds=0.5).start()
    device = live.device
    monkeypatch.setattr(Committer, "io_waits", lambda self: False)  # after boot: its own commit needs the disk

    def hold(event):
        return lambda: device._journal_hold({"event": event, "cause": "low_disk", "since_ns": 1,
                                             "disk_error": "x" * 1400, "ended_ns": None if event == "start" else 2})
    try:
        with caplog.at_level("ERROR", logger="gpu_worker.watchdog"), live.connect() as stuck, live.connect() as ops:
            done = threading.Event()
            live.server.deliver([(("thread", hold("start")), None, b"", None, None),
                                 (("thread", hold("end")), None, b"", None, None),
                                 (("thread", done.set), None, b"", None, None)])
            assert done.wait(30)
            stuck.sendall(live.register_frame(live.principals[0], 1))  # never answered: the pipeline is stuck
            wait_for(lambda: live.server.watchdog.reports >= 1, 30, what="a stall report")
            status = json.loads(call(ops, encode_frame({"v": 1, "id": 2, "op": "ping"}))["body"])
        [record] = [r for r in caplog.records if r.name == "gpu_worker.watchdog"]
    finally:
        live.stop()
    text = record.getMessage()
    assert "device pipeline stalled" in text
    assert "inbox: 1 commands; the first: ['participant.register#1']" in text
    assert "not yet on the disk 20" in text and "ticks in flight 0" in text  # the records nobody sent
    assert "requests in flight" in text                                    # per connection, from the socket thread
    assert "thread MainThread" in text or "in run" in text                 # Python stacks
    for native_thread in ("aotx-sockets", "aotx-tick-io"):                 # native stacks
        assert f" {native_thread} state " in text
    assert status["pipeline"]["stalled"] is True and status["pipeline"]["inbox"] == 1
