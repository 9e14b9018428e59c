"""Forgetting survives a failover (issue 56): a memory object retained on a primary (with the real
engine), forgotten through the primary while a hot sync standby follows; the standby takes over,
the object reads 404 there, and the new primary's next checkpoint erases its bytes from its copy
of the runtime file and from its journal directory, as the primary's own would."""
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
                with open(os.path.join(root, name), "rb") as f:
                    found.append(f.read())
    return b"".join(found)


def test_a_forgotten_object_stays_forgotten_after_a_failover_and_its_bytes_leave_the_new_primary(tmp_path):
    runtime = make_runtime(tmp_path)
    primary_dir = tmp_path / "p"
    primary_dir.mkdir()
    world = EngineWorld(runtime, primary_dir, ["a"])
    try:
        space, conversation = world.conversation("a")
        [obj] = run(world, "a", conversation, SECRET.decode())["memory"]["retained"]
        me = world.read("a", "participant.get")[1]
        principal = world.principals["a"]
    finally:
        world.device.runner.stop()
        world.device.close()
    standby_copy = str(tmp_path / "standby.aotxccir")
    shutil.copyfile(runtime, standby_copy)  # the standby's copy of the file: the same incarnation
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
        wait_for(lambda: followed(primary, follower), what="the standby to apply the deletion")
    finally:
        primary.stop()
    device = follower.take_over()
    try:
        [(_, got)] = device.committer.run_sync(collections.deque([("c", {
            "v": 1, "id": 2, "op": "memory.get", "principal": principal, "args": {"memory": obj}})]))
        assert (got.status, json.loads(got.body)["error"]["code"]) == (404, "memory_not_found")
        assert SECRET in tree_bytes(standby_copy, follower.mirror.directory)  # (the input's admission is there)
        assert device.checkpoint() is not None
        assert SECRET not in tree_bytes(standby_copy, follower.mirror.directory)
    finally:
        device.close()
