"""The mutation protocol (SPEC "Mutations and retries", "Capacity") against a small model.

A Hypothesis state machine drives a Device in-process with canonical operation bytes built
exactly like the gateway (RFC 8785 of {"method", "path", "body"}), on a runtime packed with 8
receipt slots so a full receipt table is reachable. Two participants share that table.

The model: per participant the next sequence, the retry floor and the live receipts (sequence ->
the exact command and the receipt bytes of its 202); globally the receipt slots in use. It
predicts, in the device's order of checks: below the floor 410; a known sequence 200 with the
same receipt bytes or 409 operation_changed; a future sequence 409; a key of a live operation
409; a full table 507 (one slot stays reserved for a retirement, and receipts a retirement frees
become reusable only once it is saved, i.e. after its tick); then the kind's own checks.
A restart rebuilds the device from the journal and every receipt must read back byte-identical.
"""
import collections
import json
import shutil
import tempfile
from dataclasses import dataclass, field

import pytest
import rfc8785
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)

from gpu_worker.contract.commands import TYPES
from gpu_worker.device import Device
from gpu_worker.contract.grantfile import Grants
from gpu_worker.pack import pack_tiny
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.conftest import write_grants

BASE = "/aotx/v1/shared"
SCHEMA = "aotx.shared.mutation.v1"
CAPACITY = {"participants": 4, "spaces": 64, "conversations": 64, "members": 8, "receipts": 8}
RECEIPTS = CAPACITY["receipts"]
PRINCIPALS = {"a": "a1" * 16, "b": "b2" * 16}
KEY_POOL = ["0" * 31 + str(i) for i in range(1, 5)]      # reused keys: in use / reusable after retirement
ID_POOL = ["f" * 31 + str(i) for i in range(1, 4)]       # reused resource ids: *_exists
WHO = st.sampled_from(sorted(PRINCIPALS))
KIND_OF = {"spaces.create": "space.create", "conversations.create": "conversation.create",
           "retirements.record": "retirement"}


@dataclass
class Cmd:
    op: str
    path: str
    fields: dict
    sequence: int
    key: str
    lineage: str

    @property
    def body(self):
        return {"schema": SCHEMA, "lineage": self.lineage, "operation_key": self.key,
                "sequence": str(self.sequence), **self.fields}

    @property
    def canonical(self):
        return rfc8785.dumps({"method": "POST", "path": BASE + self.path, "body": self.body})

    def args(self):
        args = {"lineage": self.lineage, "operation_key": self.key, "sequence": self.sequence,
                "canonical": self.canonical, **self.fields}
        if self.path.startswith("/spaces/"):
            args["space"] = self.path.split("/")[2]
        if "retry_floor" in args:
            args["retry_floor"] = int(args["retry_floor"])
        return args


@dataclass
class Receipt:
    cmd: Cmd
    body: bytes | None       # the exact bytes of the 202
    operation: str | None


@dataclass
class Participant:
    lineage: str
    next: int = 1
    floor: int = 1
    live: dict = field(default_factory=dict)      # sequence -> Receipt
    retired: dict = field(default_factory=dict)   # sequence -> Receipt
    spaces: list = field(default_factory=list)    # space IDs, creation order
    space_raw: set = field(default_factory=set)
    conversation_raw: set = field(default_factory=set)


@pytest.fixture(scope="module")
def small_runtime(tmp_path_factory):
    path = tmp_path_factory.mktemp("protocol") / "small.aotxccir"
    pack_tiny(str(path), shared=True, capacity=CAPACITY)
    return str(path)


