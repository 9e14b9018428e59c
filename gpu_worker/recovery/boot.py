"""`python -m gpu_worker boot --ccir F --journal DIR --service-grants G [--device cpu|cuda] [--tick-cpu N]
[--background-nice N] [--allow-uid UID ...] [--socket-group GROUP] [--stall-seconds S]
[--replicate ADDRESS [--replication sync|async] [--standby-timeout S]] [--etcd URLS [--etcd-key K]
[--lease-seconds S]] [--takeover]`, or `... --standby-of ADDRESS` (a standby:
docs/replication.md)."""
import argparse
import gc
import glob
import grp
import json
import logging
import os
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING, Callable, NamedTuple

from ..contract.grantfile import GrantFileError, Grants
from ..loop.threads import DEFAULT_NICE, keep_off_the_tick_cpu
from ..loop.watchdog import STALL_SECONDS

if TYPE_CHECKING:
    from ..device import Device
    from ..engine.engine import Engine
    from ..replication.lease import Etcd, LeaderWatch, Leadership
    from ..storage.runtime_file import RuntimeFile
    from ..storage.runtime_file_lock import FileLock


def _tables_on_the_cpu(choice: str) -> bool:
    """Whether --device puts the tables on the CPU, told before torch is imported: cpu, or auto
    on a machine with no NVIDIA device node (torch then finds no CUDA device either)."""
    return choice == "cpu" or (choice == "auto" and not glob.glob("/dev/nvidia[0-9]*"))


def _device_name(choice):
    import torch
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("boot: --device cuda requested but no CUDA device is available")
    return choice


def _other_cpus(tick_cpu):
    """The CPUs left to the device's other threads when the tick loop takes CPU tick_cpu; a
    ValueError saying why it cannot."""
    allowed = os.sched_getaffinity(0)
    if tick_cpu not in allowed:
        raise ValueError(f"--tick-cpu {tick_cpu} is not among the CPUs this process may use "
                         f"({','.join(map(str, sorted(allowed)))})")
    if len(allowed) < 2:
        raise ValueError("--tick-cpu needs at least two CPUs: the tick loop takes one, the device's other "
                         "threads the rest")
    return allowed - {tick_cpu}


PRIVATE = 0o077  # files the device creates (journal, media, owner marker, checkpoints) are its own alone


