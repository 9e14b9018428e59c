"""Server-sent event streams (SPEC "Results and memory"), as Channels consumers.

    GET /aotx/v1/shared/conversations/{con}/events?stream=true[&cursor=N][&limit=N]   the conversation's events
    GET /aotx/v1/shared/operations/{op}/events[?offset=N]                               an operation's output

A stream is a device subscription (docs/protocol.md, "Subscriptions") opened through the process's
DeviceMux; the device pushes each event as it is saved, so nothing here polls. Under the gateway's
server an event is written from the mux reader's own turn of the loop when the connection takes it
at once (`on_frame`; one frame to a thousand streams is a thousand socket writes, no task
wake-ups); otherwise it waits in the stream's queue for its task. Framing (WHATWG):
every event has `id: <path>@<cursor>` — the conversation's input order, or the byte offset the
next span starts at — `event: <type>` and one `data:` line of JSON; a comment after each
AOTX_SSE_KEEPALIVE seconds (15) of silence (within a third more) keeps idle connections open.
`Last-Event-ID` resumes from its cursor when the request gives none. A conversation stream with
`limit` ends after that many `event` events (a `gap` is none) and closes its subscription; without
it the stream runs until the client leaves. A refused stream (401, 403,
404, 400) is one JSON error body, as everywhere; an error after the stream started is a last
`event: error` with that body.

Each stream checks the token, the action and (on the device) membership when it opens; the device
ends it when grants or memberships change so that the reader loses the right (within its idle
period, 0.1 s); and the channel layer carries principal changes made in any gateway process
(`principal_changed`) to one listener per process (`PrincipalWatch`), which ends that principal's
streams there at once. The stream
runs as a task, never inside `handle`: `http.disconnect` cancels it and closes the subscription,
which never cancels an operation.
"""
from __future__ import annotations

import asyncio
import re
import time
import weakref
from typing import Any, Callable
from urllib.parse import parse_qs

from asgiref.sync import async_to_sync
from channels.generic.http import AsyncHttpConsumer
from channels.layers import get_channel_layer
from django.conf import settings

from gpu_worker.contract import ids
from gpu_worker.contract.errors import ServiceError
from gpu_worker.contract.limits import MAX_LIMIT
from gpu_worker.contract.vocabulary import BASE_PATH, READ
from gpu_worker.contract.wire import Reply

from ..http.auth import PRINCIPALS, admit
from ..device_client import KEEP_ALIVE, DeviceStream, mux
from ..errors import WWW_AUTHENTICATE
from ..http.rates import limiter, retry_headers
from ..http.server import PRIVATE_HEADERS, WRITE_NOWAIT, Scope

CONVERSATION_EVENTS = re.compile(rf"^{BASE_PATH}/conversations/([^/]+)/events$")
OPERATION_EVENTS = re.compile(rf"^{BASE_PATH}/operations/([^/]+)/events$")


PRINCIPALS_GROUP = "aotx.principals"  # the channel-layer group every gateway process listens on


async def principal_changed(principal_ids: list[str]) -> None:
    """Tell every gateway process's streams of these principals to recheck their token now."""
    layer = get_channel_layer()
    if layer is not None and principal_ids:
        await layer.group_send(PRINCIPALS_GROUP, {"type": "principal.changed", "principal_ids": principal_ids})


PRIVATE = [(name.encode(), value.encode()) for name, value in PRIVATE_HEADERS]  # (as ASGI headers)


