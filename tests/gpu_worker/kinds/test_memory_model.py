"""Memory, publication, corrections, forgetting and forks against a model (a Hypothesis state
machine), with device restarts and checkpoints between the steps, on a memory table small enough
to fill.

Two participants: a owns a private space and a room (b is a reader and writer of the room), b
owns a private space; each space has a conversation. The model holds every memory object (its
space, payload bytes and kind) and predicts each input's retention (retained while the table has
room, else `memory_full`) and each publication's answer in the device's order of checks
(destination 404/403, source 404, version 409, full table 507), each correction's (404, 403 for
another's row without manage, 409 for a stale version) and each forgetting's (404, 403). A
correction moves the object to its next version and keeps the one it replaced readable; a fork
becomes its space's conversation for the inputs after it. After every step each reader's memory
list, every object's bytes and version, and every replaced version's bytes must be exactly the
model's, and a restart or a checkpoint must change nothing."""
import base64
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from gpu_worker.pack import pack_tiny
from tests.gpu_worker.kinds.test_inputs import EngineWorld

CAPACITY = 5
TEXTS = st.text(alphabet="abcdefgh é", min_size=1, max_size=12)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("memory-model") / "memory.aotxccir")
    pack_tiny(path, shared=True, capacity={"memory": CAPACITY},
              runtime_profile={"kv_pages": 128, "page_grant": 64, "deadline_ms": 60000})
    return path


