"""What an input's prompt and the memory reads may show (issue 36, DESIGN §8 "A prompt never
carries bytes its submitter could not read"; SPEC "Scope", "Results and memory"), at the device
with the real engine and embedding model (tiny random weights):

- an input's context (earlier turns, recalled memory, published copies) is filtered by its
  submitting participant's read rights (stored rights ∩ current grants) when its lease is saved:
  a write-only member's inputs see its own turns only, retired ones included;
- a zero-rights row fences instance memory: the participant it blocks neither lists, reads,
  recalls nor publishes the memory retained in that instance space, through any other;
- a published copy's row shows its source object and source version to the destination's readers;
- a memory object's version changes when its turn's interpretation is retained, and a read or a
  publication naming another version answers 409 `stale_version`.

Each is replayed from the journal (and from a checkpoint) to the same state."""
import base64

from gpu_worker.pack import pack_tiny
from tests.gpu_worker.kinds.test_inputs import EngineWorld
from tests.gpu_worker.kinds.test_memory import PROFILE, capture_prompts, make_runtime, retire_all, rows, run, running
from tests.gpu_worker.kinds.test_memory import world  # noqa: F401  (the fixture: principals a, b, c)
from tests.gpu_worker.kinds.test_shared_state import code


def conversation_in(world, name, space):
    status, receipt = world.mutate(name, "conversations.create", f"/spaces/{space}/conversations", {})
    assert status == 202, receipt
    return receipt["target"]


def publish(world, name, space, source, version):
    return world.mutate(name, "publications.record", f"/spaces/{space}/publications",
                        {"source": source, "source_version": version})


def users(messages):
    return [m["content"] for m in messages if m["role"] == "user"]


# ---- 1. a prompt holds only what its submitter may read ---------------------------------------

def test_a_write_only_members_input_is_prompted_with_its_own_turns_only(world, monkeypatch):
    prompts = capture_prompts(monkeypatch)
    space, conversation = world.conversation("a")
    assert world.member("a", space, "b", ["write"])[0] == 202
    run(world, "a", conversation, "the owner's secret is 42")
    hello = run(world, "b", conversation, "Hello.")
    messages, system = prompts[-1]
    assert messages == [{"role": "user", "content": "Hello."}] and system is None
    # the same input in a space of b's own has the same prompt: nothing of a's space was in it
    _, alone = world.conversation("b")
    assert run(world, "b", alone, "Hello.")["result"]["input_tokens"] == hello["result"]["input_tokens"]
    run(world, "b", conversation, "again")
    messages, system = prompts[-1]
    assert users(messages) == ["Hello.", "again"] and system is None
    assert "42" not in str(messages)
    # the owner reads the space: every turn, and the space's memory recalled (asked in the secret's
    # own words: the most similar row, above the recall floor, whatever the tiny random embedder)
    run(world, "a", conversation, "the owner's secret is 42")
    messages, system = prompts[-1]
    assert users(messages) == ["the owner's secret is 42", "Hello.", "again", "the owner's secret is 42"]
    assert system is not None and "the owner's secret is 42" in system


def test_a_write_only_members_retired_turns_stay_in_its_context_and_no_one_elses(world, monkeypatch):
    prompts = capture_prompts(monkeypatch)
    space, conversation = world.conversation("a")
    assert world.member("a", space, "b", ["write"])[0] == 202
    run(world, "a", conversation, "owner one", context="plain")
    run(world, "b", conversation, "writer one", context="plain")
    retire_all(world, "a")
    retire_all(world, "b")  # both turns are in the conversation's history row now
    run(world, "b", conversation, "writer two", context="plain")
    assert users(prompts[-1][0]) == ["writer one", "writer two"]
    run(world, "a", conversation, "owner two", context="plain")
    assert users(prompts[-1][0]) == ["owner one", "writer one", "writer two", "owner two"]
    world.boot()  # the history is refolded at replay with its authors
    world.attach()
    run(world, "b", conversation, "writer three", context="plain")
    assert users(prompts[-1][0]) == ["writer one", "writer two", "writer three"]


def test_a_member_without_the_read_grant_is_prompted_as_a_write_only_member(world, monkeypatch):
    prompts = capture_prompts(monkeypatch)
    space, conversation = world.conversation("a")
    assert world.member("a", space, "b", ["read", "write"])[0] == 202
    run(world, "a", conversation, "the owner's secret is 42")
    run(world, "b", conversation, "with the grant")
    assert users(prompts[-1][0]) == ["the owner's secret is 42", "with the grant"] and prompts[-1][1] is not None
    me = world.read("b", "participant.get")[1]  # its lineage and next sequence, read while it may
    world.actions["b"] = ["shared_write"]  # current grants intersect stored rights at lease time
    world.write_grants()
    world.device.idle()
    assert code(world.read("b", "memory.list", space=space)) == (403, "grant_missing")
    read = world.read
    monkeypatch.setattr(world, "read", lambda name, op, **args: (200, me) if op == "participant.get"
                        else read(name, op, **args))
    status, receipt = world.say("b", conversation, "without it", max_output_tokens=4)
    assert status == 202, receipt
    world.pump(lambda: len(prompts) == 3 and not world.device.executions.live)
    assert users(prompts[-1][0]) == ["with the grant", "without it"] and prompts[-1][1] is None


