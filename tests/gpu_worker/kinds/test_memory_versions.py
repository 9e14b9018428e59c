"""Correcting a memory object at the device (`memory.versions`, kinds/memory_versions.py), with the
real engine and the packed embedding model: the next version in the same row with the new text's
embedding, the replaced version readable while the correction's receipt lives, rights, refusals
that change nothing, quotas, and the same state after a restart and after a checkpoint."""
import base64

import torch

from gpu_worker.storage.journal import TransferKind
from gpu_worker.storage.journal_reader import recover
from tests.gpu_worker.kinds.test_memory import retire_all, rows, run, world  # noqa: F401 (the fixture)
from tests.gpu_worker.kinds.test_shared_state import code


def correct(world, name, obj, text, version="1", **options):
    return world.mutate(name, "memory.versions", f"/memory/{obj}/versions", {"text": text, "version": version},
                        extra={"memory": obj}, **options)


def payload(world, name, obj, **args):
    status, body = world.read(name, "memory.get", memory=obj, **args)
    assert status == 200, body
    return base64.b64decode(body["bytes"]), body["memory"]


def journal_transfers(world):
    return recover(world.journal, world.device.fs, world.device.state.incarnation).transfers


def test_a_correction_writes_the_next_version_with_the_new_texts_embedding(world):
    space, conversation = world.conversation("a")
    [obj] = run(world, "a", conversation, "my favourite colour is blue")["memory"]["retained"]
    table = world.device.state.memory
    slot = table.by_id[bytes.fromhex(obj[-32:])]
    status, receipt = correct(world, "a", obj, "my favourite colour is green")
    assert status == 202, receipt
    assert receipt["kind"] == "memory.version" and receipt["target"] == obj
    assert receipt["result"]["length"] == "0" and receipt["terminal"]["status"] == "succeeded"
    data, row = payload(world, "a", obj)
    assert data == b"my favourite colour is green" and row["version"] == "2" and row["byte_length"] == "28"
    assert table.by_id[bytes.fromhex(obj[-32:])] == slot  # same object, same row
    expected = world.device.embedder.encode(["my favourite colour is green"])[0]
    assert torch.allclose(table.embeddings[slot], expected.to(table.embeddings.dtype), atol=1e-6)
    # the replaced version stays readable by version; the current one by its own
    old, old_row = payload(world, "a", obj, version=1)
    assert old == b"my favourite colour is blue" and old_row["version"] == "1" and old_row["byte_length"] == "27"
    assert payload(world, "a", obj, version=2)[0] == b"my favourite colour is green"
    assert code(world.read("a", "memory.get", memory=obj, version=3)) == (409, "stale_version")
    # the admission records the embedding: a replay needs no model
    admission = [t for t in journal_transfers(world) if t.kind == TransferKind.ADMISSION][-1]
    assert table.embeddings[slot].numpy().astype("<f4").tobytes() in admission.payload
    # search (recall's ranking) scores the new text
    status, found = world.read("a", "memory.search", space=space, q="my favourite colour is green", limit=1)
    assert status == 200 and found["items"][0]["memory"]["version"] == "2"
    assert found["items"][0]["score"] > 0.999
    # the kept version is no result of the correction
    assert code(world.read("a", "operations.result", operation=receipt["operation"])) == (409, "no_result")


def test_a_stale_version_and_other_refusals_change_nothing(world):
    space, conversation = world.conversation("a")
    [obj] = run(world, "a", conversation, "the meeting is on monday")["memory"]["retained"]
    assert correct(world, "a", obj, "the meeting is on tuesday")[0] == 202
    before = len(journal_transfers(world))
    table = world.device.state.memory
    snapshot = (table.payload.clone(), table.embeddings.clone(), table.rows.clone())
    assert code(correct(world, "a", obj, "the meeting is on friday", version="1")) == (409, "stale_version")
    assert code(correct(world, "b", obj, "b cannot see it", version="2")) == (404, "memory_not_found")
    assert code(correct(world, "a", obj, "x" * 2049, version="2")) == (400, "text_too_large")
    assert code(correct(world, "a", obj, "an <image> inside", version="2")) == (400, "reserved_token")
    assert code(correct(world, "a", obj, "", version="2")) == (400, "bad_field")
    assert code(correct(world, "a", "mem-" + "0" * 32 + "-" + "1" * 32, "nothing", version="1")) == \
        (404, "memory_not_found")
    assert len(journal_transfers(world)) == before
    assert all(torch.equal(a, b) for a, b in zip(snapshot, (table.payload, table.embeddings, table.rows)))
    assert payload(world, "a", obj)[0] == b"the meeting is on tuesday"


