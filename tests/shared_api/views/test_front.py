"""The HTTP front itself (shared_api/http/front.py), through the gateway's application: what it
answers from the headers alone, and its bound on requests waiting for the device."""
import asyncio
import threading

from asgiref.sync import async_to_sync

from shared_api import device_client
from tests import rsgi

from .conftest import BASE, OK_BODY, rsgi_request, assert_error, assert_unauthenticated, envelope, until

SPACES = f"{BASE}/spaces"


async def unread_body_request(method, path, headers):
    """rsgi_request whose body must never be read: (status, headers, body) of the answer."""
    from aotx_site.gateway import application
    proto = await rsgi.request(application, method, path, headers, [b"x" * 1024])
    assert proto.reads == 0, "the front read the body"
    return proto.status, {name.encode(): value.encode() for name, value in proto.headers}, bytes(proto.body)


def test_an_unauthenticated_post_is_answered_401_without_reading_its_body(gateway, device, people):
    status, headers, body = async_to_sync(unread_body_request)(
        "POST", SPACES, [(b"content-type", b"application/json"), (b"content-length", str(1 << 30).encode())])
    assert status == 401 and b'"unauthenticated"' in body
    assert headers[b"www-authenticate"] == b'Bearer realm="aotx"' and headers[b"connection"] == b"close"
    assert device.requests == []


def test_a_post_over_the_route_limit_is_answered_413_without_reading_its_body(gateway, device, people):
    status, headers, body = async_to_sync(unread_body_request)(
        "POST", SPACES, [(b"authorization", people["writer"].authorization.encode()),
                         (b"content-type", b"application/json"), (b"content-length", b"65537")])
    assert status == 413 and b'"body_too_large"' in body and headers[b"connection"] == b"close"
    assert device.requests == []


def test_a_media_upload_over_its_limit_is_answered_413_media_too_large_without_reading_it(gateway, device, people):
    status, _, body = async_to_sync(unread_body_request)(
        "PUT", "/aotx/v1/media/" + "a" * 64, [(b"authorization", people["writer"].authorization.encode()),
                                              (b"content-type", b"image/png"),
                                              (b"content-length", str((8 << 20) + 1).encode())])
    assert status == 413 and b'"media_too_large"' in body


def test_a_chunked_body_past_the_limit_is_refused_413(gateway, device, people):
    headers = [(b"authorization", people["writer"].authorization.encode()), (b"content-type", b"application/json"),
               (b"transfer-encoding", b"chunked")]
    chunks = [b" " * 40000, b" " * 40000, b"{}"]
    response = async_to_sync(rsgi_request)("POST", SPACES, headers, b"", chunks)
    assert_error(response, 413, "body_too_large")
    assert device.requests == []


def test_an_accept_header_without_json_is_answered_406_by_drfs_negotiation(gateway, device, people):
    """The front authenticates before the body (a refusal must not read it); DRF negotiates the
    one renderer then: 406 for an admitted caller that accepts no JSON, and nothing reaches the
    device."""
    assert_error(gateway.get(SPACES, people["reader"], HTTP_ACCEPT="text/html"), 406, "not_acceptable")
    assert_unauthenticated(gateway.get(SPACES, HTTP_ACCEPT="text/html"))
    assert device.requests == []


def test_requests_beyond_the_bound_waiting_on_the_device_answer_503_gateway_busy_at_once(gateway, device, people,
                                                                                         settings):
    settings.AOTX_DEVICE_WAITING = 2
    settings.AOTX_DEVICE_TIMEOUT = 30  # the two wait until the device answers, however slow the machine
    answer = threading.Event()
    device.handler = lambda req: (answer.wait(30), (200, OK_BODY))[1]  # answers once the test says so
    req = gateway.request("POST", SPACES, people["writer"], body=envelope())

    async def go():
        try:
            waiting = [asyncio.ensure_future(rsgi_request(*req)) for _ in range(2)]
            await until(lambda: device_client.pool().waiting == 2, what="both requests waiting on the device")
            try:
                busy = await asyncio.wait_for(rsgi_request(*req), 10)
            except asyncio.TimeoutError:
                raise AssertionError("the request beyond the bound waited instead of being answered") from None
            still_waiting = [not future.done() for future in waiting]
            answer.set()
            return busy, still_waiting, await asyncio.wait_for(asyncio.gather(*waiting), 30)
        finally:
            answer.set()
            await device_client.aclose_loop()
    busy, still_waiting, answered = async_to_sync(go)()
    assert_error(busy, 503, "gateway_busy")
    assert still_waiting == [True, True]  # at once: while the device still held both, not once a slot was free
    assert [response.status_code for response in answered] == [200, 200]
    assert len(device.requests) == 2  # the refused one reached nothing


def test_a_principal_saved_in_this_process_is_seen_at_once_despite_the_cache(gateway, device, people):
    from shared_api.models import Principal
    assert gateway.get(SPACES, people["writer"]).status_code == 200
    principal = Principal.objects.get(name="writer")
    principal.active = False
    principal.save()
    assert_unauthenticated(gateway.get(SPACES, people["writer"]))


def test_a_rewritten_grant_file_clears_the_principal_cache_of_every_process(gateway, device, people, settings):
    """A principal changed by another process (no signal here) is seen once the grant file, which
    every principal change through the admin or `principal --config` rewrites, has changed."""
    import json
    import time
    from pathlib import Path

    from shared_api import config
    from shared_api.http import auth
    from shared_api.models import Principal
    from tests.conftest import wait_for
    grants = Path(config.load(settings.AOTX_GATEWAY_CONFIG)["grants_file"])
    assert gateway.get(SPACES, people["writer"]).status_code == 200
    Principal.objects.filter(name="writer").update(active=False)  # a queryset update sends no signal
    assert gateway.get(SPACES, people["writer"]).status_code == 200  # the cached lookup still answers
    grants.write_text(json.dumps({"rewritten": True}))
    # this process's next look at the grant file (at most every GRANT_FILE_CHECK seconds) is due
    wait_for(lambda: time.monotonic() - auth.PRINCIPALS._checked >= auth.GRANT_FILE_CHECK, 10,
             what="the principal cache's next look at the grant file")
    assert_unauthenticated(gateway.get(SPACES, people["writer"]))


def test_drf_dispatches_each_shared_route_with_the_principal_the_front_admitted(gateway, device, people,
                                                                                monkeypatch):
    """The route that answers is DRF's: its dispatch runs once a request, on Django's request of
    the body the front read, with the principal the front admitted as DRF's user (authenticated
    once), and its parser and exception handler answer what the body gets wrong."""
    from rest_framework.views import APIView
    dispatched = []
    dispatch = APIView.dispatch

    def recorded(view, request, *args, **kwargs):
        answer = dispatch(view, request, *args, **kwargs)
        dispatched.append((type(view).__name__, type(request).__name__, view.request.user.principal_id))
        return answer

    monkeypatch.setattr(APIView, "dispatch", recorded)
    device.answer(200, OK_BODY)
    assert gateway.get(SPACES, people["reader"]).status_code == 200
    device.answer(202, OK_BODY)
    assert gateway.post(SPACES, people["writer"], body=envelope()).status_code == 202
    assert dispatched == [("SpacesView", "ASGIRequest", people["reader"].principal_id),
                          ("SpacesView", "ASGIRequest", people["writer"].principal_id)]
    assert_error(gateway.post(SPACES, people["writer"], raw=b'{"a": 1, "a": 2}'), 400, "duplicate_key")
    assert len(dispatched) == 3 and len(device.requests) == 2
