"""Recovery measured as a user sees it (issue 53 §3): the wall time of a whole device process,

    python -m gpu_worker boot --ccir F --journal DIR --service-grants G --device cpu

from its start (Popen) to the line "device ready" it prints, then SIGTERM and a wait for its exit.
Everything a restart waits for is inside: the interpreter, the imports, the runtime file opened
and verified (every extent a device reads against its sha256, as boot does), the journal read and replayed, the
embedding and generation models loaded, the socket. Two cases of one state, a mixed journal of
--transfers transfers:

- replay: the runtime file holds no checkpoint, the boot replays every transfer;
- from a checkpoint: the same state after `python -m gpu_worker checkpoint` (offline, in a process
  of its own, timed apart), the journal tail only the transfers the boots themselves wrote since.

    .venv/bin/python bench/recovery.py [--transfers 20000] [--repeat 3] [--page-cache drop|fadvise|warm]
                                       [--versus COMMIT] [--seed 0] [--keep DIR | --from DIR]

Each tree's bytecode is written first (compileall, as `make setup` does: a shell with
PYTHONDONTWRITEBYTECODE would otherwise compile the device's modules at every boot). Each case is
booted --repeat times (default 3), each boot a fresh process, reported as the median
and the range. Beside each boot, where the time goes: the imports (a process that imports the
modules a boot of that tree imported before it was ready, found with python -X importtime in an
untimed first boot, timed the same way: from Popen to the line it prints once they are imported,
the interpreter's start and the imports), the device's load as the ready line reports it
(`recovered N transfers in S`: the Device's construction, checkpoint and journal read and applied,
the boot transfer saved), and the rest (verifying the runtime file, loading the models, torch's
check of the engine's operators, starting the loop).

The page cache, before every timed process (boots and imports): --page-cache drop (the default)
runs `sync` and `echo 3 > /proc/sys/vm/drop_caches`; where that file cannot be written the output
says why and it falls back to fadvise. --page-cache fadvise fsyncs the runtime file and every file
of the journal directory and evicts them (posix_fadvise POSIX_FADV_DONTNEED): those files are
cold, the Python files and libraries as the machine has them, and nothing of other processes is
evicted. --page-cache warm does nothing. The output says which it was.

The mixed journal is built in this process before any timed window, through a Device, its
committer run tick by tick as a served device runs it (`Committer.run_sync`: every transfer
written and saved by the device's own code), and the engine with the tiny packed model (pack_tiny)
running the inputs as a served device does, their lease, memory row, output and completion
transfers in the same ticks as the admissions. max(64, transfers / 500) principals register first;
then rounds in which every principal submits OPS_PER_ROUND (8) operations, drawn by these weights
(MIX), after which the round's inputs still running finish:

    spaces.create          36   private or room (half each), an id of its own
    conversations.create   24   in one of its spaces
    members.set            16   another principal's read or read+write rights on one of its rooms
                                (one in ten sets a pair it set before again: the row's rights change)
    input that runs         3   in one of its conversations, 4-12 words, 4-16 output tokens, 16
                                pages: LEASE (several inputs a lease), MEMORY (its source retained),
                                OUTPUT (its result bytes), COMPLETION
    cancelled input         1   an input and, right after it, its cancellation: it ends cancelled
                                at its lease or before (COMPLETION; no output, no memory row)
    retirements.record      1   retry floor at the principal's sequence halfway through the rounds
                                so far: earlier rounds' receipts freed (inputs folded into their
                                conversations' history), rows later admissions take again

(an operation its principal cannot make yet is a space or a conversation instead; about 1% of the
inputs end failed, 0 tokens: their prompt, with the memory recalled into it, does not fit their
pages, as on a served device). At 100k
transfers that is about 39% space creations, 25% conversations, 17% member rows, 3% admissions of
inputs that ran and 11% their LEASE, MEMORY, OUTPUT and COMPLETION transfers, 3% cancelled inputs
with their cancellations and completions, 1% retirements, 0.2% registrations; the exact counts per
kind are read back from the journal and printed. --transfers 1000000 builds in about ten minutes
on two cores (progress on stderr); --keep DIR keeps a copy of the built files, --from DIR boots a
copy of kept files instead of building.

--versus COMMIT boots a copy of the same built files with that commit's code too (a git worktree),
the boots of each case alternating between the trees, each tree checkpointing its own copy, and
prints the ratios. A commit that cannot boot the mixed journal is said so and dropped. Every copy
is booted once, untimed, before the timed boots (it makes the copy its journal's own: a restore,
with a grant file written again; every timed boot is then a restart).

bench/checkpoint.py builds its state with `build` (registrations and space creations of 64
principals: the journal this bench replayed before issue 53), kept below as it was.
"""
import argparse
import collections
import contextlib
import json
import os
import queue
import random
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import rfc8785

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not bench/: bench/http.py would shadow the standard library http

