"""Memory through the real gateway and device (tiny random-weight models): an input retains its
text, the memory routes read it back exactly, a publication copies it into a room its members
see, a reader outside gets 404, and the memory stays readable during a journal hold; search,
corrections, forgetting and expiry's time to live through the SDK."""
import base64
import json

import pytest

from gpu_worker.pack import pack_tiny
from tests.conftest import wait_for
from tests.e2e.test_inputs_http import mutate
from tests.harness import Stack

pytestmark = pytest.mark.e2e
BASE = "/aotx/v1/shared"


def get(stack, token, path):
    status, headers, body = stack.http("GET", BASE + path, token=token)
    assert headers.get("Cache-Control") == "no-store"
    return status, json.loads(body)


def test_memory_is_retained_read_published_and_readable_during_a_hold(tmp_path):
    runtime = str(tmp_path / "memory.aotxccir")
    pack_tiny(runtime, shared=True, journal_limits={"journal_file_cap_bytes": 60000})
    stack = Stack(tmp_path, runtime)
    try:
        alice, bob, eve = stack.principal("alice"), stack.principal("bob"), stack.principal("eve")
        stack.boot_device()
        stack.serve()
        for token in (alice, bob, eve):
            assert mutate(stack, token, "/participant", {})[0] == 202
        space = mutate(stack, alice, "/spaces", {})[1]["target"]
        conversation = mutate(stack, alice, f"/spaces/{space}/conversations", {})[1]["target"]
        text = "the meeting moved to thursday — café at 10"
        status, receipt = mutate(stack, alice, f"/conversations/{conversation}/inputs",
                                 {"text": text, "model": "tiny-llama", "max_output_tokens": 4})
        assert status == 202, receipt
        final = wait_for(lambda: (lambda r: r if r["terminal"]["saved"] else None)(
            get(stack, alice, f"/operations/{receipt['operation']}")[1]), 60, what="terminal")
        [obj] = final["memory"]["retained"]
        assert final["memory"]["retention"] == "source" and final["memory"]["context"] == "compact"

        status, listed = get(stack, alice, f"/spaces/{space}/memory")
        assert status == 200 and [row["object"] for row in listed["items"]] == [obj]
        row = listed["items"][0]
        assert row["byte_length"] == str(len(text.encode())) and row["source"] == receipt["operation"]
        status, detail = get(stack, alice, f"/memory/{obj}")
        assert status == 200 and base64.b64decode(detail["bytes"]) == text.encode() and detail["text"] == text
        cut = text.encode().index("é".encode()) + 1  # inside the two-byte é: exact bytes, text null
        status, partial = get(stack, alice, f"/memory/{obj}?offset={cut}")
        assert base64.b64decode(partial["bytes"]) == text.encode()[cut:] and partial["text"] is None

        # bob and eve see nothing of alice's private memory
        assert get(stack, bob, f"/memory/{obj}")[0] == 404
        assert get(stack, bob, f"/spaces/{space}/memory")[1]["error"]["code"] == "space_not_found"

        # alice publishes it into a room bob reads
        room = mutate(stack, alice, "/spaces", {"scope": "room"})[1]["target"]
        par_bob = get(stack, bob, "/participant")[1]["id"]
        assert mutate(stack, alice, f"/spaces/{room}/members", {"participant": par_bob,
                                                                "permissions": ["read"]})[0] == 202
        status, stale = mutate(stack, alice, f"/spaces/{room}/publications", {"source": obj, "source_version": "9"})
        assert (status, stale["error"]["code"]) == (409, "stale_version")
        status, published = mutate(stack, alice, f"/spaces/{room}/publications",
                                   {"source": obj, "source_version": "1"})
        assert status == 202 and published["kind"] == "publication", published
        copy = published["target"]
        status, seen = get(stack, bob, f"/spaces/{room}/memory")
        assert [(r["object"], r["scope"], r["published"]) for r in seen["items"]] == [(copy, "room", True)]
        # bob cannot read the source, and sees where the copy came from
        assert seen["items"][0]["published_from"] == {"object": obj, "version": "1"}
        # a read naming the copy's current version answers, another one 409 with the current one
        assert get(stack, bob, f"/memory/{copy}?version=1")[1]["memory"] == seen["items"][0]
        status, stale = get(stack, bob, f"/memory/{copy}?version=2")
        assert (status, stale["error"]["code"], stale["error"]["version"]) == (409, "stale_version", "1")
        status, bad = get(stack, bob, f"/memory/{copy}?version=one")
        assert (status, bad["error"]["code"]) == (400, "bad_field")
        assert base64.b64decode(get(stack, bob, f"/memory/{copy}")[1]["bytes"]) == text.encode()
        assert get(stack, eve, f"/memory/{copy}")[0] == 404
        # bob may read but not manage the room
        status, refused = mutate(stack, bob, f"/spaces/{room}/publications", {"source": copy, "source_version": "1"})
        assert (status, refused["error"]["code"]) == (403, "right_missing")

        # fill the journal to its file cap: mutations 429, memory stays readable
        while True:
            status, body = mutate(stack, alice, "/spaces", {})
            if status == 429:
                break
            assert status == 202, body
        assert body["error"]["code"] == "journal_hold"
        assert get(stack, bob, f"/spaces/{room}/memory")[1] == seen
        assert base64.b64decode(get(stack, alice, f"/memory/{obj}")[1]["bytes"]) == text.encode()
    finally:
        stack.stop()


