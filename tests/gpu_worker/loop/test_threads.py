"""The device's background threads (gpu_worker/loop/threads.py): named, and below the tick loop."""
import os
import queue
import subprocess
import sys
import threading

import pytest

from gpu_worker.loop.threads import enter_background, keep_off_the_tick_cpu
from tests.gpu_worker.test_device import Rig


def _name_and_nice():
    tid = threading.get_native_id()
    with open(f"/proc/self/task/{tid}/comm") as comm:
        return comm.read().strip(), os.getpriority(os.PRIO_PROCESS, tid)


def _in_thread(work):
    out = queue.SimpleQueue()
    thread = threading.Thread(target=lambda: out.put(work()))
    thread.start()
    thread.join(10)
    return out.get_nowait()


def test_a_background_thread_is_named_and_niced_and_its_own_threads_inherit_both():
    def background():
        enter_background("aotx-test-background-thread", 7)  # past the kernel's 15 bytes: cut
        return _name_and_nice(), _in_thread(_name_and_nice)  # as torch's workers, made from it
    mine, child = _in_thread(background)
    assert mine == child == ("aotx-test-backg", 7)
    assert _name_and_nice()[1] == 0  # the calling thread (the tick loop's role) is left as it was


def test_enter_background_never_lowers_a_nice_value():
    def background():
        enter_background("aotx-a", 12)
        enter_background("aotx-b", 5)
        return _name_and_nice()
    assert _in_thread(background) == ("aotx-b", 12)


def test_the_devices_helper_threads_run_at_its_background_nice(tiny_runtime, tmp_path, principal_id):
    rig = Rig(tiny_runtime, tmp_path, {principal_id: ["shared_read"]})
    try:
        delivered = queue.SimpleQueue()
        rig.device.deliver = delivered.put  # as the server's loop: the continuation comes back to be run
        rig.device.background_nice = 9
        seen = []
        rig.device.off_thread(_name_and_nice, lambda result, error: seen.append((result, error)))
        [(key, *_)] = delivered.get(timeout=10)
        key[1]()  # the tick loop runs the continuation
        assert seen == [(("aotx-off-tick", 9), None)]
    finally:
        rig.device.close()


def test_with_a_tick_cpu_the_devices_helper_threads_and_their_processes_leave_it(tiny_runtime, tmp_path,
                                                                                 principal_id):
    """A thread copies its maker's CPU affinity: the tick loop's helpers (and the checkpoint's fold
    process they start) would otherwise run on the CPU --tick-cpu gave the tick loop alone."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    tick_cpu = min(allowed)
    rig = Rig(tiny_runtime, tmp_path, {principal_id: ["shared_read"]})

    def tick_loop():  # boot's --tick-cpu: the others for the background, this thread on its own CPU
        keep_off_the_tick_cpu(allowed - {tick_cpu})
        os.sched_setaffinity(0, {tick_cpu})
        rig.device.off_thread(lambda: (os.sched_getaffinity(0), subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], capture_output=True,
            text=True, check=True).stdout.strip()), lambda result, error: seen.append((result, error)))
        return os.sched_getaffinity(0)
    try:
        delivered = queue.SimpleQueue()
        rig.device.deliver = delivered.put
        seen = []
        assert _in_thread(tick_loop) == {tick_cpu}
        [(key, *_)] = delivered.get(timeout=30)
        key[1]()
        assert seen == [((allowed - {tick_cpu}, str(sorted(allowed - {tick_cpu}))), None)]
    finally:
        keep_off_the_tick_cpu(set())
        rig.device.close()
