"""The client SDK (aotx_client) against a real gateway and device: the client sequence done for
the caller, exact retries through a broken connection and a device outage, several threads and
processes of one participant, a journal hold waited out, results by offset and event streams
with resume."""
import asyncio
import json
import os
import secrets
import subprocess
import threading

import httpx
import pytest

from aotx_client import ApiError, AsyncClient, Client
from gpu_worker.pack import pack_tiny
from tests.conftest import PYTHON, ROOT, wait_for
from tests.harness import Stack

pytestmark = pytest.mark.e2e
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    base = tmp_path_factory.mktemp("sdk")
    runtime = base / "sdk.aotxccir"
    pack_tiny(str(runtime), shared=True, capacity={"receipts": 4096, "conversations": 2048})
    s = Stack(base, str(runtime))
    s.tokens = {name: s.principal(name) for name in ("alice", "bob", "threads", "procs", "flaky", "hold", "moves",
                                                     "sequence")}
    s.boot_device()
    s.serve()
    s.url = f"http://127.0.0.1:{s.port}"
    yield s
    s.stop()


def own_receipts(stack, token):
    """Every live receipt of the token's participant, read with plain HTTP (not the SDK)."""
    items, cursor = [], None
    while True:
        path = "/aotx/v1/shared/operations?limit=200" + (f"&cursor={cursor}" if cursor else "")
        page = json.loads(stack.http("GET", path, token=token)[2])
        items += page["items"]
        cursor = page.get("next_cursor")
        if not cursor:
            return items


def test_the_client_sequence_runs_an_input_and_reads_its_result_and_events(stack):
    with Client(stack.url, stack.tokens["alice"]) as aotx:
        me = aotx.register()
        assert me["registered"] and aotx.register()["id"] == me["id"]  # registering again is a no-op
        space = aotx.create_space()["target"]
        con = aotx.create_conversation(space)["target"]
        op = aotx.submit_input(con, "hello from the SDK", model=MODEL, max_output_tokens=8)["operation"]
        receipt = aotx.wait(op)
        assert receipt["terminal"]["saved"] and receipt["terminal"]["status"] == "succeeded"
        whole = aotx.result(op)
        assert len(whole) == int(receipt["result"]["length"]) and aotx.result(op, 3) == whole[3:]
        events = list(aotx.events(con, stop=lambda e: e.event == "event"))
        assert events[-1].data["operation"] == op and events[-1].id.endswith("@1")
        output = list(aotx.output(op))
        assert output[-1].event == "terminal"
        with pytest.raises(ApiError) as refused:
            aotx.submit_input(con, "x", model="no-such-model")
        assert refused.value.status == 409 and refused.value.code == "model_not_available"
        # the refused mutation's sequence is reused: the next one is admitted without a 409 round
        before = int(aotx.participant()["next_sequence"])
        aotx.create_conversation(space)
        assert int(aotx.participant()["next_sequence"]) == before + 1


def test_a_conversation_stream_resumes_after_a_broken_connection(stack):
    with Client(stack.url, stack.tokens["bob"]) as aotx:
        aotx.register()
        con = aotx.create_conversation(aotx.create_space()["target"])["target"]
        first = aotx.submit_input(con, "one", model=MODEL, max_output_tokens=2)["operation"]
        stream = aotx.events(con)
        seen = [e for e in _take(stream, "event", 1)]
        assert seen[-1].data["operation"] == first
        stream.close()
        second = aotx.submit_input(con, "two", model=MODEL, max_output_tokens=2)["operation"]
        resumed = list(_take(aotx.events(con, cursor=seen[-1].id.rsplit("@", 1)[1]), "event", 1))
        assert [e.data["operation"] for e in resumed if e.event == "event"] == [second]


def _take(stream, event, count):
    for e in stream:
        yield e
        if e.event == event:
            count -= 1
            if count == 0:
                return


class Flaky(httpx.HTTPTransport):
    """Loses the answer of every second POST after the gateway has it: the client sees a broken
    connection for a mutation that was (or was not yet) applied."""

    def __init__(self):
        super().__init__()
        self.posts = 0

    def handle_request(self, request):
        response = super().handle_request(request)
        if request.method == "POST":
            self.posts += 1
            if self.posts % 2 == 0:
                response.read()
                raise httpx.RemoteProtocolError("connection lost after sending", request=request)
        return response


def test_lost_answers_are_retried_exactly_and_apply_once(stack):
    transport = Flaky()
    with Client(stack.url, stack.tokens["flaky"], transport=transport) as aotx:
        aotx.register()
        space = aotx.create_space()["target"]
        made = [aotx.create_conversation(space)["target"] for _ in range(10)]
    assert transport.posts >= 15  # half of the answers were lost and their requests sent again
    assert len(set(made)) == 10
    receipts = own_receipts(stack, stack.tokens["flaky"])
    assert sorted(int(r["sequence"]) for r in receipts) == list(range(1, 13))  # register, space, 10: once each