def test_memory_search_through_the_sdk_sync_and_async(tmp_path, tiny_runtime):
    """GET /spaces/{spc}/memory/search through aotx_client: the space's rows ranked by similarity,
    the same from the async client; a reader outside gets 404, a blank query 400."""
    import asyncio

    from aotx_client import ApiError, AsyncClient, Client
    stack = Stack(tmp_path, tiny_runtime)
    try:
        alice, eve = stack.principal("alice"), stack.principal("eve")
        stack.boot_device()
        stack.serve()
        url = f"http://127.0.0.1:{stack.port}"
        with Client(url, alice, timeout=60, retry_for=0) as aotx:
            aotx.register()
            space = aotx.create_space()["target"]
            conversation = aotx.create_conversation(space)["target"]
            for text in ("the meeting moved to thursday", "my cat is called tom"):
                aotx.wait(aotx.submit_input(conversation, text, "tiny-llama", max_output_tokens=2)["operation"],
                          timeout=60)
            found = aotx.search_memory(space, "the meeting moved to thursday", limit=5)
            assert len(found) == 2 and found[0]["score"] >= found[1]["score"]
            assert base64.b64decode(aotx.get(f"/memory/{found[0]['memory']['object']}")["bytes"]) == \
                b"the meeting moved to thursday"
            with pytest.raises(ApiError) as blank:
                aotx.search_memory(space, " ")
            assert (blank.value.status, blank.value.code) == (400, "bad_search_query")

        async def from_async():
            async with AsyncClient(url, alice, timeout=60, retry_for=0) as aotx:
                return await aotx.search_memory(space, "the meeting moved to thursday", limit=5)
        assert asyncio.run(from_async()) == found
        with Client(url, eve, timeout=60, retry_for=0) as outsider:
            outsider.register()
            with pytest.raises(ApiError) as hidden:
                outsider.search_memory(space, "thursday")
            assert (hidden.value.status, hidden.value.code) == (404, "space_not_found")
    finally:
        stack.stop()


def test_memory_corrections_through_the_sdk_sync_and_async(tmp_path, tiny_runtime):
    """POST /memory/{mem}/versions through aotx_client (issue 56): the object keeps its ID and moves
    to the next version with the new text, which search ranks from then on; the version it replaced
    is read by version while the correction is live; a stale version is 409 naming the current one;
    the async client corrects with a decimal string; an outsider gets 404."""
    import asyncio

    from aotx_client import ApiError, AsyncClient, Client
    stack = Stack(tmp_path, tiny_runtime)
    try:
        alice, eve = stack.principal("alice"), stack.principal("eve")
        stack.boot_device()
        stack.serve()
        url = f"http://127.0.0.1:{stack.port}"
        with Client(url, alice, timeout=60, retry_for=0) as aotx:
            aotx.register()
            space = aotx.create_space()["target"]
            conversation = aotx.create_conversation(space)["target"]
            done = aotx.wait(aotx.submit_input(conversation, "the meeting is on monday", "tiny-llama",
                                               max_output_tokens=2)["operation"], timeout=60)
            [obj] = done["memory"]["retained"]
            receipt = aotx.correct_memory(obj, "the meeting is on tuesday", version=1)
            assert (receipt["kind"], receipt["target"]) == ("memory.version", obj)
            assert aotx.receipt(receipt["operation"])["target"] == obj
            now = aotx.get(f"/memory/{obj}")
            assert now["memory"]["version"] == "2" and now["text"] == "the meeting is on tuesday"
            before = aotx.get(f"/memory/{obj}", version="1")
            assert before["memory"]["version"] == "1" and before["text"] == "the meeting is on monday"
            [found] = aotx.search_memory(space, "the meeting is on tuesday", limit=5)
            assert found["memory"]["object"] == obj and found["memory"]["version"] == "2"
            with pytest.raises(ApiError) as stale:
                aotx.correct_memory(obj, "the meeting is on friday", version=1)
            assert (stale.value.status, stale.value.code, stale.value.details.get("version")) == \
                (409, "stale_version", "2")

        async def from_async():
            async with AsyncClient(url, alice, timeout=60, retry_for=0) as aotx:
                return await aotx.correct_memory(obj, "the meeting is on wednesday", version="2")
        assert asyncio.run(from_async())["target"] == obj
        with Client(url, alice, timeout=60, retry_for=0) as aotx:
            assert aotx.get(f"/memory/{obj}")["text"] == "the meeting is on wednesday"
        with Client(url, eve, timeout=60, retry_for=0) as outsider:
            outsider.register()
            with pytest.raises(ApiError) as hidden:
                outsider.correct_memory(obj, "mine now", version=3)
            assert (hidden.value.status, hidden.value.code) == (404, "memory_not_found")
    finally:
        stack.stop()


