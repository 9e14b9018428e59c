"""The gateway refuses before reading (issue 19, item 1), through a real gateway process
(`manage.py serve`: granian, RSGI) on loopback: what must be refused is
answered from the headers, with the one error body, and the body is never taken in."""
import json
import os
import socket
import time

import pytest

from tests.conftest import wait_for
from tests.harness import Stack

pytestmark = pytest.mark.e2e
BASE = "/aotx/v1/shared"
GIB = 1 << 30


def rss_kib(pid):
    """Resident set of a process and its descendants (a supervisor and its workers), in KiB."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            with open(f"/proc/{current}/task/{current}/children") as f:
                todo += [int(child) for child in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return total


def read_reply(sock, timeout=10.0):
    """(status, headers, body) of one HTTP/1.1 reply with a Content-Length; b"" when the
    connection closed without one."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return int(lines[0].split(" ", 2)[1]), headers, rest[:length]


def assert_error_body(reply, status, code):
    assert reply is not None, "the connection closed without an answer"
    got_status, headers, body = reply
    assert got_status == status, (got_status, body[:300])
    assert headers["content-type"] == "application/json" and headers["cache-control"] == "no-store"
    error = json.loads(body)["error"]
    assert error["code"] == code and error["message"], error
    return headers


def serving(tiny_runtime, tmp_path, **timeouts):
    """A gateway (no device: nothing here may reach it) with `timeouts` in its config, and a
    token."""
    stack = Stack(tmp_path, tiny_runtime)
    cfg = json.loads(stack.config.read_text())
    stack.config.write_text(json.dumps({**cfg, **timeouts}))
    stack.token = stack.principal("alice")
    stack.serve()
    return stack


@pytest.fixture
def gateway(tiny_runtime, tmp_path):
    """A gateway with its default timeouts: a test that does not time one out must not depend on
    how soon a loaded machine lets the server first read a connection."""
    stack = serving(tiny_runtime, tmp_path)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def impatient(tiny_runtime, tmp_path):
    """A gateway with 2 s header and body timeouts, for the tests of those timeouts."""
    stack = serving(tiny_runtime, tmp_path, header_timeout=2, body_timeout=2)
    try:
        yield stack
    finally:
        stack.stop()


def connect(stack):
    return socket.create_connection(("127.0.0.1", stack.port), timeout=10)


def test_a_1_gib_post_without_a_token_answers_401_while_the_gateway_rss_stays_bounded(gateway):
    before = rss_kib(gateway.gateway.proc.pid)
    with connect(gateway) as sock:
        sock.sendall(f"POST {BASE}/spaces HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {GIB}\r\n\r\n".encode())
        sent, chunk = 0, b"x" * (1 << 20)
        sock.settimeout(0.05)
        reply = None
        try:  # keep sending the body until the answer arrives (it comes from the headers alone)
            while sent < GIB:
                try:
                    sent += sock.send(chunk)
                except socket.timeout:
                    pass
                try:
                    if sock.recv(1, socket.MSG_PEEK):
                        break
                except socket.timeout:
                    continue
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway answered and closed while the body was still coming
        reply = read_reply(sock)
    headers = assert_error_body(reply, 401, "unauthenticated")
    assert headers["www-authenticate"] == 'Bearer realm="aotx"' and headers["connection"] == "close"
    assert sent < GIB // 4, f"the client could send {sent} bytes before the answer"
    assert rss_kib(gateway.gateway.proc.pid) - before < 64 * 1024, "the gateway took the body in"


def test_three_unauthenticated_1_gib_bodies_at_once_leave_the_rss_bounded(gateway):
    before = rss_kib(gateway.gateway.proc.pid)
    socks = [connect(gateway) for _ in range(3)]
    try:
        for sock in socks:
            sock.sendall(f"POST {BASE}/spaces HTTP/1.1\r\nHost: localhost\r\nContent-Length: {GIB}\r\n\r\n".encode()
                         + b"x" * (4 << 20))
        for sock in socks:
            assert_error_body(read_reply(sock), 401, "unauthenticated")
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        for sock in socks:
            sock.close()
    assert rss_kib(gateway.gateway.proc.pid) - before < 64 * 1024


def test_a_body_over_the_route_limit_answers_413_from_content_length_before_it_is_sent(gateway):
    with connect(gateway) as sock:
        sock.sendall(f"POST {BASE}/spaces HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {gateway.token}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {10 << 20}\r\n\r\n".encode())
        headers = assert_error_body(read_reply(sock), 413, "body_too_large")  # not one body byte was sent
        assert headers["connection"] == "close"


