"""shared_api/http/server.py's ASGI bridge over an RSGI request (tests/rsgi.py's protocol): a
streamed response's chunks keep their order whether they go through the application's `send` or
the fan-out's `write_nowait`, a write the connection did not take at once is finished before the
next, and the response ends (its transport released) when the application sends its last chunk."""
import asyncio

from asgiref.sync import async_to_sync

from shared_api.http.server import WRITE_NOWAIT, Resume, asgi
from tests import rsgi


class SlowStream(rsgi.Stream):
    """A connection that does not take a chunk while `hold` is set: the chunk waits on an event
    put in `held` for the test to set."""

    def __init__(self, proto, held):
        super().__init__(proto)
        self.hold = True
        self.held = held

    async def send_bytes(self, data):
        if self.hold:
            self.hold = False
            release = asyncio.Event()
            self.held.put_nowait(release)
            await release.wait()
        await super().send_bytes(data)


def test_write_nowait_keeps_order_with_send_and_finishes_a_waiting_write_first():
    async def go():
        proto = rsgi.Protocol([])
        held = asyncio.Queue()
        slow = None

        def response_stream(status, headers):
            nonlocal slow
            proto._start(status, headers)
            proto.streamed = True
            slow = SlowStream(proto, held)
            return slow
        proto.response_stream = response_stream
        seen = []

        async def app(scope, receive, send):
            write_nowait = scope["extensions"][WRITE_NOWAIT]
            assert write_nowait(b"early") is False  # no response started yet
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"open;", "more_body": True})  # held, then let go
            seen.append(write_nowait(b"a;"))  # taken at once
            slow.hold = True  # the next chunk is held
            seen.append(write_nowait(b"b;"))  # sent, not yet taken: pending
            seen.append(write_nowait(b"c;"))  # refused while one is pending
            await send({"type": "http.response.body", "body": b"d;", "more_body": False})  # after b
            assert write_nowait(b"late") is False  # the response has ended

        async def let_go():  # the connection takes each held chunk once its write waits
            while True:
                (await held.get()).set()
        letting = asyncio.ensure_future(let_go())
        try:
            started = await asgi(app, {"type": "http", "path": "/"}, proto)
        finally:
            letting.cancel()
        return started, proto, seen

    started, proto, seen = async_to_sync(go)()
    assert started and proto.status == 200 and proto.streamed
    assert seen == [True, True, False]
    assert bytes(proto.body) == b"open;a;b;d;"


def test_resume_finishes_an_awaitable_started_outside_a_task():
    async def go():
        done = asyncio.get_running_loop().create_future()
        order = []

        async def ready():
            order.append("at once")

        async def write():
            await done
            order.append("written")
        assert Resume.start(ready()) is None  # complete at its first step: nothing to resume
        waiting = Resume.start(write())
        assert waiting is not None and order == ["at once"]
        asyncio.get_running_loop().call_soon(done.set_result, None)
        await waiting
        return order

    assert async_to_sync(go)() == ["at once", "written"]