class Recording(httpx.HTTPTransport):
    def __init__(self):
        super().__init__()
        self.seen = []

    def handle_request(self, request):
        self.seen.append((request.method, request.url.path.removeprefix("/aotx/v1/shared")))
        return super().handle_request(request)


def test_the_client_reads_capabilities_before_its_first_mutation_and_again_when_an_answer_says_they_changed(stack):
    """Issue 53 (SPEC's client sequence: "Read capabilities and the current participant resource"
    before registering or submitting a mutation)."""
    transport = Recording()
    with Client(stack.url, stack.tokens["sequence"], transport=transport, retry_for=0) as aotx:
        aotx.register()
        assert transport.seen[:3] == [("GET", "/capabilities"), ("GET", "/participant"), ("POST", "/participant")]
        assert aotx.known_capabilities["models"][0]["name"] == MODEL
        space = aotx.create_space()["target"]
        con = aotx.create_conversation(space)["target"]
        assert [p for _, p in transport.seen].count("/capabilities") == 1  # read once while nothing changed
        with pytest.raises(ApiError) as refused:
            aotx.submit_input(con, "hi", model="no-such-model")
        assert refused.value.code == "model_not_available" and aotx.known_capabilities is None
        aotx.submit_input(con, "hi", model=MODEL, max_output_tokens=2)
        assert [p for _, p in transport.seen].count("/capabilities") == 2  # read again before the next mutation


class NotPrimary(httpx.HTTPTransport):
    """A gateway on a machine whose device is not the primary (or whose machine is gone): requests
    to `dead` fail to connect, those to `standby` answer 503 not_primary as such a gateway does."""

    def __init__(self, dead, standby):
        super().__init__()
        self.dead, self.standby, self.seen = dead, standby, []

    def handle_request(self, request):
        self.seen.append(request.url.port)
        if request.url.port == self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.port == self.standby:
            return httpx.Response(503, json={"error": {"code": "not_primary", "message": "a standby"}})
        return super().handle_request(request)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_client_given_every_gateway_moves_past_a_lost_machine_and_a_standby_by_itself(stack, asynchronous):
    """Issue 52 (8): a client talked to one gateway; after the primary's machine was lost nothing
    moved it. Given every gateway, it goes on through the one that reaches the primary, with exact
    retries (each mutation applied once)."""
    dead, standby = 9, 19  # (nothing listens there: the transport answers for them)
    urls = [f"http://127.0.0.1:{dead}", f"http://127.0.0.1:{standby}", stack.url]
    transport = NotPrimary(dead, standby)
    token = stack.tokens["moves"]

    async def run_async():
        async with AsyncClient(urls, token, transport=AsyncAdapter(transport), retry_for=30) as aotx:
            await aotx.register()
            return await aotx.create_space()

    if asynchronous:
        space = asyncio.run(run_async())
    else:
        with Client(urls, token, transport=transport, retry_for=30) as aotx:
            aotx.register()
            space = aotx.create_space()
    assert space["kind"] == "space.create"
    assert transport.seen[:2] == [dead, standby] and transport.seen[-1] == stack.port
    receipts = own_receipts(stack, token)
    assert [r["kind"] for r in receipts].count("space.create") == (2 if asynchronous else 1)


class AsyncAdapter(httpx.AsyncBaseTransport):
    """An async transport answering through a blocking one (the test's NotPrimary)."""

    def __init__(self, inner):
        self.inner = inner

    async def handle_async_request(self, request):
        body = await request.aread()
        blocking = httpx.Request(request.method, request.url, headers=request.headers, content=body)
        response = await asyncio.to_thread(self.inner.handle_request, blocking)
        return httpx.Response(response.status_code, headers=response.headers, content=response.read())


def test_eight_threads_of_one_participant_submit_200_mutations_none_lost_or_doubled(stack):
    aotx = Client(stack.url, stack.tokens["threads"])
    aotx.register()
    space = aotx.create_space()["target"]
    made, errors = [], []

    def worker():
        try:
            for _ in range(25):
                made.append(aotx.create_conversation(space)["operation"])
        except Exception as exc:  # reported below
            errors.append(exc)
    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    aotx.close()
    assert not errors and len(made) == len(set(made)) == 200
    sequences = sorted(int(r["sequence"]) for r in own_receipts(stack, stack.tokens["threads"]))
    assert sequences == list(range(1, 203))


CHILD = """
import sys
from aotx_client import Client
url, token, space = sys.argv[1:4]
with Client(url, token) as aotx:
    for _ in range(20):
        print(aotx.create_conversation(space)["operation"], flush=True)
"""


def test_processes_of_one_participant_each_with_its_own_client_lose_and_double_nothing(stack):
    token = stack.tokens["procs"]
    with Client(stack.url, token) as aotx:
        aotx.register()
        space = aotx.create_space()["target"]
    children = [subprocess.Popen([PYTHON, "-c", CHILD, stack.url, token, space], cwd=ROOT, stdout=subprocess.PIPE,
                                 text=True) for _ in range(3)]
    ops = []
    for child in children:
        out, _ = child.communicate(timeout=300)
        assert child.returncode == 0
        ops += out.split()
    assert len(ops) == len(set(ops)) == 60
    assert sorted(int(r["sequence"]) for r in own_receipts(stack, token)) == list(range(1, 63))