from bench.versus import worktree  # noqa: E402
from gpu_worker.device import Device  # noqa: E402
from gpu_worker.contract.grantfile import Grants  # noqa: E402
from gpu_worker.storage.filelayer import OsFileLayer  # noqa: E402
from gpu_worker.storage.journal import list_segments  # noqa: E402
from gpu_worker.pack import pack_tiny  # noqa: E402
from gpu_worker.storage.runtime_file import RuntimeFile  # noqa: E402
from tests.conftest import write_grants  # noqa: E402

PRINCIPALS = 64


def mutation(principal, lineage, sequence):
    key = secrets.token_hex(16)
    if sequence == 1:
        op, path, fields = "participant.register", "/aotx/v1/shared/participant", {}
    else:
        op, path, fields = "spaces.create", "/aotx/v1/shared/spaces", {"scope": "private"}
    body = {"schema": "aotx.shared.mutation.v1", "lineage": lineage, "operation_key": key,
            "sequence": str(sequence), **fields}
    return {"v": 1, "id": 0, "op": op, "principal": principal.hex(),
            "args": {"lineage": lineage, "operation_key": key, "sequence": sequence, **fields,
                     "canonical": rfc8785.dumps({"method": "POST", "path": path, "body": body})}}


def build(base, transfers, spare=(), command_bytes=512):
    """A runtime file and a journal of `transfers` transfers (64 principals' registrations and
    spaces), with room and grants for the `spare` principals (raw ids) too (bench/checkpoint.py's
    load); `command_bytes`: each receipt row's room for its command (these are about 210 bytes)."""
    runtime = str(base / "r.aotxccir")
    pack_tiny(runtime, shared=True, capacity={"participants": PRINCIPALS + len(spare), "spaces": transfers + 1,
                                              "receipts": transfers + len(spare) + 1, "command_bytes": command_bytes,
                                              "result_bytes": 16},
              journal_limits={"journal_file_cap_bytes": 1 << 40, "checkpoint_journal_bytes": 1 << 40})
    principals = [secrets.token_bytes(16) for _ in range(PRINCIPALS)]
    grants = str(base / "grants.json")
    write_grants(grants, {p.hex(): ["shared_read", "shared_write"] for p in [*principals, *spare]})
    journal = str(base / "journal")
    device = Device(RuntimeFile.open(runtime), journal, Grants(grants))
    lineages = [device.state.participants.lineage_of(p).hex() for p in principals]
    inbox = collections.deque()
    made, sequence = 1, 1  # the boot transfer
    while made < transfers:
        for p, lineage in zip(principals, lineages):
            if made + len(inbox) >= transfers:
                break
            inbox.append((None, mutation(p, lineage, sequence)))
        made += len(inbox)
        sequence += 1
        while inbox:
            device.committer.run_sync(inbox)
    journal_bytes = device.journal_bytes
    device.close()
    return runtime, journal, grants, journal_bytes


# ---- the mixed journal ------------------------------------------------------------------------

MIX = (("spaces.create", 36), ("conversations.create", 24), ("members.set", 16), ("input", 3),
       ("cancelled input", 1), ("retirements.record", 1))
