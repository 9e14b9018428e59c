"""Fair admission at the device: inputs are leased (execution.py, LeaseQueue) and admitted into
the engine (engine/scheduler.py) per principal, FIFO within one and round-robin across them, so
one principal's flood of queued inputs cannot hold another's single input back until the flood
drains, nor start the flood's deadlines before the engine can serve them, while both share the KV
pool."""
import threading

import pytest

from gpu_worker.state.executions import LEASE_AHEAD
from gpu_worker.pack import pack_tiny
from gpu_worker.state.tables import R
from tests.gpu_worker.kinds.test_inputs import EngineWorld


@pytest.fixture
def world(tmp_path):
    path = str(tmp_path / "one-at-a-time.aotxccir")
    # a pool of 16 pages and a page grant of 16: one input (its whole page limit) runs at a time
    pack_tiny(path, shared=True, runtime_profile={"kv_pages": 16, "page_grant": 16, "deadline_ms": 600000})
    w = EngineWorld(path, tmp_path, ["flood", "single"])
    yield w
    w.device.runner.stop()
    w.device.close()


def test_one_principals_flood_does_not_push_anothers_input_behind_it(world):
    engine = world.device.runner.engine
    order, gate, handed = [], threading.Event(), []
    admit, step, submit = engine.scheduler.admit, engine.step, world.device.runner.submit

    def recording_admit(*args):
        group = admit(*args)
        order.extend(seq.request_id for seq in group)
        return group

    def gated_step():  # the engine starts once every input has been handed to it
        gate.wait(60)
        return step()

    def counting_submit(request_id, prompt, **settings):
        handed.append(request_id)
        submit(request_id, prompt, **settings)
    engine.scheduler.admit, engine.step, world.device.runner.submit = recording_admit, gated_step, counting_submit

    # the flood in conversations of its own: one conversation runs one input at a time anyway
    flood_cons = [world.conversation("flood")[1] for _ in range(6)]
    _, single_con = world.conversation("single")
    flood = [world.say("flood", con, f"flood {i}", max_output_tokens=4)[1] for i, con in enumerate(flood_cons)]
    single = world.say("single", single_con, "just one", max_output_tokens=4)[1]
    world.pump(lambda: len(handed) == LEASE_AHEAD + 1)  # the flood's first ones, and the single input
    every = flood + [single]
    rows = {r["operation"]: world.device.state.receipts.by_op[bytes.fromhex(r["operation"].split("-")[2])]
            for r in every}
    t = world.device.state.tables
    # the single input's lease is saved (its deadline runs) while the whole flood is still unfinished
    assert t.value(t.receipts, rows[single["operation"]], R.LEASE)
    assert not any(t.value(t.receipts, rows[r["operation"]], R.TERMINAL) for r in flood)
    gate.set()
    world.pump(lambda: all(world.finished(name, r["operation"])()
                           for name, r in [("flood", f) for f in flood] + [("single", single)]), timeout=120)
    assert len(handed) == 7
    rows = {world.device.state.receipts.by_op[bytes.fromhex(r["operation"].split("-")[2])]: r for r in every}
    admitted = [rows[request_id[1]]["operation"] for request_id in order]
    flood_ops = [r["operation"] for r in flood]
    assert [op for op in admitted if op in flood_ops] == flood_ops  # FIFO within the flooding principal
    # round-robin: the single input waits behind at most one more of the flood, never the whole flood
    assert admitted.index(single["operation"]) <= 2
    assert admitted.index(single["operation"]) < admitted.index(flood_ops[-1])
    for name, r in [("flood", f) for f in flood] + [("single", single)]:
        assert world.read(name, "operations.get", operation=r["operation"])[1]["terminal"]["status"] == "succeeded"


def gate_engine(world):
    """The engine does not step until the returned event is set: nothing leased starts generating."""
    gate = threading.Event()
    engine = world.device.runner.engine
    step = engine.step
    engine.step = lambda: (gate.wait(60), step())[1]
    return gate


def test_one_principals_backlog_waits_unleased_and_anothers_input_is_leased_before_it(world):
    gate = gate_engine(world)
    flood_cons = [world.conversation("flood")[1] for _ in range(6)]  # (one input at a time in each)
    _, single_con = world.conversation("single")
    flood = [world.say("flood", con, f"flood {i}", max_output_tokens=4)[1]["operation"]
             for i, con in enumerate(flood_cons)]
    world.pump(lambda: not world.device.executions.leasable())  # the flood leased what it may
    single = world.say("single", single_con, "just one", max_output_tokens=4)[1]["operation"]
    t = world.device.state.tables

    def lease(op):  # the journal sequence of the input's saved lease, 0 while it has none
        return t.value(t.receipts, world.device.state.receipts.by_op[bytes.fromhex(op.split("-")[2])], R.LEASE)
    world.pump(lambda: lease(single))
    # the single input is leased (its deadline runs) at its first turn; of the flood, only the first
    # LEASE_AHEAD are, in order: the rest wait for theirs, their deadlines not started
    assert [op for op in flood if lease(op)] == flood[:LEASE_AHEAD]
    assert len(world.device.executions.to_lease) == len(flood) - LEASE_AHEAD
    gate.set()
    world.pump(lambda: all(world.finished("flood", op)() for op in flood) and world.finished("single", single)(),
               timeout=120)
    assert all(lease(single) < lease(op) for op in flood[LEASE_AHEAD:])  # leased before the backlog
    for name, op in [("flood", op) for op in flood] + [("single", single)]:
        assert world.read(name, "operations.get", operation=op)[1]["terminal"]["status"] == "succeeded"
