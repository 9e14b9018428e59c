"""Per-principal quotas at the device (kinds/quotas.py, docs/grants.md): read from the grant file,
checked at admission before anything changes, 429 `quota_exceeded` naming the quota, shown with
their use in capabilities; the defaults (a quarter of the runtime's capacities) of a principal
whose grant leaves them out, null for unlimited, v1 files read as they were meant; the receipt
reserve that keeps registration open to new principals."""
import hashlib
import json
import os
import threading
import time

import pytest

from gpu_worker.contract import grantfile
from gpu_worker.contract.limits import MAX_MEDIA_BYTES
from gpu_worker.contract.vocabulary import DEFAULT_RATES, QUOTAS, RATES
from gpu_worker.kinds import chat
from gpu_worker.pack import pack_tiny
from gpu_worker.storage.committer import Batch
from tests.conftest import ALL
from tests.gpu_worker.kinds.test_inputs import EngineWorld
from tests.gpu_worker.kinds.test_shared_state import World, code


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
    assert caps["spaces"] == {"limit": "2", "default": False, "binds": "always", "used": "2"}
    capacity = world.device.state.capacities["conversations"]  # unset: the default, a quarter of the table
    assert caps["conversations"] == {"limit": str(capacity // 4), "default": True, "binds": "always", "used": "0"}
    world.set_quotas("a", spaces=3)  # a rewritten grant file applies on the next tick
    world.space("a")


def test_a_conversations_quota_counts_the_conversations_a_principal_created(world):
    world.set_quotas("a", conversations=1)
    space = world.space("a")
    assert world.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})[0] == 202
    before = state_of(world, "a")
    refused(world.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {}), "conversations")
    assert state_of(world, "a") == before
    assert world.read("a", "capabilities")[1]["quotas"]["conversations"] == {"limit": "1", "default": False,
                                                                             "binds": "always", "used": "1"}


def test_a_receipts_quota_is_freed_by_retirement_which_it_never_refuses(world):
    world.set_quotas("a", receipts=3)  # the registration holds one
    world.space("a")
    world.space("a")
    refused(world.mutate("a", "spaces.create", "/spaces", {}), "receipts")
    status, retirement = world.mutate("a", "retirements.record", "/retirements", {"retry_floor": "3"})
    assert status == 202  # over its quota, a retirement still goes through: it is what frees receipts
    assert world.read("a", "capabilities")[1]["quotas"]["receipts"] == {"limit": "3", "default": False,
                                                                        "binds": "always", "used": "2"}
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
        w.set_quotas("filler", receipts=None)  # unlimited: the table's own bounds, not the default's
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
    assert w.read("a", "capabilities")[1]["quotas"]["kv_pages"] == {"limit": "20", "default": False,
                                                                    "binds": "always", "used": "16"}
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
    assert reply.status == 429 and b'"quota":"chats"' in reply.body
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
    w.pump(lambda: seen.extend(m for _, m in w.device.take_outbox() if m.id == 7) or seen)
    assert seen[0].status == 429 and b'"quota":"kv_pages"' in seen[0].body and b'"used":"16"' in seen[0].body
    gate.set()


def test_capabilities_show_the_principals_rates_from_the_grant_file_which_the_device_does_not_enforce(world):
    world.set_quotas("a", requests_per_second=5, body_bytes_per_second=1 << 20, output_tokens_per_second=None)
    caps = world.read("a", "capabilities")[1]
    assert caps["rates"] == {"requests_per_second": {"limit": "5", "default": False, "binds": "always"},
                             "body_bytes_per_second": {"limit": str(1 << 20), "default": False, "binds": "always"},
                             "output_tokens_per_second": {"limit": None, "default": False, "binds": "always"}}
    assert world.read("b", "capabilities")[1]["rates"] == {  # b's grant sets none: the defaults
        name: {"limit": str(DEFAULT_RATES[name]), "default": True, "binds": "contention"} for name in RATES}
    for _ in range(8):  # the gateway enforces rates; the device admits what reaches it
        world.space("a")


# ---- defaults (issue 35): a principal whose grant sets nothing gets a fair share ---------------

