"""Spaces, members, conversations, retirements and capacity at the device (SPEC "Scope",
"Resources", "Mutations and retries", "Capacity"), including replay after a restart."""
import collections
import json
import secrets

import pytest
import rfc8785

from gpu_worker.device import Device
from gpu_worker.contract.grantfile import Grants
from gpu_worker.pack import pack_tiny
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.conftest import ALL, write_grants

BASE = "/aotx/v1/shared"


class World:
    """A device with named principals; mutate() builds canonical bytes like the gateway."""

    def __init__(self, runtime, tmp_path, names, actions=None):
        self.runtime = runtime
        self.journal = str(tmp_path / "journal")
        self.grants_path = str(tmp_path / "grants.json")
        self.principals = {n: secrets.token_hex(16) for n in names}
        self.actions = {n: list(actions or ALL) for n in names}
        self.write_grants()
        self.ids = iter(range(1, 1 << 30))
        self.pushed = []  # frames for other requests (subscriptions) that arrived with a reply
        self.device = None
        self.boot()
        self.par = {}
        for name in names:
            self.mutate(name, "participant.register", "/participant", {})
            self.par[name] = self.read(name, "participant.get")[1]["id"]

    def write_grants(self):
        write_grants(self.grants_path, {self.principals[n]: a for n, a in self.actions.items()})

    def boot(self):
        if self.device is not None:
            self.device.close()  # a restart on its own journal: the same grant file
        self.device = Device(RuntimeFile.open(self.runtime), self.journal, Grants(self.grants_path))

    def send(self, name, op, args):
        """One command and its reply, in the tick or later (an upload answers once its owner is saved)."""
        req_id = next(self.ids)
        inbox = collections.deque([("c", {"v": 1, "id": req_id, "op": op, "principal": self.principals[name],
                                          "args": args})])
        replies = self.device.committer.run_sync(inbox) + self.device.take_outbox()
        [msg] = [msg for _, msg in replies if msg.id == req_id]
        self.pushed += [(conn, m) for conn, m in replies if m is not msg]  # other requests' frames
        return msg.status, json.loads(msg.body)

    def read(self, name, op, **args):
        return self.send(name, op, args)

    def mutate(self, name, op, path, fields, *, sequence=None, key=None, extra=None):
        """fields: the body's own fields; a space in the path is passed as the gateway does."""
        me = self.read(name, "participant.get")[1]
        sequence = sequence or int(me["next_sequence"])
        key = key or secrets.token_hex(16)
        body = {"schema": "aotx.shared.mutation.v1", "lineage": me["lineage"], "operation_key": key,
                "sequence": str(sequence), **fields}
        canonical = rfc8785.dumps({"method": "POST", "path": BASE + path, "body": body})
        args = {"lineage": me["lineage"], "operation_key": key, "sequence": sequence, "canonical": canonical}
        args.update(fields)
        if path.startswith("/spaces/"):
            args["space"] = path.split("/")[2]
        args.update(extra or {})
        for counter in ("retry_floor", "target_sequence"):
            if counter in args:
                args[counter] = int(args[counter])
        return self.send(name, op, args)

    def space(self, name, **fields):
        status, receipt = self.mutate(name, "spaces.create", "/spaces", fields)
        assert status == 202, receipt
        return receipt["target"]

    def member(self, name, space, who, permissions):
        return self.mutate(name, "members.set", f"/spaces/{space}/members",
                           {"participant": self.par[who], "permissions": permissions})


@pytest.fixture
def world(tiny_runtime, tmp_path):
    w = World(tiny_runtime, tmp_path, ["owner", "reader", "writer", "manager", "outsider"])
    yield w
    w.device.close()


def code(result):
    return result[0], result[1].get("error", {}).get("code")


def test_a_space_id_uses_the_creator_lineage_and_the_operation_key_by_default(world):
    key = secrets.token_hex(16)
    status, receipt = world.mutate("owner", "spaces.create", "/spaces", {}, key=key)
    lineage = world.read("owner", "participant.get")[1]["lineage"]
    assert status == 202 and receipt["target"] == f"spc-{lineage}-{key}"
    space = world.read("owner", "spaces.get", space=receipt["target"])[1]
    assert space["scope"] == "private" and space["owner"] == world.par["owner"]
    assert space["created_by_operation"] == receipt["operation"] and space["rights"] == ["manage", "read", "write"]
    explicit = "ab" * 16
    room = world.space("owner", id=explicit, scope="room")
    assert room.endswith(explicit)
    assert world.read("owner", "spaces.get", space=room)[1]["memory_owner"] == room
    other = world.space("owner")
    owners = {world.read("owner", "spaces.get", space=s)[1]["memory_owner"] for s in (receipt["target"], other)}
    assert len(owners) == 2 and all(o.startswith("private-") for o in owners)
    assert code(world.mutate("owner", "spaces.create", "/spaces", {"id": explicit})) == (409, "space_exists")


