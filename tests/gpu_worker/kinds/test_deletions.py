"""Deleting spaces and conversations at the device (kinds/deletions.py): a manager's journaled
operation that gives the capacity back — at once to the creator's quota, and the table row once
the receipts that name it are retired — refused without the right or while in use, reproduced
by replay after a restart and after a checkpoint."""
import collections

import numpy as np
import pytest

from gpu_worker.pack import pack_tiny
from gpu_worker.state.tables import TOMBSTONE, C, S, Tables
from tests.gpu_worker.kinds.test_quotas import QuotaWorld
from tests.gpu_worker.kinds.test_shared_state import code


@pytest.fixture
def world(tmp_path):
    runtime = str(tmp_path / "small.aotxccir")
    pack_tiny(runtime, shared=True, capacity={"spaces": 2, "conversations": 2})
    w = QuotaWorld(runtime, tmp_path, ["owner", "writer", "manager", "outsider"])
    yield w
    w.device.close()


def delete_conversation(world, name, conversation):
    return world.mutate(name, "conversations.delete", f"/conversations/{conversation}/deletion", {},
                        extra={"conversation": conversation})


def delete_space(world, name, space):
    return world.mutate(name, "spaces.delete", f"/spaces/{space}/deletion", {})


def conversation(world, name, space, **fields):
    status, receipt = world.mutate(name, "conversations.create", f"/spaces/{space}/conversations", fields)
    assert status == 202, receipt
    return receipt


def snapshot(world):
    """What every participant reads: its participant, spaces, receipts; and the table usage."""
    return ({n: (world.read(n, "participant.get")[1], world.read(n, "spaces.list")[1],
                 world.read(n, "operations.list")[1]) for n in world.principals},
            world.device.state.tables.usage())


def test_deleting_needs_manage_and_refuses_what_is_in_use_changing_nothing(world):
    space = world.space("owner")
    world.member("owner", space, "writer", ["read", "write"])
    world.member("owner", space, "manager", ["read", "manage"])
    con = conversation(world, "owner", space)["target"]
    before = snapshot(world)
    assert code(delete_conversation(world, "writer", con)) == (403, "right_missing")
    assert code(delete_conversation(world, "outsider", con)) == (404, "conversation_not_found")
    assert code(delete_space(world, "writer", space)) == (403, "right_missing")
    assert code(delete_space(world, "owner", space)) == (409, "space_not_empty")
    status, _ = world.mutate("owner", "conversations.input", f"/conversations/{con}/inputs",
                             {"text": "hi", "model": "tiny-llama"}, extra={"conversation": con})
    assert status == 202  # no engine in this world: the input stays unfinished
    after_input = snapshot(world)
    assert code(delete_conversation(world, "owner", con)) == (409, "conversation_busy")
    assert snapshot(world) == after_input and before != after_input


def test_a_deleted_conversation_and_space_are_gone_and_their_capacity_comes_back(world):
    world.set_quotas("owner", spaces=1, conversations=1)
    space = world.space("owner")
    world.member("owner", space, "manager", ["read", "manage"])
    world.member("owner", space, "writer", ["read", "write"])
    created = conversation(world, "owner", space, id="ab" * 16)
    con = created["target"]
    refused = world.mutate("owner", "conversations.create", f"/spaces/{space}/conversations", {})
    assert code(refused) == (429, "quota_exceeded")
    status, deletion = delete_conversation(world, "manager", con)  # a manager of the space may delete it
    assert status == 202 and deletion["kind"] == "conversation.delete" and deletion["target"] == con
    assert code(world.read("owner", "conversations.get", conversation=con)) == (404, "conversation_not_found")
    assert world.read("owner", "conversations.list", space=space)[1]["items"] == []
    # the creator's receipt still names it; another member no longer reads it
    assert world.read("owner", "operations.get", operation=created["operation"])[1]["target"] == con
    assert code(world.read("writer", "operations.get", operation=created["operation"]))[0] == 404
    assert world.read("owner", "capabilities")[1]["quotas"]["conversations"]["used"] == "0"
    again = conversation(world, "owner", space, id="ab" * 16)  # the same ID may be created again
    assert again["target"] == con and again["operation"] != created["operation"]
    assert delete_conversation(world, "owner", con)[0] == 202
    status, space_deletion = delete_space(world, "owner", space)
    assert status == 202 and space_deletion["target"] == space
    assert code(world.read("owner", "spaces.get", space=space)) == (404, "space_not_found")
    assert code(world.read("manager", "members.list", space=space)) == (404, "space_not_found")
    assert world.device.state.members.rows == {} and world.device.state.tables.usage()["members"] == 0
    assert world.read("owner", "capabilities")[1]["quotas"]["spaces"]["used"] == "0"
    # the rows stay tombstones while receipts name them: the tables are still full
    assert world.device.state.tables.usage()["spaces"] == 1
    world.space("owner")
    assert code(world.mutate("owner", "spaces.create", "/spaces", {})) == (429, "quota_exceeded")
    world.set_quotas("owner", spaces=None, conversations=None)  # unlimited: the table's own bound
    assert code(world.mutate("owner", "spaces.create", "/spaces", {})) == (507, "space_capacity")
    # retiring the receipts that name the deleted space and conversation gives the rows back
    me = world.read("owner", "participant.get")[1]
    sequence = int(me["next_sequence"])
    assert world.mutate("owner", "retirements.record", "/retirements", {"retry_floor": str(sequence)})[0] == 202
    usage = world.device.state.tables.usage()
    # the space's row is back (one live space); the first conversation's row is still named by the
    # manager's deletion receipt, until the manager retires it too
    assert (usage["spaces"], usage["conversations"]) == (1, 1)
    me = world.read("manager", "participant.get")[1]
    assert world.mutate("manager", "retirements.record", "/retirements",
                        {"retry_floor": me["next_sequence"]})[0] == 202
    assert world.device.state.tables.usage()["conversations"] == 0
    world.space("owner")
    assert world.device.state.tables.usage()["spaces"] == 2


