"""The admin console's memory commands at the device (memory/ops.py, no principal): `ops.memory`
lists every row of a space's memory whoever may read it, with a payload preview; `ops.memory.forget`
forgets one through the same `memory.delete` kind, admitted by the device's operator participant
(registered at its first forget, once), its reason and staff name kept in the receipt's command
bytes (`ops.command`); refusals change nothing; a restart replays it all."""
import base64
import collections
import json

from gpu_worker import derived
from tests.conftest import ALL
from tests.gpu_worker.kinds.test_memory import rows, run, world  # noqa: F401 (the fixture)
from tests.gpu_worker.kinds.test_memory_deletions import SECRET, forget, secret_turn, stored_bytes
from tests.gpu_worker.kinds.test_memory_versions import journal_transfers
from tests.gpu_worker.kinds.test_shared_state import code


def ops(world, op, **args):
    """An ops command as the gateway sends it (no principal), and its one reply."""
    req_id = next(world.ids)
    inbox = collections.deque([("ops", {"v": 1, "id": req_id, "op": op, "principal": None, "args": args})])
    replies = world.device.committer.run_sync(inbox) + world.device.take_outbox()
    [msg] = [msg for _, msg in replies if msg.id == req_id]
    return msg.status, json.loads(msg.body)


def staff_forget(world, obj, reason="asked to by its subject", staff="root", **more):
    return ops(world, "ops.memory.forget", memory=obj, **({"reason": reason} if reason is not None else {}),
               staff=staff, **more)


def operator_receipts(world, kind=None):
    operator = world.device.state.participants.by_principal.get(derived.operator(world.device.state.incarnation))
    if operator is None:
        return []
    par = world.device.state.participants.public_id[operator]
    return ops(world, "ops.receipts", participant=par, **({"kind": kind} if kind else {}))[1]["items"]


def command_of(world, operation):
    status, body = ops(world, "ops.command", operation=operation)
    assert status == 200, body
    assert base64.b64decode(body["bytes"]).decode() == body["text"]
    return json.loads(body["text"])


def test_ops_memory_lists_every_row_of_a_space_whoever_may_read_it_with_a_preview(world):
    room = world.space("a", scope="room")
    assert world.member("a", room, "b", ["read", "write"])[0] == 202
    conversation = world.mutate("a", "conversations.create", f"/spaces/{room}/conversations", {})[1]["target"]
    long_text = "x" + "é" * 150  # 301 bytes: the preview's 200 cut through a character
    [first] = run(world, "a", conversation, "the meeting is on tuesday")["memory"]["retained"]
    [second] = run(world, "b", conversation, long_text)["memory"]["retained"]
    assert world.member("a", room, "b", [])[0] == 202  # b may read it no more; staff still see everything
    assert code(world.read("b", "memory.list", space=room)) == (404, "space_not_found")
    assert code(world.read("c", "memory.list", space=room)) == (404, "space_not_found")
    status, listed = ops(world, "ops.memory", space=room)
    assert status == 200 and listed["next_cursor"] is None
    assert [item["object"] for item in listed["items"]] == [first, second]
    assert [{k: v for k, v in item.items() if k != "preview"} for item in listed["items"]] == rows(world, "a", room)
    short, cut = (item["preview"] for item in listed["items"])
    assert short == {"bytes": base64.b64encode(b"the meeting is on tuesday").decode(),
                     "text": "the meeting is on tuesday", "complete": True}
    assert cut["complete"] is False and len(base64.b64decode(cut["bytes"])) == 200
    assert cut["text"] == "x" + "é" * 99  # the split character left out of the text
    assert listed["items"][1]["actor"] == world.par["b"] and listed["items"][1]["byte_length"] == "301"
    page = ops(world, "ops.memory", space=room, limit=1)[1]
    assert [item["object"] for item in page["items"]] == [first] and page["next_cursor"] is not None
    rest = ops(world, "ops.memory", space=room, cursor=page["next_cursor"])[1]
    assert [item["object"] for item in rest["items"]] == [second] and rest["next_cursor"] is None
    other = world.space("c")  # another space's memory is not this one's
    assert ops(world, "ops.memory", space=other)[1] == {"items": [], "next_cursor": None}
    assert code(ops(world, "ops.memory", space=f"spc-{'1' * 32}-{'2' * 32}")) == (404, "space_not_found")
    assert code(ops(world, "ops.memory", space="spc-x")) == (400, "bad_id")


def test_a_staff_forget_is_a_memory_delete_by_the_operator_registered_once(world):
    space, conversation, receipt, obj = secret_turn(world)
    [other] = run(world, "a", conversation, "the second fact")["memory"]["retained"]
    assert operator_receipts(world) == []
    status, deleted = staff_forget(world, obj, reason="the user asked by mail", staff="alice")
    assert status == 202, deleted
    assert deleted["kind"] == "memory.delete" and deleted["target"] == obj and deleted["admission"]["saved"]
    operator = world.device.state.participants.by_principal[derived.operator(world.device.state.incarnation)]
    assert deleted["participant"] == world.device.state.participants.public_id[operator] != world.par["a"]
    assert code(world.read("a", "memory.get", memory=obj)) == (404, "memory_not_found")
    assert [row["object"] for row in rows(world, "a", space)] == [other]
    assert [item["object"] for item in ops(world, "ops.memory", space=space)[1]["items"]] == [other]
    # the same erasure as a participant's forget: the input's text is gone from its receipt
    rrow = world.device.state.receipts.op_row(bytes.fromhex(receipt["operation"][-32:]))
    assert SECRET.encode() not in world.device.state.tables.command_bytes[rrow].numpy().tobytes()
    # the reason and the staff user's name are kept in the receipt's command bytes
    assert command_of(world, deleted["operation"]) == {
        "method": "POST", "path": f"/ops/memory/{obj}/deletion",
        "body": {"reason": "the user asked by mail", "staff": "alice"}}
    [registration] = operator_receipts(world, "participant.register")
    assert command_of(world, registration["operation"]) == {"method": "POST", "path": "/ops/participant",
                                                            "body": {"staff": "alice"}}
    # a second forget: the operator's next sequence, no second registration
    status, again = staff_forget(world, other, staff="bob")
    assert status == 202 and again["target"] == other
    assert [r["kind"] for r in operator_receipts(world)] == ["participant.register", "memory.delete", "memory.delete"]
    assert [r["sequence"] for r in operator_receipts(world)] == ["1", "2", "3"]
    assert rows(world, "a", space) == []


