"""Leadership through etcd (docs/replication.md, "Leadership"): the primary holds a key under an
etcd lease and admits nothing once it cannot be sure the lease still holds.

`Leadership.campaign` grants a lease of `ttl` seconds and creates the key (a transaction: only if
no one holds it) with this primary's description as its value; the key's create revision is the
leadership's generation (etcd's revisions only grow, so every later primary has a higher one).
A thread (`aotx-lease`) renews the lease every third of its TTL. `fenced()` is what the device
asks before each admission: the lease is trusted until `margin` seconds before it could have
expired, counted from when the last renewal that succeeded was sent (the monotonic clock: a
process stopped past that point — SIGSTOP, a long pause — is fenced the moment it runs again,
before any renewal). etcd expires the lease at the earliest `ttl` seconds after that renewal
reached it, so the primary stops admitting at least `margin` seconds before any standby can
create the key.

etcd is spoken to through its JSON gateway (`POST /v3/...`, etcd 3.4 and later) with the
standard library: nothing to install beside etcd itself.
"""
from __future__ import annotations

import base64
import json
import logging
import threading
import time
import urllib.request
from typing import Any, Iterator

log = logging.getLogger("gpu_worker.replication")

REQUEST_SECONDS = 1.0  # one etcd request's bound (each endpoint in turn)


