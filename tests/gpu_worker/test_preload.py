"""A boot's checkpoint tables filled (and their maps of IDs to rows built) by a child process while
the boot imports torch (gpu_worker/recovery/preload.py): the device that takes them has exactly the
state a device that filled its own has, every table, index and free list; a child that fails, or
runs past its bound (killed), leaves the device filling them itself, to the same state; without a
checkpoint the child backs the empty tables and maps the replay fills; a process that already runs
other threads forks no child."""
import functools
import mmap
import resource
import threading

import numpy as np
import pytest

from gpu_worker.columns import table_shapes
from gpu_worker.recovery import preload, reading
from tests.gpu_worker.kinds.test_mixed_replay import assert_same, mixed_journal, saved, snapshot, world  # noqa: F401


@pytest.fixture
def filling(monkeypatch):
    """Every load of the state in this test starts as boot's does, with a child filling the tables.
    (This test's process runs other threads, which boot's has not at that point: `start` is told
    it is alone; the child only fills numpy arrays and exits.) Yields each `take`'s answer."""
    monkeypatch.setattr(reading, "start", functools.partial(reading.start, fill=True))
    monkeypatch.setattr(preload.threading, "active_count", lambda: 1)
    taken = []
    real_take = preload.Preload.take

    def take(self):
        tables = real_take(self)
        taken.append(tables)
        return tables
    monkeypatch.setattr(preload.Preload, "take", take)
    return taken


def checkpointed(world):
    mixed_journal(world)
    world.pump(lambda: not world.device.executions.live and world.device.committer.all_saved)
    assert world.device.checkpoint() is not None
    return snapshot(world.device)


def assert_loaded_as(world, live):
    world.attach()
    assert world.device.recovered <= 2  # (from the file, not the journal)
    mine, theirs = saved(live), saved(snapshot(world.device))
    for name, table in mine[0].items():
        assert bool((table == theirs[0][name]).all()), name
    assert mine[1:] == theirs[1:]


def test_the_tables_a_child_filled_load_to_exactly_the_state_the_device_kept(world, filling):
    live = checkpointed(world)
    world.boot()
    [filled] = filling
    assert filled is not None  # (the child's, taken as the device's tables and receipts' maps: no copy)
    assert np.shares_memory(world.device.state.tables.receipts.numpy(), filled.tables["receipts"])
    state = world.device.state
    indexes = {"receipts.by_sequence": state.receipts.by_sequence, "receipts.by_key": state.receipts.by_key,
               "receipts.by_op": state.receipts.by_op, "spaces.by_id": state.spaces.by_id,
               "members.rows": state.members.rows, "conversations.by_id": state.conversations.by_id}
    assert indexes.keys() == filled.maps.keys() and all(indexes[name] is filled.maps[name] for name in indexes)
    assert len(state.receipts.by_sequence) == int((filled.tables["receipts"][:, 0] != 0).sum()) > 0
    assert len(state.spaces.by_id) == int((filled.tables["spaces"][:, 0] == 1).sum()) > 0
    assert len(state.conversations.by_id) == int((filled.tables["conversations"][:, 0] == 1).sum()) > 0
    assert len(state.members.rows) == int((filled.tables["members"][:, 0] != 0).sum()) > 0
    assert_loaded_as(world, live)
    world.space("c")  # and it goes on from there
    assert world.device.state.tables.usage()["spaces"] == len(world.device.state.spaces.by_id)


def test_a_child_that_fails_leaves_the_device_filling_its_tables_itself(world, filling, monkeypatch, caplog):
    live = checkpointed(world)

    def broken(saved, tables):
        raise ValueError("injected")
    monkeypatch.setattr(preload, "fill_tables", broken)  # (the forked child runs it)
    world.boot()
    assert filling == [None] and "the tables' preload ended with status" in caplog.text
    assert_loaded_as(world, live)


def test_a_child_past_its_bound_is_killed_and_the_device_fills_its_tables_itself(world, filling, monkeypatch,
                                                                                 caplog):
    live = checkpointed(world)
    stuck = threading.Event()
    monkeypatch.setattr(preload, "fill_tables", lambda saved, tables: stuck.wait())  # (never set in the child)
    monkeypatch.setattr(preload, "PRELOAD_SECONDS", 0.2)
    world.boot()
    assert filling == [None] and "ran past 0.2 s: killed" in caplog.text
    assert_loaded_as(world, live)


