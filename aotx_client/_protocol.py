"""The client sequence of the AOTX Shared API, written once without I/O: every operation is a
generator that yields `Call`s (an HTTP request) and `Sleep`s and is sent back each `Reply` (or
has the transport's exception thrown into it). `Client` drives the generators with httpx's
blocking client, `AsyncClient` with its asyncio client, so both behave the same.

Mutations (`Mutations.mutate`):

- a sequence is taken from the local counter under a lock (threads of one client never share
  one); the canonical body — schema, lineage, a fresh operation key, the sequence and the fields —
  is built once and is what every retry sends again, byte for byte (an exact retry);
- a timeout, a broken connection, 503 (`device_unavailable`, `device_connection_lost`,
  `device_timeout`, `not_primary`) and 429 (a journal hold or a quota) are retried exactly, with
  exponential backoff capped at 0.25 s (a failover is over in seconds: the client should not sleep
  through its end), until `retry_for` seconds have passed: a mutation is never applied twice and
  never lost to a network failure. Given several gateways (`Gateways`), a failure moves the
  client to the next one, at once while some gateway is still untried;
- 409 `operation_changed` (another client of the same participant took the sequence) re-reads
  /participant and takes a new sequence past the server's next; 409 `future_sequence` while a
  lower sequence of this client is in flight waits for it and retries exactly, and with none in
  flight (a sequence this client took was given up: its request was refused) re-reads and takes
  the server's next. Either answer proves the bytes were not admitted at the old sequence, so
  moving is safe; each round admits an operation or fills a gap, so concurrent clients converge.
  409 `stale_lineage` (the device checks it after the exact-retry lookup, so it proves the
  operation was not admitted in the device's line of history: after a restore the same bytes of an
  operation the restored state kept answer 200 with its receipt) re-reads the lineage and takes a
  new sequence;
- every other error is raised as `ApiError` with the one error body's code and details.

Separate processes of one participant are safe the same way: each has its own counter and the
409 rules move the loser of a sequence race to a fresh sequence.

A process that dies mid-mutation loses its exact bytes unless it keeps them: with a pending
directory (`PendingLog`), each mutation's path and canonical body are written there (fsynced)
before it is first sent and removed once its outcome is known, and `resume` sends every one left
by a killed process again, exactly: the same sequence and bytes answer 200 with the original
receipt when it was admitted, or 202 when it never arrived; one never admitted at that sequence
(409) moves to a new one as above. Either way it is applied once."""
from __future__ import annotations

import base64
import json
import os
import random
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterator, Mapping, Sequence, TypeAlias, TypedDict, TypeVar, Union
from urllib.parse import quote

BASE = "/aotx/v1/shared"

# A JSON value as the API answers it (json.loads), and a JSON object.
JSON: TypeAlias = Union[None, bool, int, float, str, list["JSON"], dict[str, "JSON"]]
JSONObject: TypeAlias = dict[str, JSON]
Clock: TypeAlias = Callable[[], float]  # seconds, monotonic


class Save(TypedDict):
    save: JSONObject | None  # the transfer that saved it (its digest, position ...); null until saved
    saved: bool


class Terminal(Save):
    status: str | None  # succeeded, failed, cancelled ...; null until saved


class Result(TypedDict):
    finish: str | None
    input_tokens: str | None
    length: str
    output_tokens: str | None


class Receipt(TypedDict):
    """An operation's receipt (the API's Receipt, docs/api.md); counters are decimal strings."""
    admission: Save
    device: dict[str, bool]
    disk_error: JSON
    effective: dict[str, str]
    journal_hold: JSONObject | None
    kind: str
    memory: JSONObject | None
    operation: str
    operation_key: str
    participant: str
    pending_bytes: str
    result: Result
    schema: str
    sequence: str | None
    target: str
    terminal: Terminal
    transport: dict[str, bool]


class Participant(TypedDict):
    """/participant: its ID (null before it registers), lineage and counters (decimal strings)."""
    id: str | None
    registered: bool
    lineage: str
    next_sequence: str
    retry_floor: str

SCHEMA = "aotx.shared.mutation.v1"
RETRYABLE_STATUS = (429, 503)


class ApiError(Exception):
    """An error answer of the API: HTTP status, the error body's code, message and details."""

    def __init__(self, status: int, code: str, message: str, details: JSONObject | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.details = status, code, message, details or {}


class GaveUp(Exception):
    """Retries of one exact request went on for longer than `retry_for` seconds; the request may
    have been applied: retry the same mutation (`Pending.body`) with the same client later."""


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] | None = None


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:  # (what the caller expects the answer to be: the API's documented shapes)
        return json.loads(self.body) if self.body else None


