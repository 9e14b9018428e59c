"""Forks through the real gateway and device (issue 56; tiny random-weight model): POST
/conversations/{con}/forks through aotx_client, sync and async. The fork is a new conversation in
the source's space; an input in it succeeds, and its event reads start after the fork point while
the source's keep every order; the refusals (a fork point past the end, a taken ID, a source the
caller cannot read, a space it cannot write) change nothing."""
import asyncio
import secrets

import pytest

from tests.harness import Stack

pytestmark = pytest.mark.e2e
MODEL = "tiny-llama"


def _said(aotx, conversation, text):
    done = aotx.wait(aotx.submit_input(conversation, text, MODEL, max_output_tokens=2)["operation"], timeout=60)
    assert done["terminal"]["saved"] and done["terminal"]["status"] == "succeeded", done
    return done


def _cursors(events):
    return [event["cursor"] for event in events["items"]]


def test_a_conversation_is_forked_through_the_sdk_sync_and_async(tmp_path, tiny_runtime):
    from aotx_client import ApiError, AsyncClient, Client
    stack = Stack(tmp_path, tiny_runtime)
    try:
        alice, bob, eve = stack.principal("alice"), stack.principal("bob"), stack.principal("eve")
        stack.boot_device()
        stack.serve()
        url = f"http://127.0.0.1:{stack.port}"
        with Client(url, bob, timeout=60, retry_for=0) as reader:
            par_bob = reader.register()["id"]
        with Client(url, alice, timeout=60, retry_for=0) as aotx:
            aotx.register()
            space = aotx.create_space("room")["target"]
            assert aotx.set_member(space, par_bob, ["read"])["kind"] == "member.set"
            source = aotx.create_conversation(space)["target"]
            for text in ("one", "two", "three"):
                _said(aotx, source, text)

            receipt = aotx.fork_conversation(source, at=2)
            fork = receipt["target"]
            assert receipt["kind"] == "conversation.fork" and fork.startswith("con-") and fork != source
            assert aotx.receipt(receipt["operation"])["target"] == fork
            assert aotx.get(f"/conversations/{fork}")["space"] == space
            listed = [c["id"] for c in aotx.get(f"/spaces/{space}/conversations")["items"]]
            assert listed == [source, fork]

            # an input in the fork succeeds; its event orders go on from the fork point
            done = _said(aotx, fork, "four in the fork")
            events = aotx.get(f"/conversations/{fork}/events")
            assert _cursors(events) == ["3"] and events["items"][0]["operation"] == done["operation"]
            assert events["items"][0]["input"]["text"] == "four in the fork"
            assert events["gap"] is True  # orders 1..2 are the copied history
            after = aotx.get(f"/conversations/{fork}/events", cursor="2")
            assert _cursors(after) == ["3"]
            # the source keeps its own orders, and nothing of the fork's
            source_events = aotx.get(f"/conversations/{source}/events")
            assert _cursors(source_events) == ["1", "2", "3"]
            assert [e["input"]["text"] for e in source_events["items"]] == ["one", "two", "three"]

            # refusals: past the end (naming the source's inputs), a taken id
            with pytest.raises(ApiError) as past:
                aotx.fork_conversation(source, at=4)
            assert (past.value.status, past.value.code, past.value.details.get("inputs")) == \
                (409, "fork_point_past_end", "3")
            named = secrets.token_hex(16)
            assert aotx.fork_conversation(source, at="3", id=named)["target"].endswith(f"-{named}")
            with pytest.raises(ApiError) as taken:
                aotx.fork_conversation(source, at=1, id=named)
            assert (taken.value.status, taken.value.code) == (409, "conversation_exists")
        # bob reads the room but may not write there; eve cannot read it at all
        with Client(url, bob, timeout=60, retry_for=0) as reader:
            with pytest.raises(ApiError) as read_only:
                reader.fork_conversation(source, at=1)
            assert (read_only.value.status, read_only.value.code) == (403, "right_missing")
        with Client(url, eve, timeout=60, retry_for=0) as outsider:
            outsider.register()
            with pytest.raises(ApiError) as hidden:
                outsider.fork_conversation(source, at=1)
            assert (hidden.value.status, hidden.value.code) == (404, "conversation_not_found")

        async def from_async():
            async with AsyncClient(url, alice, timeout=60, retry_for=0) as aotx:
                receipt = await aotx.fork_conversation(source, at="3")
                fork = receipt["target"]
                op = (await aotx.submit_input(fork, "four in the second fork", MODEL, max_output_tokens=2))["operation"]
                done = await aotx.wait(op, timeout=60)
                events = await aotx.get(f"/conversations/{fork}/events")
                return receipt, done, events
        receipt, done, events = asyncio.run(from_async())
        assert receipt["kind"] == "conversation.fork" and receipt["target"] not in (source, fork)
        assert done["terminal"]["status"] == "succeeded", done
        assert _cursors(events) == ["4"] and events["items"][0]["operation"] == done["operation"]
        with Client(url, alice, timeout=60, retry_for=0) as aotx:
            # neither fork's input reached the source
            assert _cursors(aotx.get(f"/conversations/{source}/events")) == ["1", "2", "3"]
            assert _cursors(aotx.get(f"/conversations/{fork}/events")) == ["3"]
    finally:
        stack.stop()
