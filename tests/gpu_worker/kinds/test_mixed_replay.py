"""A restart replays a mixed journal to exactly the state the device kept as it admitted (issue 53
§3): registrations, space creations, member rows (a pair set twice in one run, another again in a
later run),
conversations, inputs that ran (lease, memory row, output, completion), an input cancelled before
its lease, a retirement freeing receipts that later runs of admissions take again. Every table —
participants, spaces, members, conversations, receipts, their digests, command and result bytes,
histories, the memory table — and every index and free list after the replay equals the live
device's, whether the stretches of spaces, conversations and member rows are applied natively
(admission.replay_stretch, the CPU's way), their runs as columns (admission.replay_run: every run,
however short, an accelerator's way) or each admission by itself."""
import collections
import itertools

import msgpack
import pytest
import torch

from gpu_worker.contract.grantfile import Grants
from gpu_worker.device import Device
from gpu_worker.memory.table import MemoryTable
from gpu_worker.pipeline import admission, execution, retention
from gpu_worker.storage.journal import JournalCorrupt, TransferKind
from gpu_worker.storage.runtime_file import RuntimeFile
from gpu_worker.kinds import conversations, history, members, spaces
from gpu_worker.pack import pack_tiny
from gpu_worker.state.tables import C, R
from tests.gpu_worker.kinds.test_inputs import EngineWorld, running

TABLES = ("participants", "spaces", "members", "conversations", "receipts", "receipt_digests", "command_bytes",
          "result_bytes", "history")
MEMORY = ("rows", "owners", "order", "payload", "embeddings", "provenance")
INDEXES = (("receipts", ("by_sequence", "by_key", "by_op", "free")), ("spaces", ("by_id", "free")),
           ("members", ("rows", "free")), ("conversations", ("by_id", "free", "inputs")),
           ("participants", ("by_principal", "by_raw", "lineage")), ("memory", ("free", "by_id", "pending")))
WITH_RUNS = (spaces.CREATE, conversations.CREATE, members.SET)


def snapshot(device):
    """Everything a replay rebuilds: the tables, the memory table, the indexes and free lists, the counters."""
    s = device.state
    tables = {name: getattr(s.tables, name).clone() for name in TABLES}
    tables.update({f"memory.{name}": getattr(s.memory, name).clone() for name in MEMORY})
    indexes = {}
    for index, fields in INDEXES:
        for field in fields:
            value = getattr(getattr(s, index), field)
            indexes[(index, field)] = [list(v or ()) for v in value] if field == "inputs" else \
                list(value) if isinstance(value, list) else dict(value)
    return tables, indexes, (s.admissions, s.memory.counter)


def assert_same(live, replayed):
    for name, table in live[0].items():
        assert torch.equal(table, replayed[0][name]), name
    for key, value in live[1].items():
        assert value == replayed[1][key], key
    assert live[2] == replayed[2]


@pytest.fixture
def world(tmp_path):
    runtime = str(tmp_path / "mixed.aotxccir")
    pack_tiny(runtime, shared=True, runtime_profile={"kv_pages": 64, "page_grant": 16, "deadline_ms": 60000},
              capacity={"history_bytes": 64})
    with running(EngineWorld(runtime, tmp_path, ["a", "b", "c"])) as w:
        yield w