@pytest.fixture
def small_world(tmp_path):
    """Tables of 8 spaces, 16 conversations and 64 receipts: a default principal gets 2, 4 and 16."""
    runtime = str(tmp_path / "small.aotxccir")
    pack_tiny(runtime, shared=True, capacity={"spaces": 8, "conversations": 16, "receipts": 64})
    w = QuotaWorld(runtime, tmp_path, ["a", "b", "c"])
    yield w
    w.device.close()


def test_a_principal_whose_grant_sets_nothing_has_a_quarter_of_each_capacity_shown_as_the_default(small_world):
    w = small_world
    d = w.device
    profile, caps = d.runtime.runtime_profile, d.state.capacities
    quotas = w.read("a", "capabilities")[1]["quotas"]
    expected = {"receipts": caps["receipts"] // 4, "spaces": caps["spaces"] // 4,
                "conversations": caps["conversations"] // 4, "memory_rows": caps["memory"] // 4,
                "kv_pages": profile["kv_pages"], "chats": profile["kv_pages"],  # the whole pool: shared
                "queued_inputs": caps["receipts"] // 4,                           # under contention
                "media_bytes": max(MAX_MEDIA_BYTES, d.runtime.shared_profile["journal_file_cap_bytes"] // 4)}
    assert {name: (q["limit"], q["default"], q["binds"]) for name, q in quotas.items()} == {
        name: (str(expected[name]), True, "contention" if name in ("kv_pages", "chats") else "always")
        for name in QUOTAS}
    assert (expected["spaces"], expected["conversations"], expected["receipts"]) == (2, 4, 16)


def test_a_default_principal_is_refused_past_its_share_and_leaves_the_rest_to_the_others(small_world):
    w = small_world
    w.space("a")
    space = w.space("a")
    error = refused(w.mutate("a", "spaces.create", "/spaces", {}), "spaces")
    assert (error["limit"], error["used"]) == ("2", "2") and "default" in error["message"]
    for _ in range(4):
        assert w.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})[0] == 202
    refused(w.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {}), "conversations")
    # what a could not take is there for the others: without defaults a would have had every row
    for name in ("b", "c"):
        other = w.space(name)
        assert w.mutate(name, "conversations.create", f"/spaces/{other}/conversations", {})[0] == 202


def test_a_default_principal_holds_a_quarter_of_the_receipts(small_world):
    w = small_world
    w.set_quotas("a", conversations=None)  # here only the receipts default bounds it
    space = w.space("a")  # with its registration, 2 receipts
    for _ in range(14):
        assert w.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})[0] == 202
    error = refused(w.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {}), "receipts")
    assert (error["limit"], error["used"]) == ("16", "16")
    assert len(w.device.state.receipts.free) > 16  # refused by its share, not by a full table


def test_null_in_the_grant_file_is_unlimited_and_said_so_explicitly(small_world):
    w = small_world
    w.set_quotas("a", spaces=None)
    assert w.read("a", "capabilities")[1]["quotas"]["spaces"] == {"limit": None, "default": False,
                                                                  "binds": "always", "used": "0"}
    for _ in range(3):  # past the default of 2
        w.space("a")
    doc = json.loads(open(w.grants_path).read())
    assert doc["schema"] == grantfile.SCHEMA
    assert doc["principals"][w.principals["a"]]["quotas"] == {"spaces": None}  # null: unlimited
    assert "quotas" not in doc["principals"][w.principals["b"]]  # left out: the defaults


def test_a_v1_grant_file_is_read_as_it_was_meant_every_quota_it_leaves_out_unlimited(small_world):
    w = small_world
    doc = {"schema": grantfile.SCHEMA_V1, "written_at_ns": time.time_ns(), "principals": {
        w.principals["a"]: {"name": "a", "actions": ALL, "quotas": {"conversations": 1}},
        w.principals["b"]: {"name": "b", "actions": ALL}, w.principals["c"]: {"name": "c", "actions": ALL}}}
    with open(w.grants_path, "w") as f:
        json.dump(doc, f)
    w.device.idle()
    quotas = w.read("a", "capabilities")[1]["quotas"]
    assert quotas["conversations"] == {"limit": "1", "default": False, "binds": "always", "used": "0"}
    assert all(q == {"limit": None, "default": False, "binds": "always", "used": q["used"]}
               for name, q in quotas.items() if name != "conversations")
    assert all(r == {"limit": None, "default": False, "binds": "always"}
               for r in w.read("b", "capabilities")[1]["rates"].values())
    for _ in range(3):  # b may take more than the default share, as a v1 file meant
        w.space("b")


