"""kill -9 of the device at random moments under concurrent mutation load (issue: "crash-proof
recovery"). After every restart, every receipt a client saw as saved reads back byte for byte;
at the end nothing was applied twice. Beside the space creators, one client runs conversation
inputs (each retains a memory row) and publishes each retained row into a room: at the end the
memory lists hold exactly the rows the saved receipts name, none lost and none doubled.
AOTX_KILLS sets the number of kills (default 100)."""
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

from gpu_worker.pack import pack_tiny
from gpu_worker.contract.wire import LENGTH, decode_payload, encode_frame
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

    def __init__(self, principal, path, stop):
        super().__init__(daemon=True)
        self.principal, self.path, self.stop = principal, path, stop
        self.lineage = None  # read from the participant resource once connected (learn_lineage)
        self.saved = {}  # sequence -> receipt bytes the client saw (202 or 200); written under `lock`
        self.lock = threading.Lock()  # the test reads `saved` while this thread goes on writing it
        self.errors = []
        self.retries = 0
        self.pause = random.Random(principal)

    def keep(self, sequence, body):
        with self.lock:
            self.saved[sequence] = body

    def saved_so_far(self):
        """(sequence, receipt bytes) of every receipt seen saved so far, in sequence order."""
        with self.lock:
            return sorted(self.saved.items())

    def mutation(self, sequence, op, path, fields, **args):
        """A device command for a mutation, canonical bytes built as the gateway builds them."""
        key = secrets.token_hex(16)
        body = {"schema": "aotx.shared.mutation.v1", "lineage": self.lineage, "operation_key": key,
                "sequence": str(sequence), **fields}
        return {"v": 1, "id": sequence, "op": op, "principal": self.principal.hex(),
                "args": {"lineage": self.lineage, "operation_key": key, "sequence": sequence, **fields, **args,
                         "canonical": rfc8785.dumps({"method": "POST", "path": BASE + path, "body": body})}}

    def request(self, sequence):
        if sequence == 1:
            return self.mutation(1, "participant.register", "/participant", {})
        return self.mutation(sequence, "spaces.create", "/spaces", {"scope": "private"})

    def exchange(self, sock, msg):
        """One request until answered, exactly the same each time (a new connection after each
        failure): (reply, socket)."""
        while True:
            try:
                if sock is None:
                    sock = socket.socket(socket.AF_UNIX)
                    sock.settimeout(10)
                    sock.connect(self.path)
                return call(sock, msg), sock
            except (OSError, ConnectionError, ValueError):
                if sock is not None:
                    sock.close()
                sock = None
                self.retries += 1
                time.sleep(0.005)

    def learn_lineage(self, sock):
        """The lineage to mutate under, from the participant resource (SPEC: "Read /participant to
        obtain the actual lineage"): the device's line of history decides it, not the file alone.
        Restarts on its own journal keep it."""
        reply, sock = self.exchange(sock, {"v": 1, "id": 0, "op": "participant.get", "principal": self.principal.hex(),
                                           "args": {}})
        self.lineage = json.loads(reply["body"])["lineage"]
        return sock

    def run(self):
        sequence, sock = 1, None
        sock = self.learn_lineage(sock)
        while not self.stop.is_set():
            reply, sock = self.exchange(sock, self.request(sequence))
            if reply["status"] not in (200, 202):
                self.errors.append((sequence, reply["status"], reply["body"]))
                break
            self.keep(sequence, reply["body"])
            sequence += 1
            time.sleep(self.pause.uniform(0.002, 0.02))  # bounded load keeps each boot's replay short
        if sock is not None:
            sock.close()


class MemoryClient(Client):
    """Inputs and publications: register, a space, a conversation and a room, then in a loop an
    input, its terminal result (polled), and a publication of the row it retained."""

    def __init__(self, principal, path, stop):
        super().__init__(principal, path, stop)
        self.space = self.conversation = self.room = None
        self.inputs, self.publications = [], []  # saved receipts' operations / publication targets

    def run(self):
        sock, sequence = self.learn_lineage(None), 1
        setup = [("participant.register", "/participant", {}, {}), ("spaces.create", "/spaces", {}, {}),
                 None, ("spaces.create", "/spaces", {"scope": "room"}, {})]
        try:
            while not self.stop.is_set() or sequence <= len(setup):
                if sequence <= len(setup):
                    step = setup[sequence - 1] or ("conversations.create", f"/spaces/{self.space}/conversations",
                                                   {}, {"space": self.space})
                    msg = self.mutation(sequence, step[0], step[1], step[2], **step[3])
                else:
                    msg = self.mutation(sequence, "conversations.input", f"/conversations/{self.conversation}/inputs",
                                        {"text": f"turn {sequence}", "model": "tiny-llama", "max_output_tokens": 1},
                                        conversation=self.conversation)
                reply, sock = self.exchange(sock, msg)
                if reply["status"] not in (200, 202):
                    self.errors.append((sequence, reply["status"], reply["body"]))
                    return
                receipt = json.loads(reply["body"])
                self.keep(sequence, reply["body"])
                sequence += 1
                if msg["op"] == "spaces.create":
                    setattr(self, "space" if self.space is None else "room", receipt["target"])
                elif msg["op"] == "conversations.create":
                    self.conversation = receipt["target"]
                elif msg["op"] == "conversations.input":
                    self.inputs.append(receipt["operation"])
                    while True:  # its terminal result, across restarts (an interrupted one ends too)
                        time.sleep(0.01)
                        got, sock = self.exchange(sock, {"v": 1, "id": 0, "op": "operations.get",
                                                         "principal": self.principal.hex(),
                                                         "args": {"operation": receipt["operation"]}})
                        done = json.loads(got["body"])
                        if done["terminal"]["saved"]:
                            break
                    for source in done["memory"]["retained"]:
                        msg = self.mutation(sequence, "publications.record", f"/spaces/{self.room}/publications",
                                            {"source": source, "source_version": "1"}, space=self.room)
                        reply, sock = self.exchange(sock, msg)
                        if reply["status"] not in (200, 202):
                            self.errors.append((sequence, reply["status"], reply["body"]))
                            return
                        self.keep(sequence, reply["body"])
                        self.publications.append(json.loads(reply["body"])["target"])
                        sequence += 1
        finally:
            if sock is not None:
                sock.close()


