"""`Client` (blocking) and `AsyncClient` (asyncio): the AOTX Shared API for one principal's
participant, on httpx. Both run the same protocol steps (_protocol.py); one instance may be used
from many threads (Client) or tasks (AsyncClient) at once.

    from aotx_client import Client
    with Client("http://127.0.0.1:8000", token) as aotx:
        aotx.register()
        space = aotx.create_space()["target"]
        con = aotx.create_conversation(space)["target"]
        op = aotx.submit_input(con, "Hello", model="SmolLM2-135M-Instruct")["operation"]
        receipt = aotx.wait(op)                 # the saved terminal result
        text = aotx.result(op).decode()
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, Sequence, TypeVar
from urllib.parse import quote

import httpx

from ._protocol import (BASE, JSON, ApiError, Call, Event, Follow, Gateways, JSONObject, Mutations, Participant,
                        PendingLog, Receipt, Reply, Sleep, SSEParser, Step, get, raise_for, read_result, request,
                        wait_for_terminal)

T = TypeVar("T")

DEFAULT_RETRY_FOR = 120.0  # seconds one exact request is retried through timeouts, 503 and 429


class _Common:
    """What both clients share: the steps, by name; the drivers differ only in how they run them."""
    mutations: Mutations
    retry_for: float

    gateways: Gateways

    def _init(self, base_url: str | Sequence[str], token: str, retry_for: float,
              pending_dir: str | None) -> dict[str, str]:
        self.gateways = Gateways(base_url)
        self.retry_for = retry_for
        self.mutations = Mutations(retry_for, time.monotonic, PendingLog(pending_dir) if pending_dir else None)
        return {"Authorization": f"Bearer {token}", "Accept": "application/json"}

    # steps -------------------------------------------------------------------------------------
    def _register(self) -> Step[Participant]:
        if self.mutations.capabilities is None:  # (SPEC's client sequence: capabilities first)
            yield from self.mutations.read_capabilities()
        me = yield from self.mutations.read_participant()
        if me.get("registered"):
            return me
        try:
            yield from self.mutations.mutate("/participant", {})
        except ApiError as exc:
            if exc.code != "already_registered":  # another client of this principal was first
                raise
        return (yield from self.mutations.read_participant())

    def _get(self, path: str, params: dict[str, str] | None = None) -> Step[Any]:
        return (yield from get(BASE + path, self.retry_for, time.monotonic, params))

    def _upload(self, data: bytes, content_type: str) -> Step[str]:
        import hashlib
        digest = hashlib.sha256(data).hexdigest()
        call = Call("PUT", f"/aotx/v1/media/{digest}", data, {"Content-Type": content_type})
        reply = yield from request(call, self.retry_for, time.monotonic)  # idempotent: same bytes, same name
        raise_for(reply)
        return digest


def _input_fields(text: str, model: str, **options: JSON) -> JSONObject:
    fields: JSONObject = {"text": text, "model": model}
    fields.update({k: v for k, v in options.items() if v is not None})
    return fields


def _space(scope: str, id: str | None, memory_ttl_seconds: int | None) -> JSONObject:
    """A space creation's fields: what the caller gave (an ID and a time to live only when given)."""
    fields: JSONObject = {"scope": scope}
    if id:
        fields["id"] = id
    if memory_ttl_seconds is not None:
        fields["memory_ttl_seconds"] = memory_ttl_seconds
    return fields


def _fork(at: int | str, id: str | None) -> JSONObject:
    """A fork's fields: `at` an int or its decimal string (an event cursor), sent as the string."""
    fields: JSONObject = {"at": str(at)}
    if id is not None:
        fields["id"] = id
    return fields


def _correction(text: str, version: int | str) -> JSONObject:
    """A correction's fields: `version` an int or its decimal string, sent as the string."""
    return {"text": text, "version": str(version)}


