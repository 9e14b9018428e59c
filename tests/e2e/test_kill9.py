"""kill -9 of the device at random moments under concurrent mutation load (issue: "crash-proof
recovery"). After every restart, every receipt a client saw as saved reads back byte for byte;
at the end nothing was applied twice. AOTX_KILLS sets the number of kills (default 100)."""
import collections
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import threading
import time

import pytest
import rfc8785

from gpu_worker.state import ids
from gpu_worker.pack import pack_tiny
from gpu_worker.contract.wire import LENGTH, decode_payload, encode_frame
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.conftest import PYTHON, ROOT, wait_for, write_grants

pytestmark = pytest.mark.e2e
KILLS = int(os.environ.get("AOTX_KILLS", "100"))
CLIENTS = 4
BASE = "/aotx/v1/shared"


def call(sock, msg):
    sock.sendall(encode_frame(msg))
    header = sock.recv(4, socket.MSG_WAITALL)
    if len(header) != 4:
        raise ConnectionError("device went away")
    (n,) = LENGTH.unpack(header)
    data = sock.recv(n, socket.MSG_WAITALL)
    if len(data) != n:
        raise ConnectionError("device went away mid-reply")
    return decode_payload(data)


class Client(threading.Thread):
    """Closed loop of mutations for one principal; an unanswered request is retried exactly."""

    def __init__(self, principal, incarnation, path, stop):
        super().__init__(daemon=True)
        self.principal, self.path, self.stop = principal, path, stop
        self.lineage = ids.lineage(incarnation, principal).hex()
        self.saved = {}  # sequence -> receipt bytes the client saw (202 or 200)
        self.errors = []
        self.retries = 0
        self.pause = random.Random(principal)

    def request(self, sequence):
        key = secrets.token_hex(16)
        fields = {} if sequence == 1 else {"scope": "private"}
        path = f"{BASE}/participant" if sequence == 1 else f"{BASE}/spaces"
        body = {"schema": "aotx.shared.mutation.v1", "lineage": self.lineage, "operation_key": key,
                "sequence": str(sequence), **fields}
        return {"v": 1, "id": sequence, "op": "participant.register" if sequence == 1 else "spaces.create",
                "principal": self.principal.hex(),
                "args": {"lineage": self.lineage, "operation_key": key, "sequence": sequence, **fields,
                         "canonical": rfc8785.dumps({"method": "POST", "path": path, "body": body})}}

    def run(self):
        sequence, pending, sock = 1, None, None
        while True:
            if pending is None:
                if self.stop.is_set():
                    break
                pending = self.request(sequence)
            try:
                if sock is None:
                    sock = socket.socket(socket.AF_UNIX)
                    sock.settimeout(10)
                    sock.connect(self.path)
                reply = call(sock, pending)
            except (OSError, ConnectionError, ValueError):
                if sock is not None:
                    sock.close()
                sock = None
                self.retries += 1
                time.sleep(0.005)
                continue
            if reply["status"] not in (200, 202):
                self.errors.append((sequence, reply["status"], reply["body"]))
                break
            self.saved[sequence] = reply["body"]
            sequence, pending = sequence + 1, None
            time.sleep(self.pause.uniform(0.002, 0.02))  # bounded load keeps each boot's replay short
        if sock is not None:
            sock.close()


class Zygote:
    def __init__(self):
        self.proc = subprocess.Popen([PYTHON, "-m", "tests.e2e.zygote"], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def boot(self, argv, log):
        self.proc.stdin.write(json.dumps({"argv": argv, "log": log}) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_kill_dash_nine_under_load_loses_no_saved_receipt_and_applies_nothing_twice(tmp_path):
    runtime = str(tmp_path / "kill.aotxccir")
    pack_tiny(runtime, shared=True, capacity={"participants": 8, "spaces": 60000, "receipts": 60000,
                                              "command_bytes": 1024, "result_bytes": 16})
    incarnation = RuntimeFile.open(runtime, verify=False).incarnation
    principals = [secrets.token_bytes(16) for _ in range(CLIENTS)]
    grants = str(tmp_path / "grants.json")
    journal = tmp_path / "journal"
    sock_path = str(journal / "service.sock")
    log = tmp_path / "device.log"
    zygote = Zygote()
    rng = random.Random(1234)

    write_grants(grants, {p.hex(): ["shared_read", "shared_write"] for p in principals})

    def boot():  # a plain restart every time: the same command, the same grant file
        log.touch()
        start = log.stat().st_size
        pid = zygote.boot(["--ccir", runtime, "--journal", str(journal), "--service-grants", grants,
                           "--device", "cpu"], str(log))
        wait_for(lambda: "device ready" in log.read_text()[start:] or not alive(pid), 60, what="device ready")
        assert alive(pid), f"boot failed: {log.read_text()[start:]}"
        return pid

    def read_receipt(verifier, client, body):
        op = json.loads(body)["operation"]
        return call(verifier, {"v": 1, "id": 0, "op": "operations.get", "principal": client.principal.hex(),
                               "args": {"operation": op}})

    stop = threading.Event()
    clients = [Client(p, incarnation, sock_path, stop) for p in principals]
    pid = boot()
    for c in clients:
        c.start()
    checked = collections.Counter()
    try:
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.01, 0.2))
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not alive(pid), 30, what="device to die")
            pid = boot()
            with socket.socket(socket.AF_UNIX) as verifier:
                verifier.connect(sock_path)
                for c in clients:  # receipts seen since the last check, plus a sample of older ones
                    seen = sorted(c.saved.items())
                    sample = seen[checked[c]:] + rng.sample(seen[:checked[c]], min(5, checked[c]))
                    for sequence, body in sample:
                        reply = read_receipt(verifier, c, body)
                        assert reply["status"] == 200 and reply["body"] == body, (sequence, reply)
                    checked[c] = len(seen)
        stop.set()
        for c in clients:
            c.join(60)
            assert not c.is_alive() and not c.errors, c.errors
        with socket.socket(socket.AF_UNIX) as verifier:
            verifier.connect(sock_path)
            for c in clients:
                for sequence, body in c.saved.items():
                    reply = read_receipt(verifier, c, body)
                    assert reply["status"] == 200 and reply["body"] == body
                me = json.loads(call(verifier, {"v": 1, "id": 0, "op": "participant.get",
                                                "principal": c.principal.hex(), "args": {}})["body"])
                assert me["next_sequence"] == str(max(c.saved) + 1)
                spaces, cursor = [], None
                while True:
                    page = json.loads(call(verifier, {"v": 1, "id": 0, "op": "spaces.list",
                                                      "principal": c.principal.hex(),
                                                      "args": {"limit": 200, **({"cursor": cursor} if cursor else {})}})["body"])
                    spaces += page["items"]
                    cursor = page["next_cursor"]
                    if cursor is None:
                        break
                assert len(spaces) == len({s["id"] for s in spaces}) == len(c.saved) - 1
        total = sum(len(c.saved) for c in clients)
        retries = sum(c.retries for c in clients)
        print(f"{KILLS} kills, {total} saved receipts, {retries} client retries")
        assert total > KILLS and retries > 0
    finally:
        stop.set()
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        zygote.close()
