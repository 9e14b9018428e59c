"""HTTP at the edges: hostile requests against the real gateway (granian, RSGI) and device, sent
over raw sockets where a client library would fix their framing. An upload that did not arrive
whole is never admitted; a request that says two things about who it is is refused; the one
error body answers everything the application answers."""
import hashlib
import json
import signal
import socket

import pytest

from aotx_client import Client
from tests.e2e.test_refuse_before_reading import assert_error_body, read_reply
from tests.harness import Stack

pytestmark = pytest.mark.e2e
BASE = "/aotx/v1/shared"


@pytest.fixture(scope="module")
def stack(tiny_runtime, tmp_path_factory):
    """Device and gateway up; alice registered (lineage known) and bob, another principal."""
    stack = Stack(tmp_path_factory.mktemp("edges"), tiny_runtime)
    stack.alice = stack.principal("alice")
    stack.bob = stack.principal("bob")
    stack.boot_device()
    stack.serve()
    with Client(f"http://127.0.0.1:{stack.port}", stack.alice, timeout=60) as aotx:
        stack.lineage = aotx.register()["lineage"]
    try:
        yield stack
    finally:
        stack.stop()


def next_sequence(stack):
    status, _, body = stack.http("GET", f"{BASE}/participant", token=stack.alice)
    assert status == 200, body
    return int(json.loads(body)["next_sequence"])


def envelope(stack, sequence):
    """A space creation's mutation body, as a client sends it (docs/api.md's envelope)."""
    return json.dumps({"schema": "aotx.shared.mutation.v1", "lineage": stack.lineage,
                       "operation_key": hashlib.md5(f"edge-{sequence}".encode()).hexdigest(),
                       "sequence": str(sequence), "scope": "private"}, separators=(",", ":")).encode()


def send(stack, head, body=b"", half_close=False, timeout=10.0):
    """Send a raw request; the reply (read_reply's) or None when the connection closed first."""
    with socket.create_connection(("127.0.0.1", stack.port), timeout=timeout) as sock:
        sock.sendall(head.encode("latin-1") + body)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        return read_reply(sock, timeout)


def chunked_head(stack, path=f"{BASE}/spaces", token=None):
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token or stack.alice}\r\n"
            f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")


def chunk(data):
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


BROKEN_ENDINGS = {
    "a chunk size that is not hex": (b"ZZ\r\n\r\n", False),
    "a chunk size past 64 bits": (b"F" * 40 + b"\r\n\r\n", False),
    "garbage before a last chunk": (b"XX0\r\n\r\n", False),
    "a half-close without the last chunk": (b"", True),
}


@pytest.mark.parametrize("name", list(BROKEN_ENDINGS))
def test_a_chunked_body_with_broken_framing_is_refused_400_and_uses_no_sequence(stack, name):
    ending, half_close = BROKEN_ENDINGS[name]
    sequence = next_sequence(stack)
    reply = send(stack, chunked_head(stack), chunk(envelope(stack, sequence)) + ending, half_close=half_close)
    assert_error_body(reply, 400, "body_incomplete")
    assert next_sequence(stack) == sequence  # nothing admitted: the same sequence is still the next
    good = send(stack, chunked_head(stack), chunk(envelope(stack, sequence)) + b"0\r\n\r\n")
    assert good is not None and good[0] == 202, good


def test_a_body_shorter_than_its_content_length_is_refused_400(stack):
    sequence = next_sequence(stack)
    body = envelope(stack, sequence)
    head = (f"POST {BASE}/spaces HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {stack.alice}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body) + 10}\r\n\r\n")
    assert_error_body(send(stack, head, body, half_close=True), 400, "body_incomplete")
    assert next_sequence(stack) == sequence


def test_a_cut_chat_completion_body_is_refused_400(stack):
    head = chunked_head(stack, "/v1/chat/completions")
    reply = send(stack, head, chunk(b'{"model": "x", "messages": []}') + b"ZZ\r\n\r\n")
    assert reply is not None and reply[0] == 400, reply
    assert json.loads(reply[2])["error"]["code"] == "body_incomplete"


def test_two_authorization_headers_are_refused_400(stack):
    for path in (f"{BASE}/participant", "/v1/models"):
        head = (f"GET {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {stack.alice}\r\n"
                f"Authorization: Bearer {stack.bob}\r\n\r\n")
        reply = send(stack, head)
        assert reply is not None and reply[0] == 400, reply
        assert json.loads(reply[2])["error"]["code"] == "repeated_header"


