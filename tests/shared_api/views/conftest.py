"""The fake device, the gateway pointed at it, the personas, and helpers to call the gateway.

FakeDevice serves a Unix socket with the real frame protocol (FrameReader in, encode_reply(reply)
out), records every request map it receives and answers with a per-test handler. A handler gets
the request map and returns
  - (status, body) or (status, body, headers): one reply frame;
  - a list of reply maps (e.g. `{"status": 200, "body": b"Hel", "more": True}`), sent one frame at a
    time, each given the request's `id` unless it names one, or of Replies (wire.reply), sent as
    they are;
    a number in that list pauses the answer that many seconds;
  - None: no answer to this request;
  - HANG_UP: close the connection without answering.
`device.silent = True` never answers anything; `device.stop()` removes the socket.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import select
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import rfc8785
from asgiref.sync import async_to_sync

from gpu_worker.contract.commands import TYPES, parse, typed
from gpu_worker.contract.vocabulary import CHAT, COMMANDS, MANAGE, MUTATION_SCHEMA, READ, WRITE
from gpu_worker.contract.wire import (PROTOCOL_VERSION, FrameReader, ProtocolError, Reply, encode_frame, encode_reply,
                                     reply)
from shared_api import device_client
from shared_api.models import Principal
from tests import rsgi

BASE = "/aotx/v1/shared"
OK_BODY = b'{"ok":true}'
WWW_AUTHENTICATE = 'Bearer realm="aotx"'
DEVICE_TIMEOUT = 0.3

Handler = Callable[[dict[str, Any]], Any]
HANG_UP = object()


def ok_handler(req: dict[str, Any]) -> tuple[int, bytes]:
    return 200, OK_BODY


class FakeDevice:
    def __init__(self, path: str) -> None:
        self.path = path
        self.handler: Handler = ok_handler
        self.silent = False
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self.hangups = 0  # connections the gateway closed
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []

    # ---- lifecycle
    def start(self) -> FakeDevice:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(64)
        self._listener = listener
        self._accepting = threading.Thread(target=self._accept, args=(listener,), daemon=True,
                                           name="fake-device-accept")
        self._accepting.start()
        return self

    def stop(self) -> None:
        """The device is gone: the socket file is removed and every connection closed."""
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
            except OSError:
                pass
            listener.close()
        if os.path.exists(self.path):
            os.unlink(self.path)
        with self._lock:
            conns, self._conns = self._conns, []
            threads, self._threads = self._threads, []
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes recv()
            except OSError:
                pass
        if self._accepting is not None:
            self._accepting.join(5)
            assert not self._accepting.is_alive(), "the fake device's accept thread did not stop"
            self._accepting = None
        for thread in threads:
            thread.join(5)
            assert not thread.is_alive(), "a fake device connection thread did not stop"
        for conn in conns:
            conn.close()

    def restart(self) -> None:
        self.stop()
        self.start()

    # ---- per-test behaviour
    def answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.handler = lambda req: (status, body, headers)

    def only_request(self) -> dict[str, Any]:
        """The one request the device received (and it must be exactly one)."""
        with self._lock:
            requests = list(self.requests)
        assert len(requests) == 1, f"expected one device request, got {[r.get('op') for r in requests]}"
        return requests[0]

    # ---- serving
    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True, name="fake-device-conn")
            with self._lock:
                if self._listener is not listener:  # stopped meanwhile
                    conn.close()
                    return
                self.connections += 1
                self._conns.append(conn)
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_frames(conn)
        finally:
            conn.close()

    def _serve_frames(self, conn: socket.socket) -> None:
        frames = FrameReader()
        # once a reply cannot be sent (the gateway closed its side), the frames it wrote before
        # closing are still read and recorded, as the device reads them: nothing more is sent
        replying = True
        while True:
            try:
                data = conn.recv(1 << 16)
            except OSError:
                return
            if not data:
                with self._lock:
                    self.hangups += 1
                return
            try:
                messages = frames.feed(data)
            except ProtocolError as exc:
                self.errors.append(exc)
                return
            for req in messages:
                with self._lock:
                    self.requests.append(req)
                if self.silent:
                    continue
                try:
                    out = self._frames(req)
                except Exception as exc:  # a broken handler fails the test at teardown
                    self.errors.append(exc)
                    return
                if out is HANG_UP:
                    return
                try:
                    for frame in out if replying else ():
                        if isinstance(frame, float):
                            time.sleep(frame)  # a slow device is the behaviour under test (at least this long)
                        else:
                            conn.sendall(frame)
                except OSError:
                    replying = False

    def _frames(self, req: dict[str, Any]) -> Any:
        result = self.handler(req)
        if result is HANG_UP:
            return HANG_UP
        if result is None:
            return []
        if isinstance(result, tuple):
            status, body, *rest = result
            return [encode_reply(reply(req.get("id"), status, body, rest[0] if rest else None))]
        return [float(msg) if isinstance(msg, (int, float)) else encode_reply(msg) if isinstance(msg, Reply)
                else encode_frame({"id": req.get("id"), **msg}) for msg in result]


@pytest.fixture
def device(settings, tmp_path):
    """A running fake device, and the gateway configured to reach it."""
    # AF_UNIX paths are limited to ~107 bytes: keep the socket in a short directory
    directory = tempfile.mkdtemp(prefix="aotx-fake-")
    fake = FakeDevice(os.path.join(directory, "service.sock")).start()
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"listen": "127.0.0.1:8000", "socket": fake.path,
                                  "grants_file": str(tmp_path / "grants.json")}))
    settings.AOTX_GATEWAY_CONFIG = str(config)
    settings.AOTX_DEVICE_TIMEOUT = DEVICE_TIMEOUT
    device_client.reset()
    try:
        yield fake
    finally:
        device_client.reset()  # closes the pooled connections
        fake.stop()
        shutil.rmtree(directory, ignore_errors=True)
    assert not fake.errors, f"the fake device failed: {fake.errors!r}"


# ---- personas ------------------------------------------------------------------------------

PERSONAS = {
    "reader": [READ],
    "writer": [READ, WRITE],
    "manager": [READ, WRITE, MANAGE],
    "chatter": [CHAT],
    "nobody": [],
}
# the persona with the fewest actions that holds each action
HOLDER = {READ: "reader", WRITE: "writer", MANAGE: "manager", CHAT: "chatter"}


def lacking(action: str) -> list[str]:
    """Names of the (active) personas without `action`."""
    return [name for name, actions in PERSONAS.items() if action not in actions]


def action_of(op: str) -> str:
    action = COMMANDS[op].action
    assert action is not None
    return action


@dataclass
class Persona:
    name: str
    principal_id: str
    token: str

    @property
    def authorization(self) -> str:
        return f"Bearer {self.token}"


@pytest.fixture
def people(db) -> dict[str, Persona]:
    """Every persona of PERSONAS, plus `revoked` (all actions, active=False)."""
    out = {}
    for name, actions in PERSONAS.items():
        principal, token = Principal.create(name, actions)
        out[name] = Persona(name, principal.principal_id, token)
    principal, token = Principal.create("revoked", [READ, WRITE, MANAGE, CHAT])
    principal.active = False
    principal.save()
    out["revoked"] = Persona("revoked", principal.principal_id, token)
    return out


# ---- calling the gateway -------------------------------------------------------------------

class Response:
    """An answer of the gateway's application, with the attributes tests read of Django's."""

    streaming = False

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], content: bytes) -> None:
        self.status_code = status
        self.headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in headers}
        self.header_list = headers
        self.content = content

    def __getitem__(self, name: str) -> str:
        return self.headers[name.lower()]

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)

    def has_header(self, name: str) -> bool:
        return name.lower() in self.headers

    def json(self) -> Any:
        return json.loads(self.content)


def meta_headers(extra: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """Django test-client style extras (HTTP_X_Y, CONTENT_TYPE) as request headers."""
    out = []
    for key, value in extra.items():
        if key.startswith("HTTP_"):
            name = key[5:]
        elif key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            name = key
        else:
            raise ValueError(f"unsupported test request extra {key!r}")
        out.append((name.replace("_", "-").lower().encode("latin-1"), str(value).encode("latin-1")))
    return out


async def rsgi_request(method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes,
                       chunks: list[bytes] | None = None) -> Response:
    """One request through the gateway's application, as the server hands it over (tests/rsgi.py)."""
    from aotx_site.gateway import application
    proto = await rsgi.request(application, method, path, headers, list(chunks) if chunks is not None else [body])
    assert proto.status is not None, "the application answered nothing"
    return Response(proto.status, [(name.encode("latin-1"), value.encode("latin-1")) for name, value in proto.headers],
                    bytes(proto.body))


