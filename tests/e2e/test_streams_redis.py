"""Two gateway processes on a real Redis channel layer (channels_redis), as in production: a
mutation through one gateway is seen by a stream open on the other, and a principal revoked
through the gateway database ends its streams in every process at once, through the channel
layer, before the device has heard of it."""
import json
import socket
import subprocess

import pytest

from tests.conftest import PYTHON, ROOT, free_port, wait_for
from tests.e2e.test_streams import Follower, mutate, say
from tests.harness import Process, Stack

pytestmark = pytest.mark.e2e
BASE = "/aotx/v1/shared"


def redis_up():
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture
def two_gateways(tiny_runtime, tmp_path):
    if not redis_up():
        pytest.fail("redis-server is not running on 127.0.0.1:6379 (.ci/run starts it)")
    db = 15  # a database of its own: nothing else on this Redis is touched
    subprocess.run(["redis-cli", "-n", str(db), "FLUSHDB"], check=True, capture_output=True)
    stack = Stack(tmp_path, tiny_runtime)
    stack.env["REDIS_URL"] = f"redis://127.0.0.1:6379/{db}"
    stack.tokens = {name: stack.principal(name) for name in ("alice", "bob")}
    stack.boot_device()
    stack.serve()
    other = tmp_path / "gateway-b.json"
    port = free_port()
    other.write_text(json.dumps({**json.loads(stack.config.read_text()), "listen": f"127.0.0.1:{port}"}))
    second = Process([PYTHON, "manage.py", "serve", "--config", str(other)], {**stack.env,
                     "AOTX_GATEWAY_CONFIG": str(other)}, tmp_path / "gateway-b.log", cwd=ROOT)
    b = Stack.__new__(Stack)  # the same stack seen through the second gateway
    b.__dict__.update(stack.__dict__)
    b.port, b.gateway = port, second
    wait_for(b._listening, 60, what="the second gateway")
    try:
        for token in stack.tokens.values():
            mutate(stack, token, "/participant", {})
        yield stack, b
    finally:
        if second.proc.poll() is None:
            second.kill()
        stack.stop()


def test_a_mutation_through_one_gateway_reaches_a_stream_on_the_other(two_gateways):
    a, b = two_gateways
    alice, bob = a.tokens["alice"], a.tokens["bob"]
    space = mutate(a, alice, "/spaces", {"scope": "instance"})["target"]
    con = mutate(a, alice, f"/spaces/{space}/conversations", {})["target"]
    follower = Follower(b, bob, f"{BASE}/conversations/{con}/events?stream=true")
    try:
        wait_for(lambda: follower.status == 200, 30, what="the stream on gateway B")
        receipt = say(a, alice, con, "through gateway A")
        [event] = follower.take(1)
        assert json.loads(event.data)["operation"] == receipt["operation"]
    finally:
        follower.close()


def test_a_principal_revoked_in_one_gateway_loses_its_streams_in_the_other_through_redis(two_gateways):
    a, b = two_gateways
    alice, bob = a.tokens["alice"], a.tokens["bob"]
    space = mutate(a, alice, "/spaces", {"scope": "instance"})["target"]
    con = mutate(a, alice, f"/spaces/{space}/conversations", {})["target"]
    follower = Follower(b, bob, f"{BASE}/conversations/{con}/events?stream=true")
    try:
        wait_for(lambda: follower.status == 200, 30, what="the stream on gateway B")
        # without --config: the grant file, and so the device, still allow bob; only the
        # gateways' database and the channel layer know
        a.manage("principal", "revoke", "bob")
        assert follower.ended.wait(10), "the stream on gateway B did not end"
        [last] = follower.take(1)
        assert last.event == "error" and json.loads(last.data)["error"]["code"] == "unauthenticated"
    finally:
        follower.close()