def test_a_default_principal_alone_queues_inputs_past_what_runs_at_once_and_runs_chats_beside_them(engine_world):
    # issue 53: a default principal's 4th unfinished input answered 429 (queued_inputs 1 here, 3 on
    # the embedded runtime) while the pool sat idle. Queued inputs hold a receipt and no page: they
    # are bounded by a quarter of the receipt table; chats and pages are shared only under contention.
    w = engine_world  # a pool of 64 pages at a page grant of 16: 4 requests at the grant at once
    gate = hold_engine(w)
    conversations = [w.conversation("a")[1] for _ in range(6)]
    ops = []
    for con in conversations:  # six inputs at the page grant, on six conversations, back to back
        status, receipt = w.say("a", con, "go", pages=16, max_output_tokens=4)
        assert status == 202, receipt
        ops.append(receipt["operation"])
    assert start_chat(w, "a", 1) == [] and start_chat(w, "a", 2) == []  # and chats beside them
    quotas = w.read("a", "capabilities")[1]["quotas"]
    assert quotas["queued_inputs"]["used"] == "6" and int(quotas["kv_pages"]["used"]) > 64  # past the pool
    gate.set()
    for op in ops:
        w.pump(w.finished("a", op))


def test_the_default_queued_inputs_quota_is_a_quarter_of_the_receipt_table(tmp_path):
    path = str(tmp_path / "engine.aotxccir")
    pack_tiny(path, shared=True, capacity={"receipts": 32},
              runtime_profile={"kv_pages": 64, "page_grant": 16, "deadline_ms": 600000})
    w = QuotaEngineWorld(path, tmp_path, ["a", "b"])
    try:
        w.set_quotas("a", receipts=None)  # only queued_inputs bounds a's unfinished inputs here
        gate = hold_engine(w)
        _, con = w.conversation("a")  # its registration, space and conversation hold 3 receipts
        for _ in range(8):  # the first runs (held), the others wait for their conversation's turn
            assert w.say("a", con, "queued", pages=16, max_output_tokens=4)[0] == 202
        before = state_of(w, "a")
        error = refused(w.say("a", con, "one too many", pages=16, max_output_tokens=4), "queued_inputs")
        assert (error["limit"], error["used"]) == ("8", "8")
        assert state_of(w, "a") == before
        _, other = w.conversation("b")
        assert w.say("b", other, "mine", pages=1, max_output_tokens=4)[0] == 202  # b's share is its own
        gate.set()
    finally:
        w.device.runner.stop()
        w.device.close()


def test_a_chat_past_its_execution_deadline_ends_504_and_frees_its_pages(engine_world):
    """Issue 53: a chat completion past its execution deadline answered 503 (the gateway's wait);
    it ends 504 deadline_exceeded now, as an input's result read does, stopped on the engine."""
    w = engine_world
    gate = hold_engine(w)
    assert start_chat(w, "a", 11, max_tokens=8) == []
    [sub] = [s for s in w.device.subscriptions.all() if s.topic[0] == "chat"]
    assert sub.data["deadline_ns"] > 0
    sub.data["deadline_ns"] = 0  # the deadline passes now
    w.device.idle()
    seen = []
    w.pump(lambda: seen.extend(m for _, m in w.device.take_outbox() if m.id == 11 and not m.more) or seen)
    [frame] = seen
    assert frame.status == 504 and b'"deadline_exceeded"' in frame.body
    assert not [s for s in w.device.subscriptions.all() if s.topic[0] == "chat"]
    gate.set()
    w.pump(lambda: w.device.runner.engine.pool.owned == 0)