class PrincipalWatch:
    """One listener per gateway process (per event loop) on the channel layer: it hands principal
    changes to that process's open streams. One channel per process, not per stream, so a
    thousand streams do not hold a thousand channel-layer connections (channels_redis pools them).
    It also keeps them alive: every third of AOTX_SSE_KEEPALIVE it nudges each stream that has
    written nothing for AOTX_SSE_KEEPALIVE, whose own task then writes a comment (one timer per
    process, not one armed and cancelled per stream and frame)."""

    def __init__(self) -> None:
        self.streams: dict[str, set[EventStream]] = {}
        self.task: asyncio.Task[None] | None = None  # listen(); both kept referenced while the loop runs
        self.ticker: asyncio.Task[None] | None = None  # keep_alive()

    def add(self, stream: EventStream) -> None:
        self.streams.setdefault(stream.principal_id, set()).add(stream)
        if self.task is None:
            loop = asyncio.get_running_loop()
            self.task = loop.create_task(self.listen())
            self.ticker = loop.create_task(self.keep_alive())

    async def keep_alive(self) -> None:
        quiet = settings.AOTX_SSE_KEEPALIVE
        while True:
            await asyncio.sleep(quiet / 3)
            now = time.monotonic()
            for streams in list(self.streams.values()):
                for stream in list(streams):
                    if now - stream.written >= quiet and stream.stream is not None:
                        stream.written = now  # (once per quiet period, however long the wake-up waits)
                        stream.stream.nudge()

    def discard(self, stream: EventStream) -> None:
        streams = self.streams.get(stream.principal_id)
        if streams is not None:
            streams.discard(stream)
            if not streams:
                del self.streams[stream.principal_id]

    async def listen(self) -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        channel = await layer.new_channel()
        await layer.group_add(PRINCIPALS_GROUP, channel)
        while True:
            message = await layer.receive(channel)
            PRINCIPALS.clear()  # the change may not have reached this process's cache any other way
            for principal_id in message.get("principal_ids", ()):
                for stream in list(self.streams.get(principal_id, ())):
                    asyncio.get_running_loop().create_task(stream.recheck())


_watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PrincipalWatch] = weakref.WeakKeyDictionary()


def watch() -> PrincipalWatch:
    loop = asyncio.get_running_loop()
    found = _watches.get(loop)
    if found is None:
        found = _watches[loop] = PrincipalWatch()
    return found


def notify_principals(principal_ids: list[str]) -> None:
    """From synchronous code (the admin, `manage.py principal`): principal_changed."""
    async_to_sync(principal_changed)(principal_ids)


def _sse(event: str, data: bytes | str, event_id: str | None = None) -> bytes:
    text = data.decode() if isinstance(data, bytes) else data
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {text}\n\n".encode()