def test_member_rows_grant_exactly_their_rights_and_outsiders_see_404(world):
    space = world.space("owner")
    for who, perms in (("reader", ["read"]), ("writer", ["write"]), ("manager", ["manage"])):
        assert world.member("owner", space, who, perms)[0] == 202
    assert world.read("reader", "spaces.get", space=space)[0] == 200
    assert code(world.read("writer", "spaces.get", space=space)) == (403, "right_missing")
    assert code(world.read("outsider", "spaces.get", space=space)) == (404, "space_not_found")
    assert code(world.mutate("reader", "conversations.create", f"/spaces/{space}/conversations", {})) == \
        (403, "right_missing")
    status, receipt = world.mutate("writer", "conversations.create", f"/spaces/{space}/conversations", {})
    assert status == 202
    assert code(world.read("writer", "conversations.get", conversation=receipt["target"])) == (403, "right_missing")
    assert world.read("reader", "conversations.get", conversation=receipt["target"])[1]["space"] == space
    assert world.member("manager", space, "outsider", ["read"])[0] == 202
    assert code(world.member("reader", space, "outsider", ["write"])) == (403, "right_missing")
    assert world.read("outsider", "spaces.get", space=space)[0] == 200
    assert code(world.member("owner", space, "owner", [])) == (409, "owner_rights_fixed")
    members = world.read("owner", "members.list", space=space)[1]["items"]
    assert members[0] == {"participant": world.par["owner"], "permissions": ["manage", "read", "write"],
                          "explicit": False}
    assert {m["participant"]: m["permissions"] for m in members[1:]} == {
        world.par["reader"]: ["read"], world.par["writer"]: ["write"], world.par["manager"]: ["manage"],
        world.par["outsider"]: ["read"]}
    assert world.member("owner", space, "outsider", [])[0] == 202
    assert code(world.read("outsider", "spaces.get", space=space)) == (404, "space_not_found")


def test_an_instance_space_admits_every_registered_participant_unless_a_zero_rights_row_blocks(world):
    space = world.space("owner", scope="instance")
    assert world.read("outsider", "spaces.get", space=space)[1]["rights"] == ["read", "write"]
    assert [s["id"] for s in world.read("reader", "spaces.list")[1]["items"]] == [space]
    assert world.member("owner", space, "outsider", [])[0] == 202
    assert code(world.read("outsider", "spaces.get", space=space)) == (404, "space_not_found")
    assert world.read("outsider", "spaces.list")[1]["items"] == []
    private = world.space("owner")
    assert code(world.read("reader", "spaces.get", space=private)) == (404, "space_not_found")


def test_current_grants_intersect_with_membership_even_for_the_owner(world):
    space = world.space("owner")
    world.actions["owner"] = ["shared_write"]
    world.write_grants()
    assert code(world.read("owner", "spaces.get", space=space)) == (403, "grant_missing")
    world.actions["owner"] = ["shared_read", "shared_write"]
    world.write_grants()
    assert world.read("owner", "spaces.get", space=space)[1]["rights"] == ["read", "write"]
    assert code(world.member("owner", space, "reader", ["read"])) == (403, "grant_missing")


def test_retirement_frees_receipts_below_the_floor_and_retired_ids_answer_410(world):
    _, first = world.mutate("owner", "spaces.create", "/spaces", {}, key="01" * 16)
    world.space("owner")
    me = world.read("owner", "participant.get")[1]
    assert me["next_sequence"] == "4"
    assert code(world.mutate("owner", "retirements.record", "/retirements", {"retry_floor": "9"})) == \
        (409, "retry_floor_ahead")
    status, retirement = world.mutate("owner", "retirements.record", "/retirements", {"retry_floor": "3"})
    assert status == 202 and retirement["kind"] == "retirement"
    assert world.read("owner", "participant.get")[1]["retry_floor"] == "3"
    assert code(world.read("owner", "operations.get", operation=first["operation"])) == (410, "operation_retired")
    fake = first["operation"][:-1] + ("0" if first["operation"][-1] != "0" else "1")
    assert code(world.read("owner", "operations.get", operation=fake)) == (404, "operation_not_found")
    assert code(world.mutate("owner", "spaces.create", "/spaces", {}, sequence=2)) == (410, "below_retry_floor")
    status, reused = world.mutate("owner", "spaces.create", "/spaces", {"id": "02" * 16}, key="01" * 16)
    assert status == 202 and reused["operation"] != first["operation"]
    assert code(world.read("owner", "operations.get", operation=first["operation"])) == (410, "operation_retired")
    assert code(world.mutate("owner", "retirements.record", "/retirements", {"retry_floor": "2"})) == \
        (409, "retry_floor_not_advanced")
    world.boot()
    assert world.read("owner", "participant.get")[1]["retry_floor"] == "3"
    assert code(world.read("owner", "operations.get", operation=first["operation"])) == (410, "operation_retired")
    assert world.read("owner", "operations.get", operation=reused["operation"])[0] == 200


