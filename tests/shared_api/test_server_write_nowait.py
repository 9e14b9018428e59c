"""shared_api/http/server.py's write_nowait: a streamed response's body chunks written from outside
the application's task, in order with those it sends, under the real uvicorn protocol."""
import http.client
import threading

import uvicorn

from shared_api.http.server import WRITE_NOWAIT, GatewayProtocol
from tests.conftest import free_port


def test_write_nowait_writes_chunks_in_order_with_send_and_only_once_the_response_started():
    seen = {}

    async def app(scope, receive, send):
        nowait = scope["extensions"][WRITE_NOWAIT]
        seen["before start"] = nowait(b"too early")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        seen["first"] = nowait(b"a")
        await send({"type": "http.response.body", "body": b"b", "more_body": True})
        seen["empty"] = nowait(b"")
        seen["second"] = nowait(b"c")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        seen["after end"] = nowait(b"too late")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=GatewayProtocol, loop="asyncio",
                                           lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            threading.Event().wait(0.05)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", "/")
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("transfer-encoding") == "chunked"
        assert response.read() == b"abc"
        connection.close()
    finally:
        server.should_exit = True
        thread.join(10)
    assert seen == {"before start": False, "first": True, "empty": False, "second": True, "after end": False}