class ProtocolMachine(RuleBasedStateMachine):
    runtime = None  # set by the test

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="aotx-protocol-")
        self.journal = f"{self.dir}/journal"
        self.grants = f"{self.dir}/grants.json"
        self.msg_ids = iter(range(1, 1 << 30))
        self.fresh = iter(range(1 << 20, 1 << 30))
        self.device = None
        self.boot()
        self.model = {}
        self.in_use = 0         # receipt slots holding a live receipt
        self.unreleased = 0     # slots retired in the current tick: reusable after its commit
        self.spaces_total = 0
        self.conversations_total = 0
        self.operations = set()  # every operation ID ever admitted
        for name in sorted(PRINCIPALS):
            status, body = self.read(name, "participant.get")
            self.model[name] = Participant(lineage=body["lineage"])
            [(status, raw, _)] = self.submit([(name, Cmd("participant.register", "/participant", {}, 1,
                                                         self.new_key(), body["lineage"]))])
            assert status == 202, raw

    # ---- driving the device ------------------------------------------------------------

    def boot(self):
        if self.device is not None:
            self.device.close()  # a restart on its own journal: the same grant file
        else:
            write_grants(self.grants, {pid: ["shared_read", "shared_write", "shared_manage"]
                                       for pid in PRINCIPALS.values()})
        self.device = Device(RuntimeFile.open(self.runtime), self.journal, Grants(self.grants))

    def teardown(self):
        if self.device is not None:
            self.device.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def tick(self, messages):
        """One device tick over [(name, op, args)]; returns the replies in request order."""
        inbox = collections.deque()
        for name, op, args in messages:
            inbox.append(("c", {"v": 1, "id": next(self.msg_ids), "op": op, "principal": PRINCIPALS[name],
                                "args": args}))
        ids = [m["id"] for _, m in inbox]
        replies = {msg.id: msg for _, msg in self.device.committer.run_sync(inbox)}
        assert not inbox, "a small tick must fit one record budget"
        return [replies[i] for i in ids]

    def read(self, name, op, **args):
        [msg] = self.tick([(name, op, args)])
        return msg.status, json.loads(msg.body)

    def new_key(self):
        return f"{next(self.fresh):032x}"

    def submit(self, batch):
        """Send [(name, Cmd)] in one tick; check each reply against the model's prediction and
        apply the model's effects. Returns [(status, body bytes, code)]."""
        predicted = [self.predict(name, cmd) for name, cmd in batch]
        replies = self.tick([(name, cmd.op, cmd.args()) for name, cmd in batch])
        results = []
        for (name, cmd), (want_status, want_code), msg in zip(batch, predicted, replies):
            status, raw = msg.status, bytes(msg.body)
            code = json.loads(raw).get("error", {}).get("code") if status >= 400 else None
            assert (status, code) == (want_status, want_code), \
                f"{name} {cmd.op} seq {cmd.sequence}: got {status} {raw[:300]!r}, model says {want_status} {want_code}"
            p = self.model[name]
            if status == 202:
                receipt = json.loads(raw)
                assert receipt["sequence"] == str(cmd.sequence) and receipt["operation_key"] == cmd.key
                assert receipt["admission"]["saved"] and receipt["terminal"]["status"] == "succeeded"
                assert msg.headers["Location"] == f"{BASE}/operations/{receipt['operation']}"
                if cmd.op in KIND_OF:
                    assert receipt["kind"] == KIND_OF[cmd.op]
                assert receipt["operation"] not in self.operations, "an operation ID was handed out twice"
                self.operations.add(receipt["operation"])
                p.live[cmd.sequence].body, p.live[cmd.sequence].operation = raw, receipt["operation"]
                if cmd.op == "spaces.create":
                    p.spaces.append(receipt["target"])
            elif status == 200:
                assert raw == p.live[cmd.sequence].body, "an exact retry must return the same receipt bytes"
            results.append((status, raw, code))
        self.in_use -= self.unreleased  # retired slots are reusable once the tick saved the retirement
        self.unreleased = 0
        return results

    def predict(self, name, cmd):
        """The model's answer for cmd, given everything earlier in the same tick; applies the
        effects of a predicted 202 (the checks below follow SPEC's order of precedence)."""
        p = self.model[name]
        if cmd.sequence < p.floor:
            return 410, "below_retry_floor"
        if cmd.sequence in p.live:
            same = p.live[cmd.sequence].cmd.canonical == cmd.canonical
            return (200, None) if same else (409, "operation_changed")
        if cmd.sequence > p.next:
            return 409, "future_sequence"
        if any(r.cmd.key == cmd.key for r in p.live.values()):
            return 409, "operation_key_in_use"
        retirement = cmd.op == "retirements.record"
        if RECEIPTS - self.in_use < (1 if retirement else 2):
            return 507, "receipt_table_full"
        if cmd.op == "spaces.create":
            raw = cmd.fields.get("id", cmd.key)
            if raw in p.space_raw:
                return 409, "space_exists"
            if self.spaces_total == CAPACITY["spaces"]:
                return 507, "space_capacity"
            p.space_raw.add(raw)
            self.spaces_total += 1
        elif cmd.op == "conversations.create":
            raw = cmd.fields.get("id", cmd.key)
            if raw in p.conversation_raw:
                return 409, "conversation_exists"
            if self.conversations_total == CAPACITY["conversations"]:
                return 507, "conversation_capacity"
            p.conversation_raw.add(raw)
            self.conversations_total += 1
        elif retirement:
            floor = int(cmd.fields["retry_floor"])
            if floor <= p.floor:
                return 409, "retry_floor_not_advanced"
            if floor > cmd.sequence:
                return 409, "retry_floor_ahead"
            for seq in [s for s in p.live if s < floor]:
                p.retired[seq] = p.live.pop(seq)
                self.unreleased += 1
            p.floor = floor
        self.in_use += 1
        p.next = cmd.sequence + 1
        p.live[cmd.sequence] = Receipt(cmd, None, None)  # its bytes arrive with the tick's replies
        return 202, None

    def one(self, name, cmd):
        [result] = self.submit([(name, cmd)])
        return result

    # ---- building commands -------------------------------------------------------------

    def space_cmd(self, name, sequence, key, resource_id=None, scope=None):
        fields = {}
        if resource_id is not None:
            fields["id"] = resource_id
        if scope is not None:
            fields["scope"] = scope
        return Cmd("spaces.create", "/spaces", fields, sequence, key, self.model[name].lineage)

    def pick_key(self, data):
        fresh = st.integers(1 << 40, 1 << 100).map(lambda i: f"{i:032x}")
        return data.draw(st.one_of(st.sampled_from(KEY_POOL), fresh), label="key")

    # ---- rules -------------------------------------------------------------------------

    @rule(who=WHO, data=st.data(), resource_id=st.sampled_from([None, *ID_POOL]),
          scope=st.sampled_from([None, "private", "room", "instance"]))
    def new_space(self, who, data, resource_id, scope):
        self.one(who, self.space_cmd(who, self.model[who].next, self.pick_key(data), resource_id, scope))

    @precondition(lambda self: any(p.spaces for p in self.model.values()))
    @rule(data=st.data(), resource_id=st.sampled_from([None, *ID_POOL]))
    def new_conversation(self, data, resource_id):
        who = data.draw(st.sampled_from([n for n, p in sorted(self.model.items()) if p.spaces]), label="who")
        p = self.model[who]
        space = data.draw(st.sampled_from(p.spaces), label="space")
        fields = {} if resource_id is None else {"id": resource_id}
        self.one(who, Cmd("conversations.create", f"/spaces/{space}/conversations", fields, p.next,
                          self.pick_key(data), p.lineage))

    @rule(who=WHO, data=st.data())
    def exact_retry(self, who, data):
        p = self.model[who]
        seq = data.draw(st.sampled_from(sorted(p.live)), label="sequence")
        status, _, _ = self.one(who, p.live[seq].cmd)
        assert status == 200

    @rule(who=WHO, data=st.data())
    def changed_input_at_an_admitted_sequence(self, who, data):
        p = self.model[who]
        seq = data.draw(st.sampled_from(sorted(p.live)), label="sequence")
        original = p.live[seq].cmd
        how = data.draw(st.sampled_from(["key", "field", "kind"]), label="change")
        if how == "key":
            changed = Cmd(original.op, original.path, original.fields, seq, self.new_key(), p.lineage)
        elif how == "field" and "id" in TYPES[original.op].__struct_fields__:
            changed = Cmd(original.op, original.path, {**original.fields, "id": self.new_key()}, seq,
                          original.key, p.lineage)
        elif how == "field" and original.op == "retirements.record":
            changed = Cmd(original.op, original.path, {"retry_floor": str(seq + 7)}, seq, original.key,
                          p.lineage)
        elif original.op == "spaces.create":
            changed = Cmd("retirements.record", "/retirements", {"retry_floor": str(seq)}, seq, original.key,
                          p.lineage)
        else:
            changed = self.space_cmd(who, seq, original.key)
        assert changed.canonical != original.canonical
        status, _, code = self.one(who, changed)
        assert (status, code) == (409, "operation_changed")

    @precondition(lambda self: any(p.floor > 1 for p in self.model.values()))
    @rule(data=st.data())
    def below_the_retry_floor(self, data):
        who = data.draw(st.sampled_from([n for n, p in sorted(self.model.items()) if p.floor > 1]), label="who")
        p = self.model[who]
        seq = data.draw(st.integers(1, p.floor - 1), label="sequence")
        retired = p.retired.get(seq)
        cmd = retired.cmd if retired is not None and data.draw(st.booleans(), label="exact") else \
            self.space_cmd(who, seq, self.new_key())
        status, _, code = self.one(who, cmd)
        assert (status, code) == (410, "below_retry_floor")

    @rule(who=WHO, ahead=st.integers(1, 3), data=st.data())
    def future_sequence(self, who, ahead, data):
        cmd = self.space_cmd(who, self.model[who].next + ahead, self.pick_key(data))
        status, raw, code = self.one(who, cmd)
        assert (status, code) == (409, "future_sequence")
        assert json.loads(raw)["error"]["next_sequence"] == str(self.model[who].next)

    @rule(who=WHO, data=st.data())
    def retirement(self, who, data):
        p = self.model[who]
        floor = data.draw(st.one_of(st.integers(p.floor + 1, p.next),              # valid
                                    st.sampled_from([p.floor, p.next + 1])),        # not advanced / ahead
                          label="retry_floor")
        cmd = Cmd("retirements.record", "/retirements", {"retry_floor": str(floor)}, p.next,
                  self.pick_key(data), p.lineage)
        self.one(who, cmd)

    @rule(who=WHO, data=st.data())
    def retire_everything_then_submit_in_the_same_tick(self, who, data):
        """The retired slots are not reusable by a command in the retirement's own tick."""
        p = self.model[who]
        retire = Cmd("retirements.record", "/retirements", {"retry_floor": str(p.next)}, p.next,
                     self.new_key(), p.lineage)
        follow = self.space_cmd(who, p.next + 1, self.new_key())
        self.submit([(who, retire), (who, follow)])

    @rule(who=WHO, data=st.data())
    def new_operation_and_its_exact_retry_in_one_tick(self, who, data):
        cmd = self.space_cmd(who, self.model[who].next, self.pick_key(data))
        first, again = self.submit([(who, cmd), (who, cmd)])
        if first[0] == 202:
            assert again[0] == 200 and again[1] == first[1]
        else:
            assert again[:2] == first[:2]

    @precondition(lambda self: self.in_use < RECEIPTS - 2)
    @rule()
    def fill_the_receipt_table(self):
        """Admit new operations until the device refuses: a full receipt table refuses with exactly
        one slot left (reserved for a retirement); the space table may fill first."""
        name = "a" if len(self.model["a"].live) <= len(self.model["b"].live) else "b"
        while True:
            status, _, code = self.one(name, self.space_cmd(name, self.model[name].next, self.new_key()))
            if status != 202:
                break
        assert status == 507 and code in ("receipt_table_full", "space_capacity"), code
        if code == "receipt_table_full":
            assert self.in_use == RECEIPTS - 1

    @rule()
    def restart(self):
        self.boot()
        for name, p in self.model.items():
            for seq, receipt in p.live.items():
                [msg] = self.tick([(name, "operations.get", {"operation": receipt.operation})])
                assert (msg.status, bytes(msg.body)) == (200, receipt.body), \
                    f"{name} receipt at sequence {seq} reads back differently after a restart"
            for seq, receipt in p.retired.items():
                status, body = self.read(name, "operations.get", operation=receipt.operation)
                assert (status, body["error"]["code"]) == (410, "operation_retired")

    # ---- invariants --------------------------------------------------------------------

    @invariant()
    def counters_and_receipts_match_the_model(self):
        if self.device is None:
            return
        for name, p in self.model.items():
            status, me = self.read(name, "participant.get")
            assert status == 200 and me["lineage"] == p.lineage
            assert (me["next_sequence"], me["retry_floor"]) == (str(p.next), str(p.floor)), (name, me)
            status, listed = self.read(name, "operations.list", limit=200)
            assert [r["sequence"] for r in listed["items"]] == [str(s) for s in sorted(p.live)]
            assert listed["items"] == [json.loads(p.live[s].body) for s in sorted(p.live)]
        assert sum(len(p.live) for p in self.model.values()) == self.in_use
        usage = self.device.state.tables.usage()
        assert (usage["receipts"], usage["spaces"], usage["conversations"]) == \
            (self.in_use, self.spaces_total, self.conversations_total)


def test_the_mutation_protocol_follows_the_model(small_runtime):
    machine = type("Machine", (ProtocolMachine,), {"runtime": small_runtime})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