def test_writers_correct_their_own_rows_and_managers_anyones(world):
    room = world.space("a", scope="room")
    assert world.member("a", room, "b", ["read", "write"])[0] == 202
    assert world.member("a", room, "c", ["read"])[0] == 202
    conversation = world.mutate("a", "conversations.create", f"/spaces/{room}/conversations", {})[1]["target"]
    [mine] = run(world, "b", conversation, "b said this")["memory"]["retained"]
    [theirs] = run(world, "a", conversation, "a said that")["memory"]["retained"]
    assert code(correct(world, "c", mine, "a reader cannot")) == (403, "right_missing")
    assert code(correct(world, "b", theirs, "a writer cannot change another's row")) == (403, "right_missing")
    assert correct(world, "b", mine, "b corrected this")[0] == 202
    assert correct(world, "a", mine, "the owner manages it", version="2")[0] == 202
    assert payload(world, "c", mine)[0] == b"the owner manages it"


def test_an_exact_retry_answers_the_first_receipt_and_applies_once(world):
    space, conversation = world.conversation("a")
    [obj] = run(world, "a", conversation, "first")["memory"]["retained"]
    me = world.read("a", "participant.get")[1]
    sequence, key = int(me["next_sequence"]), "ab" * 16
    status, first = correct(world, "a", obj, "second", sequence=sequence, key=key)
    assert status == 202
    status, again = correct(world, "a", obj, "second", sequence=sequence, key=key)
    assert status == 200 and again["operation"] == first["operation"]
    assert payload(world, "a", obj)[1]["version"] == "2"
    assert code(correct(world, "a", obj, "third", sequence=sequence, key=key)) == (409, "operation_changed")


def test_the_kept_versions_count_against_the_memory_rows_quota_until_retired(world):
    space, conversation = world.conversation("a")
    [obj] = run(world, "a", conversation, "v1")["memory"]["retained"]
    used = world.read("a", "capabilities")[1]["quotas"]["memory_rows"]["used"]
    assert correct(world, "a", obj, "v2")[0] == 202
    assert correct(world, "a", obj, "v3", version="2")[0] == 202
    assert world.read("a", "capabilities")[1]["quotas"]["memory_rows"]["used"] == str(int(used) + 2)
    retire_all(world, "a")
    assert world.read("a", "capabilities")[1]["quotas"]["memory_rows"]["used"] == used
    # retired with its receipt: the replaced versions are gone, the current one stays
    assert code(world.read("a", "memory.get", memory=obj, version=1)) == (409, "stale_version")
    assert payload(world, "a", obj)[0] == b"v3"


def test_corrections_survive_a_restart_and_a_checkpoint(world):
    space, conversation = world.conversation("a")
    [obj] = run(world, "a", conversation, "the code is 1234")["memory"]["retained"]
    assert correct(world, "a", obj, "the code is 5678")[0] == 202
    table = world.device.state.memory
    slot = table.by_id[bytes.fromhex(obj[-32:])]
    embedding = table.embeddings[slot].clone()
    listed = rows(world, "a", space)
    world.boot()  # replayed from the journal
    world.attach()
    assert rows(world, "a", space) == listed
    assert torch.equal(world.device.state.memory.embeddings[slot], embedding)
    assert payload(world, "a", obj, version=1)[0] == b"the code is 1234"
    assert world.device.checkpoint() is not None
    assert correct(world, "a", obj, "the code is 0000", version="2")[0] == 202
    world.boot()  # from the checkpoint, then the journal's tail
    world.attach()
    assert payload(world, "a", obj)[0] == b"the code is 0000"
    assert payload(world, "a", obj, version=1)[0] == b"the code is 1234"
    assert payload(world, "a", obj, version=2)[0] == b"the code is 5678"


def test_the_envelope_is_checked_before_the_correction_and_its_embedding(world, monkeypatch):
    """Every mutation's checks come first, in their order: a future sequence or a stale lineage is
    refused as such, before the object is looked at and before anything is embedded."""
    embedded = []
    real = world.device.embedder.encode
    monkeypatch.setattr(world.device.embedder, "encode", lambda texts: embedded.append(texts) or real(texts))
    nothing = "mem-" + "0" * 32 + "-" + "1" * 32
    ahead = int(world.read("a", "participant.get")[1]["next_sequence"]) + 3
    assert code(correct(world, "a", nothing, "text", sequence=ahead)) == (409, "future_sequence")
    assert code(correct(world, "a", nothing, "text")) == (404, "memory_not_found")
    assert embedded == []
