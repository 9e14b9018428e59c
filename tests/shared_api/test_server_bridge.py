"""shared_api/http/server.py's ASGI bridge over an RSGI request (tests/rsgi.py's protocol): a
streamed response's chunks keep their order whether they go through the application's `send` or
the fan-out's `write_nowait`, a write the connection did not take at once is finished before the
next, and the response ends (its transport released) when the application sends its last chunk."""
import asyncio

from asgiref.sync import async_to_sync

from shared_api.http.server import WRITE_NOWAIT, Resume, asgi
from tests import rsgi


class SlowStream(rsgi.Stream):
    """A connection that does not take the first chunk until `release` is set."""

    def __init__(self, proto):
        super().__init__(proto)
        self.release = asyncio.Event()
        self.first = True

    async def send_bytes(self, data):
        if self.first:
            self.first = False
            await self.release.wait()
        await super().send_bytes(data)


def test_write_nowait_keeps_order_with_send_and_finishes_a_waiting_write_first():
    async def go():
        proto = rsgi.Protocol([])
        slow = None

        def response_stream(status, headers):
            nonlocal slow
            proto._start(status, headers)
            proto.streamed = True
            slow = SlowStream(proto)
            return slow
        proto.response_stream = response_stream
        seen = []

        async def app(scope, receive, send):
            write_nowait = scope["extensions"][WRITE_NOWAIT]
            assert write_nowait(b"early") is False  # no response started yet
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"open;", "more_body": True})  # waits for release
            seen.append(write_nowait(b"a;"))  # taken at once
            slow.first = True  # the next chunk waits
            slow.release.clear()
            seen.append(write_nowait(b"b;"))  # sent, not yet taken: pending
            seen.append(write_nowait(b"c;"))  # refused while one is pending
            asyncio.get_running_loop().call_later(0.01, slow.release.set)
            await send({"type": "http.response.body", "body": b"d;", "more_body": False})  # after b
            assert write_nowait(b"late") is False  # the response has ended

        async def opener():
            await asyncio.sleep(0.01)
            slow.release.set()
        opening = asyncio.ensure_future(opener())
        started = await asgi(app, {"type": "http", "path": "/"}, proto)
        await opening
        return started, proto, seen

    started, proto, seen = async_to_sync(go)()
    assert started and proto.status == 200 and proto.streamed
    assert seen == [True, True, False]
    assert bytes(proto.body) == b"open;a;b;d;"


def test_resume_finishes_an_awaitable_started_outside_a_task():
    async def go():
        done = asyncio.get_running_loop().create_future()
        order = []

        async def write():
            await done
            order.append("written")
        assert Resume.start(asyncio.sleep(0, "now")) is not None  # (sleep(0) yields once)
        waiting = Resume.start(write())
        assert waiting is not None and order == []
        asyncio.get_running_loop().call_soon(done.set_result, None)
        await waiting
        return order

    assert async_to_sync(go)() == ["written"]