def main(argv):
    os.umask(PRIVATE)  # the journal holds the inputs' text in clear: nobody else reads it
    parser = argparse.ArgumentParser(prog="python -m gpu_worker boot")
    parser.add_argument("--ccir", required=True, help="the complete runtime file")
    parser.add_argument("--journal", required=True, help="journal directory (holds service.sock)")
    parser.add_argument("--service-grants", required=True, help="deployment grant file written by the gateway")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--tick-cpu", type=int, metavar="N",
                        help="run the tick loop alone on CPU N and every other thread of the device on the "
                             "remaining CPUs (docs/architecture.md, 'Threads and CPUs')")
    parser.add_argument("--background-nice", type=int, default=DEFAULT_NICE, metavar="N",
                        help="the nice value of the engine, torch's workers and the helper threads, above the "
                             f"tick loop's (default {DEFAULT_NICE}; 0 keeps them level with it): "
                             "docs/architecture.md, 'Threads and CPUs'")
    parser.add_argument("--allow-uid", type=int, action="append", default=[], metavar="UID",
                        help="a uid besides the device's own that may connect to service.sock (repeatable)")
    parser.add_argument("--socket-group", metavar="GROUP",
                        help="make service.sock mode 0660 with this group (name or gid) and accept peers whose "
                             "primary gid it is; without it the socket is 0600, the device's user only")
    parser.add_argument("--stall-seconds", type=float, default=STALL_SECONDS, metavar="S",
                        help="the stall watchdog logs the pipeline's state and every thread's stack when commands "
                             f"or replies have waited this long with no progress (default {STALL_SECONDS:g}; "
                             "docs/architecture.md, 'Who wakes whom')")
    parser.add_argument("--replicate", metavar="ADDRESS",
                        help="ship the journal to a standby that connects here (a Unix socket path, or HOST:PORT): "
                             "docs/replication.md")
    parser.add_argument("--replication", choices=("sync", "async"), default="sync",
                        help="with --replicate: sync (default) counts a transfer saved only once the standby holds "
                             "it too; async answers from the local fdatasync alone (a failover may lose the tail)")
    parser.add_argument("--standby-timeout", type=float, metavar="S",
                        help="with --replication sync: after S seconds without a standby, save transfers here alone "
                             "(as async) until a standby has caught up; without it the primary holds: it answers no "
                             "mutation until a standby holds it")
    parser.add_argument("--standby-of", metavar="ADDRESS",
                        help="run as a standby: keep --journal a byte-for-byte copy of the primary's journal at "
                             "ADDRESS (its --replicate; several, comma-separated: every machine's, and the standby "
                             "follows whichever is the primary), until SIGTERM; --ccir is a copy of the primary's "
                             "runtime file")
    parser.add_argument("--etcd", metavar="URLS",
                        help="etcd client URLs, comma-separated: a serving device holds the leader key under a lease "
                             "and admits nothing once it may have lapsed; a standby takes over by itself when the "
                             "key it saw held is gone (docs/replication.md, 'Leadership')")
    parser.add_argument("--etcd-key", default="/aotx/primary", help="the leader key (default /aotx/primary)")
    parser.add_argument("--lease-seconds", type=int, default=3, metavar="S",
                        help="the leader lease's TTL (default 3); admissions stop 1 s before it could lapse")
    parser.add_argument("--link-tls", metavar="DIR",
                        help="the replication link's TLS: DIR holds ca.pem, cert.pem and key.pem (python -m "
                             "gpu_worker link-tls makes them); required for a HOST:PORT link, which crosses machines")
    parser.add_argument("--link-timeout", type=float, default=None, metavar="S",
                        help="a replication link with no frame for S seconds is dead (default 3: the primary beats "
                             "every third of it, the standby answers each beat)")
    parser.add_argument("--machine", default=socket.gethostname(), metavar="NAME",
                        help="this device's machine in the leader key (default: the host name): gateways follow a "
                             "primary on their own machine only (gateway.json \"machine\")")
    parser.add_argument("--takeover", action="store_true",
                        help="boot a sync standby's journal as the primary's successor: the same line of history "
                             "(participants keep their lineages), not a restore")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s device %(levelname)s %(message)s")

    def fail(message, code=2):
        print(f"boot: {message}", file=sys.stderr, flush=True)
        return code

    if not 0 <= args.background_nice <= 19:
        return fail(f"--background-nice {args.background_nice}: a nice value is 0..19")
    if not 0 < args.stall_seconds < float("inf"):
        return fail(f"--stall-seconds {args.stall_seconds}: a number of seconds above 0")

    socket_group = None
    if args.socket_group is not None:
        try:
            socket_group = int(args.socket_group) if args.socket_group.isdigit() else grp.getgrnam(args.socket_group).gr_gid
        except KeyError:
            return fail(f"--socket-group {args.socket_group}: no such group")

    tick_cpu, other_cpus = args.tick_cpu, set()
    if tick_cpu is not None:
        # Threads inherit the affinity of the thread that creates them: this one takes the other
        # CPUs now, before torch is loaded, so everything it starts (native I/O threads, engine,
        # torch's workers) keeps to them; it moves to its own CPU once they run (ready(), below).
        try:
            other_cpus = _other_cpus(tick_cpu)
        except ValueError as exc:
            return fail(str(exc))
        os.sched_setaffinity(0, other_cpus)
        keep_off_the_tick_cpu(other_cpus)

    threads = _Threads(socket_group, tick_cpu, other_cpus)
    from . import DeviceBootError
    from ..storage.journal import JournalError
    from ..storage.runtime_file import RuntimeFileError

    from ..replication import DEAD_SECONDS
    if args.link_timeout is None:
        args.link_timeout = DEAD_SECONDS
    if not 0 < args.link_timeout < float("inf"):
        return fail(f"--link-timeout {args.link_timeout}: a number of seconds above 0")
    if args.link_tls is not None:
        from ..replication.tls import context
        try:
            args.link_server, args.link_client = context(args.link_tls, True), context(args.link_tls, False)
        except (ValueError, OSError) as exc:
            return fail(f"--link-tls {args.link_tls}: {exc}")
    else:
        args.link_server = args.link_client = None
    for option, addresses in (("--replicate", args.replicate), ("--standby-of", args.standby_of)):
        address = next((a for a in (addresses or "").split(",") if a and "/" not in a), None)
        if address is not None and args.link_tls is None:
            return fail(f"{option} {address}: a link over TCP crosses machines and needs --link-tls DIR "
                        "(python -m gpu_worker link-tls makes the certificates)")
    if args.standby_timeout is not None and not (args.replicate and args.replication == "sync"
                                                 and 0 <= args.standby_timeout < float("inf")):
        return fail("--standby-timeout S: seconds (0 or more) for a primary with --replicate and sync replication")
    if args.lease_seconds < 2:
        return fail(f"--lease-seconds {args.lease_seconds}: at least 2 (admissions stop 1 s before it could lapse)")
    if args.standby_of is not None:
        if args.takeover:
            return fail("--standby-of follows a primary: --takeover is for a journal a standby kept (a standby "
                        "takes over by itself on SIGUSR1, or with --etcd when the leader key is gone)")
        return _standby(args, argv, threads, fail)

    opened = _open_runtime(args, fail, beside=True)
    if isinstance(opened, int):
        return opened
    grants, runtime_lock, runtime = opened
    try:
        leadership = None
        if args.etcd is not None:  # leadership first: a takeover records its generation, nothing is admitted without
            from ..replication.lease import LeadershipError
            try:
                leadership = _campaign(args)
            except LeadershipError as exc:
                return fail(str(exc), 5)
        early = None
        try:
            os.makedirs(args.journal, exist_ok=True)
            # the journal locked and its reading started before torch is imported (with the
            # device's code, next): the reader checks and decodes the journal on another CPU
            # meanwhile, beside the runtime file's verification, and a child process fills the
            # checkpoint's tables (recovery/reading.py, preload.py); the child is forked before
            # this process starts any thread, the verification's included. The child and the
            # verification run at the background threads' nice value: the imports, which the
            # load waits for first, keep their CPU when the machine has few
            from .reading import start
            try:
                early = start(runtime, args.journal, fill=_tables_on_the_cpu(args.device), nice=args.background_nice)
            except BaseException:
                runtime.start_verify()
                runtime.verified()  # (a file that fails its check explains a state it cannot read: that first)
                raise
            runtime.start_verify(args.background_nice)
            from ..device import Device
            device = Device(runtime, args.journal, grants, device=_device_name(args.device), takeover=args.takeover,
                            leadership=leadership, early=early)
        except (DeviceBootError, RuntimeFileError) as exc:  # configuration: profile, grants, file
            if early is not None:
                early.close()
            if leadership is not None:
                leadership.stop()
            return fail(str(exc), 2)
        except (JournalError, OSError) as exc:  # the journal refused: locked, damaged, unreadable
            if early is not None:
                early.close()
            if leadership is not None:
                leadership.stop()
            return fail(str(exc), 3)
        return _serve(args, runtime, device, leadership, None, threads, fail)
    finally:
        runtime_lock.release()


