"""Forking a conversation at the device (`conversations.fork`, kinds/forks.py), with the real
engine: the fork's prompts hold the source's turns through the fork point and nothing of either
after it, its event orders go on from the fork point, refusals change nothing, and a restart and a
checkpoint give the same fork."""
from tests.gpu_worker.kinds.test_memory import capture_prompts, retire_all, run, world  # noqa: F401 (fixture)
from gpu_worker.storage.journal import TransferKind
from tests.gpu_worker.kinds.test_memory_versions import journal_transfers
from tests.gpu_worker.kinds.test_shared_state import code


def fork(world, name, conversation, at, **fields):
    return world.mutate(name, "conversations.fork", f"/conversations/{conversation}/forks", {"at": str(at), **fields},
                        extra={"conversation": conversation})


def admissions(world):
    return sum(t.kind == TransferKind.ADMISSION for t in journal_transfers(world))


def users(prompt):
    messages, _ = prompt
    return [m["content"] for m in messages if m["role"] == "user"]


def test_a_fork_holds_the_source_through_the_fork_point_and_neither_sees_the_other_after(world, monkeypatch):
    prompts = capture_prompts(monkeypatch)
    space, source = world.conversation("a")
    for text in ("one", "two", "three"):
        run(world, "a", source, text)
    status, receipt = fork(world, "a", source, 2)
    assert status == 202, receipt
    forked = receipt["target"]
    assert receipt["kind"] == "conversation.fork" and forked != source
    assert world.read("a", "conversations.get", conversation=forked)[1]["space"] == space
    run(world, "a", forked, "four in the fork")
    assert users(prompts[-1]) == ["one", "two", "four in the fork"]
    run(world, "a", source, "four in the source")
    assert users(prompts[-1]) == ["one", "two", "three", "four in the source"]
    run(world, "a", forked, "five in the fork")
    assert users(prompts[-1]) == ["one", "two", "four in the fork", "five in the fork"]
    # the fork's events go on from the fork point: orders 1..2 are its copied history (a gap)
    events = world.read("a", "conversations.events", conversation=forked)[1]
    assert [e["cursor"] for e in events["items"]] == ["3", "4"]
    # the same after a restart (replayed) and after a checkpoint
    world.boot()
    world.attach()
    run(world, "a", forked, "six")
    assert users(prompts[-1])[:4] == ["one", "two", "four in the fork", "five in the fork"]
    assert world.device.checkpoint() is not None
    world.boot()
    world.attach()
    run(world, "a", forked, "seven")
    assert users(prompts[-1])[:3] == ["one", "two", "four in the fork"]


def test_a_fork_of_retired_turns_copies_them_from_the_history(world, monkeypatch):
    prompts = capture_prompts(monkeypatch)
    space, source = world.conversation("a")
    for text in ("alpha", "beta", "gamma"):
        run(world, "a", source, text)
    retire_all(world, "a")
    assert fork(world, "a", source, 1)[0] == 202
    forked = world.read("a", "conversations.list", space=space)[1]["items"][-1]["id"]
    run(world, "a", forked, "delta")
    assert users(prompts[-1]) == ["alpha", "delta"]


def test_refusals_change_nothing(world):
    space, source = world.conversation("a")
    run(world, "a", source, "one")
    room = world.space("a", scope="room")
    assert world.member("a", room, "b", ["read"])[0] == 202
    shared = world.mutate("a", "conversations.create", f"/spaces/{room}/conversations", {})[1]["target"]
    run(world, "a", shared, "in the room")
    before = admissions(world)
    assert code(fork(world, "a", source, 2)) == (409, "fork_point_past_end")
    assert code(fork(world, "b", source, 1)) == (404, "conversation_not_found")  # b cannot read it
    assert code(fork(world, "b", shared, 1)) == (403, "right_missing")  # read but no write in the room
    assert code(fork(world, "a", source, 0)) == (400, "bad_field")
    status, receipt = world.say("a", source, "running", max_output_tokens=4)
    assert status == 202
    assert code(fork(world, "a", source, 2)) == (409, "conversation_busy")
    assert admissions(world) == before + 1  # the input's own
    world.pump(world.finished("a", receipt["operation"]))
    assert fork(world, "a", source, 2)[0] == 202
