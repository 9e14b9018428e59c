"""Per-principal rates (shared_api/http/rates.py): the buckets alone, then through the HTTP front — a
request past its principal's rate is refused 429 `rate_limited` from its headers, its body unread,
nothing sent to the device — on the shared routes and the OpenAI-compatible ones."""
import json
import math

import pytest
from asgiref.sync import async_to_sync

from gpu_worker.contract.grantfile import quota_problem
from gpu_worker.contract.vocabulary import CHAT, DEFAULT_RATES, OUTPUT_TOKENS_RATE, READ, WRITE
from shared_api import device_client
from shared_api.http import rates
from shared_api.http.auth import effective_rates
from shared_api.errors import ServiceError
from shared_api.models import DEFAULT, Principal, apply_quotas, parse_quotas
from shared_api.http.rates import MAX_TRACKED, RateLimiter, retry_headers
from shared_api.http.refusals import RefusalBackoff
from tests import rsgi
from tests.conftest import Clock

from .conftest import BASE, OK_BODY, Persona, assert_error, assert_openai_error, envelope

REQUESTS = "requests_per_second"
BYTES = "body_bytes_per_second"


def refusal(limiter, principal, rates, body_bytes=0) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        limiter.admit(principal, rates, body_bytes)
    assert caught.value.status == 429 and caught.value.code == "rate_limited"
    return caught.value


# ---- the buckets -------------------------------------------------------------------------------

def test_a_principal_gets_one_seconds_worth_at_once_then_its_rate():
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    rates = {REQUESTS: 4}
    for _ in range(4):
        limiter.admit("p", rates, 0)
    err = refusal(limiter, "p", rates)
    assert err.details["quota"] == REQUESTS and err.details["limit"] == "4"
    assert float(err.details["retry_after"]) == pytest.approx(0.25)  # one request's refill
    clock.now += 0.25
    limiter.admit("p", rates, 0)
    refusal(limiter, "p", rates)
    limiter.admit("q", rates, 0)  # another principal's bucket is its own
    limiter.admit("p", {}, 0)  # no rates: never refused


def test_a_refused_request_takes_nothing_from_any_bucket():
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    rates = {REQUESTS: 2, BYTES: 100}
    limiter.admit("p", rates, 150)  # into debt on bytes: -50
    for _ in range(5):
        refusal(limiter, "p", rates, 10)
    assert limiter.buckets["p", REQUESTS].level == 1  # the refusals took no request
    clock.now += 0.5  # bytes back to 0: a request without a body passes, one with 10 bytes not yet
    err = refusal(limiter, "p", rates, 10)
    assert err.details["quota"] == BYTES and float(err.details["retry_after"]) == pytest.approx(0.1)
    limiter.admit("p", rates, 0)
    clock.now += 0.101
    limiter.admit("p", rates, 10)


def test_a_body_larger_than_a_seconds_worth_passes_on_a_full_bucket_and_the_debt_is_waited_out():
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    rates = {BYTES: 1000}
    limiter.admit("p", rates, 4000)  # 4 s worth: never refused for its size alone
    err = refusal(limiter, "p", rates, 1)
    assert float(err.details["retry_after"]) == pytest.approx(3.001)
    assert retry_headers(err) == [("retry-after", "4"), ("retry-after-ms", "3001")]
    clock.now += 3
    refusal(limiter, "p", rates, 4000)  # the next large body waits for a full bucket again
    clock.now += 1
    limiter.admit("p", rates, 4000)


def test_undeclared_body_bytes_are_charged_after_the_body_is_read():
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    rates = {BYTES: 1000}
    limiter.admit("p", rates, 0)  # a chunked body: its size is not known from the headers
    limiter.charge("p", rates, 3000)
    assert float(refusal(limiter, "p", rates).details["retry_after"]) == pytest.approx(2.0)  # (no body: 0 bytes)
    limiter.charge("p", {REQUESTS: 5}, 3000)  # no byte rate: nothing to charge


def test_each_gateway_process_allows_its_share_and_a_changed_grant_starts_over():
    clock = Clock()
    limiter = RateLimiter(share=1 / 2, clock=clock)
    limiter.admit("p", {REQUESTS: 4}, 0)
    limiter.admit("p", {REQUESTS: 4}, 0)
    refusal(limiter, "p", {REQUESTS: 4})  # two of the four per second in this process
    limiter.admit("p", {REQUESTS: 10}, 0)  # a new rate: a new (full) bucket