def mixed_journal(w):
    """The mix, each step its own tick (World.mutate): runs of one kind where the same kind follows."""
    rooms = [w.space(name, scope="room") for name in ("a", "b", "c") for _ in range(3)]  # a run across principals
    rooms += [w.space("a", scope="room") for _ in range(2)]
    mine = [w.space("a") for _ in range(3)]
    for who, permissions in (("b", ["read"]), ("c", ["read", "write"]), ("b", ["read", "write"])):
        assert w.member("a", rooms[0], who, permissions)[0] == 202  # b's row set twice in the run
    for room in rooms[9:]:
        assert w.member("a", room, "c", ["read"])[0] == 202
    made = [w.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})
            for space in (rooms[0], rooms[9], mine[0], mine[1])]
    made += [w.mutate("b", "conversations.create", f"/spaces/{rooms[3]}/conversations", {})]
    assert {status for status, _ in made} == {202}
    chats = [receipt["target"] for _, receipt in made]
    ran = [w.say("a", chat, f"turn {i}", max_output_tokens=6)[1] for i, chat in enumerate(chats[:3])]
    ran.append(w.say("b", chats[4], "mine", max_output_tokens=6)[1])
    for receipt in ran:
        w.pump(w.finished("a" if receipt is not ran[-1] else "b", receipt["operation"]))
    # an input cancelled while it waits for its lease: it ends with no lease, output or memory row
    runner, w.device.runner = w.device.runner, None
    status, doomed = w.say("a", chats[1], "never runs", max_output_tokens=6)
    assert status == 202
    assert w.mutate("a", "cancellations.record", "/cancellations", {"target_sequence": doomed["sequence"]})[0] == 202
    w.device.runner = runner
    w.pump(w.finished("a", doomed["operation"]))
    # more turns in a conversation, folded into its history by one retirement together, the oldest
    # dropped for the row's bound (history_bytes), then a retirement of everything a made before it
    for text in ("more", "and more", "and then some"):
        w.pump(w.finished("a", w.say("a", chats[2], text, max_output_tokens=6)[1]["operation"]))
    again = w.say("a", chats[0], "again", max_output_tokens=6)[1]
    w.pump(w.finished("a", again["operation"]))
    floor = int(w.read("a", "participant.get")[1]["next_sequence"]) - 2  # (its last input stays)
    assert w.mutate("a", "retirements.record", "/retirements", {"retry_floor": str(floor)})[0] == 202
    rows = range(len(w.device.state.conversations.inputs))
    kept = [[turn[2] for turn in history.turns(w.device, crow)] for crow in rows]
    assert ["more", "and more"] in kept and not any("turn 2" in turns for turns in kept)  # (it did not fit)
    # runs on the freed receipt rows
    rooms += [w.space("a", scope="room") for _ in range(4)]
    for who in ("b", "c"):
        assert w.member("a", rooms[-1], who, ["read"])[0] == 202
    assert w.member("a", rooms[9], "c", ["read", "write"])[0] == 202  # set again, a run later
    for space in rooms[-3:]:
        assert w.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})[0] == 202
    w.space("c")


@pytest.mark.parametrize("replayed", ["in stretches", "in runs", "one by one"])
def test_a_mixed_journal_replays_to_exactly_the_live_state(world, monkeypatch, replayed):
    mixed_journal(world)
    world.pump(lambda: not world.device.executions.live and world.device.committer.all_saved)
    live = snapshot(world.device)
    listed = world.read("a", "operations.list")
    runs = collections.Counter()
    stretched = [0]
    real_run, real_stretch = admission.replay_run, admission.replay_stretch

    def counted(d, kind, transfers, prows):
        done = real_run(d, kind, transfers, prows)
        runs[kind.op] += len(transfers) if done else 0
        return done

    def counted_stretch(d, transfers, start, context):
        applied = real_stretch(d, transfers, start, context)
        stretched[0] += applied
        return applied
    monkeypatch.setattr(admission, "replay_stretch", counted_stretch)
    if replayed != "in stretches":
        monkeypatch.setattr(admission, "STRETCH_KINDS", ())  # (the accelerator's way, on the CPU)
    if replayed == "in runs":
        monkeypatch.setattr(admission, "MIN_RUN", 1)  # every run as columns, however short
        monkeypatch.setattr(admission, "replay_run", counted)
    elif replayed == "one by one":
        for kind in WITH_RUNS:
            monkeypatch.setattr(kind, "apply_run", None)
    world.boot()
    world.attach()
    if replayed == "in runs":  # each kind's runs went through the columns
        assert runs["spaces.create"] >= 9 + 2 + 3 + 4 and runs["members.set"] >= 3 + 2 + 2
        assert runs["conversations.create"] >= 5 + 3
    # natively: every space (9 + 2 + 3 + 4 + 1), member row (3 + 2 + 2 + 1) and conversation (5 + 3)
    assert stretched[0] == (19 + 8 + 8 if replayed == "in stretches" else 0)
    assert_same(live, snapshot(world.device))
    assert world.read("a", "operations.list") == listed  # (the receipts render from those rows)


def test_runs_shorter_than_the_threshold_replay_one_by_one_to_the_same_state(world, monkeypatch):
    """With a threshold between the runs' lengths, the short runs of the mix go one admission at a
    time and the longer ones as columns, in one replay (an accelerator's way): the same state."""
    monkeypatch.setattr(admission, "STRETCH_KINDS", ())
    monkeypatch.setattr(admission, "MIN_RUN", 3)
    mixed_journal(world)
    world.pump(lambda: not world.device.executions.live and world.device.committer.all_saved)
    live = snapshot(world.device)
    world.boot()
    world.attach()
    assert_same(live, snapshot(world.device))


