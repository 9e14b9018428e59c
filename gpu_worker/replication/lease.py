"""Leadership through etcd (docs/replication.md, "Leadership"): the primary holds a key under an
etcd lease and admits nothing once it cannot be sure the lease still holds.

`Leadership.campaign` grants a lease of `ttl` seconds and creates the key (a transaction: only if
no one holds it) with this primary's description as its value; the key's create revision is the
leadership's generation (etcd's revisions only grow, so every later primary has a higher one).
A thread (`aotx-lease`) renews the lease every sixth of its TTL (RENEWALS: the key lapses no more
than a TTL after a primary is gone, less a sixth on average). `fenced()` is what the device
asks before each admission: the lease is trusted until `margin` seconds before it could have
expired, counted from when the last renewal that succeeded was sent (CLOCK_BOOTTIME, which goes
on while the machine is suspended, unlike CLOCK_MONOTONIC: a process stopped or suspended past
that point — SIGSTOP, a long pause, a suspended VM — is fenced the moment it runs again, before
any renewal). etcd expires the lease at the earliest `ttl` seconds after that renewal reached it,
so the primary stops admitting at least `margin` seconds before any standby can create the key.

The key can also go without the lease lapsing: `etcdctl del` (an operator's forced failover), an
etcd restore. The primary watches its own key (`aotx-own-key`, and reads it after each renewal):
the moment it is gone or names another generation, the primary is fenced for good.

The **sync key** (`KEY/sync`, as Patroni's `/sync`) says which standby holds every transfer the
primary saved: `{"leader": generation, "standby": member or null}`. The primary writes it with a
compare-and-swap on its own leadership (the leader key's create revision): null at its campaign and
before it saves anything alone (`--standby-timeout`), a standby's member once it is in sync. A
standby takes over by itself only when the key it saw held is gone *and* the sync key names it
under that generation (`may_promote`): a deposed primary cannot write the sync key, so it stays as
the last leader left it.

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
from typing import Any, Callable, Iterator

log = logging.getLogger("gpu_worker.replication")

REQUEST_SECONDS = 1.0  # one etcd request's bound (each endpoint in turn)
RENEWALS = 6  # lease renewals per TTL


def boottime() -> float:
    """Seconds on CLOCK_BOOTTIME: monotonic, and counting the time the machine was suspended (a
    lease's clock must not stop while etcd's goes on)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def sync_key(key: bytes) -> bytes:
    return key + b"/sync"


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
        """POST to the first endpoint that answers; the one that did is tried first next time (a
        member cut off costs its timeout once, not on every call of a campaign or a renewal)."""
        data = json.dumps(body).encode()
        failures = []
        for endpoint in list(self.endpoints):
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
            if endpoint != self.endpoints[0]:  # (a list swap: threads sharing this client see one or the other)
                self.endpoints = [endpoint] + [e for e in self.endpoints if e != endpoint]
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

    def put_if_held(self, key: bytes, generation: int, target: bytes, value: bytes) -> bool:
        """Put `target` = `value` only while `key` is held at create revision `generation`."""
        answer = self.call("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "target": "CREATE", "create_revision": str(generation)}],
            "success": [{"request_put": {"key": _b64(target), "value": _b64(value)}}]})
        return bool(answer.get("succeeded"))

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
                 clock: Callable[[], float] = boottime) -> None:
        if not 0 < margin < ttl:
            raise ValueError(f"the margin ({margin}s) must be above 0 and below the lease's TTL ({ttl}s)")
        self.etcd, self.key, self.ttl, self.margin, self.clock = etcd, key, ttl, margin, clock
        self.lease = ""
        self.generation = 0          # the key's create revision while held
        self.trusted_until = 0.0     # the monotonic time after which nothing is admitted
        self.lost: str | None = None  # why the lease is gone for good (then fenced() says so)
        self._stop = threading.Event()  # stop()'s waker for the renewal thread
        self._thread: threading.Thread | None = None
        self._watch: LeaderWatch | None = None  # its own key (`_holder`)

    def campaign(self, value: bytes) -> int:
        """Take the key, or LeadershipError naming who holds it; then the sync key says no standby
        is in sync yet (none may take over by itself until one is). The generation."""
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
        self._thread.start()  # (renewing from now: what follows may wait on a member that does not answer)
        try:
            self.record_sync(None)
        except LeadershipError:
            self.stop()
            raise
        self._watch = LeaderWatch(self.etcd, self.key, on_holder=self._holder, name="aotx-own-key")
        self._watch.start()
        log.info("leadership: holding %s as generation %d (lease %s, %ds, fenced %.1fs before it could lapse)",
                 self.key.decode(), revision, self.lease, self.ttl, self.margin)
        return revision

    def record_sync(self, member: str | None) -> None:
        """The sync key names `member` (None: no standby may take over by itself), written only
        while this primary holds the leader key (LeadershipError otherwise, or etcd unreachable)."""
        value = json.dumps({"leader": self.generation, "standby": member}).encode()
        if not self.etcd.put_if_held(self.key, self.generation, sync_key(self.key), value):
            self._gone(None)
            raise LeadershipError(f"the leader key {self.key.decode()} is no longer this primary's (generation "
                                  f"{self.generation}): the sync key was not written")
        log.info("leadership: the sync key names %s", member or "no standby")

    def _holder(self, held: tuple[int, bytes] | None) -> None:
        """The own-key watch saw who holds the key now."""
        if held is None or held[0] != self.generation:
            self._gone(held)

    def _gone(self, held: tuple[int, bytes] | None) -> None:
        if self.lost is None:
            self.lost = (f"the leader key {self.key.decode()} (generation {self.generation}) "
                         + ("was deleted" if held is None else f"is held by generation {held[0]}")
                         + ": another primary may take over")
            log.error("leadership: %s; this device admits nothing more", self.lost)

    def fenced(self) -> str | None:
        """Why this primary must admit nothing now, None while its lease is trusted."""
        if self.lost is not None:
            return self.lost
        if self.clock() >= self.trusted_until:
            return (f"the leadership lease (generation {self.generation}) was not renewed in time; another "
                    "primary may hold it")
        return None

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / RENEWALS):
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
            try:  # the lease may live on without the key (deleted): the watch says so at once, this within a third
                held = self.etcd.get(self.key)
            except LeadershipError as exc:
                log.warning("leadership: reading the leader key failed: %s", exc)
                continue
            if held is None or held[0] != self.generation:
                self._gone(held)
                return
            self.trusted_until = max(self.trusted_until, sent + ttl - self.margin)

    def state(self) -> dict[str, object]:
        fenced = self.fenced()
        return {"generation": self.generation, "lease_seconds": self.ttl, "fenced": fenced,
                "trusted_for": round(max(0.0, self.trusted_until - self.clock()), 3)}

    def stop(self) -> None:
        """Stop renewing and give the key up (a clean stop: a standby may take over at once)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(10)
        if self.lease:
            try:
                self.etcd.revoke(self.lease)
            except LeadershipError as exc:
                log.warning("leadership: could not revoke the lease (it expires by itself): %s", exc)


def may_promote(etcd: Etcd, key: bytes, generation: int, member: str) -> str | None:
    """Why the standby `member` may not take over by itself now that the leader key of
    `generation` is gone (None: it may): the sync key must name it under that generation (the
    last primary recorded it in sync, and saved nothing alone since)."""
    try:
        answer = etcd.get(sync_key(key))
    except LeadershipError as exc:
        return f"the sync key cannot be read ({exc})"
    if answer is None:
        return "no sync key: no standby was recorded in sync"
    try:
        doc = json.loads(answer[1])
    except ValueError:
        return "the sync key is not JSON"
    if not isinstance(doc, dict) or doc.get("leader") != generation:
        return f"the sync key is of another leadership ({doc.get('leader') if isinstance(doc, dict) else doc})"
    if doc.get("standby") != member:
        named = doc.get("standby")
        return "the last primary saved alone (the sync key names no standby)" if named is None else \
            f"the sync key names another standby ({named})"
    return None


class LeaderWatch:
    """A look at the leader key that follows it through an etcd watch (`aotx-leader-watch`): the
    key is read, then watched from the revision read; a watch quiet for WATCH_SECONDS, or broken,
    is opened again the same way (nothing is missed: it starts where the read was). `on_holder` is
    called with the holder's (generation, value) each time it changes, and None when no one holds
    the key. Once it has seen the key held and then finds it gone (the primary's lease lapsed, or
    it stopped and gave the key up, or it was deleted), `gone` is set and `then(generation)` is
    called with the generation it saw go (a standby takes over): the watch ends when it answers
    True, and goes on when it answers False (a standby that may not take over waits for the next
    holder; `gone` clears when the key is held again). etcd unreachable is not "gone": the watch
    waits, and tries again every RETRY_SECONDS."""

    WATCH_SECONDS = 5.0
    RETRY_SECONDS = 0.5

    def __init__(self, etcd: Etcd, key: bytes, then: Callable[[int], object] | None = None,
                 on_holder: Callable[[tuple[int, bytes] | None], object] | None = None,
                 name: str = "aotx-leader-watch") -> None:
        self.etcd, self.key, self.then, self.on_holder = etcd, key, then, on_holder
        self.seen: int | None = None  # the generation it saw hold the key
        self.holder: tuple[int, bytes] | None = None
        self.gone = False
        self._stop = threading.Event()  # stop()'s waker (a watch in progress ends within WATCH_SECONDS)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

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
            self.gone = False
            return False
        if self.seen is None or self.gone:
            return False
        log.warning("leader watch: the key %s (generation %d) is gone", self.key.decode(), self.seen)
        self.gone = True
        if self.then is None:
            return False
        return bool(self.then(self.seen))  # (False: it does not take over; the watch goes on)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.WATCH_SECONDS + 2 * REQUEST_SECONDS)
