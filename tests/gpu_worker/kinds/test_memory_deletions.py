"""Forgetting a memory object at the device (`memory.delete`, kinds/memory_deletions.py), with the
real engine and the packed embedding model: gone at once from every read, from recall and from
the input's and the corrections' saved bytes; after the next checkpoint its bytes are nowhere in
the runtime file or the journal directory (grepped), whether it was forgotten live or replayed
after a restart; the audit stays verifiable; refusals change nothing."""
import json
import os

import msgpack

from gpu_worker.kinds.kind import Admission, Kind
from gpu_worker.memory.forgetting import Redactor
from gpu_worker.memory.rows import Forgotten
from gpu_worker.memory.rows import Kind as MemoryKind
from gpu_worker.storage import audit
from gpu_worker.storage.journal import TransferKind
from tests.gpu_worker.kinds.test_memory import retire_all, rows, run, world  # noqa: F401 (the fixture)
from tests.gpu_worker.kinds.test_memory_versions import correct, journal_transfers, payload
from tests.gpu_worker.kinds.test_shared_state import code

SECRET = "the vault code is swordfish-7731"
CORRECTED = "the vault code is marlin-0042"


def forget(world, name, obj, **fields):
    return world.mutate(name, "memory.delete", f"/memory/{obj}/deletion", fields, extra={"memory": obj})


def stored_bytes(world):
    """Every byte of the runtime file and of every file under the journal directory."""
    found = [open(world.runtime, "rb").read()]
    for root, _, files in os.walk(world.journal):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                found.append(f.read())
    return b"".join(found)


def secret_turn(world, **options):
    space, conversation = world.conversation("a")
    receipt = run(world, "a", conversation, SECRET)
    [obj] = receipt["memory"]["retained"]
    return space, conversation, receipt, obj


def test_a_forgotten_object_is_gone_at_once_from_reads_search_and_its_input(world):
    space, conversation, receipt, obj = secret_turn(world)
    status, deleted = forget(world, "a", obj, reason="asked by the user")
    assert status == 202, deleted
    assert deleted["kind"] == "memory.delete" and deleted["target"] == obj
    assert code(world.read("a", "memory.get", memory=obj)) == (404, "memory_not_found")
    assert rows(world, "a", space) == []
    found = world.read("a", "memory.search", space=space, q=SECRET, limit=5)[1]["items"]
    assert found == []
    # the input that retained it no longer holds its text (its receipt still reads)
    table = world.device.state.tables
    rrow = world.device.state.receipts.op_row(bytes.fromhex(receipt["operation"][-32:]))
    assert SECRET.encode() not in table.command_bytes[rrow].numpy().tobytes()
    assert world.read("a", "operations.get", operation=receipt["operation"])[0] == 200
    # nothing of it left in the memory table's tensors either
    memory = world.device.state.memory
    assert SECRET.encode() not in memory.payload.numpy().tobytes()
    # forgotten twice: 404, nothing changes
    before = len(journal_transfers(world))
    assert code(forget(world, "a", obj)) == (404, "memory_not_found")
    assert len(journal_transfers(world)) == before


def say(world, conversation, text, sequence, key, tokens=4):
    return world.mutate("a", "conversations.input", f"/conversations/{conversation}/inputs",
                        {"text": text, "model": "tiny-llama", "max_output_tokens": tokens},
                        extra={"conversation": conversation}, sequence=sequence, key=key)


def test_an_exact_retry_of_the_input_still_answers_its_receipt_after_the_text_is_forgotten(world):
    space, conversation = world.conversation("a")
    me = world.read("a", "participant.get")[1]
    sequence, key = int(me["next_sequence"]), "cd" * 16
    status, first = say(world, conversation, SECRET, sequence, key)
    assert status == 202
    world.pump(world.finished("a", first["operation"]))
    [obj] = world.read("a", "operations.get", operation=first["operation"])[1]["memory"]["retained"]
    assert forget(world, "a", obj)[0] == 202
    status, again = say(world, conversation, SECRET, sequence, key)
    assert status == 200 and again["operation"] == first["operation"]
    assert code(say(world, conversation, SECRET, sequence, key, tokens=5)) == (409, "operation_changed")
    # the text itself is what it no longer knows: a retry differing only there finds the receipt too,
    # and changes nothing (docs/memory.md "Forgetting")
    status, same = say(world, conversation, "another text", sequence, key)
    assert status == 200 and same["operation"] == first["operation"]


