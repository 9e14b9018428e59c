"""A conversation's identity and its execution slot (SPEC "Persistent shared conversations": a
conversation keeps its identity when its execution slot changes).

The slot is the conversation's row in the conversations table (state/tables.py `C`; the
conversation resource shows it as `slot`, and a lease row records it). The identity is
`con-{lineage}-{id}`, from the row's ID columns; events count conversation input order (`R.ORDER`);
receipts, leases, outputs and completions name an input by its participant and sequence. So
nothing a client sees may depend on the row: the device moves no conversation by itself, but a
state whose rows lie elsewhere (the checkpoint a restore loads, written by another layout) must
read the same. The test moves one conversation to another row in the saved state and checks its
identity, events, receipts and context across the move and a restart."""
import base64

import torch

from gpu_worker.kinds.kind import Kind
from gpu_worker.state.tables import R
from gpu_worker.storage.journal import TransferKind
from gpu_worker.storage.journal_reader import recover
from gpu_worker.storage.leases import decode as decode_lease
from tests.gpu_worker.kinds.test_inputs import EngineWorld, record_prompts, runtime  # noqa: F401 (fixture)

CONVERSATION_TARGETS = (Kind.CONVERSATION_CREATE, Kind.INPUT, Kind.CONVERSATION_DELETE)


def move_conversation(device, old, new):
    """Put the conversation of row `old` in row `new`, with its history row and every receipt that
    names it, as a state laid out otherwise holds it (the indexes are rebuilt at the next boot)."""
    t = device.state.tables
    t.conversations[new] = t.conversations[old].clone()
    t.conversations[old] = 0
    t.history[new] = t.history[old].clone()
    t.history[old] = 0
    kinds = torch.tensor([int(k) for k in CONVERSATION_TARGETS])
    names = (t.receipts[:, R.STATE] == 1) & torch.isin(t.receipts[:, R.KIND], kinds) & (t.receipts[:, R.TARGET] == old)
    t.receipts[names, R.TARGET] = new


def without_saves(value):
    """A read without its save fields (a checkpoint moves every receipt's save to the file)."""
    if isinstance(value, dict):
        return {k: without_saves(v) for k, v in value.items() if k != "save"}
    if isinstance(value, list):
        return [without_saves(v) for v in value]
    return value


def answer(world, op):
    result = world.read("a", "operations.result", operation=op)[1]
    return base64.b64decode(result["bytes"]).decode("utf-8", "replace")


def test_a_conversation_keeps_its_identity_events_and_history_when_its_slot_changes(runtime, tmp_path,
                                                                                       monkeypatch):
    world = EngineWorld(runtime, tmp_path, ["a"])
    try:
        prompts = record_prompts(monkeypatch)
        _, conversation = world.conversation("a")
        _, first = world.say("a", conversation, "first", max_output_tokens=8)
        world.pump(world.finished("a", first["operation"]))
        _, second = world.say("a", conversation, "second", max_output_tokens=8)
        world.pump(world.finished("a", second["operation"]))
        # the first turn leaves the live receipts for the conversation's history
        assert world.mutate("a", "retirements.record", "/retirements",
                            {"retry_floor": str(int(first["sequence"]) + 1)})[0] == 202
        turns = [{"role": "user", "content": "first"}, {"role": "assistant", "content": None},
                 {"role": "user", "content": "second"},
                 {"role": "assistant", "content": answer(world, second["operation"])}]
        turns[1]["content"] = prompts["second"][1]["content"]  # the first's answer, as its retired turn
        before = {"conversation": world.read("a", "conversations.get", conversation=conversation)[1],
                  "events": world.read("a", "conversations.events", conversation=conversation)[1],
                  "receipts": world.read("a", "operations.list")[1]}
        old = int(before["conversation"]["slot"])
        new = world.device.state.capacities["conversations"] - 1
        assert new != old
        move_conversation(world.device, old, new)
        world.device.checkpoint()
        world.boot()  # the state loads from the checkpoint: the conversation is in its new slot
        world.attach()
        moved = world.read("a", "conversations.get", conversation=conversation)[1]
        assert moved["slot"] == str(new)
        assert {k: v for k, v in moved.items() if k != "slot"} == \
            {k: v for k, v in before["conversation"].items() if k != "slot"}
        assert without_saves(world.read("a", "conversations.events", conversation=conversation)[1]) == \
            without_saves(before["events"])
        assert without_saves(world.read("a", "operations.list")[1]) == without_saves(before["receipts"])
        _, third = world.say("a", conversation, "third", max_output_tokens=8)
        world.pump(world.finished("a", third["operation"]))
        assert prompts["third"] == turns + [{"role": "user", "content": "third"}]  # history and live turns
        events = world.read("a", "conversations.events", conversation=conversation)[1]
        assert [e["cursor"] for e in events["items"]] == ["2", "3"] and events["event_floor"] == "2"
        transfers = recover(world.journal, world.device.fs, world.device.state.incarnation,
                            after_seq=world.device.state.checkpoint_seq).transfers
        [lease] = [t for t in transfers if t.kind == TransferKind.LEASE]
        assert [row.slot for row in decode_lease(lease.payload)[1]] == [new]  # its lease names the new slot
        after = world.read("a", "operations.get", operation=third["operation"])[1]
        world.boot()  # the journal since the move replays into the moved conversation
        world.attach()
        assert world.read("a", "operations.get", operation=third["operation"])[1] == after
        assert world.read("a", "conversations.get", conversation=conversation)[1] == moved
    finally:
        if world.device.runner is not None:
            world.device.runner.stop()
        world.device.close()