class EventStream(AsyncHttpConsumer):
    """One SSE response fed by one device subscription."""

    command = ""  # the device command that opens the subscription
    channel_layer_alias = "none"  # no channel of its own: the process's PrincipalWatch listens for it

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.task: asyncio.Task[None] | None = None
        self.stream: DeviceStream | None = None
        self.token = ""
        self.principal_id = ""
        self.path = ""
        self.path_bytes = b""
        self.finished = False
        self.written = time.monotonic()  # when this stream last wrote (PrincipalWatch.keep_alive)
        self.writing = False  # the pump's write is waiting for the connection: on_frame must queue
        self.write_nowait: Callable[[bytes], bool] | None = None  # the server's (shared_api/http/server.py)
        self.limit: int | None = None  # `event` events after which the stream ends (None: it runs on)
        self.sent = 0  # `event` events written
        self.ending: asyncio.Task[None] | None = None  # `end`, begun outside the stream's task

    # ---- the request ----------------------------------------------------------------

    async def http_request(self, message: dict[str, Any]) -> None:
        """As AsyncHttpConsumer's, except that handling only starts the stream: the consumer then
        stays, to see `http.disconnect` and channel-layer messages, until the response ends."""
        if "body" in message:
            self.body.append(message["body"])
        if not message.get("more_body"):
            await self.handle(b"".join(self.body))

    async def handle(self, body: bytes) -> None:
        self.path = self.scope["path"]
        self.path_bytes = self.path.encode()
        try:
            if self.scope["method"] not in ("GET", "HEAD"):
                raise ServiceError(405, "method_not_allowed", f"method {self.scope['method']} is not allowed here")
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self.scope["headers"]}
            self.token = headers.get("authorization", "")
            user = await admit(self.token, READ)
            limiter().admit(user.principal_id, user.rates, 0, user.shared_rates)
            self.principal_id = user.principal_id
            query = {k: v for k, v in parse_qs(self.scope["query_string"].decode("latin-1"),
                                               keep_blank_values=True).items()}
            args = self.arguments(query, headers.get("last-event-id"))
            self.stream = await mux().open(self.command, self.principal_id, args)
            first = await self.stream.next(settings.AOTX_DEVICE_TIMEOUT)
        except asyncio.TimeoutError:
            await self.refuse(ServiceError(503, "device_timeout", "the device did not answer in time"))
            return
        except ServiceError as err:
            await self.refuse(err)
            return
        if first.status != 200:
            await self.send_response(first.status, first.body, headers=self.json_headers())
            return
        await self.send_headers(status=200, headers=[
            (b"Content-Type", b"text/event-stream; charset=utf-8"), *PRIVATE,
            (b"X-Accel-Buffering", b"no")])
        await self.write(b": stream open\n\n")
        watch().add(self)
        self.write_nowait = self.scope.get("extensions", {}).get(WRITE_NOWAIT)
        if self.write_nowait is not None:
            self.stream.on_frame = self.on_frame
        self.stream.backlog_limit = settings.AOTX_STREAM_BACKLOG_BYTES
        self.stream.on_backlog = self.backlogged
        self.task = asyncio.get_running_loop().create_task(self.pump())

    def arguments(self, query: dict[str, list[str]], last_event_id: str | None) -> dict[str, object]:
        raise NotImplementedError

    def resume_cursor(self, last_event_id: str | None) -> str | None:
        """The cursor a Last-Event-ID names; it must name this stream."""
        if last_event_id is None:
            return None
        path, _, cursor = last_event_id.rpartition("@")
        if path != self.path or not ids.COUNTER.match(cursor):
            raise ServiceError(400, "bad_last_event_id", f"Last-Event-ID {last_event_id!r} is not an event of "
                                                         f"{self.path} (<path>@<cursor>)")
        return cursor

    @staticmethod
    def json_headers(extra: list[tuple[bytes, bytes]] | None = None) -> list[tuple[bytes, bytes]]:
        return [(b"Content-Type", b"application/json"), *PRIVATE, *(extra or [])]

    async def refuse(self, err: ServiceError) -> None:
        extra = ([(b"WWW-Authenticate", WWW_AUTHENTICATE.encode())] if err.status == 401
                 else [(name.encode(), value.encode()) for name, value in retry_headers(err)]
                 if err.code == "rate_limited" else None)
        await self.send_response(err.status, err.body(), headers=self.json_headers(extra))

    # ---- the stream ---------------------------------------------------------------------

    async def pump(self) -> None:
        assert self.stream is not None
        try:
            while True:
                msg = await self.stream.next()
                if msg is KEEP_ALIVE:
                    await self.write(b": keep-alive\n\n")
                    continue
                if msg.status != 200:
                    await self.finish(_sse("error", msg.body))
                    return
                event = self.render(msg)
                if self.at_limit(msg):  # the last event the request asked for: the subscription closes
                    stream = self.stream
                    await self.finish(event)
                    if stream is not None:
                        await stream.close()
                    return
                if not msg.more:
                    await self.finish(event)
                    return
                if event:
                    await self.write(event)
                    self.count(msg)
        except ServiceError as err:
            await self.finish(_sse("error", err.body()))

    async def write(self, data: bytes) -> None:
        if not self.finished:
            self.written = time.monotonic()
            # send_body's message, straight to the server (a fan-out makes a write per stream and event)
            self.writing = True
            try:
                await self.base_send({"type": "http.response.body", "body": data, "more_body": True})
            finally:
                self.writing = False

    def on_frame(self, msg: Reply) -> bool:
        """The DeviceMux's reader hands each frame here first: an event the connection takes at once
        is written now, in the reader's turn of the loop, so one event fanned out to a thousand
        streams costs a thousand socket writes and no task wake-ups. Anything else — the last
        frame, an error, a connection that would make the write wait, a write still waiting —
        returns False and goes through the queue to `pump`, in order."""
        if (self.writing or self.finished or msg.status != 200 or not msg.more
                or self.at_limit(msg)):
            return False
        event = self.render(msg)
        if event:
            assert self.write_nowait is not None
            if not self.write_nowait(event):
                return False
            self.written = time.monotonic()
            self.count(msg)
        return True

    def at_limit(self, msg: Reply) -> bool:
        """Whether `msg` is the stream's last event under its `limit` (a `gap` is no event)."""
        return self.limit is not None and msg.event == "event" and self.sent + 1 >= self.limit

    def count(self, msg: Reply) -> None:
        """A frame was written: an `event` counts toward `limit`."""
        if msg.event == "event":
            self.sent += 1

    def render(self, msg: Reply) -> bytes:
        """A device frame as one event of this stream (the device names the event and its cursor;
        its body is the data, as is): no parsing on the way through."""
        event = msg.event
        if event == "open":
            return b""  # the stream is accepted: the opening comment went out already
        cursor = msg.cursor
        head = b"id: %s@%s\n" % (self.path_bytes, cursor.encode()) if cursor is not None else b""
        return head + b"event: " + str(event).encode() + b"\ndata: " + msg.body + b"\n\n"

    async def finish(self, last: bytes) -> None:
        """The last event; the device has ended the subscription (or it is closed here first)."""
        if self.finished:
            return
        self.finished = True
        self.stream = None
        await self.send_body(last, more_body=False)

    async def end(self, err: ServiceError) -> None:
        """End the stream here with `err` as its last event: the stream's task stops writing, the
        subscription closes, and the last event gets AOTX_DEVICE_TIMEOUT to go out (a client that
        does not read may never take it: the response then ends without it)."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        stream, self.stream = self.stream, None
        if stream is not None:
            await stream.close()
        try:
            async with asyncio.timeout(settings.AOTX_DEVICE_TIMEOUT):
                await self.finish(_sse("error", err.body()))
        except TimeoutError:
            pass

    async def recheck(self) -> None:
        """A principal change in some gateway process: end the stream if the token lost its read."""
        try:
            await admit(self.token, READ)
        except ServiceError as err:
            await self.end(err)

    def backlogged(self) -> None:
        """The client reads slower than its events come: AOTX_STREAM_BACKLOG_BYTES of them wait in
        this process. The stream ends (`stream_backlog`) and what waits is dropped; the client
        resumes from the last event it read (Last-Event-ID). Called from the device reader's turn."""
        err = ServiceError(503, "stream_backlog", f"more than {settings.AOTX_STREAM_BACKLOG_BYTES} bytes of events "
                                                  "waited for this client to read them; resume with Last-Event-ID")
        self.ending = asyncio.get_running_loop().create_task(self.end(err))

    async def disconnect(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.stream is not None:
            stream, self.stream = self.stream, None
            await stream.close()
        watch().discard(self)


class ConversationEvents(EventStream):
    command = "conversations.subscribe"

    def arguments(self, query: dict[str, list[str]], last_event_id: str | None) -> dict[str, object]:
        match = CONVERSATION_EVENTS.match(self.path)
        assert match is not None
        conversation = match.group(1)
        if not ids.CONVERSATION_ID.match(conversation):
            raise ServiceError(400, "bad_id", f"{conversation!r} is not a valid ID ({ids.shape('con')}, lowercase hex)")
        unknown = sorted(set(query) - {"stream", "cursor", "limit"})
        if unknown:
            raise ServiceError(400, "unknown_parameter", f"unknown query parameter(s): {', '.join(unknown)}")
        if "limit" in query:  # the stream ends after this many events; without it, it runs on
            limit = query["limit"][-1]
            if not re.fullmatch(r"[0-9]{1,4}", limit) or not 1 <= int(limit) <= MAX_LIMIT:
                raise ServiceError(400, "bad_limit", f"limit must be an integer 1..{MAX_LIMIT}")
            self.limit = int(limit)
        cursor = query["cursor"][-1] if "cursor" in query else self.resume_cursor(last_event_id)
        if cursor is not None and not ids.COUNTER.match(cursor):
            raise ServiceError(400, "bad_field", "cursor must be a decimal string without leading zeros")
        args: dict[str, object] = {"conversation": conversation}
        if cursor is not None:
            args["cursor"] = cursor
        return args



class OperationEvents(EventStream):
    command = "operations.subscribe"

    def arguments(self, query: dict[str, list[str]], last_event_id: str | None) -> dict[str, object]:
        match = OPERATION_EVENTS.match(self.path)
        assert match is not None
        operation = match.group(1)
        if not ids.OPERATION_ID.match(operation):
            raise ServiceError(400, "bad_id", f"{operation!r} is not a valid ID ({ids.shape('op')}, lowercase hex)")
        unknown = sorted(set(query) - {"offset"})
        if unknown:
            raise ServiceError(400, "unknown_parameter", f"unknown query parameter(s): {', '.join(unknown)}")
        offset = query["offset"][-1] if "offset" in query else self.resume_cursor(last_event_id) or "0"
        if not re.fullmatch(r"[0-9]{1,18}", offset):
            raise ServiceError(400, "bad_offset", "offset must be a non-negative integer")
        return {"operation": operation, "offset": int(offset)}



STREAMS: tuple[type[EventStream], ...] = (ConversationEvents, OperationEvents)


def wants_stream(scope: Scope) -> type[EventStream] | None:
    """The consumer of an HTTP request that asks for an event stream, if it does."""
    path = scope["path"]
    if OPERATION_EVENTS.match(path):
        return OperationEvents
    if CONVERSATION_EVENTS.match(path):
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if query.get("stream", [""])[-1] == "true":
            return ConversationEvents
    return None