def test_the_api_routes_apply_the_allowed_hosts_as_the_admin_does(stack):
    for path in (f"{BASE}/participant", "/v1/models", "/metrics", "/admin/login/"):
        head = (f"GET {path} HTTP/1.1\r\nHost: evil.example\r\nAuthorization: Bearer {stack.alice}\r\n\r\n")
        assert_error_body(send(stack, head), 400, "bad_host")
    ok = send(stack, f"GET {BASE}/participant HTTP/1.1\r\nHost: localhost:{stack.port}\r\n"
                     f"Authorization: Bearer {stack.alice}\r\n\r\n")
    assert ok is not None and ok[0] == 200, ok


def test_head_of_the_schema_answers_without_a_traceback_in_the_log(stack):
    for _ in range(3):
        reply = send(stack, "HEAD /aotx/v1/openapi.json HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        assert reply is not None and reply[0] == 200, reply
    reply = send(stack, f"GET {BASE}/capabilities HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert reply is not None
    output = stack.gateway.output()
    assert "Traceback" not in output and "RSGIProtocolClosed" not in output, output[-3000:]


@pytest.mark.parametrize("path", ["/metrics", "/healthz", "/healthz/primary"])
def test_a_wrong_method_on_an_ops_route_answers_405_in_the_error_body(stack, path):
    reply = send(stack, f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n")
    headers = assert_error_body(reply, 405, "method_not_allowed")
    assert "GET" in headers["allow"]


@pytest.mark.parametrize("content_type", ["image", "image/", "image/ png", "/png", "text/plain", ""])
def test_a_media_upload_without_a_whole_media_type_is_refused_415(stack, content_type):
    body = b"\x89PNG\r\n\x1a\n" + b"\0" * 32
    ctype = f"Content-Type: {content_type}\r\n" if content_type else ""
    head = (f"PUT /aotx/v1/media/{hashlib.sha256(body).hexdigest()} HTTP/1.1\r\nHost: localhost\r\n"
            f"Authorization: Bearer {stack.alice}\r\n"
            f"{ctype}Content-Length: {len(body)}\r\n\r\n")
    assert_error_body(send(stack, head, body), 415, "unsupported_media_type")


def test_every_route_answers_the_one_401_body(stack):
    """No token, a malformed header, an unknown token: the same answer on a shared route, an
    event stream, an OpenAI-compatible route and an unknown /v1 path (one function admits them)."""
    paths = (f"{BASE}/participant", f"{BASE}/conversations/con-x/events?stream=true", "/v1/models", "/v1/nowhere")
    headers = ("", "Authorization: Basic abc\r\n", "Authorization: Bearer\r\n", "Authorization: Bearer aotx_nobody\r\n")
    bodies = set()
    for path in paths:
        for header in headers:
            reply = send(stack, f"GET {path} HTTP/1.1\r\nHost: localhost\r\n{header}Connection: close\r\n\r\n")
            assert reply is not None and reply[0] == 401, (path, header, reply)
            assert reply[1]["www-authenticate"] == 'Bearer realm="aotx"'
            error = json.loads(reply[2])["error"]
            bodies.add((error["code"], error["message"]))
    assert bodies == {("unauthenticated", "a valid token is required: send 'Authorization: Bearer <token>'")}


def test_the_address_the_gateway_listens_on_is_an_allowed_host(tiny_runtime, tmp_path):
    """A gateway listening on 127.0.0.2 (not in the default AOTX_ALLOWED_HOSTS) answers requests
    that name it, as clients of a gateway on another machine's address do; another host is still
    refused."""
    from tests.conftest import free_port, wait_for
    from tests.harness import PYTHON, Process
    stack = Stack(tmp_path, tiny_runtime)
    port = free_port()
    stack.config.write_text(json.dumps({**json.loads(stack.config.read_text()), "listen": f"127.0.0.2:{port}"}))
    gateway = Process([PYTHON, "manage.py", "serve", "--config", str(stack.config)], stack.env, tmp_path / "gw.log")

    def ask(host):
        try:
            with socket.create_connection(("127.0.0.2", port), timeout=10) as sock:
                sock.sendall(f"GET {BASE}/capabilities HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
                return read_reply(sock)
        except OSError:
            return None
    try:
        wait_for(lambda: ask(f"127.0.0.2:{port}") is not None, 60, what="the gateway on 127.0.0.2")
        assert_error_body(ask(f"127.0.0.2:{port}"), 401, "unauthenticated")  # (its host allowed: no token)
        assert_error_body(ask("elsewhere.example"), 400, "bad_host")
    finally:
        gateway.kill(signal.SIGTERM)
