"""Revocation at the device: the grant file's rewrite reaches open streams and chats of the
revoked principal at the next grant check (every tick, and between ticks every 0.1 s: loop/server.py
IDLE_SECONDS), which ends them with a last 403 `grant_missing` frame and stops the chat's
generation, freeing its pages."""
import collections

import pytest

from gpu_worker.loop.server import IDLE_SECONDS
from gpu_worker.pack import pack_tiny
from tests.gpu_worker.kinds.test_quotas import QuotaEngineWorld, hold_engine, start_chat


@pytest.fixture
def world(tmp_path):
    path = str(tmp_path / "engine.aotxccir")
    pack_tiny(path, shared=True, runtime_profile={"kv_pages": 64, "page_grant": 16, "deadline_ms": 600000})
    w = QuotaEngineWorld(path, tmp_path, ["mallory", "alice"])
    yield w
    w.device.runner.stop()
    w.device.close()


def frames_of(world, req_id):
    pushed, world.pushed = world.pushed + world.device.take_outbox(), []
    world.seen = getattr(world, "seen", []) + pushed
    return [m for _, m in world.seen if req_id in (m.ids or (m.id,))]


def test_a_revoked_principals_streamed_chat_and_event_stream_end_at_the_next_grant_check(world):
    assert IDLE_SECONDS <= 0.1  # the bound docs/grants.md states
    gate = hold_engine(world)
    _, con = world.conversation("mallory")
    inbox = collections.deque([("sub", {"v": 1, "id": 500, "op": "conversations.subscribe",
                                        "principal": world.principals["mallory"], "args": {"conversation": con}})])
    assert world.device.committer.run_sync(inbox) == []
    assert start_chat(world, "mallory", 501, max_tokens=150) == []
    assert start_chat(world, "alice", 502, max_tokens=150) == []
    engine = world.device.runner.engine
    world.pump(lambda: not world.device.usage.chats_tokenizing)  # both handed to the (held) engine
    world.actions["mallory"] = []  # the gateway's revocation: an empty action list in the grant file
    world.write_grants()
    world.device.idle()  # the next grant check, as the loop runs it between ticks
    for req_id in (500, 501):
        last = frames_of(world, req_id)[-1]
        assert last.status == 403 and b"grant_missing" in last.body and not last.more, (req_id, last)
    gate.set()
    # mallory's chat was cancelled in the engine: only alice's runs to its end
    world.pump(lambda: any(not m.more for m in frames_of(world, 502)))
    assert frames_of(world, 502)[-1].status == 200
    world.pump(lambda: not engine.has_work)
    assert engine.pool.owned == 0
    assert not [m for m in frames_of(world, 501) if m.status == 200 and not m.more]