T = TypeVar("T")
# A request's steps: the calls and sleeps a driver (the blocking or the asyncio client) carries out,
# each call's Reply sent back in; its value is the request's outcome.
Step: TypeAlias = Generator["Call | Sleep", "Reply | None", T]


def raise_for(reply: Reply) -> None:
    if reply.status < 400:
        return
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        raise ApiError(reply.status, "http_error", reply.body[:500].decode(errors="replace")) from None
    details = {k: v for k, v in error.items() if k not in ("code", "message")}
    raise ApiError(reply.status, str(error.get("code")), str(error.get("message")), details)


def canonical(value: object) -> bytes:
    """Sorted keys, no spaces: the bytes an exact retry sends again."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# 503 codes that say this gateway cannot reach the primary now: the next request goes to another
# gateway of the list (the same bytes: an exact retry)
ELSEWHERE = frozenset({"not_primary", "device_unavailable", "device_connection_lost", "device_timeout"})


class Gateways:
    """The gateway URLs a client may use (every machine's gateway: docs/client.md, "Several
    gateways"), and the one in use. A transport failure, or a 503 saying that this gateway cannot
    reach the primary (ELSEWHERE), moves the client to the next one, round the list: after the
    primary's machine is lost, requests go on through the survivors by themselves. Exact retries
    make moving safe: every mutation is resent byte for byte, wherever it lands."""

    def __init__(self, urls: str | Sequence[str]) -> None:
        listed = [urls] if isinstance(urls, str) else list(urls)
        if not listed or not all(isinstance(u, str) and u for u in listed):
            raise ValueError("at least one gateway URL")
        self.urls = [u.rstrip("/") for u in listed]
        self.current = 0
        self.untried = 0  # gateways moved to since the last answer, not yet tried: the next try goes at once
        self.lock = threading.Lock()

    def url(self, path: str) -> tuple[int, str]:
        at = self.current
        return at, self.urls[at] + path

    def failed(self, at: int) -> None:
        """The gateway `at` failed a request: the next one is used (unless another request of
        this client moved on already), at once while some gateway is still untried."""
        with self.lock:
            if self.current == at:
                self.current = (at + 1) % len(self.urls)
                self.untried = len(self.urls) - 1 if self.untried == 0 else self.untried - 1

    def answered(self, at: int, reply: Reply) -> None:
        if reply.status == 503 and _code(reply) in ELSEWHERE:
            self.failed(at)
        else:
            self.untried = 0

    def wait(self, seconds: float) -> float:
        """How long to wait before the next try: nothing while it goes to a gateway not yet tried
        since the last answer (moving on is not backing off), else the backoff's `seconds`."""
        return 0.0 if self.untried > 0 else seconds


class Backoff:
    def __init__(self, first: float = 0.05, cap: float = 0.25) -> None:
        self.delay, self.cap = first, cap

    def next(self) -> float:
        delay = self.delay
        self.delay = min(self.cap, self.delay * 2)
        return delay * (0.5 + random.random())  # jittered: clients of one hold do not retry in step


def request(call: Call, retry_for: float, clock: Clock) -> Step[Reply]:
    """One request, retried exactly on transport errors, 429 and 503, for up to retry_for seconds."""
    deadline = clock() + retry_for
    backoff = Backoff()
    while True:
        try:
            reply = yield call
        except (OSError, TimeoutError) as exc:  # the drivers turn the transport's errors into these
            if clock() >= deadline:
                raise GaveUp(f"{call.method} {call.path}: {exc}") from exc
            yield Sleep(backoff.next())
            continue
        assert reply is not None
        if reply.status in RETRYABLE_STATUS and clock() < deadline:
            retry_after = reply.headers.get("retry-after")
            yield Sleep(float(retry_after) if retry_after and retry_after.isdigit() else backoff.next())
            continue
        return reply


@dataclass
class Pending:
    """A mutation in flight: its sequence and the exact bytes sent."""
    path: str
    fields: JSONObject
    key: str
    sequence: int = 0
    body: bytes = b""


class PendingLog:
    """Mutations in flight, kept on disk so a restarted process can retry them exactly: one file
    per sequence (`<sequence>.json`: path, canonical body), written atomically and fsynced before
    the first send, removed once the outcome is known. Processes of one participant may share a
    directory: sequences are the participant's, so their files never collide."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, mode=0o700, exist_ok=True)

    def _name(self, sequence: int) -> str:
        return os.path.join(self.directory, f"{sequence:020d}.json")

    def write(self, pending: Pending) -> None:
        final = self._name(pending.sequence)
        tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps({"path": pending.path, "fields": pending.fields, "key": pending.key,
                                     "sequence": pending.sequence, "body": pending.body.decode()}).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        self._sync_dir()

    def remove(self, sequence: int) -> None:
        try:
            os.unlink(self._name(sequence))
        except FileNotFoundError:
            return
        self._sync_dir()

    def _sync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self) -> list[Pending]:
        """What a killed process left, lowest sequence first."""
        found = []
        for name in sorted(os.listdir(self.directory)):
            if not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(self.directory, name), encoding="utf-8") as f:
                    saved = json.load(f)
            except (OSError, ValueError):
                continue  # a file another process is removing, or never completed (tmp names differ)
            found.append(Pending(saved["path"], saved["fields"], saved["key"], saved["sequence"],
                                 saved["body"].encode()))
        return found


# Answers that say what capabilities describe changed (a journal hold, a quota, the models or the
# page grant, the primary, the line of history): the client reads capabilities again before its
# next mutation.
STALE_CAPABILITIES = frozenset({"journal_hold", "quota_exceeded", "rate_limited", "model_not_available",
                                "model_lacks_media", "page_limit_exceeds_grant", "page_limit_exceeds_pool",
                                "not_primary", "stale_lineage", "receipt_table_full"})


class Mutations:
    """The participant's lineage and sequence counter, shared by every thread of one client, and
    the capabilities it read (SPEC's client sequence: capabilities and the participant resource
    before the first mutation)."""

    def __init__(self, retry_for: float, clock: Clock, log: PendingLog | None = None) -> None:
        self.retry_for, self.clock, self.log = retry_for, clock, log
        self.lock = threading.Lock()
        self.lineage: str | None = None
        self.next_sequence = 0
        self.in_flight: set[int] = set()
        self.participant: Participant | None = None
        self.capabilities: JSONObject | None = None  # None: to be read before the next mutation

    def read_capabilities(self) -> Step[JSONObject]:
        """GET /capabilities: the models, limits, quotas and hold state the next mutations meet."""
        reply = yield from request(Call("GET", f"{BASE}/capabilities"), self.retry_for, self.clock)
        raise_for(reply)
        found: JSONObject = reply.json()
        self.capabilities = found
        return found

    def _noted(self, reply: Reply | None, receipt: Receipt | None = None) -> None:
        """An answer that says the capabilities read changed (STALE_CAPABILITIES, or a receipt run by
        a model they do not list): read them again before the next mutation."""
        known = self.capabilities
        if known is None:
            return
        if reply is not None and _code(reply) in STALE_CAPABILITIES:
            self.capabilities = None
        elif receipt is not None:
            digest = (receipt.get("effective") or {}).get("model_digest")
            models = known.get("models") or []
            held = {m.get("digest") for m in models if isinstance(m, dict)} if isinstance(models, list) else set()
            if digest is not None and digest not in held:
                self.capabilities = None

    def read_participant(self, rewind: bool = False) -> Step[Participant]:
        """Read /participant: the lineage, and the next sequence — moved forward to the server's
        when other clients used sequences, or back to it (rewind) when sequences this client took
        were given up and a later one answered future_sequence."""
        reply = yield from request(Call("GET", f"{BASE}/participant"), self.retry_for, self.clock)
        raise_for(reply)
        me: Participant = reply.json()
        with self.lock:
            self.participant = me
            self.lineage = me["lineage"]
            server_next = int(me["next_sequence"])
            self.next_sequence = server_next if rewind else max(self.next_sequence, server_next)
        return me

    def _assign(self, pending: Pending) -> None:
        old = pending.sequence
        with self.lock:
            pending.sequence = self.next_sequence
            self.next_sequence += 1
            self.in_flight.add(pending.sequence)
            body = {"schema": SCHEMA, "lineage": self.lineage, "operation_key": pending.key,
                    "sequence": str(pending.sequence), **pending.fields}
            pending.body = canonical(body)
        if self.log is not None:  # on disk before it is sent: a restarted process retries it exactly
            self.log.write(pending)
            if old:
                self.log.remove(old)

    def _release(self, pending: Pending) -> None:
        with self.lock:
            self.in_flight.discard(pending.sequence)

    def mutate(self, path: str, fields: Mapping[str, JSON]) -> Step[Receipt]:
        """Submit one mutation; returns its receipt (202 new, 200 the exact retry's)."""
        if self.capabilities is None:
            yield from self.read_capabilities()
        if self.lineage is None:
            yield from self.read_participant()
        pending = Pending(path, dict(fields), secrets.token_hex(16))
        self._assign(pending)
        return (yield from self._submit(pending))

    def resume(self) -> Step[list[Receipt]]:
        """Send again, exactly, every mutation a killed process of this client left in the pending
        directory; returns their receipts, lowest sequence first."""
        if self.log is None:
            return []
        left = self.log.load()
        yield from self.read_participant()
        receipts: list[Receipt] = []
        for pending in left:
            with self.lock:
                self.in_flight.add(pending.sequence)
                self.next_sequence = max(self.next_sequence, pending.sequence + 1)
            receipts.append((yield from self._submit(pending)))
        return receipts

    def _submit(self, pending: Pending) -> Step[Receipt]:
        """Send a mutation until its outcome is known: a receipt, or a refusal raised."""
        waits = Backoff(0.01, 0.5)
        known = False  # GaveUp (the transport failed for retry_for) leaves it pending on disk
        try:
            while True:
                call = Call("POST", BASE + pending.path, pending.body, {"Content-Type": "application/json"})
                reply = yield from request(call, self.retry_for, self.clock)
                if reply.status in (200, 202):
                    known = True
                    receipt: Receipt = reply.json()
                    self._noted(None, receipt)
                    return receipt
                self._noted(reply)
                code = _code(reply)
                if reply.status == 409 and code == "future_sequence":
                    with self.lock:
                        lower = any(s < pending.sequence for s in self.in_flight)
                    if lower:  # an earlier sequence of ours has not reached the device yet
                        yield Sleep(waits.next())
                        continue
                if reply.status == 409 and code in ("operation_changed", "future_sequence", "stale_lineage"):
                    self._release(pending)  # not admitted at this sequence: the answer says so
                    yield from self.read_participant(rewind=code == "future_sequence")
                    self._assign(pending)
                    continue
                with self.lock:  # refused: the sequence stays unused; the next mutation may take it
                    if self.next_sequence == pending.sequence + 1:
                        self.next_sequence = pending.sequence
                known = True
                raise_for(reply)
        finally:
            self._release(pending)
            if known and self.log is not None:
                self.log.remove(pending.sequence)


def _code(reply: Reply) -> str | None:
    try:
        return str(reply.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


def get(path: str, retry_for: float, clock: Clock, params: dict[str, str] | None = None) -> Step[Any]:
    reply = yield from request(Call("GET", path, params=params), retry_for, clock)
    raise_for(reply)
    return reply.json()


def wait_for_terminal(op: str, retry_for: float, clock: Clock, timeout: float) -> Step[Receipt]:
    """Poll the receipt until its terminal result is saved; the receipt. A read past the input's
    execution deadline answers 504: raised as ApiError."""
    deadline = clock() + timeout
    backoff = Backoff(0.02, 0.5)
    while True:
        receipt: Receipt = yield from get(f"{BASE}/operations/{quote(op)}", retry_for, clock)
        terminal = receipt.get("terminal") or {}
        if terminal.get("saved"):
            return receipt
        if clock() >= deadline:
            raise TimeoutError(f"{op}: no saved terminal result after {timeout} s")
        yield Sleep(backoff.next())


def read_result(op: str, offset: int, retry_for: float, clock: Clock) -> Step[bytes]:
    """The result bytes from offset on."""
    body = yield from get(f"{BASE}/operations/{quote(op)}/result", retry_for, clock, {"offset": str(offset)})
    return base64.b64decode(body["bytes"])


@dataclass(frozen=True)
class Event:
    """One server-sent event: its type, its id (path@cursor, for resuming) and its JSON data."""
    event: str
    id: str | None
    data: Any  # the event's JSON, its shape the event type's (docs/api.md)


class SSEParser:
    """WHATWG server-sent events from chunks of bytes."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, chunk: bytes) -> Iterator[Event]:
        self.buffer += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in self.buffer:
            block, self.buffer = self.buffer.split(b"\n\n", 1)
            fields: dict[str, str] = {}
            data: list[str] = []
            for line in block.decode("utf-8").split("\n"):
                if not line or line.startswith(":"):
                    continue
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if name == "data":
                    data.append(value)
                else:
                    fields[name] = value
            if data:
                yield Event(fields.get("event", "message"), fields.get("id"), json.loads("\n".join(data)))


class Follow:
    """One followed event stream across its reconnections: the request to make next (resuming
    with Last-Event-ID once an event was seen) and what each event does."""

    def __init__(self, params: dict[str, str], cursor: str | None, stop: Callable[[Event], bool] | None) -> None:
        self.params = {**params, **({"cursor": cursor} if cursor is not None else {})}
        self.stop = stop
        self.last_id: str | None = None

    def request(self) -> tuple[dict[str, str], dict[str, str]]:
        """(headers, query) of the next connection."""
        headers = {"Accept": "text/event-stream", **({"Last-Event-ID": self.last_id} if self.last_id else {})}
        query = {k: v for k, v in self.params.items() if not (self.last_id and k == "cursor")}
        return headers, query

    def seen(self, event: Event) -> bool:
        """An event about to be handed to the caller: an `error` event raises ApiError; True when
        the stream should end after this one."""
        if event.event == "error":
            error = event.data.get("error", {})
            raise ApiError(0, str(error.get("code")), str(error.get("message")))
        self.last_id = event.id or self.last_id
        return self.stop is not None and self.stop(event)
