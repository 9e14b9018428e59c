"""Forgetting across machines (issue 56): a memory object retained on a primary (with the real
engine; a checkpoint put its text in the runtime file), forgotten through the primary while a hot
sync standby follows. The primary's next checkpoint, folded beside its ticks, erases the bytes
from its own files and from the standby's copies (the runtime file: the audit components written
again redacted, its unreachable bytes zeroed; the journal: the folded segments removed); the
standby then takes over and the object reads 404 there."""
import collections
import json
import os
import shutil

import rfc8785

from gpu_worker.contract.wire import encode_frame
from tests.conftest import wait_for
from tests.gpu_worker.kinds.test_inputs import EngineWorld
from tests.gpu_worker.kinds.test_memory import make_runtime, run
from tests.gpu_worker.loop.test_server import call
from tests.gpu_worker.test_replication import Follower, Primary, followed

SECRET = b"the safe's combination is 31-07-44"


def tree_bytes(*paths):
    found = []
    for path in paths:
        if os.path.isfile(path):
            found.append(open(path, "rb").read())
            continue
        for root, _, files in os.walk(path):
            for name in files:
                if os.path.isfile(os.path.join(root, name)):  # (not the device's socket)
                    with open(os.path.join(root, name), "rb") as f:
                        found.append(f.read())
    return b"".join(found)


def test_a_forgotten_objects_bytes_leave_the_standbys_copies_and_it_stays_forgotten_after_a_failover(tmp_path):
    runtime = make_runtime(tmp_path)
    primary_dir = tmp_path / "p"
    primary_dir.mkdir()
    world = EngineWorld(runtime, primary_dir, ["a"])
    try:
        space, conversation = world.conversation("a")
        [obj] = run(world, "a", conversation, SECRET.decode())["memory"]["retained"]
        me = world.read("a", "participant.get")[1]
        principal = world.principals["a"]
        assert world.device.checkpoint() is not None  # the text in the runtime file's state and audit too
    finally:
        world.device.runner.stop()
        world.device.close()
    standby_copy = str(tmp_path / "standby.aotxccir")
    shutil.copyfile(runtime, standby_copy)  # the standby's copy of the file: the same incarnation
    assert SECRET in tree_bytes(standby_copy)
    primary = Primary(runtime, primary_dir, 0, sync=True).start()  # (it keeps the world's grant file)
    follower = Follower(primary.address, str(tmp_path / "s" / "journal"), standby_copy, hot_grants=primary.grants)
    try:
        wait_for(lambda: followed(primary, follower), what="the standby to follow the primary's journal")
        body = {"schema": "aotx.shared.mutation.v1", "lineage": me["lineage"], "operation_key": "ef" * 16,
                "sequence": me["next_sequence"]}
        canonical = rfc8785.dumps({"method": "POST", "path": f"/aotx/v1/shared/memory/{obj}/deletion", "body": body})
        args = {"lineage": me["lineage"], "operation_key": "ef" * 16, "sequence": int(me["next_sequence"]),
                "canonical": canonical, "memory": obj}
        with primary.connect() as sock:
            done = call(sock, encode_frame({"v": 1, "id": 1, "op": "memory.delete", "principal": principal,
                                            "args": args}))
            assert done["status"] == 202, done
            # the primary's checkpoint, folded beside its ticks (the fold process redacts the audit)
            folded = call(sock, encode_frame({"v": 1, "id": 2, "op": "checkpoint", "principal": None, "args": {}}))
            assert folded["status"] == 200, folded
        wait_for(lambda: followed(primary, follower), what="the standby to follow past the checkpoint")
        assert SECRET not in tree_bytes(runtime, str(primary_dir / "journal"))
        assert SECRET not in tree_bytes(standby_copy, follower.mirror.directory)
    finally:
        primary.stop()
    device = follower.take_over()
    try:
        [(_, got)] = device.committer.run_sync(collections.deque([("c", {
            "v": 1, "id": 3, "op": "memory.get", "principal": principal, "args": {"memory": obj}})]))
        assert (got.status, json.loads(got.body)["error"]["code"]) == (404, "memory_not_found")
    finally:
        device.close()
