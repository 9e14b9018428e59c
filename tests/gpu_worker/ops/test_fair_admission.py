"""Fair admission at the device (engine/scheduler.py): inputs and chats queue per principal, FIFO
within one and round-robin across them, so one principal's flood of queued inputs cannot hold
another's single input back until the flood drains, while both share the KV pool."""
import threading

import pytest

from gpu_worker.pack import pack_tiny
from gpu_worker.state.tables import R
from tests.gpu_worker.ops.test_inputs import EngineWorld


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

    def recording_admit():
        group = admit()
        order.extend(seq.request_id for seq in group)
        return group

    def gated_step():  # the engine starts once every input has been handed to it
        gate.wait(60)
        return step()

    def counting_submit(request_id, prompt, **settings):
        handed.append(request_id)
        submit(request_id, prompt, **settings)
    engine.scheduler.admit, engine.step, world.device.runner.submit = recording_admit, gated_step, counting_submit

    _, flood_con = world.conversation("flood")
    _, single_con = world.conversation("single")
    flood = [world.say("flood", flood_con, f"flood {i}", max_output_tokens=4)[1] for i in range(6)]
    single = world.say("single", single_con, "just one", max_output_tokens=4)[1]
    world.pump(lambda: len(handed) == 7)
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
    rows = {world.device.state.receipts.by_op[bytes.fromhex(r["operation"].split("-")[2])]: r for r in every}
    admitted = [rows[request_id[1]]["operation"] for request_id in order]
    flood_ops = [r["operation"] for r in flood]
    assert [op for op in admitted if op in flood_ops] == flood_ops  # FIFO within the flooding principal
    # round-robin: the single input waits behind at most one more of the flood, never the whole flood
    assert admitted.index(single["operation"]) <= 2
    assert admitted.index(single["operation"]) < admitted.index(flood_ops[-1])
    for name, r in [("flood", f) for f in flood] + [("single", single)]:
        assert world.read(name, "operations.get", operation=r["operation"])[1]["terminal"]["status"] == "succeeded"