def test_buckets_of_a_bounded_number_of_principals_are_kept_the_least_recent_forgotten_first():
    limiter = RateLimiter(clock=Clock())
    limiter.admit("first", {REQUESTS: 1}, 0)
    for i in range(MAX_TRACKED):
        limiter.admit(f"p{i}", {REQUESTS: 1}, 0)
    assert len(limiter.buckets) == MAX_TRACKED and ("first", REQUESTS) not in limiter.buckets


def test_a_default_rate_binds_only_while_another_principal_is_active():
    from gpu_worker.contract.rates import ACTIVE_SECONDS
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    shared = frozenset({REQUESTS})
    for _ in range(20):  # alone, past its default of 4 a second
        limiter.admit("alone", {REQUESTS: 4}, 0, shared)
    limiter.admit("other", {}, 0)  # another principal sends a request: now it binds
    for _ in range(4):  # a bucket that starts full
        limiter.admit("alone", {REQUESTS: 4}, 0, shared)
    refusal(limiter, "alone", {REQUESTS: 4})
    with pytest.raises(ServiceError):
        limiter.admit("alone", {REQUESTS: 4}, 0, shared)
    clock.now += ACTIVE_SECONDS + 0.01  # the other one has been quiet long enough: alone again
    for _ in range(20):
        limiter.admit("alone", {REQUESTS: 4}, 0, shared)
    clock.now += ACTIVE_SECONDS + 0.01
    for _ in range(4):  # a rate its grant sets binds alone too
        limiter.admit("capped", {REQUESTS: 4}, 0)
    refusal(limiter, "capped", {REQUESTS: 4})


def test_rates_are_grant_limits_of_at_least_one():
    assert quota_problem({REQUESTS: 5, BYTES: 1 << 20, "spaces": 0}) is None
    assert "from 1" in quota_problem({REQUESTS: 0})
    assert "unknown quota" in quota_problem({"requests_per_minute": 5})
    assert parse_quotas([f"{REQUESTS}=20", f"{BYTES}=unlimited"]) == {REQUESTS: 20, BYTES: None}
    with pytest.raises(ValueError, match="from 1"):
        parse_quotas([f"{REQUESTS}=0"])


def test_a_rate_left_out_has_its_default_and_one_set_to_null_is_unlimited():
    assert effective_rates({}) == DEFAULT_RATES
    assert effective_rates({REQUESTS: None, BYTES: 5}) == {BYTES: 5,
                                                           OUTPUT_TOKENS_RATE: DEFAULT_RATES[OUTPUT_TOKENS_RATE]}
    assert quota_problem({REQUESTS: None, "spaces": None}) is None  # null: unlimited, said explicitly
    changes = parse_quotas([f"{REQUESTS}=unlimited", f"{BYTES}=default", "spaces=3"])
    assert changes == {REQUESTS: None, BYTES: DEFAULT, "spaces": 3}
    assert apply_quotas({BYTES: 10, "chats": 1}, changes) == {REQUESTS: None, "spaces": 3, "chats": 1}


# ---- through the front ---------------------------------------------------------------------------

@pytest.fixture
def front(monkeypatch):
    """The front with a stopped clock for its rates (nothing refills while a test runs) and its
    waits before refusals recorded instead of slept."""
    from aotx_site.gateway import application
    waits = []

    async def sleep(seconds):
        waits.append(seconds)
    monkeypatch.setattr(application, "sleep", sleep)
    monkeypatch.setattr(application, "refusals", RefusalBackoff())
    monkeypatch.setattr(rates, "_limiter", RateLimiter(clock=Clock()))
    return waits


def limited(name: str, actions: list[str], **rates: int) -> Persona:
    principal, token = Principal.create(name, actions, rates)
    return Persona(name, principal.principal_id, token)


def test_a_request_past_the_principals_rate_is_refused_from_its_headers_and_reaches_no_device(gateway, device, db,
                                                                                                front):
    slow = limited("slow", [READ, WRITE], requests_per_second=2)
    answers = gateway.session([gateway.request("GET", f"{BASE}/participant", slow) for _ in range(4)])
    assert [a.status_code for a in answers] == [200, 200, 429, 429]
    error = assert_error(answers[2], 429, "rate_limited", quota=REQUESTS, limit="2")
    assert float(error["retry_after"]) == pytest.approx(0.5)
    assert answers[2]["Retry-After"] == "1" and answers[2]["Retry-After-Ms"] == "500"
    assert len(device.requests) == 2  # the refused ones reached nothing
    assert front == [0.01]  # the second refusal in a row waits, as over-quota refusals do
    # another principal is not limited by this one's rate
    assert gateway.get(f"{BASE}/participant", limited("other", [READ], requests_per_second=1)).status_code == 200


