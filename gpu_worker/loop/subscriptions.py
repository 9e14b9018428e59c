"""Pushes: requests the device answers with a stream of frames instead of one reply.

A subscription is one request on one gateway connection (its frames carry the request's id, or
the ids of every subscription of that connection a frame is for): a conversation's events, an
operation's output, a chat's tokens. Every frame but the last says `"more": true`; the last ends
it. What a subscription carries and who may hold one is the
operations' business (gpu_worker/kinds/events.py, kinds/chat.py); this registry only keeps them by
topic and by connection and queues their frames for the server to send, in order, after the step
that produced them. A closed connection drops its subscriptions; a subscription's owner can also
close it (`subscriptions.close`).
"""
from __future__ import annotations

from typing import Any

from ..contract.wire import Answer, Reply

Topic = tuple[str, int]  # ("con", conversation row), ("op", receipt row), ("chat", chat number)


class Subscription:
    __slots__ = ("conn", "req_id", "topic", "principal", "data")

    def __init__(self, conn: object, req_id: int, topic: Topic, principal: bytes | None, data: Any) -> None:
        self.conn = conn
        self.req_id = req_id
        self.topic = topic
        self.principal = principal  # whose rights it was opened with (rechecked when they change)
        self.data = data            # what its topic needs (a cursor, an ID, a chat's state)


class Subscriptions:
    def __init__(self) -> None:
        self._by_topic: dict[Topic, list[Subscription]] = {}
        self._by_conn: dict[object, dict[int, Subscription]] = {}  # conn -> request id -> subscription
        self.outbox: list[Answer] = []

    def open(self, conn: object, req_id: int, topic: Topic, principal: bytes | None, data: Any = None) -> Subscription:
        sub = Subscription(conn, req_id, topic, principal, data)
        self._by_topic.setdefault(topic, []).append(sub)
        self._by_conn.setdefault(conn, {})[req_id] = sub
        return sub

    def move(self, sub: Subscription, topic: Topic) -> None:
        """The subscription follows another topic (its receipt's row changed: kinds/events.py)."""
        if sub.topic == topic:
            return
        subs = self._by_topic[sub.topic]
        subs.remove(sub)
        if not subs:
            del self._by_topic[sub.topic]
        sub.topic = topic
        self._by_topic.setdefault(topic, []).append(sub)

    def of(self, topic: Topic) -> list[Subscription]:
        """The subscriptions of a topic, oldest first (a copy: pushing may end some)."""
        return list(self._by_topic.get(topic, ()))

    def count(self) -> int:
        return sum(len(subs) for subs in self._by_topic.values())

    def all(self) -> list[Subscription]:
        return [sub for subs in self._by_topic.values() for sub in subs]

    def push(self, sub: Subscription, body: bytes, event: str | None = None, cursor: str | None = None,
             index: int = 0, logprobs: list[dict[str, object]] | None = None) -> None:
        """One frame of a subscription: an event's type and cursor, or a chat token's choice and
        logprobs entries, go in the frame (wire.Reply)."""
        self.outbox.append((sub.conn, Reply(id=sub.req_id, status=200, more=True, body=body, event=event,
                                            cursor=cursor, index=index, logprobs=logprobs)))

    def push_all(self, subs: list[Subscription], body: bytes, event: str, cursor: str) -> None:
        """The same event to many subscriptions: one frame per connection, naming them all in `ids`
        (a thousand streams of one gateway watching one conversation cost one frame, not a
        thousand)."""
        for conn, req_ids in self._by_connection(subs).items():
            self.outbox.append((conn, Reply(ids=req_ids, status=200, more=True, body=body, event=event, cursor=cursor)))

    def end(self, sub: Subscription, status: int, body: bytes, event: str | None = None,
            cursor: str | None = None) -> None:
        """The last frame (a final event, or an error that ends the stream); the subscription goes."""
        self.outbox.append((sub.conn, Reply(id=sub.req_id, status=status, body=body, event=event, cursor=cursor)))
        self._remove(sub)

    def end_all(self, subs: list[Subscription], status: int, body: bytes, event: str | None = None,
                cursor: str | None = None) -> None:
        for conn, req_ids in self._by_connection(subs).items():
            self.outbox.append((conn, Reply(ids=req_ids, status=status, body=body, event=event, cursor=cursor)))
        for sub in subs:
            self._remove(sub)

    @staticmethod
    def _by_connection(subs: list[Subscription]) -> dict[object, list[int]]:
        grouped: dict[object, list[int]] = {}
        for sub in subs:
            grouped.setdefault(sub.conn, []).append(sub.req_id)
        return grouped

    def close(self, conn: object, req_id: int) -> Subscription | None:
        """Its owner closes it (no frame follows)."""
        sub = self._by_conn.get(conn, {}).get(req_id)
        if sub is not None:
            self._remove(sub)
        return sub

    def connection_closed(self, conn: object) -> list[Subscription]:
        gone = list(self._by_conn.get(conn, {}).values())
        for sub in gone:
            self._remove(sub)
        return gone

    def take_outbox(self) -> list[Answer]:
        outbox, self.outbox = self.outbox, []
        return outbox

    def _remove(self, sub: Subscription) -> None:
        mine = self._by_conn[sub.conn]
        del mine[sub.req_id]
        if not mine:
            del self._by_conn[sub.conn]
        subs = self._by_topic[sub.topic]
        subs.remove(sub)
        if not subs:
            del self._by_topic[sub.topic]