class Client(_Common):
    """Blocking client. `base_url`: a gateway's URL, or several (every machine's: a request that
    one cannot serve moves on to the next, `Gateways`). `timeout` is each HTTP request's;
    `retry_for` bounds exact retries."""

    def __init__(self, base_url: str | Sequence[str], token: str, *, timeout: float | httpx.Timeout = 30.0,
                 retry_for: float = DEFAULT_RETRY_FOR, transport: httpx.BaseTransport | None = None,
                 pending_dir: str | None = None) -> None:
        headers = self._init(base_url, token, retry_for, pending_dir)
        self.http = httpx.Client(headers=headers, timeout=timeout, transport=transport)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _run(self, step: Step[T]) -> T:
        reply: Reply | BaseException | None = None
        try:
            while True:
                if isinstance(reply, BaseException):
                    action = step.throw(reply)
                else:
                    action = step.send(reply)
                if isinstance(action, Sleep):
                    time.sleep(self.gateways.wait(action.seconds))
                    reply = None
                    continue
                reply = self._send(action)
        except StopIteration as done:
            return done.value

    def _send(self, call: Call) -> Reply | BaseException:
        at, url = self.gateways.url(call.path)
        try:
            r = self.http.request(call.method, url, content=call.body, headers=call.headers, params=call.params)
        except httpx.TimeoutException as exc:
            self.gateways.failed(at)
            return TimeoutError(str(exc))
        except httpx.TransportError as exc:
            self.gateways.failed(at)
            return ConnectionError(str(exc))
        reply = Reply(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content)
        self.gateways.answered(at, reply)
        return reply

    # the API -----------------------------------------------------------------------------------
    def capabilities(self) -> JSONObject:
        """Read now (and kept: the client reads them before its first mutation and again when an
        answer says they changed; `known_capabilities` is the last read)."""
        return self._run(self.mutations.read_capabilities())

    @property
    def known_capabilities(self) -> JSONObject | None:
        return self.mutations.capabilities

    def participant(self) -> Participant:
        return self._run(self.mutations.read_participant())

    def register(self) -> Participant:
        """Register this principal's participant unless it is; returns /participant."""
        return self._run(self._register())

    def mutate(self, path: str, fields: Mapping[str, JSON]) -> Receipt:
        """A mutation (path under /aotx/v1/shared); its receipt."""
        return self._run(self.mutations.mutate(path, fields))

    def resume(self) -> list[Receipt]:
        """With `pending_dir`: retry exactly what a killed process left there; their receipts."""
        return self._run(self.mutations.resume())

    def create_space(self, scope: str = "private", id: str | None = None,
                     memory_ttl_seconds: int | None = None) -> Receipt:
        """A space of `scope` (private, room, instance), its ID `id` (32 hex; None: the operation
        key); with `memory_ttl_seconds` (1..3660 days in seconds) the memory rows retained or
        published in it expire that long after each is written (their `expires_at_ns`)."""
        return self.mutate("/spaces", _space(scope, id, memory_ttl_seconds))

    def set_member(self, space: str, participant: str, permissions: list[str]) -> Receipt:
        return self.mutate(f"/spaces/{quote(space)}/members",
                           {"participant": participant, "permissions": [*permissions]})

    def create_conversation(self, space: str, id: str | None = None) -> Receipt:
        return self.mutate(f"/spaces/{quote(space)}/conversations", {"id": id} if id else {})

    def fork_conversation(self, conversation: str, at: int | str, id: str | None = None) -> Receipt:
        """A new conversation in the source's space whose history is `conversation`'s through the
        input at event cursor `at` (its first input is `at + 1`); `id` as for create_conversation.
        The receipt's `target` is the fork."""
        return self.mutate(f"/conversations/{quote(conversation)}/forks", _fork(at, id))

    def submit_input(self, conversation: str, text: str, model: str, **options: JSON) -> Receipt:
        """options: max_output_tokens, pages, temperature, top_p, media ([{type, sha256}]), retention,
        context, response_format ({type: json_schema, schema} or {type: json_object}),
        memory_ttl_seconds (the rows it retains expire that long after they are written; else its
        space's time to live)."""
        return self.mutate(f"/conversations/{quote(conversation)}/inputs", _input_fields(text, model, **options))

    def cancel(self, target_sequence: int) -> Receipt:
        return self.mutate("/cancellations", {"target_sequence": str(target_sequence)})

    def retire(self, retry_floor: int) -> Receipt:
        """Free every receipt below retry_floor (each must have a saved terminal result)."""
        return self.mutate("/retirements", {"retry_floor": str(retry_floor)})

    def receipt(self, operation: str) -> Receipt:
        return self._run(self._get(f"/operations/{quote(operation)}"))

    def wait(self, operation: str, timeout: float = 600.0) -> Receipt:
        """The receipt once its terminal result is saved."""
        return self._run(wait_for_terminal(operation, self.retry_for, time.monotonic, timeout))

    def result(self, operation: str, offset: int = 0) -> bytes:
        return self._run(read_result(operation, offset, self.retry_for, time.monotonic))

    def upload_media(self, data: bytes, content_type: str) -> str:
        """Upload a media source; its sha256 (the name inputs refer to it by)."""
        return self._run(self._upload(data, content_type))

    def get(self, path: str, **params: str) -> JSON:
        """A read under /aotx/v1/shared: its JSON."""
        return self._run(self._get(path, params or None))

    def search_memory(self, space: str, q: str, limit: int = 10) -> list[JSONObject]:
        """The rows of the space's memory most similar to `q`, best first: [{memory, score}]."""
        return self._run(self._get(f"/spaces/{quote(space)}/memory/search", {"q": q, "limit": str(limit)}))["items"]

    def correct_memory(self, memory: str, text: str, version: int | str) -> Receipt:
        """Replace a memory object's payload with `text` while `version` is its current version
        (409 `stale_version` otherwise, naming the current one); it moves to the next version."""
        return self.mutate(f"/memory/{quote(memory)}/versions", _correction(text, version))

    def forget_memory(self, memory: str, reason: str | None = None) -> Receipt:
        """Forget a memory object (its reads answer 404 from then on); `reason` is kept in the receipt."""
        return self.mutate(f"/memory/{quote(memory)}/deletion", {} if reason is None else {"reason": reason})

    def events(self, conversation: str, cursor: str | None = None,
               stop: Callable[[Event], bool] | None = None) -> Iterator[Event]:
        """A conversation's events as they are saved (the backlog after cursor first); reconnects
        with Last-Event-ID when the connection breaks; ends when stop(event) is true."""
        return self._follow(f"{BASE}/conversations/{quote(conversation)}/events", {"stream": "true"},
                            cursor, stop)

    def output(self, operation: str, stop: Callable[[Event], bool] | None = None) -> Iterator[Event]:
        """An operation's output spans as saved, then its terminal event (the stream ends there)."""
        return self._follow(f"{BASE}/operations/{quote(operation)}/events", {}, None, stop)

    def _follow(self, path: str, params: dict[str, str], cursor: str | None,
                stop: Callable[[Event], bool] | None) -> Iterator[Event]:
        follow = Follow(params, cursor, stop)
        while True:
            headers, query = follow.request()
            parser = SSEParser()
            at, url = self.gateways.url(path)
            try:
                with self.http.stream("GET", url, params=query, headers=headers, timeout=None) as r:
                    if r.status_code != 200:
                        r.read()
                        reply = Reply(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content)
                        self.gateways.answered(at, reply)
                        raise_for(reply)
                    for chunk in r.iter_bytes():
                        for event in parser.feed(chunk):
                            done = follow.seen(event)
                            yield event
                            if done:
                                return
                    return  # the server ended the stream (an operation's terminal event)
            except httpx.TransportError:
                self.gateways.failed(at)
                time.sleep(0.1)  # resume from the last event seen (at the next gateway)


