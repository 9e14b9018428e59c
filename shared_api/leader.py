"""The gateway's way to the current primary device (gateway.json `"etcd"`: docs/replication.md,
"Gateways").

With several devices (a primary and its standby), the one that admits holds the leader key in
etcd, and the key's value names its socket. Each gateway process follows the key through an etcd
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
import threading
from typing import Any, Callable

from gpu_worker.replication.lease import Etcd, LeaderWatch, LeadershipError

log = logging.getLogger("shared_api.leader")


class Leader:
    """The primary's socket as the leader key says (module docstring); `moved(socket)` is called
    on the watch's thread when a new primary holds the key."""

    def __init__(self, endpoints: str, key: str, fallback: str, moved: Callable[[str], None]) -> None:
        self.key = key
        self.socket = fallback  # until the key names one: gateway.json's "socket"
        self.generation: int | None = None
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
            found = json.loads(value)["socket"]
            if not isinstance(found, str) or not found:
                raise ValueError("not a socket path")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("leader key %s (generation %d) names no device socket (%s): ignored", self.key,
                        generation, exc)
            return
        first, was = self.generation is None, self.socket
        self.socket, self.generation = found, generation
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


def socket_of(cfg: dict[str, Any], moved: Callable[[str], None]) -> str:
    """The device socket to use now under gateway config `cfg`: the leader key's primary with
    "etcd", else "socket". The watch starts on first use in each process (a forked worker starts
    its own)."""
    global _current
    if not cfg.get("etcd"):
        return str(cfg["socket"])
    wanted = (cfg["etcd"], cfg["etcd_key"])
    with _lock:
        current = _current
        if current is None or current[0] != os.getpid() or current[1] != wanted:
            if current is not None and current[0] == os.getpid():
                current[2].stop()
            current = _current = (os.getpid(), wanted, Leader(cfg["etcd"], cfg["etcd_key"], cfg["socket"], moved))
    return current[2].socket


def stop() -> None:
    """Stop this process's watch (tests that point the gateway at another config: device_client.reset)."""
    global _current
    with _lock:
        current, _current = _current, None
    if current is not None and current[0] == os.getpid():
        current[2].stop()