def test_cancelling_an_operation_that_finished_at_admission_is_a_clear_409(world):
    world.space("owner")
    assert code(world.mutate("owner", "cancellations.record", "/cancellations", {"target_sequence": "2"})) == \
        (409, "not_cancellable")
    assert code(world.mutate("owner", "cancellations.record", "/cancellations", {"target_sequence": "7"})) == \
        (404, "operation_not_found")
    assert world.read("owner", "participant.get")[1]["next_sequence"] == "3"


def test_fixed_capacities_answer_507_and_a_retirement_frees_the_receipt_table(tmp_path):
    runtime = str(tmp_path / "small.aotxccir")
    pack_tiny(runtime, shared=True, capacity={"participants": 2, "spaces": 2, "receipts": 6})
    w = World(runtime, tmp_path, ["a", "b"])
    w.space("a")
    w.space("a")
    assert code(w.mutate("a", "spaces.create", "/spaces", {})) == (507, "space_capacity")
    space = w.read("a", "spaces.list")[1]["items"][0]["id"]
    assert w.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})[0] == 202
    # 6 receipts: 2 registrations + 3 of a's; one slot stays reserved for a retirement
    assert code(w.mutate("b", "spaces.create", "/spaces", {})) == (507, "receipt_table_full")
    assert w.mutate("a", "retirements.record", "/retirements", {"retry_floor": "4"})[0] == 202
    assert w.mutate("b", "conversations.create", f"/spaces/{space}/conversations", {})[0] == 404
    assert code(w.mutate("b", "spaces.create", "/spaces", {})) == (507, "space_capacity")
    status, _ = w.member("a", space, "b", ["read", "write"])
    assert status == 202
    assert w.mutate("b", "conversations.create", f"/spaces/{space}/conversations", {})[0] == 202
    w.device.close()


def test_everything_replays_to_the_same_reads_after_a_restart(world):
    space = world.space("owner", scope="room")
    world.member("owner", space, "reader", ["read"])
    conv = world.mutate("owner", "conversations.create", f"/spaces/{space}/conversations", {})[1]["target"]
    before = [world.read("reader", op, **args) for op, args in (
        ("spaces.list", {}), ("members.list", {"space": space}), ("conversations.list", {"space": space}),
        ("conversations.get", {"conversation": conv}), ("operations.list", {}))]
    listed = world.read("owner", "operations.list")[1]["items"]
    world.boot()
    after = [world.read("reader", op, **args) for op, args in (
        ("spaces.list", {}), ("members.list", {"space": space}), ("conversations.list", {"space": space}),
        ("conversations.get", {"conversation": conv}), ("operations.list", {}))]
    assert before == after
    assert world.read("owner", "operations.list")[1]["items"] == listed
    foreign = world.read("reader", "operations.get", operation=listed[-1]["operation"])[1]
    assert foreign["sequence"] is None and foreign["operation"] == listed[-1]["operation"]
    other = world.read("reader", "participants.get", participant=world.par["owner"])[1]
    assert other["next_sequence"] is None and other["retry_floor"] is None and other["id"] == world.par["owner"]