def test_refusals_change_nothing_and_register_nobody(world):
    space, conversation, receipt, obj = secret_turn(world)
    before = len(journal_transfers(world))
    assert code(staff_forget(world, obj, reason=None)) == (400, "bad_field")  # missing
    assert code(staff_forget(world, obj, reason="")) == (400, "bad_field")
    assert code(staff_forget(world, obj, reason="x" * 257)) == (400, "bad_field")
    assert code(staff_forget(world, obj, staff="")) == (400, "bad_field")
    assert code(staff_forget(world, f"mem-{'1' * 32}-{'2' * 32}")) == (404, "memory_not_found")
    assert code(staff_forget(world, obj[:-32] + "0" * 32)) == (404, "memory_not_found")
    assert code(staff_forget(world, f"mem-{'3' * 32}{obj[-33:]}")) == (404, "memory_not_found")  # another lineage
    # a participant's own memory.delete cannot say it is staff's (its type refuses the field)
    assert code(forget(world, "b", obj, staff="root")) == (400, "bad_field")
    assert code(forget(world, "b", obj)) == (404, "memory_not_found")  # (b reads no row of a's)
    assert len(journal_transfers(world)) == before and operator_receipts(world) == []
    assert rows(world, "a", space)[0]["object"] == obj
    # once the operator exists, an unknown object still admits nothing
    [other] = run(world, "a", conversation, "the second fact")["memory"]["retained"]
    assert staff_forget(world, other)[0] == 202
    before = len(journal_transfers(world))
    assert code(staff_forget(world, other)) == (404, "memory_not_found")  # forgotten already
    assert len(journal_transfers(world)) == before and len(operator_receipts(world)) == 2


def test_the_operators_principal_is_refused_as_a_commands_principal(world):
    operator = derived.operator_hex(world.device.state.incarnation)
    world.principals["intruder"] = operator
    world.actions["intruder"] = list(ALL)
    world.write_grants()  # even a grant file that names it
    assert code(world.read("intruder", "participant.get")) == (403, "grant_missing")
    registration = {"lineage": "a" * 32, "operation_key": "b" * 32, "sequence": 1, "canonical": b"{}"}
    assert code(world.send("intruder", "participant.register", registration)) == (403, "grant_missing")
    assert operator_receipts(world) == []


def test_staff_forgets_replay_after_a_restart_and_are_erased_at_the_next_checkpoint(world):
    space, conversation, receipt, obj = secret_turn(world)
    [other] = run(world, "a", conversation, "the second fact")["memory"]["retained"]
    status, deleted = staff_forget(world, obj, reason="erasure request 17")
    assert status == 202
    before = operator_receipts(world)
    world.boot()  # the registration and the deletion replayed from the journal
    world.attach()
    assert code(world.read("a", "memory.get", memory=obj)) == (404, "memory_not_found")
    assert operator_receipts(world) == before
    assert command_of(world, deleted["operation"])["body"]["reason"] == "erasure request 17"
    assert SECRET.encode() in stored_bytes(world)  # (the journal still holds the input's admission)
    assert world.device.checkpoint() is not None
    assert SECRET.encode() not in stored_bytes(world)
    # after the restart the operator goes on from its next sequence, registered once
    status, again = staff_forget(world, other)
    assert status == 202 and again["sequence"] == "3"
    assert [r["kind"] for r in operator_receipts(world)] == ["participant.register", "memory.delete", "memory.delete"]
    world.boot()
    world.attach()
    assert rows(world, "a", space) == [] and len(operator_receipts(world)) == 3


def test_the_operator_retires_its_older_receipts_itself_and_staff_forgets_go_on(world, monkeypatch):
    """Nobody else can retire the operator's receipts: at OPERATOR_KEEP live ones it retires the
    older half before the next forget, so staff forgets never run into its receipts quota."""
    from gpu_worker.memory import ops as memory_ops
    monkeypatch.setattr(memory_ops, "OPERATOR_KEEP", 4)
    space, conversation = world.conversation("a")
    objects = [run(world, "a", conversation, f"fact number {n}")["memory"]["retained"][0] for n in range(7)]
    for n, obj in enumerate(objects):
        status, receipt = staff_forget(world, obj, reason=f"request {n}")
        assert status == 202, receipt
    assert len(operator_receipts(world)) <= 4 + 1  # (its newest, and the retirement's own)
    assert rows(world, "a", space) == []
    newest = [r for r in operator_receipts(world, kind="memory.delete")][-1]
    assert command_of(world, newest["operation"])["body"]["reason"] == "request 6"
