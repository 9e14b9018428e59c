"""Event streams through the real gateway (granian, Channels consumers) and device: conversation
events pushed as they are saved, operation output then its terminal event, Last-Event-ID
resumption, keep-alive comments, and streams that end when the reader loses the right."""
import base64
import json
import queue
import threading

import httpx
import pytest
from httpx_sse import connect_sse

from aotx_client import Client
from tests.conftest import wait_for
from tests.harness import Stack

pytestmark = pytest.mark.e2e
BASE = "/aotx/v1/shared"


class Follower:
    """An SSE client on its own thread (httpx + httpx-sse); its events collect in a queue."""

    def __init__(self, stack, token, path, headers=None):
        self.events = queue.Queue()
        self.status = None
        self.ended = threading.Event()
        self.comments = 0
        self._client = httpx.Client(base_url=f"http://127.0.0.1:{stack.port}", timeout=httpx.Timeout(30, read=60))
        headers = {"Authorization": f"Bearer {token}", **(headers or {})}
        self._thread = threading.Thread(target=self._run, args=(path, headers), daemon=True)
        self._thread.start()

    def _run(self, path, headers):
        try:
            with connect_sse(self._client, "GET", path, headers=headers) as source:
                self.status = source.response.status_code
                self.content_type = source.response.headers.get("content-type", "")
                self.cache = source.response.headers.get("cache-control")
                if self.status != 200:
                    self.body = source.response.read()
                    return
                for sse in source.iter_sse():
                    self.events.put(sse)
        except (httpx.HTTPError, RuntimeError):
            pass
        finally:
            self.ended.set()

    def take(self, n, timeout=60):
        out = []
        for _ in range(n):
            out.append(self.events.get(timeout=timeout))
        return out

    def close(self):
        self._client.close()
        self._thread.join(10)


def mutate(stack, token, path, fields):
    """A mutation through the client SDK (one client per principal: its sequences are the SDK's)."""
    clients = stack.__dict__.setdefault("clients", {})
    if token not in clients:
        clients[token] = Client(f"http://127.0.0.1:{stack.port}", token, timeout=60)
    return clients[token].mutate(path, fields)


@pytest.fixture(scope="module")
def stack(tiny_runtime, tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("streams"), tiny_runtime)
    s.env["AOTX_SSE_KEEPALIVE"] = "0.3"
    s.tokens = {name: s.principal(name) for name in ("alice", "bob", "carol")}
    s.boot_device()
    s.serve()
    for token in s.tokens.values():
        mutate(s, token, "/participant", {})
    yield s
    for client in s.clients.values():
        client.close()
    s.stop()


@pytest.fixture
def conversation(stack):
    alice, bob = stack.tokens["alice"], stack.tokens["bob"]
    space = mutate(stack, alice, "/spaces", {})["target"]
    par_bob = json.loads(stack.http("GET", f"{BASE}/participant", token=bob)[2])["id"]
    mutate(stack, alice, f"/spaces/{space}/members", {"participant": par_bob, "permissions": ["read", "write"]})
    return space, mutate(stack, alice, f"/spaces/{space}/conversations", {})["target"]


def say(stack, token, conversation, text, **fields):
    return mutate(stack, token, f"/conversations/{conversation}/inputs",
                  {"text": text, "model": "tiny-llama", "max_output_tokens": 8, **fields})


def test_a_conversation_stream_sends_the_backlog_then_each_saved_input_and_resumes(stack, conversation):
    _, con = conversation
    alice, bob = stack.tokens["alice"], stack.tokens["bob"]
    first = say(stack, alice, con, "first")
    path = f"{BASE}/conversations/{con}/events"
    follower = Follower(stack, bob, path + "?stream=true")
    try:
        [backlog] = follower.take(1)
        assert follower.status == 200 and follower.content_type.startswith("text/event-stream")
        assert follower.cache == "no-store"
        assert backlog.event == "event" and backlog.id == f"{path}@1"
        event = json.loads(backlog.data)
        assert event["operation"] == first["operation"] and event["input"]["text"] == "first"
        assert event["sequence"] is None  # alice's input, read by bob
        second = say(stack, bob, con, "second")
        [pushed] = follower.take(1)
        assert pushed.id == f"{path}@2" and json.loads(pushed.data)["operation"] == second["operation"]
        assert json.loads(pushed.data)["sequence"] == second["sequence"]
    finally:
        follower.close()
    resumed = Follower(stack, bob, path + "?stream=true", {"Last-Event-ID": f"{path}@1"})
    try:
        [event] = resumed.take(1)
        assert event.id == f"{path}@2"
        assert resumed.events.empty()
    finally:
        resumed.close()
    listed = json.loads(stack.http("GET", path + "?cursor=1", token=bob)[2])
    assert [e["cursor"] for e in listed["items"]] == ["2"] and listed["gap"] is False


def test_an_idle_stream_gets_keep_alive_comments(stack, conversation):
    _, con = conversation
    path = f"{BASE}/conversations/{con}/events?stream=true"
    with httpx.Client(base_url=f"http://127.0.0.1:{stack.port}", timeout=30) as client:
        with client.stream("GET", path, headers={"Authorization": f"Bearer {stack.tokens['bob']}"}) as response:
            lines = response.iter_lines()
            seen = []
            while sum(1 for line in seen if line == ": keep-alive") < 2:
                seen.append(next(lines))
    assert seen[0] == ": stream open"


