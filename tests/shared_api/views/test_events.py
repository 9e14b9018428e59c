"""GET /aotx/v1/shared/conversations/{conversation}/events (`conversations.events`, the plain
read) and GET /aotx/v1/shared/operations/{operation}/events, as Django's entry point sees them.
The streams themselves (`stream=true`, and every operation event read) are served by the ASGI
application's Channels consumers before Django sees them: tests/e2e/test_streams.py."""
import pytest
from django.test import Client

from .conftest import (BAD_AUTHORIZATIONS, BAD_CURSORS, BAD_LIMITS, BASE, HOLDER, action_of, assert_error,
                       assert_passed_through, assert_request, assert_unauthenticated, bad_ids, conversation_id,
                       lacking, operation_id)

OP = "conversations.events"
ACTION = action_of(OP)


def path(conversation):
    return f"{BASE}/conversations/{conversation}/events"


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_it_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.get(path(conversation_id()), authorization=authorization))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(ACTION))
def test_it_refuses_a_principal_without_the_read_action(gateway, device, people, name):
    assert_error(gateway.get(path(conversation_id()), people[name]), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("bad", bad_ids("con"))
def test_it_rejects_a_malformed_conversation_id(gateway, device, people, bad):
    assert_error(gateway.get(path(bad), people["reader"]), 400, "bad_id")
    assert device.requests == []


@pytest.mark.parametrize("limit", BAD_LIMITS)
def test_it_rejects_a_bad_limit(gateway, device, people, limit):
    assert_error(gateway.get(f"{path(conversation_id())}?limit={limit}", people["reader"]), 400, "bad_limit")
    assert device.requests == []


@pytest.mark.parametrize("cursor", BAD_CURSORS)
def test_it_rejects_a_bad_cursor(gateway, device, people, cursor):
    assert_error(gateway.get(f"{path(conversation_id())}?cursor={cursor}", people["reader"]), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("query", ["stream=yes", "stream=1", "stream=", "offset=3"])
def test_it_rejects_a_bad_stream_flag_or_an_unknown_parameter(gateway, device, people, query):
    response = gateway.get(f"{path(conversation_id())}?{query}", people["reader"])
    assert response.status_code == 400
    assert device.requests == []


def test_it_sends_the_conversation_and_the_paging_args(gateway, device, people):
    conversation = conversation_id()
    body = b'{"event_floor":"3","gap":true,"items":[],"next_cursor":null}'
    device.answer(200, body)
    persona = people[HOLDER[ACTION]]
    assert_passed_through(gateway.get(f"{path(conversation)}?cursor=2&limit=5&stream=false", persona), 200, body)
    assert_request(device.only_request(), OP, persona.principal_id,
                   {"conversation": conversation, "cursor": "2", "limit": 5})


def test_a_shared_route_that_reaches_django_is_a_deployment_error(device, people):
    """Django's own entry point (its test client here) answers no shared route, streams included:
    the ASGI front hands streams to their consumers and answers the rest itself, so a request that
    reached Django came around it. Nothing reaches the device."""
    client = Client(HTTP_AUTHORIZATION=people["reader"].authorization)
    for url in (f"{path(conversation_id())}?stream=true", f"{BASE}/operations/{operation_id()}/events",
                f"{BASE}/spaces"):
        error = assert_error(client.get(url), 500, "internal_error")
        assert "aotx_site.gateway:application" in error["message"]
    assert device.requests == []


@pytest.mark.parametrize("bad", bad_ids("op"))
def test_an_operation_stream_rejects_a_malformed_operation_id(gateway, device, people, bad):
    assert_error(gateway.get(f"{BASE}/operations/{bad}/events", people["reader"]), 400, "bad_id")
    assert device.requests == []


def subscription_frames(count):
    """A fake device's answer to `conversations.subscribe`: the open frame, then `count` events
    (and the subscription stays open, as a live conversation's does)."""
    frames = [{"status": 200, "more": True, "event": "open", "body": b'{"event_floor":"1"}'},
              {"status": 200, "more": True, "event": "gap", "cursor": "0", "body": b'{"event_floor":"1","gap":true}'}]
    frames += [{"status": 200, "more": True, "event": "event", "cursor": str(n), "body": b'{"cursor":"%d"}' % n}
               for n in range(1, count + 1)]
    return frames


def test_a_conversation_stream_ends_after_limit_events_and_closes_its_subscription(gateway, device, people):
    """`limit` on a stream was checked and then ignored: the stream ran on. Now the stream ends
    after `limit` events (a `gap` is not an event), and its device subscription is closed; a client
    resumes with Last-Event-ID from the last one."""
    import asyncio
    from asgiref.sync import async_to_sync
    from shared_api import device_client
    from .conftest import rsgi_request

    def handler(req):
        if req["op"] == "conversations.subscribe":
            return subscription_frames(5)
        return 200, b'{"closed":true}'
    device.handler = handler
    conversation = conversation_id()
    persona = people[HOLDER[ACTION]]
    method, url, headers, raw = gateway.request("GET", f"{path(conversation)}?stream=true&limit=2&cursor=0", persona)

    async def run():
        try:  # bounded: a stream that ignores `limit` never ends
            return await asyncio.wait_for(rsgi_request(method, url, headers, raw), 30)
        finally:
            await device_client.aclose_loop()
    response = async_to_sync(run)()
    assert response.status_code == 200 and response["Content-Type"].startswith("text/event-stream")
    events = [block for block in response.content.decode().split("\n\n") if "\nevent: " in f"\n{block}"]
    kinds = [line.split(": ", 1)[1] for block in events for line in block.split("\n") if line.startswith("event: ")]
    assert kinds == ["gap", "event", "event"], response.content
    assert events[-1].startswith(f"id: {path(conversation)}@2\n")
    opened = next(r for r in device.requests if r["op"] == "conversations.subscribe")
    assert opened["args"] == {"conversation": conversation, "cursor": "0"}
    closes = [r for r in device.requests if r["op"] == "subscriptions.close"]
    assert [c["args"] for c in closes] == [{"id": opened["id"]}]