# ---- 2. a zero-rights row fences instance memory -------------------------------------------

def test_a_zero_rights_row_fences_instance_memory_from_listing_detail_recall_and_publication(world, monkeypatch):
    prompts = capture_prompts(monkeypatch)
    fenced, shared = world.space("a", scope="instance"), world.space("a", scope="instance")
    [obj] = run(world, "a", conversation_in(world, "a", fenced), "the instance secret is 42")["memory"]["retained"]
    assert world.member("a", fenced, "c", [])[0] == 202  # c is blocked from `fenced` only
    # b, with no row, sees the instance's memory through either instance space
    assert obj in [r["object"] for r in rows(world, "b", shared)]
    assert world.read("b", "memory.get", memory=obj)[0] == 200
    # c neither lists, reads, recalls nor publishes it, through `shared` or any other path
    assert code(world.read("c", "memory.list", space=fenced)) == (404, "space_not_found")
    assert rows(world, "c", shared) == []
    assert code(world.read("c", "memory.get", memory=obj)) == (404, "memory_not_found")
    room = world.space("c", scope="room")
    assert code(publish(world, "c", room, obj, "1")) == (404, "memory_not_found")
    conversation = conversation_in(world, "c", shared)
    [mine] = run(world, "c", conversation, "what is the instance secret")["memory"]["retained"]
    assert prompts[-1][1] is None  # nothing it may read was there to recall
    run(world, "b", conversation, "the instance secret is 42")  # its own words: the most similar row
    assert '"the instance secret is 42"' in prompts[-1][1]  # b reads both spaces: recalled
    for _ in range(2):  # live, then replayed from the journal
        listed = [r["object"] for r in rows(world, "b", shared)]
        assert obj in listed and mine in listed
        assert [r["object"] for r in rows(world, "c", shared)] == [o for o in listed if o != obj]
        assert code(world.read("c", "memory.get", memory=obj)) == (404, "memory_not_found")
        world.boot()
        world.attach()


def test_deleting_an_instance_space_frees_the_memory_retained_in_it(world):
    space, other = world.space("a", scope="instance"), world.space("a", scope="instance")
    conversation = conversation_in(world, "a", space)
    [obj] = run(world, "a", conversation, "to be forgotten")["memory"]["retained"]
    [kept] = run(world, "a", conversation_in(world, "a", other), "to be kept")["memory"]["retained"]
    assert world.mutate("a", "conversations.delete", f"/conversations/{conversation}/deletion", {},
                        extra={"conversation": conversation})[0] == 202
    assert world.mutate("a", "spaces.delete", f"/spaces/{space}/deletion", {})[0] == 202
    assert [r["object"] for r in rows(world, "b", other)] == [kept]
    assert code(world.read("a", "memory.get", memory=obj)) == (404, "memory_not_found")
    assert world.device.state.memory.used() == 1
    world.boot()
    world.attach()
    assert world.device.state.memory.used() == 1 and [r["object"] for r in rows(world, "b", other)] == [kept]


# ---- 3. a published copy shows its provenance ---------------------------------------------

def test_a_published_copy_shows_its_source_object_and_version_to_the_destinations_readers(world):
    private, conversation = world.conversation("a")
    [obj] = run(world, "a", conversation, "a shared fact")["memory"]["retained"]
    room = world.space("a", scope="room")
    assert world.member("a", room, "b", ["read"])[0] == 202
    status, published = publish(world, "a", room, obj, "1")
    assert status == 202, published
    [row] = rows(world, "b", room)  # b cannot read the source, and sees where the copy came from
    assert row["object"] == published["target"] and row["published_from"] == {"object": obj, "version": "1"}
    assert world.read("b", "memory.get", memory=row["object"])[1]["memory"] == row
    assert code(world.read("b", "memory.get", memory=obj)) == (404, "memory_not_found")
    assert rows(world, "a", private)[0]["published_from"] is None
    world.boot()  # replayed from the publication's admission record
    world.attach()
    assert rows(world, "b", room) == [row]
    assert world.device.checkpoint() is not None
    world.boot()  # loaded from the checkpoint
    world.attach()
    assert rows(world, "b", room) == [row]


# ---- 4. object versions -----------------------------------------------------------------