OPS_PER_ROUND = 8          # each principal's operations per round (then the round's inputs run)
TRANSFERS_PER_PRINCIPAL = 500
BASE = "/aotx/v1/shared"
ACTIONS = ["shared_read", "shared_write", "shared_manage"]
WORDS = ("the quick brown fox jumps over a lazy dog while seven ravens watch from an old oak near the river "
         "bank and count every leaf that falls in autumn").split()


class _Principal:
    __slots__ = ("raw", "hex", "pid", "lineage", "lineage_raw", "seq", "floor", "marks", "spaces", "rooms",
                 "conversations", "members")

    def __init__(self, raw, pid, lineage):
        self.raw, self.hex, self.pid = raw, raw.hex(), pid
        self.lineage_raw, self.lineage = lineage, lineage.hex()
        self.seq, self.floor = 1, 1
        self.marks = []            # its next sequence at the start of each round
        self.spaces, self.rooms, self.conversations = [], [], []
        self.members = []          # (room, participant id) pairs it has set


class MixedBuilder:
    """Builds the mixed journal (the module docstring): a Device in this process, its committer
    run as a served device runs it, and an engine (the tiny packed model) for the inputs."""

    def __init__(self, base, transfers, seed=0, progress=True):
        from gpu_worker.contract import ids as public
        from gpu_worker.engine.engine import Engine
        from gpu_worker.loop.runner import Runner
        from gpu_worker import derived
        self.ids = public
        self.transfers, self.progress = transfers, progress
        self.rng = random.Random(seed)
        n = max(PRINCIPALS, transfers // TRANSFERS_PER_PRINCIPAL)
        self.runtime = str(base / "r.aotxccir")
        self.journal = str(base / "journal")
        self.grants = str(base / "grants.json")
        share = {name: weight / sum(w for _, w in MIX) for name, weight in MIX}
        slack = 1024
        pack_tiny(self.runtime, shared=True,
                  capacity={"participants": n + 1,
                            # (more than their share: an operation its principal cannot make yet is a space or
                            # a conversation instead)
                            "spaces": int(transfers * share["spaces.create"] * 1.25) + n + slack,
                            "conversations": int(transfers * share["conversations.create"] * 1.25) + n + slack,
                            "members": int(transfers * share["members.set"]) + slack,
                            "receipts": transfers + slack, "command_bytes": 512, "result_bytes": 256,
                            "memory": int(transfers * share["input"]) + slack, "history_bytes": 512},
                  runtime_profile={"deadline_ms": 3_600_000},
                  journal_limits={"journal_file_cap_bytes": 1 << 40, "checkpoint_journal_bytes": 1 << 40})
        raws = [self.rng.randbytes(16) for _ in range(n)]
        write_grants(self.grants, {raw.hex(): ACTIONS for raw in raws})
        self.device = Device(RuntimeFile.open(self.runtime), self.journal, Grants(self.grants))
        state = self.device.state
        self.principals = [_Principal(raw, public.participant_id(derived.participant(state.incarnation, raw)),
                                      state.participants.lineage_of(raw)) for raw in raws]
        self.events = queue.SimpleQueue()
        self.runner = Runner(Engine(self.runtime, "cpu"), self.events.put)
        self.runner.start()
        self.device.runner = self.runner
        self.request = 0
        self.started = self.last_report = time.perf_counter()

    @property
    def made(self):
        return self.device.committer.writer.next_seq - 1

    def build(self):
        """Returns (runtime, journal, grants, journal bytes)."""
        try:
            self._round([self._mutation(p, "participant.register", "/participant", {}) for p in self.principals])
            while self.made < self.transfers:
                # about 1.15 transfers an operation: the last rounds shrink to land near the target
                budget = max(1, int((self.transfers - self.made) / 1.2))
                for p in self.principals:
                    p.marks.append(p.seq)
                messages = []
                for _ in range(OPS_PER_ROUND):
                    for p in self.principals:
                        if len(messages) >= budget:
                            break
                        messages += self._operation(p)
                self._round(messages)
            journal_bytes = self.device.journal_bytes
        finally:
            self.runner.stop()
            self.device.close()
        self._report(force=True)
        return self.runtime, self.journal, self.grants, journal_bytes

    def _report(self, force=False):
        now = time.perf_counter()
        if self.progress and (force or now - self.last_report >= 10):
            self.last_report = now
            print(f"  built {self.made:,} of {self.transfers:,} transfers ({now - self.started:.0f} s)",
                  file=sys.stderr, flush=True)

    def _round(self, messages):
        """Admit the messages in ticks (every one must be admitted) while the engine runs the
        inputs admitted (their transfers go into the same ticks, as on a served device), then wait
        for the inputs still running: each ends with its saved completion (a cancelled one at its
        lease), so the next round's retirements may retire everything before this one."""
        inbox = collections.deque((None, m) for m in messages)
        device, ex = self.device, self.device.executions
        committer = device.committer
        while True:
            got = self._engine_events()
            for _, msg in committer.run_sync(inbox):
                if msg.status not in (200, 202):
                    raise SystemExit(f"the mixed build was refused: {msg.status} {msg.body!r:.500}")
            if not inbox and not (ex.live or ex.to_lease or ex.leasing or ex.cancel_when_leased) \
                    and committer.all_saved:
                break
            if not inbox and not got:
                try:
                    device.engine_events(self.events.get(timeout=0.005))
                except queue.Empty:
                    pass
        self._report()

    def _engine_events(self):
        """Hand the engine's events to the device (as the served loop does between ticks)."""
        got = False
        while True:
            try:
                self.device.engine_events(self.events.get_nowait())
            except queue.Empty:
                return got
            got = True

    def _mutation(self, p, op, path, fields, extra=None):
        sequence = p.seq
        p.seq += 1
        key = self.rng.randbytes(16).hex()
        body = {"schema": "aotx.shared.mutation.v1", "lineage": p.lineage, "operation_key": key,
                "sequence": str(sequence), **fields}
        args = {**fields, "lineage": p.lineage, "operation_key": key, "sequence": sequence,
                "canonical": rfc8785.dumps({"method": "POST", "path": BASE + path, "body": body}), **(extra or {})}
        self.request += 1
        return {"v": 1, "id": self.request, "op": op, "principal": p.hex, "args": args}

    def _operation(self, p):
        """One operation of the mix for p (its messages: two for a cancelled input)."""
        rng = self.rng
        kind = rng.choices([name for name, _ in MIX], [weight for _, weight in MIX])[0]
        floor = p.marks[len(p.marks) // 2] if p.marks else 1
        if kind == "retirements.record" and floor <= p.floor:
            kind = "spaces.create"
        if kind in ("input", "cancelled input") and not p.conversations:
            kind = "conversations.create"
        if (kind == "conversations.create" and not p.spaces) or (kind == "members.set" and not p.rooms):
            kind = "spaces.create"
        if kind == "spaces.create":
            raw = rng.randbytes(16)
            scope = rng.choice(("private", "room"))
            space = self.ids.space_id(p.lineage_raw, raw)
            p.spaces.append(space)
            if scope == "room":
                p.rooms.append(space)
            return [self._mutation(p, kind, "/spaces", {"id": raw.hex(), "scope": scope})]
        if kind == "conversations.create":
            raw, space = rng.randbytes(16), rng.choice(p.spaces)
            p.conversations.append(self.ids.conversation_id(p.lineage_raw, raw))
            return [self._mutation(p, kind, f"/spaces/{space}/conversations", {"id": raw.hex()}, {"space": space})]
        if kind == "members.set":
            if p.members and rng.random() < 0.1:  # set again: the row's rights change
                space, who = rng.choice(p.members)
            else:
                space, who = rng.choice(p.rooms), p
                while who is p:
                    who = rng.choice(self.principals)
                who = who.pid
                p.members.append((space, who))
            permissions = rng.choice((["read"], ["read", "write"]))
            return [self._mutation(p, kind, f"/spaces/{space}/members",
                                   {"participant": who, "permissions": permissions}, {"space": space})]
        if kind == "retirements.record":
            p.floor = floor
            return [self._mutation(p, kind, "/retirements", {"retry_floor": str(floor)}, {"retry_floor": floor})]
        conversation = rng.choice(p.conversations)
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        fields = {"text": text, "model": "tiny-llama", "max_output_tokens": rng.randint(4, 16), "pages": 8}
        made = [self._mutation(p, "conversations.input", f"/conversations/{conversation}/inputs", fields,
                               {"conversation": conversation})]
        if kind == "cancelled input":
            target = made[0]["args"]["sequence"]
            made.append(self._mutation(p, "cancellations.record", "/cancellations",
                                       {"target_sequence": str(target)}, {"target_sequence": target}))
        return made


def build_mixed(base, transfers, seed=0, progress=True):
    """A runtime file and a mixed journal of about `transfers` transfers (the module docstring):
    (runtime, journal, grants, journal bytes)."""
    return MixedBuilder(base, transfers, seed, progress).build()


def journal_mix(runtime, journal):
    """Transfers per kind in the journal, admissions by their operation kind, read as a boot
    reads them (storage/journal_reader.py ReadAhead)."""
    from gpu_worker.kinds.kind import KIND_AT
    from gpu_worker.kinds.registry import KINDS
    from gpu_worker.state.tables import Finish
    from gpu_worker.storage.journal import TransferKind
    from gpu_worker.storage.journal_reader import ReadAhead
    incarnation = RuntimeFile.open(runtime, verify=False).incarnation
    counts = collections.Counter()
    reading = ReadAhead(journal, OsFileLayer(), incarnation)
    try:
        for piece in reading:
            for transfer in piece:
                if transfer.kind is TransferKind.ADMISSION:
                    counts[KINDS[transfer.payload[KIND_AT]].op] += 1
                else:
                    name = transfer.kind.name
                    if transfer.kind is TransferKind.COMPLETION:  # (how the input ended)
                        name += f" ({Finish(msgpack.unpackb(transfer.payload)[2]).name.lower()})"
                    counts[name] += 1
        reading.result()
    finally:
        reading.close()
    return counts


# ---- timed boots ------------------------------------------------------------------------------

def _files(runtime, journal):
    """The runtime file and every file under the journal directory."""
    out = [runtime]
    for folder, _, names in os.walk(journal):
        out += [os.path.join(folder, n) for n in names if n not in ("lock", "service.sock")]
    return out


def cold_cache(mode, runtime, journal):
    """Make the page cache cold for the next process (see the module docstring); what was done."""
    if mode == "warm":
        return "warm (nothing dropped)"
    why = None
    if mode == "drop":
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "dropped (sync; echo 3 > /proc/sys/vm/drop_caches)"
        except OSError as exc:
            why = f"drop_caches not writable: {exc.strerror or exc}"
    for path in _files(runtime, journal):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # (only clean pages leave the cache)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return ("fadvise: runtime file and journal files evicted (POSIX_FADV_DONTNEED), the Python files and "
            "libraries warm" + (f"; {why}" if why else ""))


_READY = re.compile(rb"recovered (\d+) transfers in ([0-9.]+)s")
# a module boot imported itself (python -X importtime: the top level of its tree of imports)
_TOP_IMPORT = re.compile(rb"import time:\s+\d+ \|\s+\d+ \| (\S+)\n")
# imports the modules a boot imported before "device ready", in its order, says so, and exits
_IMPORTS = ("import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
            "print('imported', flush=True)\n")


def fresh_grants(grants):
    """The grant file written again as it is, now: a boot on a copy of the files (a restore)
    needs grants written after the file's last boot (docs/checkpoint.md); a restart takes it too."""
    write_grants(grants, {pid: sorted(a) for pid, a in Grants(grants).principals.items()})


def boot_process(tree, files, cache, importtime=False):
    """One boot with `tree`'s code: {"seconds" (Popen to "device ready"), "load" (the device's own
    figure), "recovered", "cache"}; with `importtime` (python -X importtime, not for a timed
    boot) also "modules", those it imported itself before it was ready."""
    runtime, journal, grants = files
    fresh_grants(grants)
    done = cold_cache(cache, runtime, journal)
    argv = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "gpu_worker", "boot",
            "--ccir", runtime, "--journal", journal, "--service-grants", grants, "--device", "cpu"]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output, ready = [], None
    try:
        for line in proc.stdout:
            output.append(line)
            if b"device ready" in line:
                ready = time.perf_counter() - started
                break
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=300)
    if ready is None:
        raise RuntimeError(f"the device exited {proc.returncode} before it was ready:\n"
                           + b"".join(output + [rest]).decode("utf-8", "replace")[-3000:])
    found = _READY.search(output[-1])
    modules = [m.group(1).decode() for line in output if (m := _TOP_IMPORT.match(line))]
    return {"seconds": ready, "recovered": int(found.group(1)) if found else None,
            "load": float(found.group(2)) if found else float("nan"), "cache": done,
            "modules": list(dict.fromkeys(modules))}