class Gateway:
    """Requests through the gateway's application with the gateway's conventions: a persona's
    bearer token, JSON bodies. Each call runs in an event loop of its own (its device connections
    are closed at its end); `session` runs several calls in one loop, as one server process would."""

    def request(self, method: str, path: str, persona: Persona | None = None, *, body: Any = None,
                raw: bytes | None = None, content_type: str = "application/json",
                authorization: str | None = None, **extra: Any) -> tuple[str, str, list[tuple[bytes, bytes]], bytes]:
        headers = [(b"host", b"testserver")]
        if authorization is not None:
            headers.append((b"authorization", authorization.encode("latin-1")))
        elif persona is not None:
            headers.append((b"authorization", persona.authorization.encode("latin-1")))
        if raw is None:
            raw = b"" if body is None else json.dumps(body).encode()
        if raw or method not in ("GET", "HEAD"):
            headers.append((b"content-type", content_type.encode("latin-1")))
            headers.append((b"content-length", str(len(raw)).encode()))
        headers += meta_headers(extra)
        return method, path, headers, raw

    def call(self, method: str, path: str, persona: Persona | None = None, **kwargs: Any) -> Response:
        return self.session([self.request(method, path, persona, **kwargs)])[0]

    def session(self, requests: list[Any]) -> list[Response]:
        """Requests (from `request`) in one event loop, in order; a callable among them runs
        between two requests (e.g. `device.restart`), and then the loop takes in what it did to the
        device connections (as the time between two requests would): the next request starts once
        no connection of the loop has unread input or an unseen close."""
        async def run() -> list[Response]:
            answers = []
            try:
                for req in requests:
                    if callable(req):
                        req()
                        await until(connections_settled, what="the gateway's device connections to take in "
                                                              f"what {getattr(req, '__name__', req)} did")
                    else:
                        answers.append(await rsgi_request(*req))
                return answers
            finally:
                await device_client.aclose_loop()
        return async_to_sync(run)()

    def get(self, path: str, persona: Persona | None = None, **kwargs: Any) -> Response:
        return self.call("GET", path, persona, **kwargs)

    def post(self, path: str, persona: Persona | None = None, body: Any = None, **kwargs: Any) -> Response:
        return self.call("POST", path, persona, body=body, **kwargs)

    def put(self, path: str, persona: Persona | None = None, **kwargs: Any) -> Response:
        return self.call("PUT", path, persona, **kwargs)