def interpreting(world, text):
    """The engine answers every interpretation with `text` (the tiny random model may write
    nothing printable); the turn itself runs on the engine."""
    runner = world.device.runner
    submit = runner.submit

    def fake(request_id, *args, **kwargs):
        if request_id[0] == "interpret":
            world.events.put([(request_id, 1, text, "stop", None)])
        else:
            submit(request_id, *args, **kwargs)
    runner.submit = fake


def test_a_sources_version_changes_when_its_interpretation_is_retained_and_a_stale_read_is_409(tmp_path):
    path = str(tmp_path / "qualified.aotxccir")
    pack_tiny(path, shared=True, runtime_profile=PROFILE, automatic_memory=True)
    with running(EngineWorld(path, tmp_path, ["a"])) as w:
        interpreting(w, b"the user likes tea")
        space, conversation = w.conversation("a")
        receipt = run(w, "a", conversation, "i like tea", retention="interpret")
        source, interpretation = rows(w, "a", space)
        assert receipt["memory"]["retained"] == [source["object"], interpretation["object"]]
        assert (source["kind"], source["version"], source["interpreted"]) == ("source", "2", True)
        assert (interpretation["kind"], interpretation["version"], interpretation["interpreted"]) == (
            "interpretation", "1", False)
        status, stale = w.read("a", "memory.get", memory=source["object"], version=1)
        assert (status, stale["error"]["code"], stale["error"]["version"]) == (409, "stale_version", "2")
        status, current = w.read("a", "memory.get", memory=source["object"], version=2)
        assert status == 200 and current["memory"] == source and base64.b64decode(current["bytes"]) == b"i like tea"
        assert w.read("a", "memory.get", memory=interpretation["object"], version=1)[0] == 200
        room = w.space("a", scope="room")
        status, refused = publish(w, "a", room, source["object"], "1")
        assert (status, refused["error"]["code"], refused["error"]["version"]) == (409, "stale_version", "2")
        status, published = publish(w, "a", room, source["object"], "2")
        assert status == 202, published
        [copy] = rows(w, "a", room)
        assert copy["version"] == "1" and copy["published_from"] == {"object": source["object"], "version": "2"}
        listed = rows(w, "a", space)
        w.boot()
        w.attach()
        assert rows(w, "a", space) == listed and rows(w, "a", room) == [copy]


def test_a_turn_without_an_interpretation_keeps_version_1(world):
    space, conversation = world.conversation("a")
    [obj] = run(world, "a", conversation, "just a source")["memory"]["retained"]
    [row] = rows(world, "a", space)
    assert row["version"] == "1" and row["interpreted"] is False
    assert world.read("a", "memory.get", memory=obj, version=1)[0] == 200
    assert code(world.read("a", "memory.get", memory=obj, version=2)) == (409, "stale_version")


def test_a_bad_version_is_refused_and_an_invisible_object_stays_404(world):
    space, conversation = world.conversation("a")
    [obj] = run(world, "a", conversation, "private")["memory"]["retained"]
    for bad in ("1", -1, 0, 1.5, True):  # (null is "not given", as every optional argument's)
        assert code(world.read("a", "memory.get", memory=obj, version=bad)) == (400, "bad_field")
    assert code(world.read("b", "memory.get", memory=obj, version=9)) == (404, "memory_not_found")


def test_instance_rows_of_an_earlier_checkpoint_show_only_to_readers_of_every_instance_space(world):
    """A checkpoint written before the fence filed every instance row under one number and kept
    no space for it: such a row is shown only to a participant no instance space is closed to."""
    fenced, shared = world.space("a", scope="instance"), world.space("a", scope="instance")
    [obj] = run(world, "a", conversation_in(world, "a", fenced), "an old instance fact")["memory"]["retained"]
    table = world.device.state.memory
    table.owners[table.by_id[bytes.fromhex(obj[-32:])]] = table.legacy_instance  # as that checkpoint filed it
    assert world.device.checkpoint() is not None
    world.boot()
    world.attach()
    assert world.member("a", fenced, "c", [])[0] == 202
    assert obj in [r["object"] for r in rows(world, "b", shared)]
    assert world.read("b", "memory.get", memory=obj)[0] == 200
    assert obj not in [r["object"] for r in rows(world, "c", shared)]
    assert code(world.read("c", "memory.get", memory=obj)) == (404, "memory_not_found")


def test_history_records_without_an_author_are_given_to_readers_of_the_space_only():
    """A checkpoint's history written before authors were kept: `order | user length | user |
    answer length | answer` records read back with an unknown author, beside authored ones."""
    import struct
    from gpu_worker.kinds import history
    old = struct.pack("<II", 3, 2) + b"hi" + struct.pack("<I", 3) + b"yes"
    new = history._encode(4, 7, b"me", b"ok")
    assert history._records(old + new) == [(3, history.UNKNOWN, b"hi", b"yes"), (4, 7, b"me", b"ok")]