def test_the_child_runs_at_the_background_nice_value(world, monkeypatch):
    """preload.start(..., nice): the child fills at that nice value (boot's background one: the
    parent's imports keep their CPU), the parent's stays as it was."""
    import os
    checkpointed(world)
    world.device.close()
    monkeypatch.setattr(preload.threading, "active_count", lambda: 1)
    real = preload.fill_tables

    def fill(saved, tables):
        tables["participants"][-1, 0] = os.nice(0)  # (a free row's first column: the parent reads it back)
        return real(saved, tables)
    monkeypatch.setattr(preload, "fill_tables", fill)
    mine = os.nice(0)
    early = reading.start(world.device.runtime, world.journal, fill=True, nice=min(mine + 5, 19))
    try:
        filled = early.tables.take()
        assert filled is not None and int(filled.tables["participants"][-1, 0]) == min(mine + 5, 19)
    finally:
        early.close()
    assert os.nice(0) == mine


def test_without_a_checkpoint_the_child_backs_the_empty_tables_and_maps_the_replay_fills(world, filling):
    """A journal with no checkpoint: the child backs every page of the empty tables and maps
    (MADV_POPULATE_WRITE), the device replays the whole journal into them (the child's memory, no
    torch.zeros) to exactly the state the live device had."""
    mixed_journal(world)
    world.pump(lambda: not world.device.executions.live and world.device.committer.all_saved)
    live = snapshot(world.device)
    world.boot()
    [filled] = filling
    assert filled is not None
    state = world.device.state
    assert np.shares_memory(state.tables.receipts.numpy(), filled.tables["receipts"])
    assert state.receipts.by_op is filled.maps["receipts.by_op"] and len(state.receipts.by_op) > 0
    assert state.spaces.by_id is filled.maps["spaces.by_id"] and len(state.spaces.by_id) > 0
    world.attach()
    assert_same(live, snapshot(world.device))


def _faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_the_device_maps_the_pages_the_child_backed_in_a_fault_for_sixteen_and_writes_them_with_none(monkeypatch):
    """Without a checkpoint the parent maps every page the child backed before the replay writes
    them: with a read's populate, whose faults map sixteen pages each (the kernel's fault-around),
    writable, so that the replay's writes then fault no more (a write's populate faults once a page;
    none at all, once a page as the replay first writes it). Counted in the process's minor faults."""
    monkeypatch.setattr(preload.threading, "active_count", lambda: 1)
    capacities = {"participants": 64, "spaces": 4096, "members": 4096, "conversations": 4096, "receipts": 16384,
                  "command_bytes": 512, "result_bytes": 256, "history_bytes": 512}
    started = preload.start(capacities, bytes(16), None)
    assert started is not None
    pages = sum(-(-len(memory) // mmap.PAGESIZE) for memory in started.backed)
    before = _faults()
    filled = started.take()
    mapped = _faults() - before
    assert filled is not None and pages > 4096
    before = _faults()
    for table in filled.tables.values():
        table.reshape(-1).view(np.uint8)[::mmap.PAGESIZE // table.itemsize * table.itemsize] = 1
    for memory in started.maps.values():
        np.frombuffer(memory, dtype=np.uint8)[::mmap.PAGESIZE] = 1
    written = _faults() - before
    assert mapped < pages / 4, (mapped, pages)
    assert written < pages / 16, (written, pages)  # (41 of 5,969 here: the loop's own allocations)


def test_no_child_is_forked_beside_other_threads():
    other = threading.Event()
    thread = threading.Thread(target=other.wait)
    thread.start()
    try:
        capacities = {"participants": 2, "spaces": 2, "members": 2, "conversations": 2, "receipts": 2,
                      "command_bytes": 8, "result_bytes": 8, "history_bytes": 8}
        assert preload.start(capacities, bytes(16), {"tables": {}}) is None
        assert preload.start(capacities, bytes(16), None) is None
    finally:
        other.set()
        thread.join()
    assert set(table_shapes(capacities)) == {"participants", "spaces", "members", "conversations", "receipts",
                                             "receipt_digests", "command_bytes", "result_bytes", "history"}


def test_the_child_keys_every_row_by_the_lineage_of_its_line_of_history(tmp_path, filling):
    """A restore starts a second line of history: every participant's lineage changes while the IDs
    made before keep the old one. The restore test's boots from its checkpoint of both lines, each
    with the child deriving the lineages and building the spaces' and conversations' maps: the IDs
    of both lines are found (a child that keyed them all by the current lineage loses the old ones)."""
    from tests.gpu_worker import test_restart
    test_restart.test_a_restore_gives_every_participant_a_new_lineage_and_keeps_every_saved_id(tmp_path)
    assert sum(filled is not None for filled in filling) >= 2


def test_without_populate_the_child_backs_the_pages_by_writing_them(world, filling, monkeypatch):
    """On a kernel with no MADV_POPULATE_WRITE the child writes one byte of each page instead (and
    the device maps them as it touches them): the same replayed state."""
    mixed_journal(world)
    world.pump(lambda: not world.device.executions.live and world.device.committer.all_saved)
    live = snapshot(world.device)
    monkeypatch.setattr(preload, "populate", lambda memory, advice=None: False)
    world.boot()
    assert filling[0] is not None
    world.attach()
    assert_same(live, snapshot(world.device))
