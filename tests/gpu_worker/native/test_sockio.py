"""The native I/O threads (gpu_worker/native/sockio.cpp and tick_io.cpp) on their own, without a device. The socket loop:
frames in, replies out, backpressure by requests in flight and by reply bytes, closes both ways.
The tick I/O thread: write + fdatasync, errno reported, one request at a time."""
import errno
import os
import select
import socket
import time

import pytest

from gpu_worker import native
from gpu_worker.contract.wire import LENGTH, encode_frame

MAX_FRAME = 1 << 24


@pytest.fixture
def loop(tmp_path):
    loops = []

    def make(high_water=1 << 20, max_in_flight=128):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(tmp_path / f"s{len(loops)}.sock"))
        listener.listen(16)
        listener.setblocking(False)
        io = native.load("sockio").Loop(listener.fileno(), high_water, max_in_flight, MAX_FRAME, 1.0)
        io.start()
        loops.append((io, listener))

        def connect():
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(listener.getsockname())
            c.settimeout(10)
            return c
        return io, connect

    yield make
    for io, listener in loops:
        io.stop()
        listener.close()


def take_until(io, count, timeout=10.0):
    """Events from io until `count` of them arrived (or the timeout)."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        select.select([io.fileno()], [], [], 0.05)
        got += io.take()
    return got


def settle(io, seconds=0.3):
    """Whatever arrives within `seconds` (to show that nothing more does)."""
    time.sleep(seconds)
    return io.take()


def frames(start, n):
    return b"".join(encode_frame({"v": 1, "id": i}) for i in range(start, start + n))


def test_frames_arrive_in_order_and_replies_go_back(loop):
    io, connect = loop()
    with connect() as client:
        client.sendall(frames(1, 5))
        events = take_until(io, 5)
        assert [payload for _, payload in events] == [encode_frame({"v": 1, "id": i})[4:] for i in range(1, 6)]
        [conn_id] = {c for c, _ in events}
        io.send([(conn_id, b"".join(encode_frame({"id": i}) for i in range(1, 6)), 5)])
        expected = b"".join(encode_frame({"id": i}) for i in range(1, 6))
        got = b""
        while len(got) < len(expected):
            got += client.recv(65536)
        assert got == expected
    assert take_until(io, 1) == [(conn_id, None)]  # the peer closed


def test_a_connection_is_not_read_while_its_requests_in_flight_reach_the_cap(loop):
    io, connect = loop(max_in_flight=3)
    with connect() as client:
        client.sendall(frames(1, 5))        # one read takes all five (the cap applies to the next read)
        first = take_until(io, 5)
        conn_id = first[0][0]
        client.sendall(frames(6, 4))
        assert settle(io) == []             # five in flight >= 3: not read
        io.send([(conn_id, frames(100, 2), 2)])
        assert settle(io) == []             # three still in flight
        io.send([(conn_id, frames(200, 1), 1)])
        assert len(take_until(io, 4)) == 4  # two in flight: read again


def test_replies_past_high_water_stop_reading_until_they_drain(loop):
    io, connect = loop(high_water=64 << 10)
    with connect() as client:
        client.sendall(frames(1, 1))
        [(conn_id, _)] = take_until(io, 1)
        big = encode_frame({"body": b"x" * (4 << 20)})
        io.send([(conn_id, big, 1)])        # far more than the socket buffer: most of it waits
        client.settimeout(10)
        got = client.recv(1)  # the socket thread has taken the send (else it could read frame 2 first)
        client.sendall(frames(2, 1))
        assert settle(io) == []
        assert io.pending(conn_id) > 64 << 10
        while len(got) < len(big):
            got += client.recv(1 << 20)
        assert got == big
        assert [p for _, p in take_until(io, 1)] == [encode_frame({"v": 1, "id": 2})[4:]]
        assert io.pending(conn_id) == 0


def test_close_drops_the_connection_and_what_it_had_to_send(loop):
    io, connect = loop()
    with connect() as client:
        client.sendall(frames(1, 1))
        [(conn_id, _)] = take_until(io, 1)
        io.close(conn_id)
        assert client.recv(1) == b""
        io.send([(conn_id, b"late", 1)])  # an id that is gone is ignored
        assert io.pending(conn_id) == -1
    assert settle(io) == []               # a close the interpreter asked for is not reported back


def test_a_frame_over_the_limit_closes_its_connection_with_a_warning(loop):
    io, connect = loop()
    with connect() as client:
        client.sendall(LENGTH.pack(MAX_FRAME + 1))
        events = take_until(io, 2)
        assert client.recv(1) == b""
    warning, closed = events
    assert warning == (0, f"closing connection: frame of {MAX_FRAME + 1} bytes exceeds {MAX_FRAME}")
    assert closed[1] is None


def test_bad_arguments_are_refused(tmp_path):
    module = native.load("sockio")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with listener:
        with pytest.raises(ValueError):
            module.Loop(listener.fileno(), 0, 1, 1, 1.0)
        with pytest.raises(OSError, match="cannot watch"):
            module.Loop(-1, 1, 1, 1, 1.0)
        io = module.Loop(listener.fileno(), 1, 1, 1, 1.0)
        with pytest.raises(TypeError):
            io.send([(2, "text", 1)])
        with pytest.raises(TypeError):
            io.send([(2, b"x")])


# ---- the tick I/O thread ---------------------------------------------------------------------

def _result(syncer, timeout=10):
    """Wait for the syncer's eventfd, as the device's epoll loop does, then take the result."""
    assert select.select([syncer.fileno()], [], [], timeout)[0], "no tick I/O result"
    return syncer.result()


@pytest.fixture
def syncer():
    s = native.load("sockio").Syncer()
    yield s
    s.close()  # closing twice is fine


class Descriptors:
    """Files and pipes a test opens, all closed after it (the fds fixture)."""

    def __init__(self):
        self.opened = []

    def open(self, path, flags=os.O_WRONLY | os.O_CREAT | os.O_APPEND):
        self.opened.append(os.open(path, flags))
        return self.opened[-1]

    def pipe(self):
        ends = os.pipe()
        self.opened += ends
        return ends


@pytest.fixture
def fds():
    d = Descriptors()
    yield d
    for fd in d.opened:
        os.close(fd)


def test_the_syncer_writes_all_of_a_tick_then_reports_success(syncer, fds, tmp_path):
    fd = fds.open(tmp_path / "segment")
    with pytest.raises(RuntimeError, match="no tick I/O was requested"):
        syncer.result()
    data = bytes(range(256)) * 40
    syncer.request(fd, data)
    assert _result(syncer) == 0
    assert not select.select([syncer.fileno()], [], [], 0)[0]  # taken: the eventfd is read
    with pytest.raises(RuntimeError, match="no tick I/O was requested"):
        syncer.result()  # a result is taken once
    syncer.request(fd, b"")  # a sync alone
    assert _result(syncer) == 0
    syncer.request(fd, b"tail")
    assert _result(syncer) == 0
    assert (tmp_path / "segment").read_bytes() == data + b"tail"
    syncer.close()
    syncer.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        syncer.request(fd, b"")


def test_the_syncer_reports_the_errno_of_the_call_that_failed(syncer, fds, tmp_path):
    read_end, write_end = fds.pipe()
    readonly = fds.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT)
    syncer.request(readonly, b"x")  # the write fails
    assert _result(syncer) == errno.EBADF
    syncer.request(write_end, b"into a pipe")  # the write works, a pipe cannot be synced
    assert _result(syncer) == errno.EINVAL
    assert os.read(read_end, 100) == b"into a pipe"
    syncer.request(-1, b"")
    assert _result(syncer) == errno.EBADF


def test_the_syncer_runs_queued_requests_in_order_one_after_another(syncer, fds, tmp_path):
    read_end, write_end = fds.pipe()
    fd = fds.open(tmp_path / "segment")
    os.set_blocking(write_end, True)
    big = b"y" * (1 << 20)  # more than a pipe holds: the write blocks until it is read
    syncer.request(write_end, big)
    syncer.request(fd, b"second")  # queued behind the first
    assert syncer.result() is None  # the first still runs
    assert (tmp_path / "segment").read_bytes() == b""  # the second waits for it
    got = bytearray()
    while len(got) < len(big):
        got += os.read(read_end, 1 << 16)
    assert bytes(got) == big
    assert _result(syncer) == errno.EINVAL  # the first: written in full, a pipe cannot be synced
    # ... which cancelled the second: nothing queued behind a failure runs
    assert _result(syncer) == errno.ECANCELED
    assert (tmp_path / "segment").read_bytes() == b""
    syncer.request(fd, b"third")  # after the failure was taken, requests run again
    syncer.request(fd, b"fourth")
    assert (_result(syncer), _result(syncer)) == (0, 0)
    assert (tmp_path / "segment").read_bytes() == b"thirdfourth"


def test_a_request_made_before_a_failure_is_taken_is_cancelled(syncer, fds, tmp_path):
    readonly = fds.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT)
    fd = fds.open(tmp_path / "segment")
    syncer.request(readonly, b"x")
    assert select.select([syncer.fileno()], [], [], 10)[0]  # failed, not yet taken
    syncer.request(fd, b"late")
    assert syncer.result() == errno.EBADF
    assert _result(syncer) == errno.ECANCELED
    assert (tmp_path / "segment").read_bytes() == b""


def test_closing_the_syncer_finishes_what_was_queued(syncer, fds, tmp_path):
    fd = fds.open(tmp_path / "segment")
    for part in (b"a", b"b", b"c"):
        syncer.request(fd, part)
    syncer.close()
    assert (tmp_path / "segment").read_bytes() == b"abc"