class AsyncClient(_Common):
    """asyncio client; the same methods as Client, as coroutines (events and output: async
    iterators)."""

    def __init__(self, base_url: str | Sequence[str], token: str, *, timeout: float | httpx.Timeout = 30.0,
                 retry_for: float = DEFAULT_RETRY_FOR, transport: httpx.AsyncBaseTransport | None = None,
                 pending_dir: str | None = None) -> None:
        headers = self._init(base_url, token, retry_for, pending_dir)
        self.http = httpx.AsyncClient(headers=headers, timeout=timeout, transport=transport)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.http.aclose()

    async def _run(self, step: Step[T]) -> T:
        reply: Reply | BaseException | None = None
        try:
            while True:
                action = step.throw(reply) if isinstance(reply, BaseException) else step.send(reply)
                if isinstance(action, Sleep):
                    await asyncio.sleep(self.gateways.wait(action.seconds))
                    reply = None
                    continue
                reply = await self._send(action)
        except StopIteration as done:
            return done.value

    async def _send(self, call: Call) -> Reply | BaseException:
        at, url = self.gateways.url(call.path)
        try:
            r = await self.http.request(call.method, url, content=call.body, headers=call.headers, params=call.params)
        except httpx.TimeoutException as exc:
            self.gateways.failed(at)
            return TimeoutError(str(exc))
        except httpx.TransportError as exc:
            self.gateways.failed(at)
            return ConnectionError(str(exc))
        reply = Reply(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content)
        self.gateways.answered(at, reply)
        return reply

    async def capabilities(self) -> JSONObject:
        return await self._run(self.mutations.read_capabilities())

    @property
    def known_capabilities(self) -> JSONObject | None:
        return self.mutations.capabilities

    async def participant(self) -> Participant:
        return await self._run(self.mutations.read_participant())

    async def register(self) -> Participant:
        return await self._run(self._register())

    async def resume(self) -> list[Receipt]:
        """With `pending_dir`: retry exactly what a killed process left there; their receipts."""
        return await self._run(self.mutations.resume())

    async def mutate(self, path: str, fields: Mapping[str, JSON]) -> Receipt:
        return await self._run(self.mutations.mutate(path, fields))

    async def create_space(self, scope: str = "private", id: str | None = None,
                           memory_ttl_seconds: int | None = None) -> Receipt:
        return await self.mutate("/spaces", _space(scope, id, memory_ttl_seconds))

    async def set_member(self, space: str, participant: str, permissions: list[str]) -> Receipt:
        return await self.mutate(f"/spaces/{quote(space)}/members",
                                 {"participant": participant, "permissions": [*permissions]})

    async def create_conversation(self, space: str, id: str | None = None) -> Receipt:
        return await self.mutate(f"/spaces/{quote(space)}/conversations", {"id": id} if id else {})

    async def fork_conversation(self, conversation: str, at: int | str, id: str | None = None) -> Receipt:
        return await self.mutate(f"/conversations/{quote(conversation)}/forks", _fork(at, id))

    async def submit_input(self, conversation: str, text: str, model: str, **options: JSON) -> Receipt:
        return await self.mutate(f"/conversations/{quote(conversation)}/inputs",
                                 _input_fields(text, model, **options))

    async def cancel(self, target_sequence: int) -> Receipt:
        return await self.mutate("/cancellations", {"target_sequence": str(target_sequence)})

    async def retire(self, retry_floor: int) -> Receipt:
        return await self.mutate("/retirements", {"retry_floor": str(retry_floor)})

    async def receipt(self, operation: str) -> Receipt:
        return await self._run(self._get(f"/operations/{quote(operation)}"))

    async def wait(self, operation: str, timeout: float = 600.0) -> Receipt:
        return await self._run(wait_for_terminal(operation, self.retry_for, time.monotonic, timeout))

    async def result(self, operation: str, offset: int = 0) -> bytes:
        return await self._run(read_result(operation, offset, self.retry_for, time.monotonic))

    async def upload_media(self, data: bytes, content_type: str) -> str:
        return await self._run(self._upload(data, content_type))

    async def get(self, path: str, **params: str) -> JSON:
        return await self._run(self._get(path, params or None))

    async def search_memory(self, space: str, q: str, limit: int = 10) -> list[JSONObject]:
        found = await self._run(self._get(f"/spaces/{quote(space)}/memory/search", {"q": q, "limit": str(limit)}))
        return found["items"]

    async def correct_memory(self, memory: str, text: str, version: int | str) -> Receipt:
        return await self.mutate(f"/memory/{quote(memory)}/versions", _correction(text, version))

    async def forget_memory(self, memory: str, reason: str | None = None) -> Receipt:
        return await self.mutate(f"/memory/{quote(memory)}/deletion", {} if reason is None else {"reason": reason})

    def events(self, conversation: str, cursor: str | None = None,
               stop: Callable[[Event], bool] | None = None) -> AsyncIterator[Event]:
        return self._follow(f"{BASE}/conversations/{quote(conversation)}/events", {"stream": "true"},
                            cursor, stop)

    def output(self, operation: str, stop: Callable[[Event], bool] | None = None) -> AsyncIterator[Event]:
        return self._follow(f"{BASE}/operations/{quote(operation)}/events", {}, None, stop)

    async def _follow(self, path: str, params: dict[str, str], cursor: str | None,
                      stop: Callable[[Event], bool] | None) -> AsyncIterator[Event]:
        follow = Follow(params, cursor, stop)
        while True:
            headers, query = follow.request()
            parser = SSEParser()
            at, url = self.gateways.url(path)
            try:
                async with self.http.stream("GET", url, params=query, headers=headers, timeout=None) as r:
                    if r.status_code != 200:
                        await r.aread()
                        reply = Reply(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content)
                        self.gateways.answered(at, reply)
                        raise_for(reply)
                    async for chunk in r.aiter_bytes():
                        for event in parser.feed(chunk):
                            done = follow.seen(event)
                            yield event
                            if done:
                                return
                    return
            except httpx.TransportError:
                self.gateways.failed(at)
                await asyncio.sleep(0.1)