def list_spaces(sock, principal):
    """Every space the principal sees, all pages."""
    spaces, cursor = [], None
    while True:
        page = json.loads(call(sock, {"v": 1, "id": 0, "op": "spaces.list", "principal": principal.hex(),
                                      "args": {"limit": 200, **({"cursor": cursor} if cursor else {})}})["body"])
        spaces += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            return spaces


def memory_objects(sock, principal, space):
    objects, cursor = [], None
    while True:
        page = json.loads(call(sock, {"v": 1, "id": 0, "op": "memory.list", "principal": principal.hex(),
                                      "args": {"space": space, "limit": 200,
                                               **({"cursor": cursor} if cursor else {})}})["body"])
        objects += [row["object"] for row in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            return objects


class Zygote:
    def __init__(self):
        self.proc = subprocess.Popen([PYTHON, "-m", "tests.e2e.zygote"], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def boot(self, argv, log, netns=None):
        self.proc.stdin.write(json.dumps({"argv": argv, "log": log, **({"netns": netns} if netns else {})}) + "\n")
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
                                              "command_bytes": 1024, "result_bytes": 16, "memory": 60000})
    principals = [secrets.token_bytes(16) for _ in range(CLIENTS)]
    grants = str(tmp_path / "grants.json")
    journal = tmp_path / "journal"
    sock_path = str(journal / "service.sock")
    log = tmp_path / "device.log"
    zygote = Zygote()
    rng = random.Random(1234)

    memory_principal = secrets.token_bytes(16)
    write_grants(grants, {**{p.hex(): ["shared_read", "shared_write"] for p in principals},
                          memory_principal.hex(): ["shared_read", "shared_write", "shared_manage"]})

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
    clients = [Client(p, sock_path, stop) for p in principals]
    memory_client = MemoryClient(memory_principal, sock_path, stop)
    pid = boot()
    for c in clients + [memory_client]:
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
                    seen = c.saved_so_far()
                    sample = seen[checked[c]:] + rng.sample(seen[:checked[c]], min(5, checked[c]))
                    for sequence, body in sample:
                        reply = read_receipt(verifier, c, body)
                        assert reply["status"] == 200 and reply["body"] == body, (sequence, reply)
                    checked[c] = len(seen)
        # the memory checks below need a saved publication: how far the memory client got between
        # kills depends on the machine's speed, so it goes on, with the device up, until it has one
        wait_for(lambda: memory_client.publications or not memory_client.is_alive(), 120,
                 what="the memory client's first publication")
        stop.set()
        for c in clients + [memory_client]:
            c.join(60)
            assert not c.is_alive() and not c.errors, c.errors
        with socket.socket(socket.AF_UNIX) as verifier:
            verifier.connect(sock_path)
            # memory: exactly the rows the inputs' saved receipts name, and one copy per publication
            m = memory_client
            for sequence, body in m.saved.items():
                reply = read_receipt(verifier, m, body)
                assert reply["status"] == 200 and reply["body"] == body or \
                    json.loads(body)["kind"] == "conversation.input", (sequence, reply)  # inputs end later
            retained = []
            for op in m.inputs:
                receipt = json.loads(call(verifier, {"v": 1, "id": 0, "op": "operations.get",
                                                     "principal": m.principal.hex(), "args": {"operation": op}})["body"])
                retained += receipt["memory"]["retained"]
            private, room = memory_objects(verifier, m.principal, m.space), memory_objects(verifier, m.principal, m.room)
            assert len(private) == len(set(private)) and sorted(private) == sorted(retained)
            assert len(room) == len(set(room)) and room == m.publications
            assert m.inputs and m.publications
            for c in clients:
                for sequence, body in c.saved.items():
                    reply = read_receipt(verifier, c, body)
                    assert reply["status"] == 200 and reply["body"] == body
                me = json.loads(call(verifier, {"v": 1, "id": 0, "op": "participant.get",
                                                "principal": c.principal.hex(), "args": {}})["body"])
                assert me["next_sequence"] == str(max(c.saved) + 1)
                spaces = list_spaces(verifier, c.principal)
                assert len(spaces) == len({s["id"] for s in spaces}) == len(c.saved) - 1
        total = sum(len(c.saved) for c in clients)
        retries = sum(c.retries for c in clients)
        print(f"{KILLS} kills, {total} saved receipts, {retries} client retries, {len(m.inputs)} inputs, "
              f"{len(m.publications)} publications")
        assert total > KILLS and retries > 0
    finally:
        stop.set()
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        zygote.close()
