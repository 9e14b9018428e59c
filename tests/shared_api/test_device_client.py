"""The gateway never hangs on the device: a silent or absent device is a 503 with a clear code."""
import socket
import threading

import pytest

from shared_api.device_client import BlockingDevice
from shared_api.errors import ServiceError

# The fake devices below answer by command; a client sends only the contract's commands
# (gpu_worker/contract/commands.py), so they tell real ones apart.
SLOW, FAST, LATE, HANG_UP = "checkpoint", "ping", "capabilities", "models.list"


def test_it_answers_503_device_unavailable_when_no_device_listens(tmp_path):
    client = BlockingDevice(str(tmp_path / "service.sock"), timeout=1)
    with pytest.raises(ServiceError) as err:
        client.call("ping", None)
    assert err.value.status == 503 and err.value.code == "device_unavailable"
    client.close()


def _pinged_device(path, answers):
    """A device answering every request with the count of requests so far, each connection on a
    thread of its own; `answers` collects (connection number, request id)."""
    from gpu_worker.contract.wire import FrameReader, encode_reply, reply

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()

    def answer(conn, number):
        frames = FrameReader()
        with conn:
            while data := conn.recv(65536):
                for msg in frames.feed(data):
                    answers.append((number, msg["id"]))
                    conn.sendall(encode_reply(reply(msg["id"], 200, str(len(answers)).encode())))

    def serve():
        number = 0
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            number += 1
            threading.Thread(target=answer, args=(conn, number), daemon=True).start()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def test_blocking_calls_share_one_connection_and_a_restarted_device_is_found_again(tmp_path):
    """The blocking face is the one async client on a thread of its own: calls from several
    threads go on its one connection; when the device goes away between calls, the next call
    connects again (nothing reached the device on the stale connection)."""
    path = str(tmp_path / "service.sock")
    answers = []
    server, thread = _pinged_device(path, answers)
    client = BlockingDevice(path, timeout=5)
    replies = []
    callers = [threading.Thread(target=lambda: replies.append(client.call("ping", None))) for _ in range(8)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(10)
    assert len(replies) == 8 and all(r.status == 200 for r in replies)
    assert {number for number, _ in answers} == {1}  # one connection carried them all
    assert [t.name for t in threading.enumerate()].count("aotx-device-client") == 1
    # the device restarts: the old connection is gone
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    thread.join(5)
    import os
    os.unlink(path)
    server, thread = _pinged_device(path, answers)
    found = None
    for _ in range(2):  # the first call may still see the old connection close under it
        try:
            found = client.call("ping", None)
            break
        except ServiceError as err:
            assert err.code in ("device_unavailable", "device_connection_lost")
    assert found is not None and found.status == 200
    client.close()
    assert "aotx-device-client" not in [t.name for t in threading.enumerate()]
    server.shutdown(socket.SHUT_RDWR)
    server.close()


def test_a_forked_child_calls_through_a_client_of_its_own(tmp_path):
    """Celery's prefork workers: a child forked from a process whose client has a running loop
    thread starts its own thread and connection, and the parent's keeps serving."""
    import os
    path = str(tmp_path / "service.sock")
    answers = []
    server, _ = _pinged_device(path, answers)
    client = BlockingDevice(path, timeout=5)
    assert client.call("ping", None).status == 200
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if its call was answered
        try:
            os._exit(0 if client.call("ping", None).status == 200 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.call("ping", None).status == 200
    client.close()
    server.shutdown(socket.SHUT_RDWR)
    server.close()


def test_it_answers_503_device_timeout_when_the_device_is_silent(tmp_path):
    path = str(tmp_path / "service.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True)
    thread.start()
    client = BlockingDevice(path, timeout=0.3)
    with pytest.raises(ServiceError) as err:
        client.call("ping", None)
    assert err.value.status == 503 and err.value.code == "device_timeout"
    client.close()
    thread.join(5)
    server.close()


def test_a_reply_after_its_call_timed_out_is_dropped_and_the_connection_keeps_serving(tmp_path):
    """DeviceMux.call: the first call times out (503 device_timeout); its reply, arriving later on
    the same connection, is dropped, and the next call on that connection gets its own reply."""
    import asyncio

    from gpu_worker.contract.wire import FrameReader, encode_reply, reply
    from shared_api.device_client import DeviceMux

    path = str(tmp_path / "service.sock")

    async def device(reader, writer):
        frames = FrameReader()
        held = None
        while data := await reader.read(65536):
            for msg in frames.feed(data):
                if msg["op"] == SLOW:
                    held = msg  # answered only after the next request arrives
                    continue
                if held is not None:
                    writer.write(encode_reply(reply(held["id"], 200, b'"late"')))
                    held = None
                writer.write(encode_reply(reply(msg["id"], 200, b'"fast"')))
                await writer.drain()

    async def go():
        server = await asyncio.start_unix_server(device, path)
        mux = DeviceMux(path, timeout=1.0)  # the slow call waits it out; the fast ones must not on a loaded machine
        try:
            with pytest.raises(ServiceError) as err:
                await mux.call(SLOW, None)
            answer = await mux.call(FAST, None)
            again = await mux.call(FAST, None)
            return err.value, answer, again, mux._abandoned
        finally:
            await mux.aclose()
            server.close()
    err, answer, again, abandoned = asyncio.run(go())
    assert err.status == 503 and err.code == "device_timeout"
    assert answer.body == b'"fast"' and again.body == b'"fast"'
    assert abandoned == set()  # the late reply was the abandoned id's last frame


def test_a_device_that_stops_reading_times_a_large_request_out_instead_of_holding_it(tmp_path):
    """DeviceMux: a request that fills the write buffer waits for room only up to the device timeout
    (a device that stops reading, as its backpressure does, must not hold a request for good): 503
    device_timeout, the exact-retry answer."""
    import asyncio

    from shared_api.device_client import DeviceMux

    path = str(tmp_path / "service.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True)
    thread.start()

    async def go():
        mux = DeviceMux(path, timeout=0.5)
        try:
            errors = []
            for _ in range(2):  # the first fills the write buffer; the second must wait for room
                with pytest.raises(ServiceError) as err:
                    await asyncio.wait_for(mux.call("media.put", "0" * 32, {"sha256": "0" * 64, "data": b"x" * (8 << 20), "type": "image"}), 30)
                errors.append(err.value)
            return errors
        finally:
            await mux.aclose()

    errors = asyncio.run(go())
    assert [(e.status, e.code) for e in errors] == [(503, "device_timeout")] * 2
    thread.join(5)
    for conn, _ in accepted:
        conn.close()
    server.close()