def _open_runtime(args: argparse.Namespace, fail: Callable[..., int],
                  beside: bool = False) -> "tuple[Grants, FileLock, RuntimeFile] | int":
    """The grant file, the runtime file's writer lock and the file (a device, and a standby that
    may become one), or boot's exit code once `fail` said why. The device is the file's one writer
    (its checkpoints append to it; a standby's copy takes the primary's) for as long as it runs: a
    second device or a pack on it refuses. The caller releases the lock. `beside`: the file's
    extents are checked on a thread while the device loads (`RuntimeFile.start_verify`; the
    Device waits for the answer before it journals or serves; the caller starts it), else before
    this returns."""
    from ..storage.runtime_file import RuntimeFile, RuntimeFileError
    from ..storage.runtime_file_lock import FileLock, RuntimeFileLocked
    try:
        grants = Grants(args.service_grants)
    except GrantFileError as exc:
        return fail(str(exc))
    try:
        runtime_lock = FileLock(args.ccir)
    except RuntimeFileLocked as exc:
        return fail(str(exc), 3)
    except RuntimeFileError as exc:
        return fail(f"cannot open runtime file {args.ccir}: {exc}")
    try:
        runtime = RuntimeFile.open(args.ccir, verify=not beside)
    except (OSError, RuntimeFileError) as exc:
        runtime_lock.release()
        return fail(f"cannot open runtime file {args.ccir}: {exc}")
    if runtime.inode != runtime_lock.inode:
        runtime_lock.release()
        return fail(f"runtime file {args.ccir} was replaced while the device opened it; boot again", 3)
    return grants, runtime_lock, runtime


