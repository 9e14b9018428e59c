"""Memory that expires (memory/expiry.py): a space's or an input's time to live fixes each row's
expiry when it is written (journaled with it); past it the row is gone from reads, search and
recall at once, by the device's clock, and the device forgets it with one EXPIRY transfer per
batch, live and at replay; its bytes leave the runtime file at the next checkpoint."""
import time

import pytest

from gpu_worker.memory import table as memory_table
from gpu_worker.storage.journal import TransferKind
from tests.gpu_worker.kinds.test_memory import capture_prompts, rows, run, world  # noqa: F401 (fixture)
from tests.gpu_worker.kinds.test_memory_deletions import stored_bytes
from tests.gpu_worker.kinds.test_memory_versions import journal_transfers, payload
from tests.gpu_worker.kinds.test_shared_state import code

SECOND = 1_000_000_000


@pytest.fixture
def clock(monkeypatch):
    """The device's wall clock, moved by the test: clock.shift(seconds)."""
    class Clock:
        at = time.time_ns()

        def shift(self, seconds):
            self.at += seconds * SECOND
    c = Clock()
    monkeypatch.setattr(memory_table, "now", lambda: c.at)
    return c


def conversation_in(world, **space_fields):
    space = world.space("a", **space_fields)
    status, receipt = world.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})
    assert status == 202
    return space, receipt["target"]


def expiries(world):
    return [t for t in journal_transfers(world) if t.kind == TransferKind.EXPIRY]


def test_a_spaces_time_to_live_expires_its_rows_at_once_and_the_device_forgets_them(world, clock, monkeypatch):
    space, conversation = conversation_in(world, memory_ttl_seconds=60)
    assert world.read("a", "spaces.get", space=space)[1]["memory_ttl_seconds"] == "60"
    [obj] = run(world, "a", conversation, "the alarm code is 9931")["memory"]["retained"]
    [row] = rows(world, "a", space)
    assert int(row["expires_at_ns"]) == pytest.approx(clock.at + 60 * SECOND, abs=5 * SECOND)
    clock.shift(30)
    assert payload(world, "a", obj)[0] == b"the alarm code is 9931"
    assert expiries(world) == []
    clock.shift(31)
    # gone from reads, lists, search and recall at once (whatever the journal says yet)
    assert code(world.read("a", "memory.get", memory=obj)) == (404, "memory_not_found")
    assert rows(world, "a", space) == []
    assert world.read("a", "memory.search", space=space, q="the alarm code", limit=5)[1]["items"] == []
    prompts = capture_prompts(monkeypatch)
    run(world, "a", conversation, "what is the alarm code?", context="source_only")
    assert "9931" not in str(prompts[-1][1] or "")
    # forgotten by the device: one EXPIRY transfer (the reads' ticks journaled it)
    [transfer] = expiries(world)
    assert world.device.state.memory.by_id.get(bytes.fromhex(obj[-32:])) is None
    assert world.device.state.memory.soonest == 0 or world.device.state.memory.soonest > clock.at
    # a restart replays it; the next checkpoint erases its bytes
    world.boot()
    world.attach()
    assert code(world.read("a", "memory.get", memory=obj)) == (404, "memory_not_found")
    assert world.device.checkpoint() is not None
    assert b"the alarm code is 9931" not in stored_bytes(world)


def test_an_inputs_own_time_to_live_wins_and_rows_without_one_stay(world, clock):
    space, conversation = conversation_in(world)
    [kept] = run(world, "a", conversation, "this stays")["memory"]["retained"]
    [brief] = run(world, "a", conversation, "this goes soon", memory_ttl_seconds=5)["memory"]["retained"]
    assert payload(world, "a", kept)[1]["expires_at_ns"] is None
    clock.shift(6)
    assert code(world.read("a", "memory.get", memory=brief)) == (404, "memory_not_found")
    assert payload(world, "a", kept)[0] == b"this stays"
    clock.shift(10 ** 8)  # years later
    assert payload(world, "a", kept)[0] == b"this stays"
    assert len(expiries(world)) == 1


def test_a_published_copy_expires_with_its_destinations_rows(world, clock):
    private, conversation = conversation_in(world)
    [obj] = run(world, "a", conversation, "a fact worth sharing")["memory"]["retained"]
    room = world.space("a", scope="room", memory_ttl_seconds=10)
    status, published = world.mutate("a", "publications.record", f"/spaces/{room}/publications",
                                     {"source": obj, "source_version": "1"})
    assert status == 202
    copy = published["target"]
    clock.shift(11)
    assert code(world.read("a", "memory.get", memory=copy)) == (404, "memory_not_found")
    assert payload(world, "a", obj)[0] == b"a fact worth sharing"


def test_the_expiry_is_the_journaled_instant_after_a_restart(world, clock):
    space, conversation = conversation_in(world, memory_ttl_seconds=100)
    [obj] = run(world, "a", conversation, "remember me")["memory"]["retained"]
    expires = payload(world, "a", obj)[1]["expires_at_ns"]
    clock.shift(50)
    world.boot()  # replayed 50 s later: the same instant, not 100 s from now
    world.attach()
    assert payload(world, "a", obj)[1]["expires_at_ns"] == expires
    assert world.device.checkpoint() is not None
    world.boot()  # from the checkpoint
    world.attach()
    assert payload(world, "a", obj)[1]["expires_at_ns"] == expires
    clock.shift(51)
    assert code(world.read("a", "memory.get", memory=obj)) == (404, "memory_not_found")


def test_bad_times_to_live_are_refused(world):
    assert code(world.mutate("a", "spaces.create", "/spaces", {"memory_ttl_seconds": 0})) == (400, "bad_field")
    assert code(world.mutate("a", "spaces.create", "/spaces", {"memory_ttl_seconds": "60"})) == (400, "bad_field")
    space, conversation = conversation_in(world)
    status, body = world.say("a", conversation, "x", memory_ttl_seconds=10 ** 10)
    assert (status, body["error"]["code"]) == (400, "bad_field")
