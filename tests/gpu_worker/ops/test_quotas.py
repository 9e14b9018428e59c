"""Per-principal quotas at the device (ops/quotas.py, docs/grants.md): read from the grant file,
checked at admission before anything changes, 429 `quota_exceeded` naming the quota, shown with
their use in capabilities; the receipt reserve that keeps registration open to new principals."""
import hashlib
import os
import threading

import pytest

from gpu_worker.contract import grantfile
from gpu_worker.ops import chat
from gpu_worker.pack import pack_tiny
from gpu_worker.storage.committer import Batch
from tests.conftest import ALL
from tests.gpu_worker.ops.test_inputs import EngineWorld
from tests.gpu_worker.ops.test_shared_state import World, code


class Quotas:
    """A World whose grant file carries quotas: self.limits {name: {quota: limit}}."""

    def write_grants(self):
        limits = getattr(self, "limits", {})
        grantfile.write(self.grants_path, grantfile.document(
            {self.principals[n]: (n, a) for n, a in self.actions.items()},
            quotas={self.principals[n]: q for n, q in limits.items()}))

    def set_quotas(self, name, **limits):
        self.limits = {**getattr(self, "limits", {}), name: limits}
        self.write_grants()
        self.device.idle()  # the device rereads the grant file between ticks


class QuotaWorld(Quotas, World):
    pass


class QuotaEngineWorld(Quotas, EngineWorld):
    pass


def refused(result, quota):
    status, body = result
    assert (status, body["error"]["code"], body["error"]["quota"]) == (429, "quota_exceeded", quota), body
    return body["error"]


@pytest.fixture
def world(tiny_runtime, tmp_path):
    w = QuotaWorld(tiny_runtime, tmp_path, ["a", "b"])
    yield w
    w.device.close()


def state_of(world, name):
    return (world.read(name, "participant.get")[1], world.read(name, "spaces.list")[1],
            world.read(name, "operations.list")[1])


def test_a_spaces_quota_refuses_the_next_space_naming_it_and_changes_nothing(world):
    world.set_quotas("a", spaces=2)
    world.space("a")
    world.space("a")
    before = state_of(world, "a")
    error = refused(world.mutate("a", "spaces.create", "/spaces", {}), "spaces")
    assert (error["limit"], error["used"]) == ("2", "2")
    assert state_of(world, "a") == before  # no receipt, no row, the same next sequence
    world.space("b")  # another principal is not bound by a's quota
    caps = world.read("a", "capabilities")[1]["quotas"]
    assert caps["spaces"] == {"limit": "2", "used": "2"}
    assert caps["conversations"] == {"limit": None, "used": "0"}  # unset: unlimited
    world.set_quotas("a", spaces=3)  # a rewritten grant file applies on the next tick
    world.space("a")


def test_a_conversations_quota_counts_the_conversations_a_principal_created(world):
    world.set_quotas("a", conversations=1)
    space = world.space("a")
    assert world.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})[0] == 202
    before = state_of(world, "a")
    refused(world.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {}), "conversations")
    assert state_of(world, "a") == before
    assert world.read("a", "capabilities")[1]["quotas"]["conversations"] == {"limit": "1", "used": "1"}


def test_a_receipts_quota_is_freed_by_retirement_which_it_never_refuses(world):
    world.set_quotas("a", receipts=3)  # the registration holds one
    world.space("a")
    world.space("a")
    refused(world.mutate("a", "spaces.create", "/spaces", {}), "receipts")
    status, retirement = world.mutate("a", "retirements.record", "/retirements", {"retry_floor": "3"})
    assert status == 202  # over its quota, a retirement still goes through: it is what frees receipts
    assert world.read("a", "capabilities")[1]["quotas"]["receipts"] == {"limit": "3", "used": "2"}
    world.space("a")


def test_a_media_bytes_quota_refuses_before_the_bytes_are_written(world):
    world.set_quotas("a", media_bytes=100)
    first, second = b"x" * 80, b"y" * 30
    assert world.read("a", "media.put", sha256=hashlib.sha256(first).hexdigest(), data=first, type="image")[0] == 201
    sha = hashlib.sha256(second).hexdigest()
    error = refused(world.read("a", "media.put", sha256=sha, data=second, type="image"), "media_bytes")
    assert (error["limit"], error["used"]) == ("100", "80")
    assert not os.path.exists(os.path.join(world.journal, "media", sha))  # nothing written
    # re-uploading what it owns adds nothing; another principal's quota is its own
    assert world.read("a", "media.put", sha256=hashlib.sha256(first).hexdigest(), data=first, type="image")[0] == 200
    assert world.read("b", "media.put", sha256=sha, data=second, type="image")[0] == 201