class _Threads(NamedTuple):
    """Where the serving device's socket and threads go (--socket-group, --tick-cpu)."""
    socket_group: int | None
    tick_cpu: int | None
    other_cpus: set[int]


def _campaign(args: argparse.Namespace, etcd: "Etcd | None" = None) -> "Leadership":
    """Take the leader key (--etcd): the Leadership, or LeadershipError (another primary holds it,
    etcd unreachable). The key's value says where this device serves (gateways follow it). `etcd`:
    the client a standby used so far (it knows which members answer)."""
    from ..replication.lease import Etcd, Leadership
    leadership = Leadership(etcd or Etcd(args.etcd.split(",")), args.etcd_key.encode(), ttl=args.lease_seconds)
    leadership.campaign(json.dumps({"host": socket.gethostname(), "machine": args.machine, "pid": os.getpid(),
                                    "journal": args.journal,
                                    "socket": os.path.abspath(os.path.join(args.journal, "service.sock")),
                                    "replicate": args.replicate}).encode())
    return leadership


def _serve(args: argparse.Namespace, runtime: "RuntimeFile", device: "Device", leadership: "Leadership | None",
           engine: "Engine | None", threads: _Threads,
           fail: Callable[..., int]) -> int:
    """Serve `device` on DIR/service.sock until SIGTERM: the replication shipper (--replicate), the
    engine runner (`engine` when a hot standby loaded it already), then the loop. Stops the
    device, the shipper and the leadership when it ends."""
    from ..loop.server import Server
    from ..storage.journal import JournalError
    from ..storage.runtime_file import RuntimeFileError
    tick_cpu = threads.tick_cpu
    socket_path = os.path.join(args.journal, "service.sock")
    shipper = None
    if args.replicate is not None:
        from ..replication.primary import Shipper
        try:
            shipper = Shipper(args.replicate, args.journal, device.runtime.path, sync=args.replication == "sync",
                              alone_after=args.standby_timeout, leadership=leadership, dead_after=args.link_timeout,
                              tls=args.link_server)
        except (OSError, ValueError, RuntimeFileError) as exc:
            device.close()
            if leadership is not None:
                leadership.stop()
            return fail(f"--replicate {args.replicate}: {exc}")
    server = Server(device, socket_path, allow_uids=tuple(args.allow_uid), socket_group=threads.socket_group,
                    stall_seconds=args.stall_seconds, replica=shipper)
    device.deliver = server.deliver  # other threads' results come back through the loop
    device.background_nice = args.background_nice
    try:
        from ..engine.engine import Engine
        from ..loop.runner import Runner
        runner = device.runner = Runner(engine or Engine(runtime, device.state.tables.device.type), server.deliver,
                                        nice=args.background_nice)
        runner.engine.pacer.rate_of = device.token_rate  # output tokens per second (grant file)
    except Exception as exc:  # a runtime whose model cannot load serves no inputs: say why, stop
        device.close()
        if shipper is not None:
            shipper.close()
        if leadership is not None:
            leadership.stop()
        return fail(f"cannot load the generation model of {args.ccir}: {exc}", 2)

    def ready():
        runner.start()  # after the loop exists: its events come back through the loop
        if tick_cpu is not None:
            os.sched_setaffinity(0, {tick_cpu})  # this thread only (Linux: affinity is per thread)
        # What boot built (torch, the model, the indexes) lives as long as the process: keep it out
        # of the cyclic GC's full collections, which would otherwise scan all of it every few
        # thousand admissions (docs/architecture.md, "The device's memory"; docs/performance.md)
        gc.freeze()
        print(f"device ready: socket {socket_path} boot {device.state.boot} recovered {device.recovered} "
              f"transfers in {device.boot_seconds:.3f}s on {device.state.tables.device}"
              + (f"; {device.dropped}" if device.dropped else "")
              + (f"; tick loop on CPU {tick_cpu}, other threads on CPUs {','.join(map(str, sorted(threads.other_cpus)))}"
                 if tick_cpu is not None else ""), flush=True)

    try:
        server.run(on_ready=ready)
    except JournalError as exc:
        return fail(f"stopped on journal error, restart to recover: {exc}", 1)
    finally:
        device.runner.stop()
        device.close()
        if shipper is not None:
            shipper.close()
        if leadership is not None:
            leadership.stop()  # the key goes at once: a standby need not wait for the lease
    return 0


