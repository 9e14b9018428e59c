"""Front.native, the shared routes answered without an ASGI task (shared_api/http/server.py calls it for a
request whose body has arrived with its headers): the device request and the answer are those of
the ASGI path, and anything but the common case is declined with nothing sent or charged, for the
ASGI path to answer as it always has."""
import json

import pytest
from asgiref.sync import async_to_sync

from shared_api import device_client
from shared_api.http import rates
from shared_api.http.auth import PRINCIPALS, authenticate
from shared_api.http.front import BASE_HEADERS
from shared_api.models import Principal
from shared_api.http.rates import RateLimiter
from shared_api.http.refusals import RefusalBackoff
from tests.conftest import Clock

from .conftest import BASE, OK_BODY, Persona, asgi_request, envelope

QUOTA = json.dumps({"error": {"code": "quota_exceeded", "message": "over", "quota": "spaces", "limit": "1",
                              "used": "1"}}).encode()


def scope_of(method, path, persona=None, body=b"", query=b"", extra=()):
    headers = [(b"host", b"testserver"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), *extra]
    if persona is not None:
        headers.append((b"authorization", persona.authorization.encode()))
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "", "headers": headers,
            "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}


def native(*requests):
    """Each (scope, body) through application.native on one loop whose device connections are
    open (as a server's are after its first requests): [(taken, answer or None)]."""
    from aotx_site.asgi import application

    async def go():
        import asyncio
        try:
            for mux in device_client.pool().muxes:
                await mux._connection()
            out = []
            for scope, body in requests:
                answered = asyncio.get_running_loop().create_future()
                taken = application.native(scope, body, lambda *a: answered.set_result(a))
                out.append((taken, await asyncio.wait_for(answered, 5) if taken else None))
            return out
        finally:
            await device_client.aclose_loop()
    return async_to_sync(go)()


@pytest.fixture
def cached(people):
    """The personas' principals in the gateway's cache, as after their first request."""
    PRINCIPALS.clear()
    for persona in people.values():
        if persona.name != "revoked":
            authenticate(persona.authorization)
    return people


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    from aotx_site.asgi import application
    monkeypatch.setattr(rates, "_limiter", RateLimiter(clock=Clock()))
    monkeypatch.setattr(application, "refusals", RefusalBackoff())


def test_a_mutation_is_answered_natively_with_the_device_request_and_answer_of_the_asgi_path(gateway, device,
                                                                                              cached):
    body = json.dumps(envelope(scope="private")).encode()
    [(taken, (status, content, headers))] = native((scope_of("POST", f"{BASE}/spaces", cached["writer"], body), body))
    assert taken and (status, content) == (200, OK_BODY)
    assert headers == [*BASE_HEADERS, (b"content-length", str(len(OK_BODY)).encode())]
    sent = device.only_request()
    device.requests.clear()
    headers = scope_of("POST", "/", cached["writer"], body)["headers"]
    asgi = async_to_sync(asgi_request)("POST", f"{BASE}/spaces", headers, body)
    assert (asgi.status_code, asgi.content) == (200, OK_BODY)
    again = device.only_request()
    assert {k: v for k, v in again.items() if k != "id"} == {k: v for k, v in sent.items() if k != "id"}


def test_reads_with_a_query_are_answered_natively(gateway, device, cached):
    [(taken, (status, _, _))] = native((scope_of("GET", f"{BASE}/spaces", cached["reader"], query=b"limit=5"), b""))
    assert taken and status == 200 and device.only_request()["args"]["limit"] == 5


@pytest.mark.parametrize("case", ["uncached", "no token", "refused action", "bad body", "head", "token in query",
                                  "not acceptable", "unknown route"])
def test_anything_but_the_common_case_is_declined_with_nothing_sent(gateway, device, cached, db, case):
    stranger_principal, token = Principal.create("stranger", ["shared_read"])
    stranger = Persona("stranger", stranger_principal.principal_id, token)
    good = json.dumps(envelope(scope="private")).encode()
    scope, body = {
        "uncached": (scope_of("GET", f"{BASE}/participant", stranger), b""),
        "no token": (scope_of("GET", f"{BASE}/participant"), b""),
        "refused action": (scope_of("POST", f"{BASE}/spaces", cached["reader"], good), good),
        "bad body": (scope_of("POST", f"{BASE}/spaces", cached["writer"], b"{"), b"{"),
        "head": (scope_of("HEAD", f"{BASE}/participant", cached["reader"]), b""),
        "token in query": (scope_of("GET", f"{BASE}/participant", cached["reader"], query=b"token=aotx_x"), b""),
        "not acceptable": (scope_of("GET", f"{BASE}/participant", cached["reader"], extra=[(b"accept", b"text/html")]),
                           b""),
        "unknown route": (scope_of("GET", f"{BASE}/nowhere", cached["reader"]), b""),
    }[case]
    assert native((scope, body)) == [(False, None)]
    assert device.requests == []


def test_a_rate_refusal_is_declined_with_nothing_charged_and_a_pass_is_charged_once(gateway, device, db):
    principal, token = Principal.create("hasty", ["shared_read"], {"requests_per_second": 1})
    hasty = Persona("hasty", principal.principal_id, token)
    PRINCIPALS.clear()
    authenticate(hasty.authorization)
    request = (scope_of("GET", f"{BASE}/participant", hasty), b"")
    assert [taken for taken, _ in native(request, request)] == [True, False]
    assert rates.limiter().buckets[hasty.principal_id, "requests_per_second"].level == 0
    assert len(device.requests) == 1


def test_an_over_quota_answer_waits_as_the_asgi_paths_does_and_carries_retry_after(gateway, device, cached,
                                                                                      monkeypatch):
    from aotx_site.asgi import application
    device.answer(429, QUOTA)
    delays = []
    monkeypatch.setattr(application.refusals, "delay", lambda principal: delays.append(principal) or 0.05)
    body = json.dumps(envelope(scope="private")).encode()
    [(taken, (status, content, headers))] = native((scope_of("POST", f"{BASE}/spaces", cached["writer"], body), body))
    assert taken and (status, content) == (429, QUOTA) and (b"retry-after", b"1") in headers
    assert delays == [cached["writer"].principal_id]