def test_a_chunked_body_answers_413_as_soon_as_it_passes_the_route_limit(gateway):
    with connect(gateway) as sock:
        sock.sendall(f"POST {BASE}/spaces HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {gateway.token}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        piece = b"x" * 16384
        try:
            for _ in range(8):  # 128 KiB, twice the shared routes' 64 KiB
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert_error_body(read_reply(sock), 413, "body_too_large")


def test_a_60_kb_authorization_header_answers_431_in_the_error_body(gateway):
    with connect(gateway) as sock:
        sock.sendall(f"GET {BASE}/capabilities HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {'a' * 60_000}\r\n\r\n"
                     .encode())
        assert_error_body(read_reply(sock), 431, "headers_too_large")


def test_a_head_past_the_servers_buffer_is_refused_431_and_closed(gateway):
    with connect(gateway) as sock:
        sock.sendall(f"GET {BASE}/capabilities HTTP/1.1\r\nHost: localhost\r\nX-Pad: {'a' * 600_000}\r\n\r\n".encode())
        reply = read_reply(sock)
        assert reply is not None and reply[0] == 431  # (the server's own answer: hyper's, with no body)
        assert sock.recv(1) == b""


def test_a_token_in_the_query_string_is_refused_and_never_lands_in_the_access_log(gateway):
    for query in (f"access_token={gateway.token}", f"cursor={gateway.token}"):
        status, _, body = gateway.http("GET", f"{BASE}/spaces?{query}")
        assert status == 401 and json.loads(body)["error"]["code"] == "unauthenticated"
    status, _, _ = gateway.http("GET", f"{BASE}/spaces?limit=5", token=gateway.token)
    assert status == 503  # no device here; the request itself was accepted

    def logged():  # the gateway's output once the access log has a line for each of the three requests
        out = gateway.gateway.output()
        return out if out.count(f"GET {BASE}/spaces HTTP/1.1") >= 3 else None
    log = wait_for(logged, 30, what="the three requests' lines in the access log")
    assert f"{BASE}/spaces?" not in log and "limit=5" not in log, log[-2000:]  # paths only, never a query
    assert gateway.token not in log and gateway.token[len("aotx_"):] not in log


def test_headers_that_do_not_arrive_within_the_header_timeout_close_the_connection(impatient):
    with connect(impatient) as sock:
        sock.sendall(f"GET {BASE}/capabilities HTTP/1.1\r\nHost: localhost\r\n".encode())  # never finished
        started = time.monotonic()
        sock.settimeout(10)
        assert sock.recv(1) == b""  # closed, unanswered (the server's header read timeout)
    assert 1 < time.monotonic() - started < 9


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(impatient):
    with connect(impatient) as sock:
        started = time.monotonic()
        sock.settimeout(10)
        assert sock.recv(1) == b""
    assert 1 < time.monotonic() - started < 9


def test_a_body_that_stalls_answers_408_after_the_body_timeout(impatient):
    with connect(impatient) as sock:
        sock.sendall(f"POST {BASE}/spaces HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {impatient.token}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"schema\"".encode())
        assert_error_body(read_reply(sock), 408, "body_timeout")


def test_an_idle_keep_alive_connection_is_closed_after_the_header_timeout(impatient):
    with connect(impatient) as sock:
        sock.sendall(f"GET {BASE}/capabilities HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        assert_error_body(read_reply(sock), 401, "unauthenticated")  # answered, kept alive
        answered = time.monotonic()
        sock.settimeout(10)
        assert sock.recv(1) == b""  # the next request's head did not come within header_timeout
        assert 1 < time.monotonic() - answered < 9


def test_pipelined_requests_are_answered_in_order_on_one_connection(gateway):
    with connect(gateway) as sock:
        sock.sendall(b"".join(f"GET {BASE}/spaces?limit={n} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode() for n in (1, 2, 3)))
        for _ in range(3):
            assert_error_body(read_reply(sock), 401, "unauthenticated")


def test_an_unauthenticated_chat_completion_body_is_refused_401_before_it_is_read(gateway):
    with connect(gateway) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {GIB}\r\n\r\n".encode())
        reply = read_reply(sock)
    assert reply is not None and reply[0] == 401
    error = json.loads(reply[2])["error"]
    assert error["type"] == "authentication_error" and error["code"] == "unauthenticated"


def test_an_admin_post_over_the_upload_limit_answers_413_before_it_is_read(gateway):
    with connect(gateway) as sock:
        sock.sendall(f"POST /admin/login/ HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                     f"Content-Length: {GIB}\r\n\r\n".encode())
        assert_error_body(read_reply(sock), 413, "body_too_large")


@pytest.mark.parametrize("workers", [2])
def test_the_gateway_serves_with_several_worker_processes(tiny_runtime, tmp_path, workers):
    stack = Stack(tmp_path, tiny_runtime)
    cfg = json.loads(stack.config.read_text())
    stack.config.write_text(json.dumps({**cfg, "workers": workers}))
    token = stack.principal("bob")
    stack.boot_device()
    stack.serve()
    try:
        children = open(f"/proc/{stack.gateway.proc.pid}/task/{stack.gateway.proc.pid}/children").read().split()
        assert len(children) >= workers, children
        for _ in range(20):  # connections spread over the workers; each answers from the same device
            status, _, body = stack.http("GET", f"{BASE}/participant", token=token)
            assert status == 200 and json.loads(body)["registered"] is False
    finally:
        stack.stop()
    assert os.path.exists(stack.config)