def test_lists_page_with_cursor_and_limit(world):
    made = [world.space("owner") for _ in range(5)]
    seen, cursor = [], None
    while True:
        args = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = world.read("owner", "spaces.list", **args)[1]
        seen += [s["id"] for s in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == made


def test_indexes_rebuilt_from_the_tables_equal_those_kept_as_the_device_admitted(world):
    """Boot derives every index from the tables in whole-column passes (state/indexes.py); the
    device keeps them row by row as it admits, retires and deletes. After a mix of all of those,
    indexes rebuilt from a copy of the tables are the kept ones, free rows and input order included."""
    from gpu_worker.kinds.kind import Kind
    from gpu_worker.state import DeviceState
    spaces = [world.space("owner", scope="room") for _ in range(3)] + [world.space("writer")]
    world.member("owner", spaces[0], "reader", ["read"])
    world.member("owner", spaces[1], "writer", ["read", "write"])
    conversations = [world.mutate("owner", "conversations.create", f"/spaces/{s}/conversations", {})[1]["target"]
                     for s in spaces[:2]]
    for conversation in conversations + conversations[:1]:  # (admitted; no engine runs them here)
        status, _ = world.mutate("owner", "conversations.input", f"/conversations/{conversation}/inputs",
                                 {"text": "hello", "model": "tiny-llama"}, extra={"conversation": conversation})
        assert status == 202
    assert world.mutate("owner", "spaces.delete", f"/spaces/{spaces[2]}/deletion", {})[0] == 202
    floor = int(world.read("writer", "participant.get")[1]["next_sequence"])
    assert world.mutate("writer", "retirements.record", "/retirements", {"retry_floor": str(floor)})[0] == 202
    kept = world.device.state
    rebuilt = DeviceState(kept.capacities, "cpu", kept.incarnation, kept.generation)
    for name in ("participants", "spaces", "members", "conversations", "receipts"):
        getattr(rebuilt.tables, name).copy_(getattr(kept.tables, name))
    rebuilt.participants.load_lineages([[f, n] for f, n in zip(kept.participants.starts, kept.participants.nonces)])
    rebuilt.rebuild_indexes(int(Kind.INPUT))
    for index, fields in (("receipts", ("by_sequence", "by_key", "by_op", "free")), ("spaces", ("by_id", "free")),
                          ("members", ("rows", "free")), ("conversations", ("by_id", "free", "inputs"))):
        for field in fields:
            mine, theirs = getattr(getattr(rebuilt, index), field), getattr(getattr(kept, index), field)
            if field == "free":  # (the same rows; the device appends the ones a retirement frees)
                mine, theirs = sorted(mine), sorted(theirs)
            assert mine == theirs, (index, field)


def test_a_replay_indexes_receipts_and_spaces_as_the_device_did_live_even_with_lookups_between(world):
    """A load notes each replayed receipt and space and indexes the rows in whole-column passes
    when a lookup needs them (state/indexes.py, `_Deferring`): a retirement, a cancellation, a
    member row and a space deletion in the middle of the journal look them up before its end. The
    indexes after the restart are the ones the device kept as it admitted."""
    spaces = [world.space("writer") for _ in range(4)]
    world.member("writer", spaces[0], "reader", ["read"])
    assert world.mutate("writer", "spaces.delete", f"/spaces/{spaces.pop(1)}/deletion", {})[0] == 202
    floor = int(world.read("writer", "participant.get")[1]["next_sequence"]) - 2
    assert world.mutate("writer", "retirements.record", "/retirements", {"retry_floor": str(floor)})[0] == 202
    conversation = world.mutate("owner", "conversations.create", f"/spaces/{world.space('owner')}/conversations",
                                {})[1]["target"]
    status, receipt = world.mutate("owner", "conversations.input", f"/conversations/{conversation}/inputs",
                                   {"text": "hello", "model": "tiny-llama"}, extra={"conversation": conversation})
    assert status == 202
    assert world.mutate("owner", "cancellations.record", "/cancellations",
                        {"target_sequence": receipt["sequence"]})[0] == 202
    spaces += [world.space("writer") for _ in range(3)]
    kept = world.device.state
    before = {(index, field): dict(getattr(getattr(kept, index), field))
              for index, field in (("receipts", "by_sequence"), ("receipts", "by_key"), ("receipts", "by_op"),
                                   ("spaces", "by_id"))}
    world.boot()
    for index in (world.device.state.receipts, world.device.state.spaces):
        assert index._pending == [] and index._tables is None  # settled: adds index at once again
    for (index, field), entries in before.items():
        assert getattr(getattr(world.device.state, index), field) == entries, (index, field)
    assert world.read("writer", "spaces.list")[1]["items"][0]["id"] in spaces


@pytest.mark.parametrize("replayed", ["in stretches", "in runs", "in runs decoded one by one"])
def test_a_replay_in_stretches_or_runs_leaves_exactly_the_state_one_admission_at_a_time_leaves(world, monkeypatch,
                                                                                                replayed):
    """A load on the CPU applies each stretch of space creations, conversations and member rows
    natively (admission.replay_stretch), stopping at a payload in another layout (a space with a
    memory TTL) for the Python path; on an accelerator each run of one kind as columns
    (admission.replay_run; here every run, however short: MIN_RUN 1), decoded natively or, for
    payloads in another layout, one by one. With stretches of several participants' creations
    between registrations, member rows, deletions and retirements (receipt and space rows freed
    and used again, commands of other lengths), the tables, commit digests, command bytes, indexes
    and free lists are those that applying each admission by itself leaves."""
    import torch
    from gpu_worker.pipeline import admission
    from gpu_worker.kinds import spaces as space_kind
    from gpu_worker.kinds.kind import Admission, Kind
    from gpu_worker.storage.journal import TransferKind
    for _ in range(3):
        for name in ("owner", "writer", "reader"):
            world.space(name, scope="room" if name == "owner" else "private")
    world.space("owner", memory_ttl_seconds=60)  # (in the middle of a stretch: not in the native layout)
    world.space("reader")
    doomed = world.space("writer", id="cd" * 16)
    world.member("writer", doomed, "reader", ["read"])
    assert world.mutate("writer", "spaces.delete", f"/spaces/{doomed}/deletion", {})[0] == 202
    floor = int(world.read("writer", "participant.get")[1]["next_sequence"])
    assert world.mutate("writer", "retirements.record", "/retirements", {"retry_floor": str(floor)})[0] == 202
    for _ in range(4):  # on rows the retirement freed
        world.space("writer")
        world.space("outsider", id=secrets.token_hex(16))
    world.mutate("manager", "conversations.create", f"/spaces/{world.space('manager')}/conversations", {})
    world.space("manager")

    def state():
        s = world.device.state
        tables = {name: getattr(s.tables, name).clone() for name in (
            "participants", "spaces", "members", "conversations", "receipts", "command_bytes", "receipt_digests")}
        indexes = {(index, field): getattr(getattr(s, index), field) for index, fields in (
            ("receipts", ("by_sequence", "by_key", "by_op", "free")), ("spaces", ("by_id", "free")),
            ("members", ("rows", "free")), ("conversations", ("by_id", "free")),
            ("participants", ("by_principal", "lineage"))) for field in fields}
        return tables, {k: (list(v) if isinstance(v, list) else dict(v)) for k, v in indexes.items()}, s.admissions

    runs, stretches, stopped = [], [], []
    real_run, real_stretch = admission.replay_run, admission.replay_stretch

    def counted(d, kind, transfers, prows):
        done = real_run(d, kind, transfers, prows)
        if kind is space_kind.CREATE:
            runs.append(len(transfers) if done else 0)
        return done

    def stretched(d, transfers, start, context):
        applied = real_stretch(d, transfers, start, context)
        stretches.append(applied)
        if start + applied < len(transfers) and transfers[start + applied].kind is TransferKind.ADMISSION:
            stopped.append(Admission.decode(transfers[start + applied].payload).kind)  # (what it left to Python)
        return applied
    with_runs = [k for k in world.device.kinds.values() if k.apply_run is not None]
    monkeypatch.setattr(admission, "STRETCH_KINDS", ())
    for k in with_runs:  # no stretches, no runs: each by itself
        monkeypatch.setattr(k, "apply_run", None)
    world.boot()
    one_by_one = state()
    monkeypatch.undo()
    monkeypatch.setattr(admission, "replay_run", counted)
    monkeypatch.setattr(admission, "replay_stretch", stretched)
    monkeypatch.setattr(admission, "MIN_RUN", 1)  # every run as columns, however short
    if replayed != "in stretches":
        monkeypatch.setattr(admission, "STRETCH_KINDS", ())
    if replayed == "in runs decoded one by one":
        for k in with_runs:
            monkeypatch.setattr(k, "decode_run", lambda payloads: None)
    world.boot()
    replayed_state = state()
    if replayed == "in stretches":  # 3 * 3 + 1 + 1 + 1 + 4 * 2 + 2 space creations, a member row, a conversation:
        # every one natively but the one with a TTL, which stopped its stretch once
        assert not runs and sum(stretches) == 3 * 3 + 1 + 1 + 1 + 4 * 2 + 2 + 1 + 1 - 1
        assert stopped.count(Kind.SPACE_CREATE) == 1 and Kind.MEMBER_SET not in stopped
    elif replayed == "in runs":  # the run with the TTL went one by one whole; then 4 * 2 + 1, 1
        assert not stretches and runs == [0, 4 * 2 + 1, 1]
    else:
        assert not stretches and len(runs) >= 3 and set(runs) == {0}
    for name, table in one_by_one[0].items():
        assert torch.equal(table, replayed_state[0][name]), name
    assert one_by_one[1:] == replayed_state[1:]