def test_a_mutation_sent_while_the_device_is_down_is_applied_once_it_is_back(stack):
    with Client(stack.url, stack.tokens["alice"], retry_for=120) as aotx:
        space = aotx.create_space()["target"]
        stack.device.kill()  # the gateway answers 503 device_unavailable until the device is back
        restarted = threading.Timer(1.0, stack.boot_device)
        restarted.start()
        receipt = aotx.create_conversation(space)
        restarted.join()
        assert receipt["kind"] == "conversation.create"
        assert aotx.receipt(receipt["operation"])["admission"]["saved"]


def test_the_async_client_does_the_same_with_tasks(stack):
    async def run():
        async with AsyncClient(stack.url, stack.tokens["bob"]) as aotx:
            await aotx.register()
            space = (await aotx.create_space())["target"]
            made = await asyncio.gather(*(aotx.create_conversation(space) for _ in range(20)))
            con = made[0]["target"]
            op = (await aotx.submit_input(con, "async hello", model=MODEL, max_output_tokens=4))["operation"]
            receipt = await aotx.wait(op)
            events = [e async for e in aotx.output(op)]
            return made, receipt, events
    made, receipt, events = asyncio.run(run())
    assert len({m["operation"] for m in made}) == 20
    assert receipt["terminal"]["status"] == "succeeded" and events[-1].event == "terminal"


def test_a_journal_hold_is_waited_out(stack, tmp_path):
    from tests.e2e.test_admin_browser import FILE_CAP  # a journal cap small enough to fill in a test
    runtime = tmp_path / "held.aotxccir"
    pack_tiny(str(runtime), shared=True, journal_limits={"journal_file_cap_bytes": FILE_CAP})
    held = Stack(tmp_path, str(runtime))
    token = held.principal("hold")
    held.boot_device()
    held.serve()
    try:
        with Client(f"http://127.0.0.1:{held.port}", token, retry_for=120) as aotx:
            aotx.register()
            while True:  # fill the journal with plain HTTP until it holds
                me = aotx.participant()
                status, _, _ = held.http("POST", "/aotx/v1/shared/spaces", {
                    "schema": "aotx.shared.mutation.v1", "lineage": me["lineage"],
                    "operation_key": secrets.token_hex(16), "sequence": me["next_sequence"]}, token=token)
                if status == 429:
                    break
                assert status == 202
            lifted = threading.Timer(1.0, lambda: held.manage("shell", "-c", "from shared_api.tasks import "
                                                                            "checkpoint; checkpoint()"))
            lifted.start()
            receipt = aotx.create_space()  # 429 journal_hold until the checkpoint lifts it
            lifted.join()
            assert receipt["kind"] == "space.create"
            wait_for(lambda: aotx.receipt(receipt["operation"])["admission"]["saved"], 30, what="saved")
    finally:
        held.stop()


KILLED = """
import os, sys
import httpx
from aotx_client import Client
url, token, space, pending, when = sys.argv[1:6]


class Dies(httpx.HTTPTransport):
    '''The process dies on its first POST: before sending it, or once it was sent (the answer lost).'''
    def handle_request(self, request):
        if request.method == "POST" and when == "before":
            os._exit(9)
        response = super().handle_request(request)
        if request.method == "POST":
            os._exit(9)
        return response


with Client(url, token, pending_dir=pending, transport=Dies()) as aotx:
    aotx.create_conversation(space)
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_client_killed_mid_request_and_restarted_retries_exactly_and_ends_with_one_receipt(stack, tmp_path, when):
    token = stack.principal(f"killed_{when}")
    pending = str(tmp_path / "pending")
    with Client(stack.url, token) as aotx:
        aotx.register()
        space = aotx.create_space()["target"]
    child = subprocess.run([PYTHON, "-c", KILLED, stack.url, token, space, pending, when], cwd=ROOT, timeout=120)
    assert child.returncode == 9
    [left] = os.listdir(pending)  # the mutation's exact bytes, on disk before the first send
    before = own_receipts(stack, token)
    assert len(before) == (3 if when == "after" else 2)  # registration, space (and the conversation)
    with Client(stack.url, token, pending_dir=pending) as aotx:
        [receipt] = aotx.resume()
        assert receipt["kind"] == "conversation.create" and receipt["sequence"] == left.split(".")[0].lstrip("0")
        assert os.listdir(pending) == []
        assert aotx.resume() == []
        after = own_receipts(stack, token)
        assert [r["kind"] for r in after] == ["participant.register", "space.create", "conversation.create"]
        if when == "after":  # it was admitted: the retry answered with the original receipt
            assert after == before
        assert aotx.create_space()["sequence"] == "4"  # the counter goes on past the resumed one