class MemoryMachine(RuleBasedStateMachine):
    runtime = None  # set by the test

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="aotx-memory-model-")
        runtime = shutil.copy(self.runtime, f"{self.dir}/memory.aotxccir")  # checkpoints write into it
        self.world = w = EngineWorld(runtime, _Dir(self.dir), ["a", "b"])
        self.spaces = {}
        self.spaces["a_private"], con_a = w.conversation("a")
        room = w.space("a", scope="room")
        assert w.member("a", room, "b", ["read", "write"])[0] == 202
        status, receipt = w.mutate("a", "conversations.create", f"/spaces/{room}/conversations", {})
        assert status == 202
        self.spaces["room"] = room
        self.spaces["b_private"], con_b = w.conversation("b")
        self.conversations = {"a_private": con_a, "room": receipt["target"], "b_private": con_b}
        self.readable = {"a": {"a_private", "room"}, "b": {"b_private", "room"}}
        self.manages = {"a": {"a_private", "room"}, "b": {"b_private"}}
        self.objects = {}  # memory ID -> (space name, payload bytes), in write order
        self.actors = {}  # memory ID -> who wrote it
        self.versions = {}  # memory ID -> its current version
        self.kept = {}  # (memory ID, version) -> the bytes a correction replaced
        self.orders = {}  # conversation -> its last event order

    def teardown(self):
        self.world.device.runner.stop()
        self.world.device.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(who=st.sampled_from(["a", "b"]), where=st.sampled_from(["a_private", "room", "b_private"]), text=TEXTS)
    def input(self, who, where, text):
        if where not in self.readable[who]:
            where = "room"
        w = self.world
        status, receipt = w.say(who, self.conversations[where], text, max_output_tokens=1)
        assert status == 202, receipt
        self.orders[self.conversations[where]] = self.orders.get(self.conversations[where], 0) + 1
        w.pump(w.finished(who, receipt["operation"]))
        memory = w.read(who, "operations.get", operation=receipt["operation"])[1]["memory"]
        if len(self.objects) < CAPACITY:
            [obj] = memory["retained"]
            assert memory["not_retained"] == []
            self.objects[obj] = (where, text.encode())
            self.actors[obj], self.versions[obj] = who, 1
        else:
            assert memory["retained"] == []
            assert memory["not_retained"] == [{"kind": "source", "reason": "memory_full"}]

    @rule(who=st.sampled_from(["a", "a", "b"]), dest=st.sampled_from(["a_private", "room", "room", "b_private"]),
          data=st.data(), stale=st.sampled_from([False, False, False, True]))
    def publish(self, who, dest, data, stale):
        w = self.world
        source = data.draw(st.sampled_from(list(self.objects) or ["mem-" + "1" * 32 + "-" + "2" * 32]))
        version = "2" if stale else "1"
        status, body = w.mutate(who, "publications.record", f"/spaces/{self.spaces[dest]}/publications",
                                {"source": source, "source_version": version})
        code = body.get("error", {}).get("code")
        if dest not in self.readable[who] and dest not in self.manages[who]:
            expected = (404, "space_not_found")
        elif dest not in self.manages[who]:
            expected = (403, "right_missing")
        elif source not in self.objects or self.objects[source][0] not in self.readable[who]:
            expected = (404, "memory_not_found")
        elif stale:
            expected = (409, "stale_version")
        elif len(self.objects) >= CAPACITY:
            expected = (507, "memory_full")
        else:
            expected = (202, None)
        assert (status, code) == expected, (who, dest, body)
        if status == 202:
            self.objects[body["target"]] = (dest, self.objects[source][1])
            self.actors[body["target"]], self.versions[body["target"]] = who, 1

    def _change_expected(self, who, obj):
        """The answer the model expects a correction or a forgetting to start with: None when it
        goes on to the kind's own checks."""
        if obj not in self.objects or self.objects[obj][0] not in self.readable[who]:
            return (404, "memory_not_found")
        if self.actors[obj] != who and self.objects[obj][0] not in self.manages[who]:
            return (403, "right_missing")
        return None

    @rule(who=st.sampled_from(["a", "b"]), data=st.data(), text=TEXTS, stale=st.sampled_from([False, False, True]))
    def correct(self, who, data, text, stale):
        w = self.world
        obj = data.draw(st.sampled_from(list(self.objects) or ["mem-" + "1" * 32 + "-" + "2" * 32]))
        version = self.versions.get(obj, 1) + (1 if stale else 0)
        status, body = w.mutate(who, "memory.versions", f"/memory/{obj}/versions",
                                {"text": text, "version": str(version)}, extra={"memory": obj})
        expected = self._change_expected(who, obj) or ((409, "stale_version") if stale else (202, None))
        assert (status, body.get("error", {}).get("code")) == expected, (who, obj, body)
        if status == 202:
            space, old = self.objects[obj]
            self.kept[(obj, self.versions[obj])] = old
            self.objects[obj] = (space, text.encode())
            self.versions[obj] += 1

    @rule(who=st.sampled_from(["a", "b"]), data=st.data())
    def forget(self, who, data):
        w = self.world
        obj = data.draw(st.sampled_from(list(self.objects) or ["mem-" + "1" * 32 + "-" + "2" * 32]))
        status, body = w.mutate(who, "memory.delete", f"/memory/{obj}/deletion", {}, extra={"memory": obj})
        expected = self._change_expected(who, obj) or (202, None)
        assert (status, body.get("error", {}).get("code")) == expected, (who, obj, body)
        if status == 202:
            del self.objects[obj], self.actors[obj], self.versions[obj]
            self.kept = {key: value for key, value in self.kept.items() if key[0] != obj}

    @rule(where=st.sampled_from(["a_private", "room", "b_private"]))
    def fork(self, where):
        """The space's conversation forked at its last input: the fork takes its place."""
        w = self.world
        who = "b" if where == "b_private" else "a"
        source = self.conversations[where]
        at = self.orders.get(source, 0)
        status, body = w.mutate(who, "conversations.fork", f"/conversations/{source}/forks", {"at": str(at or 1)},
                                extra={"conversation": source})
        if at == 0:
            assert (status, body["error"]["code"]) == (409, "fork_point_past_end")
            return
        assert status == 202, body
        self.conversations[where] = body["target"]
        self.orders[body["target"]] = at  # (its inputs' event orders go on from the fork point)

    @rule()
    def restart(self):
        self.world.boot()
        self.world.attach()

    @rule()
    def checkpoint(self):
        self.world.device.checkpoint()

    @invariant()
    def every_reader_sees_exactly_the_models_memory(self):
        w = self.world
        for who, names in self.readable.items():
            for name in names:
                status, body = w.read(who, "memory.list", space=self.spaces[name], limit=200)
                assert status == 200
                want = [obj for obj, (space, _) in self.objects.items() if space == name]
                assert [row["object"] for row in body["items"]] == want
                for row in body["items"]:
                    detail = w.read(who, "memory.get", memory=row["object"])[1]
                    assert base64.b64decode(detail["bytes"]) == self.objects[row["object"]][1]
                    assert row["byte_length"] == str(len(self.objects[row["object"]][1]))
                    assert row["version"] == str(self.versions[row["object"]])
        for (obj, version), old in self.kept.items():
            who = "a" if self.objects[obj][0] in self.readable["a"] else "b"
            detail = w.read(who, "memory.get", memory=obj, version=version)[1]
            assert base64.b64decode(detail["bytes"]) == old
        assert w.device.state.memory.used() == len(self.objects)


class _Dir:
    """What EngineWorld takes for a tmp_path."""

    def __init__(self, path):
        self.path = path

    def __truediv__(self, name):
        return f"{self.path}/{name}"


def test_memory_and_publication_follow_the_model(runtime):
    machine = type("Machine", (MemoryMachine,), {"runtime": runtime})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=20, stateful_step_count=20, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
