"""Over-quota refusals answered later for a principal that keeps asking (shared_api/http/refusals.py),
alone and through the HTTP front, for the shared routes and the OpenAI-compatible ones."""
import json

import pytest

from shared_api.http.refusals import MAX_DELAY, MAX_TRACKED, QUIET, RefusalBackoff, is_quota_refusal
from tests.conftest import Clock

QUOTA = json.dumps({"error": {"code": "quota_exceeded", "message": "the chats quota of this principal is 2 and 2 are "
                                                                    "in use; this needs 1 more", "quota": "chats",
                              "limit": "2", "used": "2"}}).encode()
HOLD = b'{"error":{"code":"journal_hold","message":"persistent admission is paused (low disk)"}}'


def test_the_first_refusal_is_at_once_then_each_waits_twice_as_long_up_to_a_second():
    clock = Clock()
    backoff = RefusalBackoff(clock)
    delays = []
    for _ in range(10):
        delays.append(backoff.delay("p"))
        clock.now += 0.001
    assert delays == [0.0, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, MAX_DELAY, MAX_DELAY]
    assert backoff.delay("q") == 0.0  # another principal's streak is its own


def test_a_quiet_second_starts_the_streak_over():
    clock = Clock()
    backoff = RefusalBackoff(clock)
    assert [backoff.delay("p") for _ in range(3)] == [0.0, 0.01, 0.02]
    clock.now += QUIET
    assert [backoff.delay("p") for _ in range(2)] == [0.0, 0.01]


def test_it_remembers_a_bounded_number_of_principals_the_least_recent_forgotten_first():
    clock = Clock()
    backoff = RefusalBackoff(clock)
    backoff.delay("first")
    for i in range(MAX_TRACKED):
        backoff.delay(f"p{i}")
    assert len(backoff.streaks) == MAX_TRACKED and "first" not in backoff.streaks
    assert backoff.delay("first") == 0.0


def test_only_quota_refusals_count():
    assert is_quota_refusal(429, QUOTA)
    assert not is_quota_refusal(429, HOLD)  # a journal hold refuses everyone: no one is looping on their own limit
    assert not is_quota_refusal(200, QUOTA)


@pytest.fixture
def waits(monkeypatch):
    """The front's waits before answering, recorded instead of slept."""
    from aotx_site.gateway import application
    recorded = []

    async def sleep(seconds):
        recorded.append(seconds)
    monkeypatch.setattr(application, "sleep", sleep)
    monkeypatch.setattr(application, "refusals", RefusalBackoff())
    return recorded


def test_the_front_answers_a_principals_repeated_quota_refusals_later_with_retry_after(gateway, device, people, waits):
    device.answer(429, QUOTA)
    body = {"schema": "aotx.shared.mutation.v1", "lineage": "0" * 32, "operation_key": "1" * 32, "sequence": "1",
            "scope": "private"}
    answers = gateway.session([gateway.request("POST", "/aotx/v1/shared/spaces", people["writer"], body=body)
                               for _ in range(3)])
    assert [a.status_code for a in answers] == [429] * 3
    assert all(a["Retry-After"] == "1" and a.json()["error"]["code"] == "quota_exceeded" for a in answers)
    assert answers[0].content == QUOTA  # the device's answer, as it is
    assert waits == [0.01, 0.02]  # the first at once
    device.answer(429, HOLD)
    hold = gateway.post("/aotx/v1/shared/spaces", people["manager"], body)
    assert hold.status_code == 429 and not hold.has_header("Retry-After") and waits == [0.01, 0.02]


def test_the_openai_routes_answer_repeated_quota_refusals_later_too(gateway, device, people, waits):
    device.answer(429, QUOTA)
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    answers = gateway.session([gateway.request("POST", "/v1/chat/completions", people["chatter"], body=chat)
                               for _ in range(2)])
    assert [a.status_code for a in answers] == [429, 429] and answers[1]["Retry-After"] == "1"
    assert answers[1].json()["error"]["code"] == "quota_exceeded" and waits == [0.01]