def test_a_refused_body_is_not_read_and_the_connection_is_closed(device, db, front):
    from aotx_site.gateway import application
    slow = limited("slow", [READ, WRITE], body_bytes_per_second=100)
    body = json.dumps(envelope(scope="private")).encode()
    received = []

    async def call() -> tuple[int, dict[bytes, bytes], bytes]:
        headers = [(b"host", b"testserver"), (b"authorization", slow.authorization.encode()),
                   (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        try:
            proto = await rsgi.request(application, "POST", f"{BASE}/spaces", headers, [body])
        finally:
            await device_client.aclose_loop()
        received.extend([True] * proto.reads)
        return proto.status, {k.encode(): v.encode() for k, v in proto.headers}, bytes(proto.body)

    assert async_to_sync(call)()[0] == 200  # a full bucket: the body (more than 100 bytes) passes, into debt
    assert received == [True]
    status, headers, content = async_to_sync(call)()
    assert status == 429 and json.loads(content)["error"]["quota"] == BYTES
    assert received == [True]  # the second body was never read
    assert headers[b"connection"] == b"close"
    # the debt (len - 100), then a full bucket (100 bytes), at 100 bytes a second
    assert len(body) > 100 and headers[b"retry-after"] == str(math.ceil(len(body) / 100)).encode()
    assert len(device.requests) == 1


def test_the_openai_routes_refuse_past_the_rate_in_openais_shape_with_retry_after(gateway, device, db, front):
    chatty = limited("chatty", [CHAT], requests_per_second=1)
    device.answer(200, OK_BODY)
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    assert gateway.post("/v1/chat/completions", chatty, chat).status_code != 429
    before = len(device.requests)
    refused = gateway.post("/v1/chat/completions", chatty, chat)
    assert_openai_error(refused, 429, "rate_limit_exceeded", "rate_limit_error")
    assert refused["Retry-After"] == "1" and refused["Retry-After-Ms"] == "1000"
    assert refused["Connection"] == "close"  # its body was not read
    assert len(device.requests) == before


def test_a_principal_created_without_rates_is_held_to_the_default_request_rate_beside_others(gateway, device, db,
                                                                                              front):
    principal, token = Principal.create("plain", [READ])  # as `principal create` makes it: no quotas
    plain = Persona("plain", principal.principal_id, token)
    limit = DEFAULT_RATES[REQUESTS]
    for _ in range(limit + 5):  # alone: the default does not bind
        rates.limiter().admit(plain.principal_id, {REQUESTS: limit}, 0, frozenset({REQUESTS}))
    assert gateway.get(f"{BASE}/participant", plain).status_code == 200
    rates.limiter().admit("another principal", {}, 0)  # (the stopped clock keeps it active)
    for _ in range(limit - 1):  # (the front's bucket for it, started full: nothing refills)
        rates.limiter().admit(plain.principal_id, {REQUESTS: limit}, 0)
    assert gateway.get(f"{BASE}/participant", plain).status_code == 200  # the second's last request
    refused = gateway.get(f"{BASE}/participant", plain)
    assert_error(refused, 429, "rate_limited", quota=REQUESTS, limit=str(limit))
    assert len(device.requests) == 2


def test_a_rate_set_to_unlimited_is_never_refused(gateway, device, db, front):
    principal, token = Principal.create("free", [READ], {REQUESTS: None, BYTES: None})
    free = Persona("free", principal.principal_id, token)
    limit = DEFAULT_RATES[REQUESTS]
    for _ in range(limit):  # what would have spent a default principal's second
        rates.limiter().admit(free.principal_id, {REQUESTS: limit}, 0)
    assert gateway.get(f"{BASE}/participant", free).status_code == 200


def test_opening_an_event_stream_counts_as_a_request(gateway, device, db, front):
    watcher = limited("watcher", [READ], requests_per_second=1)
    rates.limiter().admit(watcher.principal_id, {REQUESTS: 1}, 0)  # this second's request is spent
    refused = gateway.get(f"{BASE}/operations/op-{'0' * 32}-{'1' * 32}/events", watcher)
    assert_error(refused, 429, "rate_limited", quota=REQUESTS)
    assert refused["Retry-After"] == "1" and device.requests == []