class LeadershipError(Exception):
    """etcd could not be reached, or another primary holds the key."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class Etcd:
    """The few etcd v3 calls leadership needs, over the JSON gateway, trying each endpoint in turn."""

    def __init__(self, endpoints: list[str]) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        failures = []
        for endpoint in self.endpoints:
            request = urllib.request.Request(endpoint + path, data, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as response:
                    answer = json.loads(response.read())
            except (OSError, ValueError) as exc:  # (urllib.error.URLError is an OSError)
                failures.append(f"{endpoint}: {exc}")
                continue
            if not isinstance(answer, dict):
                failures.append(f"{endpoint}: not a JSON object")
                continue
            return answer
        raise LeadershipError("etcd unreachable: " + "; ".join(failures))

    def grant(self, ttl: int) -> str:
        answer = self.call("/v3/lease/grant", {"TTL": ttl})
        if "ID" not in answer:
            raise LeadershipError(f"etcd granted no lease: {answer}")
        return str(answer["ID"])

    def create(self, key: bytes, value: bytes, lease: str) -> tuple[bool, int, bytes]:
        """Create `key` under `lease` unless it exists: (created, its create revision, its value)."""
        k = _b64(key)
        answer = self.call("/v3/kv/txn", {
            "compare": [{"key": k, "target": "CREATE", "create_revision": "0"}],
            "success": [{"request_put": {"key": k, "value": _b64(value), "lease": lease}},
                        {"request_range": {"key": k}}],
            "failure": [{"request_range": {"key": k}}]})
        ranges = [r["response_range"] for r in answer.get("responses", []) if "response_range" in r]
        kvs = ranges[-1].get("kvs", []) if ranges else []
        if not kvs:
            raise LeadershipError(f"etcd answered the election without the key: {answer}")
        return bool(answer.get("succeeded")), int(kvs[0]["create_revision"]), base64.b64decode(kvs[0].get("value", ""))

    def keepalive(self, lease: str) -> int:
        """Renew `lease`: its TTL now (0: it has expired)."""
        answer = self.call("/v3/lease/keepalive", {"ID": lease})
        return int((answer.get("result") or {}).get("TTL") or 0)

    def revoke(self, lease: str) -> None:
        self.call("/v3/lease/revoke", {"ID": lease})

    def get(self, key: bytes) -> tuple[int, bytes] | None:
        """(create revision, value) of `key`, None when no one holds it."""
        return self.read(key)[1]

    def read(self, key: bytes) -> tuple[int, tuple[int, bytes] | None]:
        """The store's revision, and `key`'s (create revision, value) then (None: no one holds it)."""
        answer = self.call("/v3/kv/range", {"key": _b64(key)})
        kvs = answer.get("kvs") or []
        revision = int((answer.get("header") or {}).get("revision") or 0)
        return revision, (int(kvs[0]["create_revision"]), base64.b64decode(kvs[0].get("value", ""))) if kvs else None

    def watch(self, key: bytes, revision: int, quiet: float) -> Iterator[dict[str, Any]]:
        """The events on `key` from `revision` on, as etcd streams them, until the stream is quiet
        for `quiet` seconds or ends (then it returns: watch again from the last revision seen)."""
        body = json.dumps({"create_request": {"key": _b64(key), "start_revision": str(revision)}}).encode()
        failures = []
        for endpoint in self.endpoints:
            request = urllib.request.Request(endpoint + "/v3/watch", body, {"Content-Type": "application/json"})
            try:
                response = urllib.request.urlopen(request, timeout=quiet)
            except OSError as exc:
                failures.append(f"{endpoint}: {exc}")
                continue
            with response:
                while True:
                    try:
                        line = response.readline()
                    except TimeoutError:
                        return
                    except OSError as exc:
                        raise LeadershipError(f"etcd watch on {endpoint}: {exc}") from exc
                    if not line:
                        return
                    try:
                        result = json.loads(line).get("result") or {}
                    except (ValueError, AttributeError) as exc:
                        raise LeadershipError(f"etcd watch on {endpoint}: {line[:200]!r}") from exc
                    yield from result.get("events") or ()
        raise LeadershipError("etcd unreachable: " + "; ".join(failures))


class Leadership:
    """This primary's hold on the leader key (module docstring)."""

    def __init__(self, etcd: Etcd, key: bytes, ttl: int = 3, margin: float = 1.0,
                 clock: Any = time.monotonic) -> None:
        if not 0 < margin < ttl:
            raise ValueError(f"the margin ({margin}s) must be above 0 and below the lease's TTL ({ttl}s)")
        self.etcd, self.key, self.ttl, self.margin, self.clock = etcd, key, ttl, margin, clock
        self.lease = ""
        self.generation = 0          # the key's create revision while held
        self.trusted_until = 0.0     # the monotonic time after which nothing is admitted
        self.lost: str | None = None  # why the lease is gone for good (then fenced() says so)
        self._stop = threading.Event()  # stop()'s waker for the renewal thread
        self._thread: threading.Thread | None = None

    def campaign(self, value: bytes) -> int:
        """Take the key, or LeadershipError naming who holds it. The generation."""
        sent = self.clock()
        self.lease = self.etcd.grant(self.ttl)
        created, revision, holder = self.etcd.create(self.key, value, self.lease)
        if not created:
            self.etcd.revoke(self.lease)
            raise LeadershipError(f"another primary holds {self.key.decode()} (generation {revision}): "
                                  f"{holder.decode('utf-8', 'replace')}")
        self.generation = revision
        self.trusted_until = sent + self.ttl - self.margin
        self._thread = threading.Thread(target=self._renew, name="aotx-lease", daemon=True)
        self._thread.start()
        log.info("leadership: holding %s as generation %d (lease %s, %ds, fenced %.1fs before it could lapse)",
                 self.key.decode(), revision, self.lease, self.ttl, self.margin)
        return revision

    def fenced(self) -> str | None:
        """Why this primary must admit nothing now, None while its lease is trusted."""
        if self.lost is not None:
            return self.lost
        if self.clock() >= self.trusted_until:
            return (f"the leadership lease (generation {self.generation}) was not renewed in time; another "
                    "primary may hold it")
        return None

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            sent = self.clock()
            try:
                ttl = self.etcd.keepalive(self.lease)
            except LeadershipError as exc:
                log.warning("leadership: renewal failed: %s", exc)
                continue
            if ttl <= 0:
                self.lost = f"the leadership lease (generation {self.generation}) expired: another primary may hold it"
                log.error("leadership: %s; this device admits nothing more", self.lost)
                return
            self.trusted_until = max(self.trusted_until, sent + ttl - self.margin)

    def state(self) -> dict[str, Any]:
        fenced = self.fenced()
        return {"generation": self.generation, "lease_seconds": self.ttl, "fenced": fenced,
                "trusted_for": round(max(0.0, self.trusted_until - self.clock()), 3)}

    def stop(self) -> None:
        """Stop renewing and give the key up (a clean stop: a standby may take over at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self.lease:
            try:
                self.etcd.revoke(self.lease)
            except LeadershipError as exc:
                log.warning("leadership: could not revoke the lease (it expires by itself): %s", exc)


class LeaderWatch:
    """A look at the leader key that follows it through an etcd watch (`aotx-leader-watch`): the
    key is read, then watched from the revision read; a watch quiet for WATCH_SECONDS, or broken,
    is opened again the same way (nothing is missed: it starts where the read was). `on_holder` is
    called with the holder's (generation, value) each time it changes, and None when no one holds
    the key. Once it has seen the key held and then finds it gone (the primary's lease lapsed, or
    it stopped and gave the key up), `gone` is set and `then` is called (a standby takes over), and
    the watch ends if `then` was given. etcd unreachable is not "gone": the watch waits, and tries
    again every RETRY_SECONDS."""

    WATCH_SECONDS = 5.0
    RETRY_SECONDS = 0.5

    def __init__(self, etcd: Etcd, key: bytes, then: Any = None, on_holder: Any = None) -> None:
        self.etcd, self.key, self.then, self.on_holder = etcd, key, then, on_holder
        self.seen: int | None = None  # the generation it saw hold the key
        self.holder: tuple[int, bytes] | None = None
        self.gone = False
        self._stop = threading.Event()  # stop()'s waker (a watch in progress ends within WATCH_SECONDS)
        self._thread = threading.Thread(target=self._run, name="aotx-leader-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                revision, held = self.etcd.read(self.key)
                if self._saw(held):
                    return
                for event in self.etcd.watch(self.key, revision + 1, self.WATCH_SECONDS):
                    kv = event.get("kv") or {}
                    held = None if event.get("type") == "DELETE" else (
                        int(kv["create_revision"]), base64.b64decode(kv.get("value", "")))
                    if self._stop.is_set() or self._saw(held):
                        return
            except LeadershipError as exc:
                log.warning("leader watch: %s", exc)
                self._stop.wait(self.RETRY_SECONDS)

    def _saw(self, held: tuple[int, bytes] | None) -> bool:
        """Note who holds the key now: whether the watch ends (gone, and a `then` called)."""
        if held != self.holder:
            self.holder = held
            if self.on_holder is not None:
                self.on_holder(held)
        if held is not None:
            self.seen = held[0]
            return False
        if self.seen is None or self.gone:
            return False
        log.warning("leader watch: the key %s (generation %d) is gone", self.key.decode(), self.seen)
        self.gone = True
        if self.then is None:
            return False
        self.then()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.WATCH_SECONDS + 2 * REQUEST_SECONDS)