def test_memory_is_forgotten_through_the_sdk_sync_and_async(tmp_path, tiny_runtime):
    """POST /memory/{mem}/deletion through aotx_client (issue 56): the receipt names the object, its
    reads answer 404 from then on and its space's list and search leave it out; the async client
    forgets with a reason; an outsider gets 404."""
    import asyncio

    from aotx_client import ApiError, AsyncClient, Client
    stack = Stack(tmp_path, tiny_runtime)
    try:
        alice, eve = stack.principal("alice"), stack.principal("eve")
        stack.boot_device()
        stack.serve()
        url = f"http://127.0.0.1:{stack.port}"
        with Client(url, alice, timeout=60, retry_for=0) as aotx:
            aotx.register()
            space = aotx.create_space()["target"]
            conversation = aotx.create_conversation(space)["target"]
            objects = []
            for text in ("the meeting is on monday", "my cat is called tom"):
                done = aotx.wait(aotx.submit_input(conversation, text, "tiny-llama", max_output_tokens=2)["operation"],
                                 timeout=60)
                objects += done["memory"]["retained"]
            first, second = objects
        with Client(url, eve, timeout=60, retry_for=0) as outsider:
            outsider.register()
            with pytest.raises(ApiError) as hidden:
                outsider.forget_memory(first)
            assert (hidden.value.status, hidden.value.code) == (404, "memory_not_found")
        with Client(url, alice, timeout=60, retry_for=0) as aotx:
            receipt = aotx.forget_memory(first)
            assert (receipt["kind"], receipt["target"]) == ("memory.delete", first)
            with pytest.raises(ApiError) as gone:
                aotx.get(f"/memory/{first}")
            assert (gone.value.status, gone.value.code) == (404, "memory_not_found")

        async def from_async():
            async with AsyncClient(url, alice, timeout=60, retry_for=0) as aotx:
                return await aotx.forget_memory(second, reason="no longer true")
        assert asyncio.run(from_async())["target"] == second
        with Client(url, alice, timeout=60, retry_for=0) as aotx:
            assert aotx.get(f"/spaces/{space}/memory")["items"] == []
            assert aotx.search_memory(space, "the meeting is on monday") == []
    finally:
        stack.stop()