def imports_process(tree, files, cache, modules):
    """Seconds from Popen to the line a process prints once it has imported `modules` (what a boot
    imported before it was ready), after the same cache treatment as a boot (its exit, the
    interpreter tearing torch down, is not a boot's)."""
    cold_cache(cache, files[0], files[1])
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _IMPORTS, *modules], cwd=tree, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    line = proc.stdout.readline()
    seconds = time.perf_counter() - started
    _, err = proc.communicate(timeout=300)
    if line != b"imported\n" or proc.returncode:
        raise RuntimeError(f"the imports failed with {tree}:\n{err.decode('utf-8', 'replace')[-2000:]}")
    return seconds


def checkpoint_process(tree, files):
    """`python -m gpu_worker checkpoint` (offline) with `tree`'s code: its answer and seconds."""
    runtime, journal, _ = files
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gpu_worker", "checkpoint", "--ccir", runtime, "--journal", journal],
                          cwd=tree, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"the checkpoint with {tree} failed:\n{done.stderr[-3000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1].split(":", 1)[1])
    return {**answer, "seconds": seconds}


def alternating(places, repeat, cache):
    """Each tree's boots of its copy, in turns (a, b, a, b, ...), and its imports' times."""
    boots = {name: [] for name in places}
    imports = {name: [] for name in places}
    for _ in range(repeat):
        for name, (tree, files, modules) in places.items():
            boots[name].append(boot_process(tree, files, cache))
            imports[name].append(imports_process(tree, files, cache, modules))
    return boots, imports