def test_rights_and_refusals_change_nothing(world):
    room = world.space("a", scope="room")
    assert world.member("a", room, "b", ["read", "write"])[0] == 202
    assert world.member("a", room, "c", ["read"])[0] == 202
    conversation = world.mutate("a", "conversations.create", f"/spaces/{room}/conversations", {})[1]["target"]
    [theirs] = run(world, "a", conversation, "a said that")["memory"]["retained"]
    before = len(journal_transfers(world))
    assert code(forget(world, "c", theirs)) == (403, "right_missing")
    assert code(forget(world, "b", theirs)) == (403, "right_missing")  # another's row needs manage
    assert code(forget(world, "a", theirs, reason="x" * 257)) == (400, "bad_field")
    assert len(journal_transfers(world)) == before
    assert payload(world, "c", theirs)[0] == b"a said that"


def test_after_a_checkpoint_its_bytes_are_nowhere_in_the_runtime_file_or_the_journal(world):
    space, conversation, receipt, obj = secret_turn(world)
    assert correct(world, "a", obj, CORRECTED)[0] == 202  # a correction's text and its kept version too
    assert world.device.checkpoint() is not None  # both in the runtime file's state and audit now
    assert SECRET.encode() in stored_bytes(world) and CORRECTED.encode() in stored_bytes(world)
    run(world, "a", conversation, "an unrelated turn after it")
    assert forget(world, "a", obj)[0] == 202
    assert world.device.checkpoint() is not None
    data = stored_bytes(world)
    assert SECRET.encode() not in data and CORRECTED.encode() not in data
    assert b"an unrelated turn after it" in data  # (the grep finds what was not forgotten)
    # the audit still exports and verifies, the redacted transfers marked
    export = os.path.join(os.path.dirname(world.journal), "audit.jsonl")
    summary = audit.export(world.runtime, world.journal, export)
    assert audit.verify(export, world.runtime, world.journal) is None
    with open(export) as f:
        assert sum('"redacted":true' in line for line in f) >= 2
    assert summary["transfers"] == len(list(audit.transfers(world.runtime, world.journal)))
    # and after a restart the state is the forgotten one
    world.boot()
    world.attach()
    assert code(world.read("a", "memory.get", memory=obj)) == (404, "memory_not_found")


def test_a_forget_replayed_after_a_restart_is_erased_at_the_next_checkpoint(world):
    space, conversation, receipt, obj = secret_turn(world)
    retire_all(world, "a")  # the turn folded into the conversation's history
    assert forget(world, "a", obj)[0] == 202
    history = world.device.state.tables.history.numpy().tobytes()
    assert SECRET.encode() not in history
    world.boot()  # the deletion replayed from the journal: its erasure still owed to the file
    world.attach()
    assert code(world.read("a", "memory.get", memory=obj)) == (404, "memory_not_found")
    assert SECRET.encode() in stored_bytes(world)  # (the journal still holds the input's admission)
    assert world.device.checkpoint() is not None
    assert SECRET.encode() not in stored_bytes(world)


def test_the_audit_redactor_takes_every_forgotten_object_one_input_wrote():
    """An input's source and its interpretation are two objects of one operation: forgotten both,
    the input's admission loses its text and both MEMORY transfers their text and embedding."""
    actor, op, vector = b"a" * 16, b"o" * 16, bytes(range(16))
    canonical = json.dumps({"body": {"text": SECRET}, "method": "POST", "path": "/x"}).encode()
    admission = Admission(int(Kind.INPUT), b"p" * 16, 7, b"k" * 16, op, canonical, {}).encode()
    source = msgpack.packb([actor, 7, int(MemoryKind.SOURCE), 0, 0, None, vector, 0], use_bin_type=True)
    interpretation = msgpack.packb([actor, 7, int(MemoryKind.INTERPRETATION), 0, 0, b"the user gave a code",
                                    vector, 0], use_bin_type=True)
    redact = Redactor([Forgotten(b"s" * 16, op, actor, int(MemoryKind.SOURCE), False),
                       Forgotten(b"i" * 16, op, actor, int(MemoryKind.INTERPRETATION), False)])
    assert SECRET.encode() not in redact(int(TransferKind.ADMISSION), admission)
    for payload in (source, interpretation):
        fields = msgpack.unpackb(redact(int(TransferKind.MEMORY), payload))
        assert fields[5] in (None, b"") and fields[6] == bytes(len(vector))