def tombstones(world):
    """Each index's tombstone rows, checked against its table's STATE column (a retirement finds
    the tombstones it may release in the index's set, not in the table)."""
    state = world.device.state
    for index, table, col in ((state.spaces, "spaces", S.STATE), (state.conversations, "conversations", C.STATE)):
        values = Tables.array(getattr(state.tables, table))
        assert index.tombstones == set(np.flatnonzero(values[:, col] == TOMBSTONE).tolist()), table
    return len(state.spaces.tombstones), len(state.conversations.tombstones)


def test_deletion_replays_after_a_restart_and_after_a_checkpoint(world):
    world.set_quotas("owner", spaces=None)  # both rows of the table (the default share is one)
    space = world.space("owner")
    con = conversation(world, "owner", space)["target"]
    _, deletion = delete_conversation(world, "owner", con)
    other = world.space("owner")
    _, space_deletion = delete_space(world, "owner", other)
    before = snapshot(world)
    assert tombstones(world) == (1, 1)
    receipts = [world.read("owner", "operations.get", operation=r["operation"])[1]
                for r in (deletion, space_deletion)]
    world.boot()  # replay of the journal
    assert snapshot(world) == before and tombstones(world) == (1, 1)
    assert [world.read("owner", "operations.get", operation=r["operation"])[1]
            for r in (deletion, space_deletion)] == receipts
    assert code(world.read("owner", "conversations.get", conversation=con)) == (404, "conversation_not_found")
    world.device.checkpoint()
    world.boot()  # the tombstones come back from the runtime file
    assert snapshot(world)[1] == before[1] and tombstones(world) == (1, 1)
    assert code(world.read("owner", "spaces.get", space=other)) == (404, "space_not_found")
    assert conversation(world, "owner", space)["target"] != con  # a new conversation takes a fresh row
    # a retirement after that boot releases the tombstones the checkpoint held: rows back, cleared
    usage = world.device.state.tables.usage()
    me = world.read("owner", "participant.get")[1]
    assert world.mutate("owner", "retirements.record", "/retirements", {"retry_floor": me["next_sequence"]})[0] == 202
    assert tombstones(world) == (0, 0)
    after = world.device.state.tables.usage()
    assert (after["spaces"], after["conversations"]) == (usage["spaces"] - 1, usage["conversations"] - 1)
    world.boot()  # and so does a replay of that retirement
    assert tombstones(world) == (0, 0) and world.device.state.tables.usage() == after


def test_an_open_stream_of_a_deleted_conversation_ends(world):
    space = world.space("owner")
    con = conversation(world, "owner", space)["target"]
    inbox = collections.deque([("sub", {"v": 1, "id": 900, "op": "conversations.subscribe",
                                        "principal": world.principals["owner"], "args": {"conversation": con}})])
    assert world.device.committer.run_sync(inbox) == []
    world.device.take_outbox()
    delete_conversation(world, "owner", con)
    frames = [m for _, m in world.pushed + world.device.take_outbox() if m.id == 900]
    assert frames and frames[-1].status == 404 and not frames[-1].more
