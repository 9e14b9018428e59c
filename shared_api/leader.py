"""The gateway's way to the current primary device (gateway.json `"etcd"`: docs/replication.md,
"Gateways").

With several devices (a primary and its standby), the one that admits holds the leader key in
etcd, and the key's value names its machine and socket. A gateway follows only a primary on its own
machine (gateway.json "machine", the device's `boot --machine`): device sockets do not cross
machines, so each machine's gateway serves its own device, answers 503 while it is not the primary
(a standby's device serves no socket; a fenced one answers `not_primary`), and clients given every
gateway's URL move to the primary's (docs/replication.md, "Across machines"). Each gateway process follows the key through an etcd
watch (gpu_worker/replication/lease.py LeaderWatch, thread `aotx-leader-watch`): when another
device takes the key (a failover: a new generation), every device connection of the process is
closed and the next request connects to the new primary. What those connections carried is
answered 503 `device_connection_lost` (an exact retry gets the receipt, from whichever device
holds it); a request made while no one holds the key goes to the last primary known, and gets
a 503 the client retries as well. Without `"etcd"`, the gateway reaches `"socket"` alone.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
from typing import Callable

from gpu_worker.replication.lease import Etcd, LeaderWatch, LeadershipError

from .config import GatewayConfig

log = logging.getLogger("shared_api.leader")


class Leader:
    """The primary's socket as the leader key says (module docstring); `moved(socket)` is called
    on the watch's thread when a new primary holds the key."""

    def __init__(self, endpoints: str, key: str, fallback: str, moved: Callable[[str], None],
                 machine: str = "") -> None:
        self.key = key
        self.machine = machine or socket.gethostname()
        self.socket = fallback  # until the key names one: gateway.json's "socket"
        self.generation: int | None = None
        self.elsewhere: str | None = None  # the machine the primary is on, when not this one
        self._moved = moved
        etcd = Etcd([e for e in endpoints.split(",") if e])
        try:  # read once now (bounded by the etcd request timeout): the first requests go to the primary
            self._holder(etcd.read(key.encode())[1])
        except LeadershipError as exc:
            log.warning("leader key %s: %s; requests go to %s until etcd answers", key, exc, fallback)
        self._watch = LeaderWatch(etcd, key.encode(), on_holder=self._holder)
        self._watch.start()

    def _holder(self, held: tuple[int, bytes] | None) -> None:
        if held is None or held[0] == self.generation:
            return  # no one holds it (a failover under way): keep the last primary
        generation, value = held
        try:
            doc = json.loads(value)
            found = doc["socket"]
            if not isinstance(found, str) or not found:
                raise ValueError("not a socket path")
            machine = doc.get("machine") or doc.get("host")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("leader key %s (generation %d) names no device socket (%s): ignored", self.key,
                        generation, exc)
            return
        if machine != self.machine:  # the primary is on another machine: this one's device is not it
            log.warning("leader key %s: generation %d is on machine %s, not this gateway's (%s): requests are "
                        "answered 503 not_primary (clients move to that machine's gateway)", self.key, generation,
                        machine, self.machine)
            was_here = self.elsewhere is None and self.generation is not None
            self.generation, self.elsewhere = generation, str(machine)
            if was_here:  # what this machine's (deposed) device still holds is answered 503 at once
                self._moved(self.socket)
            return
        first, was = self.generation is None, self.socket
        self.socket, self.generation, self.elsewhere = found, generation, None
        if first:
            log.info("leader key %s: generation %d, the primary's socket %s", self.key, generation, found)
        else:  # a failover: worth the operator's eye
            log.warning("leader key %s: a new primary, generation %d, at %s (was %s): device connections moved",
                        self.key, generation, found, was)
            self._moved(found)

    def stop(self) -> None:
        self._watch.stop()


_current: tuple[int, tuple[str, str], Leader] | None = None  # this process's: (pid, (endpoints, key), leader)
_lock = threading.Lock()


class Elsewhere(Exception):
    """The leader key names a primary on another machine (its name is the message)."""


def socket_of(cfg: GatewayConfig, moved: Callable[[str], None]) -> str:
    """The device socket to use now under gateway config `cfg`: the leader key's primary with
    "etcd", else "socket"; Elsewhere when the key names a primary on another machine. The watch
    starts on first use in each process (a forked worker starts its own)."""
    global _current
    if not cfg.get("etcd"):
        return str(cfg["socket"])
    wanted = (cfg["etcd"], cfg["etcd_key"])
    with _lock:
        current = _current
        if current is None or current[0] != os.getpid() or current[1] != wanted:
            if current is not None and current[0] == os.getpid():
                current[2].stop()
            current = _current = (os.getpid(), wanted, Leader(cfg["etcd"], cfg["etcd_key"], cfg["socket"], moved,
                                                              cfg.get("machine", "")))
    if current[2].elsewhere is not None:
        raise Elsewhere(current[2].elsewhere)
    return current[2].socket


def elsewhere() -> str | None:
    """The machine the leader key names when it is not this gateway's (None: this one, or no etcd):
    read on every shared request, so that none goes to this machine's device while it is not the
    primary (a standby's serves nothing; a deposed one's state lags)."""
    current = _current
    return current[2].elsewhere if current is not None and current[0] == os.getpid() else None


def newest_generation() -> int:
    """The newest leadership generation this process's watch saw hold the key (0: none, or no
    etcd): a device reply of an older one is a deposed primary's (device_client refuses it)."""
    current = _current
    if current is None or current[0] != os.getpid():
        return 0
    return current[2].generation or 0


def stop() -> None:
    """Stop this process's watch (tests that point the gateway at another config: device_client.reset)."""
    global _current
    with _lock:
        current, _current = _current, None
    if current is not None and current[0] == os.getpid():
        current[2].stop()