def test_the_receipt_reserve_keeps_registration_open_when_others_filled_the_table(tmp_path):
    runtime = str(tmp_path / "small.aotxccir")
    pack_tiny(runtime, shared=True, capacity={"receipts": 128})  # a reserve of 128 // 64 = 2 slots
    w = QuotaWorld(runtime, tmp_path, ["filler"])
    try:
        assert w.device.registration_reserve == 2
        status = 202
        while status == 202:
            status, body = w.mutate("filler", "spaces.create", "/spaces", {})
        assert (status, body["error"]["code"]) == (507, "receipt_table_full")
        free = len(w.device.state.receipts.free)
        assert free == 1 + w.device.registration_reserve  # the retirement slot and the reserve are left
        for i in range(w.device.registration_reserve):  # a new principal can still register
            name = f"late{i}"
            w.principals[name] = os.urandom(16).hex()
            w.actions[name] = list(ALL)
            w.write_grants()
            w.device.idle()
            assert w.mutate(name, "participant.register", "/participant", {})[0] == 202
            w.par[name] = w.read(name, "participant.get")[1]["id"]
        # ...but it may not take what is left for the retirement that frees the table
        assert code(w.mutate("late0", "spaces.create", "/spaces", {})) == (507, "receipt_table_full")
        assert w.mutate("filler", "retirements.record", "/retirements", {"retry_floor": "60"})[0] == 202
    finally:
        w.device.close()


@pytest.fixture
def engine_world(tmp_path):
    path = str(tmp_path / "engine.aotxccir")
    pack_tiny(path, shared=True, runtime_profile={"kv_pages": 64, "page_grant": 16, "deadline_ms": 600000})
    w = QuotaEngineWorld(path, tmp_path, ["a", "b"])
    yield w
    w.device.runner.stop()
    w.device.close()


def hold_engine(world):
    """The engine does not step until the returned event is set: inputs stay unfinished."""
    gate = threading.Event()
    engine = world.device.runner.engine
    step = engine.step
    engine.step = lambda: (gate.wait(60), step())[1]
    return gate


def test_queued_inputs_and_kv_pages_quotas_count_unfinished_inputs(engine_world):
    w = engine_world
    gate = hold_engine(w)
    _, con = w.conversation("a")
    w.set_quotas("a", queued_inputs=2, kv_pages=20)
    assert w.say("a", con, "one", pages=8, max_output_tokens=4)[0] == 202
    error = refused(w.say("a", con, "too many pages", pages=16, max_output_tokens=4), "kv_pages")
    assert (error["limit"], error["used"]) == ("20", "8")
    _, second = w.say("a", con, "two", pages=8, max_output_tokens=4)
    before = state_of(w, "a")
    refused(w.say("a", con, "three", pages=1, max_output_tokens=4), "queued_inputs")
    assert state_of(w, "a") == before
    assert w.read("a", "capabilities")[1]["quotas"]["kv_pages"] == {"limit": "20", "used": "16"}
    gate.set()
    w.pump(w.finished("a", second["operation"]))
    w.pump(lambda: w.read("a", "capabilities")[1]["quotas"]["queued_inputs"]["used"] == "0")
    assert w.say("a", con, "three", pages=1, max_output_tokens=4)[0] == 202  # finished inputs give it back


def start_chat(world, name, req_id, max_tokens=4):
    batch = Batch()
    chat.start(world.device, f"conn-{req_id}", {"id": req_id, "principal": world.principals[name], "args": {
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}}, batch)
    return batch.replies


def test_a_chats_quota_refuses_a_chat_beyond_it_until_one_ends(engine_world):
    w = engine_world
    gate = hold_engine(w)
    w.set_quotas("a", chats=1)
    assert start_chat(w, "a", 1) == []  # taken: the engine answers it
    [(_, reply)] = start_chat(w, "a", 2)
    assert reply["status"] == 429 and b'"quota":"chats"' in reply["body"]
    assert start_chat(w, "b", 3) == []  # b has no chats quota
    w.pump(lambda: w.read("a", "capabilities")[1]["quotas"]["chats"]["used"] == "1")
    gate.set()
    w.pump(lambda: w.read("a", "capabilities")[1]["quotas"]["chats"]["used"] == "0")
    assert start_chat(w, "a", 4) == []


def test_a_chats_pages_count_with_the_principals_unfinished_inputs_against_kv_pages(engine_world):
    w = engine_world
    gate = hold_engine(w)
    _, con = w.conversation("a")
    assert w.say("a", con, "one", pages=16, max_output_tokens=4)[0] == 202
    w.set_quotas("a", kv_pages=17)  # the input holds 16; the chat's prompt needs more than one page
    assert start_chat(w, "a", 7) == []  # refused once its prompt is tokenized and its pages known
    seen = []
    w.pump(lambda: seen.extend(m for _, m in w.device.take_outbox() if m.get("id") == 7) or seen)
    assert seen[0]["status"] == 429 and b'"quota":"kv_pages"' in seen[0]["body"] and b'"used":"16"' in seen[0]["body"]
    gate.set()


def test_capabilities_show_the_principals_rates_from_the_grant_file_which_the_device_does_not_enforce(world):
    world.set_quotas("a", requests_per_second=5, body_bytes_per_second=1 << 20)
    caps = world.read("a", "capabilities")[1]
    assert caps["rates"] == {"requests_per_second": {"limit": "5"}, "body_bytes_per_second": {"limit": str(1 << 20)},
                             "output_tokens_per_second": {"limit": None}}
    assert all(r["limit"] is None for r in world.read("b", "capabilities")[1]["rates"].values())
    for _ in range(8):  # the gateway enforces rates; the device admits what reaches it
        world.space("a")