def test_a_checkpoint_of_the_mixed_state_loads_to_exactly_the_live_state(world):
    """The same mix folded into the runtime file: a boot from the checkpoint (its tables, byte rows
    and memory payloads put back row after row, the indexes rebuilt from them) has every table,
    index and free list the live device had after the checkpoint."""
    mixed_journal(world)
    world.pump(lambda: not world.device.executions.live and world.device.committer.all_saved)
    assert world.device.checkpoint() is not None
    live = snapshot(world.device)
    assert bool((live[0]["memory.payload"] != 0).any()) and live[1][("memory", "by_id")]  # (memory rows to load)
    world.boot()
    world.attach()
    assert world.device.recovered <= 2  # (from the file, not the journal)
    assert_same(saved(live), saved(snapshot(world.device)))


def saved(snap):
    """A snapshot as a checkpoint keeps it: the live rows of each table, each byte row up to its
    length (a free row, and the bytes past a length, are whatever was there last: not state), the
    free rows of each table."""
    tables = dict(snap[0])
    for name in ("participants", "spaces", "members", "conversations", "receipts"):
        tables[name] = tables[name] * (tables[name][:, 0] != 0).unsqueeze(1)
    receipts = tables["receipts"]
    tables["receipt_digests"] = tables["receipt_digests"] * (receipts[:, R.STATE] != 0).view(-1, 1, 1)
    for name, lengths in (("command_bytes", receipts[:, R.COMMAND_LEN]), ("result_bytes", receipts[:, R.RESULT_LEN]),
                          ("history", tables["conversations"][:, C.HISTORY_LEN])):
        table = tables[name]
        tables[name] = table * (torch.arange(table.shape[1]).unsqueeze(0) < lengths.unsqueeze(1))
    memory_lengths = tables["memory.rows"][:, 44:48].contiguous().view(torch.int32).flatten().to(torch.int64)
    payload = tables["memory.payload"]
    tables["memory.payload"] = payload * (torch.arange(payload.shape[1]).unsqueeze(0) < memory_lengths.unsqueeze(1))
    # free lists as sets: a boot lists a table's free rows lowest first, a live device in the order it freed them
    indexes = {key: sorted(value) if key[1] == "free" else value for key, value in snap[1].items()}
    return tables, indexes, snap[2]


@pytest.mark.parametrize("batched", ["every row", "every other row"])
def test_runs_of_memory_rows_replay_at_once_to_exactly_the_live_state(world, monkeypatch, batched):
    """Inputs in several conversations at once retain their sources in the same ticks: runs of
    MEMORY transfers, which a replay on the CPU writes to the memory table at once
    (retention.replay_memory_run, MemoryTable.write_run); with every other row left to
    `apply_memory` (`_batchable` refusing it), the runs interleave batches and single writes. The
    replayed state is the live one, the memory table's rows, order and free rows included."""
    mixed_journal(world)
    spaces = [world.space("a", scope="room") for _ in range(4)]
    chats = [world.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})[1]["target"]
             for space in spaces]
    for round_ in range(2):  # (admitted with no runner, the four are leased, and retained, in one tick)
        runner, world.device.runner = world.device.runner, None
        sent = [world.say("a", chat, f"all at once {round_} {i}", max_output_tokens=4)[1]
                for i, chat in enumerate(chats)]
        world.device.runner = runner
        for receipt in sent:
            world.pump(world.finished("a", receipt["operation"]))
    world.pump(lambda: not world.device.executions.live and world.device.committer.all_saved)
    live = snapshot(world.device)
    runs = []
    real_write_run = MemoryTable.write_run

    def counted(self, items):
        runs.append(len(items))
        return real_write_run(self, items)
    monkeypatch.setattr(MemoryTable, "write_run", counted)
    if batched == "every other row":
        real_batchable, turn = retention._batchable, itertools.count()
        monkeypatch.setattr(retention, "_batchable",
                            lambda table, r: real_batchable(table, r) and next(turn) % 2 == 0)
    world.boot()
    world.attach()
    assert runs and (max(runs) >= 2 if batched == "every row" else max(runs) == 1), runs
    assert_same(live, snapshot(world.device))