async def until(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """tests.conftest.wait_for on the running event loop: the loop runs meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := condition()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)
    return value


def connections_settled() -> bool:
    """Whether every open device connection of the running loop (its DevicePool's and its stream
    DeviceMux) has taken in what its socket holds: nothing readable, no close not yet seen. A
    connection the device closed is readable (EOF) until its reader task has ended it."""
    loop = asyncio.get_running_loop()
    found = device_client._pools.get(loop)
    muxes = [*(found.muxes if found is not None else []), *filter(None, [device_client._muxes.get(loop)])]
    for mux in muxes:
        writer = mux._writer
        if writer is None or writer.is_closing():
            continue
        sock = writer.get_extra_info("socket")
        if sock is not None and select.select([sock.fileno()], [], [], 0)[0]:
            return False
    return True


@pytest.fixture
def gateway(device) -> Gateway:
    return Gateway()


def hex32() -> str:
    return secrets.token_hex(16)


def envelope(**fields: Any) -> dict[str, Any]:
    """A valid mutation body: the envelope (fresh lineage and nonzero key, sequence "1") plus fields."""
    key = hex32()
    while int(key, 16) == 0:
        key = hex32()
    return {"schema": MUTATION_SCHEMA, "lineage": hex32(), "operation_key": key, "sequence": "1", **fields}


def canonical(path: str, body: dict[str, Any], method: str = "POST") -> bytes:
    return rfc8785.dumps({"method": method, "path": path, "body": body})


def mutation_args(path: str, body: dict[str, Any], **own: Any) -> dict[str, Any]:
    """The device args a valid mutation must produce: the envelope's values, the canonical bytes of
    the body as sent, and the route's own fields as the view passes them."""
    return {"lineage": body["lineage"], "operation_key": body["operation_key"], "sequence": int(body["sequence"]),
            "canonical": canonical(path, body), **own}


def space_id() -> str:
    return f"spc-{hex32()}-{hex32()}"


def conversation_id() -> str:
    return f"con-{hex32()}-{hex32()}"


def operation_id() -> str:
    return f"op-{hex32()}-{hex32()}"


def participant_id() -> str:
    return f"par-{hex32()}"


def memory_id() -> str:
    return f"mem-{hex32()}-{hex32()}"


# ---- assertions ----------------------------------------------------------------------------

def assert_error(response, status: int, code: str, **details: Any) -> dict[str, Any]:
    """The one error body {"error": {"code", "message", ...details}}, with no-store."""
    assert response.status_code == status, (response.status_code, response.content[:300])
    assert response["Content-Type"] == "application/json"
    assert response["Cache-Control"] == "no-store"
    doc = json.loads(response.content)
    assert set(doc) == {"error"}, doc
    error = doc["error"]
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"], error
    for name, value in details.items():
        assert error[name] == value, error
    return error


def assert_unauthenticated(response) -> None:
    assert_error(response, 401, "unauthenticated")
    assert response["WWW-Authenticate"] == WWW_AUTHENTICATE


def assert_openai_error(response, status: int, code: str, type_: str) -> dict[str, Any]:
    """OpenAI's error shape {"error": {"message", "type", "param", "code"}}, with no-store."""
    assert response.status_code == status, (response.status_code, response.content[:300])
    assert response["Content-Type"] == "application/json"
    assert response["Cache-Control"] == "no-store"
    doc = json.loads(response.content)
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}, doc
    error = doc["error"]
    assert error["code"] == code and error["type"] == type_, error
    assert isinstance(error["message"], str) and error["message"], error
    return error