def _spread(values, fmt="{:.2f}"):
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transfers", type=int, default=20_000, help="transfers of the mixed journal (about)")
    parser.add_argument("--repeat", type=int, default=3, help="boots of each case (median and range reported)")
    parser.add_argument("--page-cache", choices=("drop", "fadvise", "warm"), default="drop",
                        help="before each timed process: drop the whole page cache (falls back to fadvise where it "
                             "cannot), evict the runtime file and journal only, or nothing")
    parser.add_argument("--versus", metavar="COMMIT", help="also boot a copy of the same files with that commit's code")
    parser.add_argument("--seed", type=int, default=0, help="the mix's random choices")
    parser.add_argument("--keep", metavar="DIR", help="keep a copy of the built files in DIR (for --from)")
    parser.add_argument("--from", dest="source", metavar="DIR", help="boot a copy of files kept with --keep; no build")
    args = parser.parse_args()
    (ROOT / "var").mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-recovery-", dir=ROOT / "var")))
        trees = {"this": ROOT}
        if args.versus:
            other = worktree(stack, args.versus, work / "tree")
            trees = {args.versus: other, "this": ROOT}
        built = work / "built"
        if args.source:
            shutil.copytree(args.source, built)
            journal_bytes = sum(p.stat().st_size for p in (built / "journal").glob("*.journal"))
            print(f"booting a copy of {args.source}", file=sys.stderr)
        else:
            built.mkdir()
            print(f"building a mixed journal of about {args.transfers:,} transfers", file=sys.stderr, flush=True)
            started = time.perf_counter()
            *_, journal_bytes = build_mixed(built, args.transfers, args.seed)
            print(f"built in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
            if args.keep:
                shutil.copytree(built, args.keep, ignore=shutil.ignore_patterns("lock", "service.sock"))
        mix = journal_mix(str(built / "r.aotxccir"), str(built / "journal"))
        total = sum(mix.values())
        print(f"journal: {total:,} transfers, {journal_bytes / 2**20:.1f} MiB; per kind:")
        for name, count in mix.most_common():
            print(f"  {name:<22} {count:>10,} {count / total:>7.1%}")
        # each tree boots its own copy (its checkpoint is in its own format); the first boot of
        # each, untimed, makes the copy its journal's own (a restore): every timed boot is a restart
        places = {}
        for i, (name, tree) in enumerate(trees.items()):
            place = work / f"copy{i}"
            shutil.copytree(built, place, ignore=shutil.ignore_patterns("lock", "service.sock"))
            # its bytecode written, as `make setup` writes it (with PYTHONDONTWRITEBYTECODE set, as on
            # this machine's shells, every boot compiled the device's modules again)
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(tree) / "gpu_worker")], check=True)
            files = tuple(str(place / n) for n in ("r.aotxccir", "journal", "grants.json"))
            try:  # (and which modules it imports on its way: what the imports' process imports)
                first = boot_process(tree, files, "warm", importtime=True)
            except RuntimeError as exc:
                if name == "this":
                    raise
                print(f"{name} cannot boot this mixed journal, dropped: {str(exc).splitlines()[-1]}")
                continue
            places[name] = (tree, files, first["modules"])
        shutil.rmtree(built)
        rows = {}
        replays, replay_imports = alternating(places, args.repeat, args.page_cache)
        folded = {name: checkpoint_process(tree, files) for name, (tree, files, _) in places.items()}
        afters, after_imports = alternating(places, args.repeat, args.page_cache)
        for name, (_, files, _) in places.items():
            assert len(list_segments(files[1], OsFileLayer())) >= 1
            rows[name] = [("replay", replays[name], replay_imports[name]),
                          ("from checkpoint", afters[name], after_imports[name])]
    cache = next(iter(replays.values()))[0]["cache"]
    print(f"page cache before each timed process: {cache}")
    print(f"{args.repeat} boots of each case, each a fresh `python -m gpu_worker boot` process, median (range), "
          f"seconds from its start to \"device ready\":")
    print(f"{'code':>10} {'case':>16} {'replayed':>10} {'boot s':>20} {'imports s':>18} {'device load s':>18} "
          f"{'rest s':>7} {'replayed/s':>11}")
    for name, cases in rows.items():
        for case, boots, imports in cases:
            seconds = [b["seconds"] for b in boots]
            loads = [b["load"] for b in boots]
            rest = statistics.median(seconds) - statistics.median(imports) - statistics.median(loads)
            replayed = boots[-1]["recovered"]
            rate = f"{replayed / statistics.median(seconds):,.0f}" if case == "replay" else "-"
            print(f"{name:>10} {case:>16} {replayed:>10,} {_spread(seconds):>20} {_spread(imports):>18} "
                  f"{_spread(loads):>18} {rest:>7.2f} {rate:>11}")
        checkpoint = folded[name]
        print(f"{name:>10} checkpoint: folded {checkpoint.get('folded', 0):,} transfers, state "
              f"{checkpoint.get('state_bytes', 0) / 2**20:.1f} MiB, {checkpoint['seconds']:.2f} s (its own process)")
    if len(rows) == 2:
        (base, base_cases), (_, these) = rows.items()
        for (case, boots, _), (_, theirs, _) in zip(these, base_cases):
            ratio = statistics.median(b["seconds"] for b in boots) / statistics.median(b["seconds"] for b in theirs)
            print(f"{case}, this / {base}: {ratio:.3f}")


if __name__ == "__main__":
    main()