def _standby(args: argparse.Namespace, argv: list[str], threads: _Threads, fail: Callable[..., int]) -> int:
    """`boot --standby-of`: a hot standby (gpu_worker/replication/ standby.py, mirror.py and
    follower.py). Its device loads the tables from its journal and the model, then follows the
    primary: the journal copy grows and the tables apply it, until SIGTERM or SIGINT (stop), or
    SIGUSR1 (take over now, as `boot --takeover` would), or, with --etcd, until the leader key this
    standby saw held is gone (take over and hold the key). A takeover serves in this process at
    once: the tables and the model are ready. Should applying the copy have failed, this process
    becomes `boot --takeover` of its journal instead (a boot that reads it again)."""
    from ..device import Device
    from . import DeviceBootError
    from ..engine.engine import Engine
    from ..replication.follower import Follower
    from ..replication.marker import read_mark
    from ..replication.mirror import Mirror, StandbyDiskError
    from ..replication.standby import Standby, StandbyRefused
    from ..storage.journal import JournalError
    from ..storage.journal_lock import JournalLock
    from ..storage.runtime_file import RuntimeFileError

    opened = _open_runtime(args, fail)
    if isinstance(opened, int):
        return opened
    grants, runtime_lock, runtime = opened
    try:
        try:
            os.makedirs(args.journal, exist_ok=True)
            lock = JournalLock(args.journal)
        except (JournalError, OSError) as exc:
            return fail(str(exc), 3)
        try:
            device = Device(runtime, args.journal, grants, device=_device_name(args.device), following=True)
            assert device.following is not None
            mirror = Mirror(args.journal, runtime.incarnation, lock=lock, position=device.following.position,
                            fs=device.fs)
        except (DeviceBootError, RuntimeFileError) as exc:
            lock.release()
            return fail(str(exc), 2)
        except (JournalError, OSError) as exc:
            lock.release()
            return fail(str(exc), 3)
        try:
            engine = Engine(runtime, device.state.tables.device.type)  # loaded now: a takeover serves at once
        except Exception as exc:  # as boot: a runtime whose model cannot load serves no inputs
            mirror.close()
            return fail(f"cannot load the generation model of {args.ccir}: {exc}", 2)
        follower = Follower(device, mirror.position)
        standby = Standby(args.standby_of, mirror, args.ccir, follower, dead_after=args.link_timeout,
                          tls=args.link_client)
        promote = threading.Event()
        etcd = None
        if args.etcd is not None:  # one client for the watch, the checks and the campaign: it learns who answers
            from ..replication.lease import Etcd
            etcd = Etcd(args.etcd.split(","))

        def not_promotable(generation: int | None) -> str | None:
            """Why this standby may not take over now (None: it may): its journal must be in sync
            (it holds every transfer the primary saved), and, when etcd's leader key of
            `generation` went, the sync key must name it (the primary saved nothing alone since)."""
            kept = read_mark(args.journal)
            if kept != "sync":
                return (f"its journal is {kept or 'not'} in sync (DIR/standby): it may lack saved transfers "
                        "(a catching-up standby holds them only once it has acknowledged what the primary had "
                        "saved when it connected)")
            if generation is not None and etcd is not None:
                from ..replication.lease import may_promote
                return may_promote(etcd, args.etcd_key.encode(), generation, standby.member)
            return None

        def take_over_now(generation: int | None = None) -> bool:
            why = not_promotable(generation)
            if why is not None:
                print(f"standby: not taking over: {why}", flush=True)
                return False
            promote.set()
            standby.stop()
            return True

        previous = {sig: signal.signal(sig, lambda *_: standby.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda *_: take_over_now())
        watch = None

        def watching() -> "LeaderWatch | None":
            if etcd is None:
                return None
            from ..replication.lease import LeaderWatch

            def holder(held: tuple[int, bytes] | None) -> None:  # a new primary: its link's address
                if held is not None:
                    try:
                        standby.prefer(json.loads(held[1]).get("replicate"))
                    except (ValueError, AttributeError):
                        pass
            started = LeaderWatch(etcd, args.etcd_key.encode(), take_over_now, holder)
            started.start()
            return started

        follower.start()
        print(f"standby ready: journal {args.journal} at {mirror.position}, {device.recovered} transfers applied, "
              f"following {args.standby_of}", flush=True)
        try:
            while True:
                watch = watching()
                try:
                    standby.run()
                finally:
                    if watch is not None:
                        watch.stop()
                if not promote.is_set():
                    break
                # the journal was in sync when the takeover was decided; a rewind may have come since
                why = not_promotable(None)
                if why is None:
                    break
                print(f"standby: not taking over after all: {why}; following again", flush=True)
                promote.clear()
                standby.resume()
        except StandbyRefused as exc:
            mirror.close()
            return fail(str(exc), 4)
        except StandbyDiskError as exc:
            mirror.close()
            return fail(f"{exc}: stopped, acknowledging nothing more (restart it once the disk is sound)", 6)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        until = mirror.sync()
        print(f"standby stopped: journal {args.journal} at {until}", flush=True)
        if not promote.is_set():
            mirror.close()
            return 0
        hot = follower.finish(until)
        mirror.close(keep_lock=hot)
        if not hot:
            runtime_lock.release()
            takeover = _without(argv, "--standby-of") + ["--takeover"]
            print(f"standby: taking over by a boot from the journal ({follower.error})", flush=True)
            os.execv(sys.executable, [sys.executable, "-m", "gpu_worker", "boot", *takeover])
        print("standby: taking over" + (f": the leader key {args.etcd_key} is gone" if watch is not None else ""),
              flush=True)
        leadership = None
        if args.etcd is not None:
            from ..replication.lease import LeadershipError
            try:
                leadership = _campaign(args, etcd)
            except LeadershipError as exc:
                lock.release()
                return fail(str(exc), 5)
        try:
            device.take_over(lock, leadership, until)
        except DeviceBootError as exc:
            if leadership is not None:
                leadership.stop()
            return fail(str(exc), 2)
        except (JournalError, OSError) as exc:
            if leadership is not None:
                leadership.stop()
            return fail(str(exc), 3)
        return _serve(args, runtime, device, leadership, engine, threads, fail)
    finally:
        runtime_lock.release()


def _without(argv: list[str], option: str) -> list[str]:
    """argv without `option` and its value (`--x V` or `--x=V`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out