def assert_passed_through(response, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
    assert response.status_code == status
    assert response.content == body
    assert response["Content-Type"] == "application/json"
    assert response["Cache-Control"] == "no-store"
    for name, value in (headers or {}).items():
        assert response[name] == value


def assert_request(req: dict[str, Any], op: str, principal: str, args: dict[str, Any]) -> None:
    """One device request map, all of it: `args` read back as the command's declared type are
    `args` as that type (gpu_worker/contract/commands.py: a default may be left out of the frame,
    numbers are in the field's type), and the frame holds nothing else."""
    assert set(req) == {"v", "id", "op", "principal", "args"}, req
    assert req["v"] == PROTOCOL_VERSION
    assert isinstance(req["id"], int)
    assert req["op"] == op
    assert req["principal"] == principal
    expected = typed(op, args)
    assert parse(TYPES[op], req["args"]) == expected
    assert set(req["args"]) <= set(args), req["args"]
    for name, value in req["args"].items():  # == would let 1 match 1.0 and True; the types must match too
        assert type(value) is type(getattr(expected, name)), (name, value)


# authorization headers that must be refused with 401 (None: no header at all)
BAD_AUTHORIZATIONS = [
    pytest.param(None, id="no-header"),
    pytest.param("Basic dXNlcjpwYXNz", id="basic-scheme"),
    pytest.param("Bearer", id="bearer-without-token"),
    pytest.param("Bearer    ", id="bearer-with-blank-token"),
    pytest.param("aotx_sometoken", id="token-without-scheme"),
    pytest.param("Bearer aotx_" + "x" * 43, id="unknown-token"),
]


# ---- malformed mutation bodies -------------------------------------------------------------
# Each builds the raw bytes sent from a valid body of the route; all are refused before the
# device sees anything.

def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _with(**changes: Any) -> Callable[[dict[str, Any]], bytes]:
    return lambda body: _json({**body, **changes})


def _append(raw: bytes) -> Callable[[dict[str, Any]], bytes]:
    """The valid body with raw bytes spliced in before its closing brace."""
    return lambda body: _json(body)[:-1] + raw + b"}"


MALFORMED_BODIES = [
    pytest.param(lambda body: b"{nope", 400, "invalid_json", id="not-json"),
    pytest.param(lambda body: b"[]", 400, "invalid_json", id="an-array"),
    pytest.param(lambda body: b'"schema"', 400, "invalid_json", id="a-string"),
    pytest.param(_append(b', "pad": NaN'), 400, "invalid_json", id="nan"),
    pytest.param(_append(b', "pad": "\xff\xfe"'), 400, "invalid_utf8", id="invalid-utf8"),
    pytest.param(_append(b', "schema": "aotx.shared.mutation.v1"'), 400, "duplicate_key", id="duplicate-key"),
    pytest.param(lambda body: b"", 400, "missing_field", id="empty-body"),
    pytest.param(_with(schema="aotx.shared.mutation.v2"), 400, "bad_field", id="wrong-schema"),
    pytest.param(_with(schema=None), 400, "bad_field", id="null-schema"),
    pytest.param(_with(lineage="A" * 32), 400, "bad_field", id="uppercase-lineage"),
    pytest.param(_with(lineage="a" * 31), 400, "bad_field", id="short-lineage"),
    pytest.param(_with(lineage="a" * 32 + "\n"), 400, "bad_field", id="lineage-with-newline"),
    pytest.param(_with(lineage=1), 400, "bad_field", id="integer-lineage"),
    pytest.param(_with(operation_key="0" * 32), 400, "bad_field", id="zero-operation-key"),
    pytest.param(_with(operation_key="g" * 32), 400, "bad_field", id="non-hex-operation-key"),
    pytest.param(_with(sequence="0"), 400, "bad_field", id="sequence-0"),
    pytest.param(_with(sequence="01"), 400, "bad_field", id="sequence-01"),
    pytest.param(_with(sequence="1.0"), 400, "bad_field", id="sequence-1.0-string"),
    pytest.param(_with(sequence=1), 400, "bad_field", id="sequence-integer"),
    pytest.param(_with(sequence=1.0), 400, "bad_field", id="sequence-float"),
    pytest.param(_with(sequence="-1"), 400, "bad_field", id="sequence-negative"),
    pytest.param(_with(sequence="1\n"), 400, "bad_field", id="sequence-with-newline"),
    pytest.param(_with(sequence="\u0661"), 400, "bad_field", id="sequence-arabic-indic-digit"),
    pytest.param(_with(sequence=str(1 << 63)), 400, "bad_field", id="sequence-2-to-the-63"),
    pytest.param(_with(pad="x" * 65536), 413, "body_too_large", id="body-too-large"),
]


def without(body: dict[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in names}


def bad_ids(prefix: str) -> list[Any]:
    """Path segments (URL-encoded where needed) that are not a valid ID of this prefix."""
    a, other = "a" * 32, "con" if prefix != "con" else "spc"
    if prefix == "par":
        shapes = {"uppercase": f"par-{'A' * 32}", "short": f"par-{'a' * 31}", "two-parts": f"par-{a}-{a}",
                  "other-prefix": f"spc-{a}", "no-prefix": a, "trailing-newline": f"par-{a}%0A",
                  "fullwidth-digits": "par-" + "%EF%BC%91" * 32}
    else:
        shapes = {"uppercase": f"{prefix}-{'A' * 32}-{a}", "short": f"{prefix}-{a}-{'a' * 31}",
                  "one-part": f"{prefix}-{a}", "three-parts": f"{prefix}-{a}-{a}-{a}",
                  "other-prefix": f"{other}-{a}-{a}", "non-hex": f"{prefix}-{a}-{'g' * 32}",
                  "trailing-newline": f"{prefix}-{a}-{a}%0A", "fullwidth-digits": f"{prefix}-{a}-" + "%EF%BC%91" * 32}
    return [pytest.param(value, id=name) for name, value in shapes.items()]


BAD_LIMITS = [pytest.param(v, id=f"limit={v}") for v in ("0", "201", "-1", "abc", "1.5", "%C2%B2", "%D9%A3", "")]
BAD_CURSORS = [pytest.param(v, id=f"cursor={v}") for v in ("01", "-1", "abc", "1.0", "9223372036854775808", "")]