@pytest.mark.parametrize("taken", ["every transfer", "every other transfer"])
def test_runs_of_outputs_and_completions_replay_in_one_loop_to_exactly_the_live_state(world, monkeypatch, taken):
    """Inputs that end in the same ticks save their outputs and completions one after another:
    runs that a replay on the CPU applies in one loop (execution.replay_ends); with every other
    transfer left to its own path (apply_output, apply_completion), the runs interleave both. The
    replayed state is the live one, receipts, result bytes and digests included."""
    mixed_journal(world)
    spaces_ = [world.space("a", scope="room") for _ in range(3)]
    chats = [world.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})[1]["target"]
             for space in spaces_]
    runner, world.device.runner = world.device.runner, None  # (leased, run and ended in the same ticks)
    sent = [world.say("a", chat, f"ends together {i}", max_output_tokens=4)[1] for i, chat in enumerate(chats)]
    world.device.runner = runner
    for receipt in sent:
        world.pump(world.finished("a", receipt["operation"]))
    world.pump(lambda: not world.device.executions.live and world.device.committer.all_saved)
    live = snapshot(world.device)
    runs, alone = [], collections.Counter()
    real_ends, real_output, real_completion = execution.replay_ends, execution.apply_output, execution.apply_completion

    def counted_ends(d, transfers, source):
        runs.append(len(transfers))
        return real_ends(d, transfers, source)

    def output(d, payload, transfer):
        alone["output"] += 1
        return real_output(d, payload, transfer)

    def completion(d, payload, transfer, source=None):
        alone["completion"] += 1
        return real_completion(d, payload, transfer, source)
    monkeypatch.setattr(execution, "replay_ends", counted_ends)
    monkeypatch.setattr(execution, "apply_output", output)
    monkeypatch.setattr(execution, "apply_completion", completion)
    if taken == "every other transfer":
        real_fields, turn = execution._fields, itertools.count()
        monkeypatch.setattr(execution, "_fields", lambda payload: real_fields(payload) if next(turn) % 2 else None)
    world.boot()
    ended = sum(runs)
    assert runs and max(runs) >= 2 and ended >= 2 * 10, runs  # (every input's output and completion)
    if taken == "every transfer":
        assert not alone, alone
    else:
        assert sum(alone.values()) == (ended + 1) // 2, (alone, ended)  # (the first, the third, ...)
    world.attach()
    assert_same(live, snapshot(world.device))


@pytest.mark.parametrize("forged", ["an offset past the saved result", "a sequence of no input"])
def test_an_output_a_replay_cannot_apply_stops_it_with_the_error_of_its_own_path(world, forged):
    """An OUTPUT transfer in a run that names no input, or whose offset does not follow the saved
    result, fails the load closed, naming the journal file and offset, as `apply_output` alone does."""
    mixed_journal(world)
    world.pump(lambda: not world.device.executions.live and world.device.committer.all_saved)
    d = world.device
    t = d.state.tables
    rrow = next(r for r in sorted(d.state.receipts.by_op.values())
                if t.value(t.receipts, r, R.KIND) == 6 and t.value(t.receipts, r, R.RESULT_LEN) > 0)
    row = t.row(t.receipts, rrow)
    actor = next(raw for raw, prow in d.state.participants.by_raw.items() if prow == row[R.PARTICIPANT])
    sequence = row[R.SEQUENCE] if forged == "an offset past the saved result" else row[R.SEQUENCE] + 10_000
    d.append(TransferKind.OUTPUT, msgpack.packb([actor, sequence, row[R.RESULT_LEN] + 1, b"x"]))
    d.append(TransferKind.OUTPUT, msgpack.packb([actor, row[R.SEQUENCE], row[R.RESULT_LEN], b"y"]))
    d.committer.commit()
    world.pump(lambda: world.device.committer.all_saved)
    d.runner.stop()
    d.runner = None
    d.close()  # (closed again as the test ends: a device's close is idempotent)
    reason = "does not follow the saved result" if forged == "an offset past the saved result" else \
        f"output transfer names no input at sequence {sequence}"
    with pytest.raises(JournalCorrupt, match=r"00000001\.journal: offset \d+: .*" + reason):
        Device(RuntimeFile.open(world.runtime), world.journal, Grants(world.grants_path))