def test_memory_expiry_is_set_through_the_sdk_sync_and_async(tmp_path, tiny_runtime):
    """memory_ttl_seconds through aotx_client (issue 56, "Expiry"): a space created with one shows
    it; a row retained there expires that long after it was written (`expires_at_ns`, by the
    device's clock, the wall clock here), an input's own time to live wins for its rows, a published
    copy takes its destination's, a space without one shows null and its rows never expire; a
    time to live out of bounds is 400 before the device sees it. The expiry itself (rows gone at
    that instant, forgotten by the device) is tested at the device, whose clock a test can move:
    tests/gpu_worker/kinds/test_memory_expiry.py."""
    import asyncio
    import time

    from aotx_client import ApiError, AsyncClient, Client
    from gpu_worker.contract.limits import MAX_MEMORY_TTL_SECONDS
    second = 1_000_000_000

    def expiry_within(aotx, conversation, text, ttl, **options):
        """Submit `text`; its row, and that its expiry is `ttl` seconds after the row was written."""
        before = time.time_ns()
        done = aotx.wait(aotx.submit_input(conversation, text, "tiny-llama", max_output_tokens=2, **options)[
            "operation"], timeout=60)
        after = time.time_ns()
        [obj] = done["memory"]["retained"]
        row = aotx.get(f"/memory/{obj}")["memory"]
        assert before + ttl * second - second <= int(row["expires_at_ns"]) <= after + ttl * second + second, row
        return row

    stack = Stack(tmp_path, tiny_runtime)
    try:
        alice = stack.principal("alice")
        stack.boot_device()
        stack.serve()
        url = f"http://127.0.0.1:{stack.port}"
        with Client(url, alice, timeout=60, retry_for=0) as aotx:
            aotx.register()
            space = aotx.create_space(memory_ttl_seconds=3600)["target"]
            assert aotx.get(f"/spaces/{space}")["memory_ttl_seconds"] == "3600"
            assert [s["memory_ttl_seconds"] for s in aotx.get("/spaces")["items"] if s["id"] == space] == ["3600"]
            conversation = aotx.create_conversation(space)["target"]
            # the space's time to live, then an input's own
            row = expiry_within(aotx, conversation, "the meeting moved to thursday", 3600)
            own = expiry_within(aotx, conversation, "my cat is called tom", 60, memory_ttl_seconds=60)
            assert int(own["expires_at_ns"]) < int(row["expires_at_ns"])
            # every read shows it: the list, search
            listed = {r["object"]: r["expires_at_ns"] for r in aotx.get(f"/spaces/{space}/memory")["items"]}
            assert listed == {row["object"]: row["expires_at_ns"], own["object"]: own["expires_at_ns"]}
            found = aotx.search_memory(space, "the meeting moved to thursday", limit=5)
            assert {f["memory"]["object"]: f["memory"]["expires_at_ns"] for f in found} == listed

            # a space without a time to live: null, and its rows never expire
            plain = aotx.create_space()["target"]
            assert aotx.get(f"/spaces/{plain}")["memory_ttl_seconds"] is None
            kept = aotx.wait(aotx.submit_input(aotx.create_conversation(plain)["target"], "keep this forever",
                                               "tiny-llama", max_output_tokens=2)["operation"], timeout=60)
            [obj] = kept["memory"]["retained"]
            assert aotx.get(f"/memory/{obj}")["memory"]["expires_at_ns"] is None
            # ... until it is published into a room with one: the copy takes its destination's
            room = aotx.create_space("room", memory_ttl_seconds=120)["target"]
            before = time.time_ns()
            copy = aotx.mutate(f"/spaces/{room}/publications", {"source": obj, "source_version": "1"})["target"]
            after = time.time_ns()
            expires = int(aotx.get(f"/memory/{copy}")["memory"]["expires_at_ns"])
            assert before + 119 * second <= expires <= after + 121 * second
            assert aotx.get(f"/memory/{obj}")["memory"]["expires_at_ns"] is None  # the source keeps its own

            # out of bounds: 400 bad_field, nothing created
            spaces = len(aotx.get("/spaces", limit="200")["items"])
            for ttl in (0, -5, MAX_MEMORY_TTL_SECONDS + 1):
                with pytest.raises(ApiError) as refused:
                    aotx.create_space(memory_ttl_seconds=ttl)
                assert (refused.value.status, refused.value.code) == (400, "bad_field")
            with pytest.raises(ApiError) as refused:
                aotx.submit_input(conversation, "x", "tiny-llama", memory_ttl_seconds=0)
            assert (refused.value.status, refused.value.code) == (400, "bad_field")
            assert len(aotx.get("/spaces", limit="200")["items"]) == spaces
            # (the sequences those refusals took are given back: the next mutation is admitted)
            assert aotx.create_space(memory_ttl_seconds=1)["kind"] == "space.create"

        async def from_async():
            async with AsyncClient(url, alice, timeout=60, retry_for=0) as aotx:
                return (await aotx.create_space("room", memory_ttl_seconds=MAX_MEMORY_TTL_SECONDS))["target"]
        made = asyncio.run(from_async())
        with Client(url, alice, timeout=60, retry_for=0) as aotx:
            assert aotx.get(f"/spaces/{made}")["memory_ttl_seconds"] == str(MAX_MEMORY_TTL_SECONDS)
    finally:
        stack.stop()