def test_an_operation_stream_sends_its_output_then_the_terminal_event_and_ends(stack, conversation):
    _, con = conversation
    alice, bob = stack.tokens["alice"], stack.tokens["bob"]
    receipt = say(stack, alice, con, "tell me a story", max_output_tokens=24)
    path = f"{BASE}/operations/{receipt['operation']}/events"
    follower = Follower(stack, bob, path)
    try:
        assert follower.ended.wait(60)
        events = []
        while not follower.events.empty():
            events.append(follower.events.get())
    finally:
        follower.close()
    *spans, terminal = events
    assert spans and all(e.event == "output" for e in spans) and terminal.event == "terminal"
    data = b"".join(base64.b64decode(json.loads(e.data)["bytes"]) for e in spans)
    result = json.loads(stack.http("GET", f"{BASE}/operations/{receipt['operation']}/result", token=alice)[2])
    assert data == base64.b64decode(result["bytes"])
    assert [e.id for e in spans] == [f"{path}@{json.loads(e.data)['next_offset']}" for e in spans]
    end = json.loads(terminal.data)
    assert end["status"] == "succeeded" and end["terminal"]["saved"] and end["result"]["length"] == str(len(data))
    middle = len(data) // 2
    resumed = Follower(stack, alice, path, {"Last-Event-ID": f"{path}@{middle}"})
    try:
        assert resumed.ended.wait(60)
        span, last = resumed.events.get(), resumed.events.get()
        assert base64.b64decode(json.loads(span.data)["bytes"]) == data[middle:] and last.event == "terminal"
    finally:
        resumed.close()


def test_a_refused_stream_is_one_error_body(stack, conversation):
    _, con = conversation
    carol = stack.tokens["carol"]
    path = f"{BASE}/conversations/{con}/events?stream=true"
    for token, headers, status, code in (
            (carol, {}, 404, "conversation_not_found"), (None, {}, 401, "unauthenticated"),
            (stack.tokens["bob"], {"Last-Event-ID": "elsewhere@3"}, 400, "bad_last_event_id")):
        got, response_headers, body = stack.http("GET", path, token=token, headers=headers)
        assert got == status and json.loads(body)["error"]["code"] == code, body
        assert response_headers["Cache-Control"] == "no-store"
    got, response_headers, _ = stack.http("GET", path, token=None)
    assert response_headers["WWW-Authenticate"] == 'Bearer realm="aotx"'
    got, _, body = stack.http("GET", f"{BASE}/operations/op-{'0' * 32}-{'1' * 32}/events", token=carol)
    assert got == 404 and json.loads(body)["error"]["code"] == "operation_not_found"


def test_disconnecting_never_cancels_the_input(stack, conversation):
    _, con = conversation
    alice = stack.tokens["alice"]
    receipt = say(stack, alice, con, "keep going", max_output_tokens=24)
    with httpx.Client(base_url=f"http://127.0.0.1:{stack.port}", timeout=30) as client:
        with client.stream("GET", f"{BASE}/operations/{receipt['operation']}/events",
                           headers={"Authorization": f"Bearer {alice}"}) as response:
            next(response.iter_lines())
    final = wait_for(lambda: (lambda r: r if r["terminal"]["saved"] else None)(json.loads(
        stack.http("GET", f"{BASE}/operations/{receipt['operation']}", token=alice)[2])), 60, what="terminal")
    assert final["terminal"]["status"] == "succeeded"


def test_a_revoked_grant_or_a_removed_membership_ends_an_open_stream(stack, conversation):
    space, con = conversation
    alice, bob = stack.tokens["alice"], stack.tokens["bob"]
    path = f"{BASE}/conversations/{con}/events?stream=true"
    follower = Follower(stack, bob, path)
    try:
        wait_for(lambda: follower.status == 200, 30, what="the stream to open")
        par_bob = json.loads(stack.http("GET", f"{BASE}/participant", token=bob)[2])["id"]
        mutate(stack, alice, f"/spaces/{space}/members", {"participant": par_bob, "permissions": []})
        assert follower.ended.wait(10), "the stream did not end when the membership went"
        [last] = follower.take(1)
        assert last.event == "error" and json.loads(last.data)["error"]["code"] == "conversation_not_found"
    finally:
        follower.close()
    mutate(stack, alice, f"/spaces/{space}/members", {"participant": par_bob, "permissions": ["read"]})
    follower = Follower(stack, bob, path)
    try:
        wait_for(lambda: follower.status == 200, 30, what="the stream to open again")
        stack.manage("principal", "revoke", "bob", "--actions", "shared_read", "--config", str(stack.config))
        assert follower.ended.wait(10), "the stream did not end when the grant went"
        [last] = follower.take(1)
        assert last.event == "error" and json.loads(last.data)["error"]["code"] == "grant_missing"
    finally:
        follower.close()
        stack.manage("principal", "grant", "bob", "--actions", "shared_read", "--config", str(stack.config))
