"""shared_api/http/server.py's body_ready: a request body that has all arrived is handed over without
a wait, one that is still coming is left to `receive` (with its timeout), under the real uvicorn
protocol; the front's read_body gives the same bytes either way."""
import socket
import threading

import uvicorn

from shared_api.http.front import read_body
from shared_api.http.server import BODY_READY, GatewayProtocol
from tests.conftest import free_port, wait_for


def serve(app):
    """`app` under GatewayProtocol in a thread (proxy_headers off, as the gateway runs: the protocol
    then sees the application itself); (server, thread, port)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=GatewayProtocol, loop="asyncio",
                                           lifespan="off", log_level="warning", proxy_headers=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), 30, what="the server listening")
    assert server.started, "the server thread ended before it listened"
    return server, thread, port


def post(port, pieces, after_first=None):
    """POST /echo with a Content-Length body sent in `pieces` (`after_first()` runs once the first
    piece, with the headers, is sent: it waits for whatever must happen before the rest is sent);
    the reply's body."""
    body = b"".join(pieces)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + pieces[0])
        if after_first is not None:
            after_first()
        for piece in pieces[1:]:
            sock.sendall(piece)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.endswith(b"!"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    return reply.partition(b"\r\n\r\n")[2]


def test_a_body_that_arrived_whole_is_handed_over_and_one_in_pieces_is_read_through_receive():
    seen = []

    async def app(scope, receive, send):
        ready = scope["extensions"][BODY_READY]
        first = ready()
        seen.append(first is not None)
        body = first if first is not None else await read_body(scope, receive, 1 << 20, "body_too_large", 5)
        if first is not None:
            assert ready() == b""  # taken once, as receive takes it: nothing is handed over twice
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % (len(body) + 1))]})
        await send({"type": "http.response.body", "body": body + b"!"})

    server, thread, port = serve(app)
    try:
        assert post(port, [b'{"a": 1}']) == b'{"a": 1}!'

        def asked():  # the rest is sent once the application has looked and found the body still coming
            wait_for(lambda: len(seen) == 2, 30, what="the application's look at the second body")
        assert post(port, [b"x" * 1000, b"y" * 1000, b"z"], after_first=asked) == b"x" * 1000 + b"y" * 1000 + b"z!"
    finally:
        server.should_exit = True
        thread.join(10)
    assert seen == [True, False]


def test_read_body_refuses_a_whole_body_over_the_limit():
    import asyncio

    from shared_api.http.front import BodyRefused

    class Cycle:  # as uvicorn's RequestResponseCycle holds a body whose end the parser has seen
        more_body, disconnected, response_complete = False, False, False
        body = bytearray(b"x" * 11)
        message_event = asyncio.Event()

        class flow:
            @staticmethod
            def resume_reading():
                pass

    from shared_api.http.server import _body_ready

    async def go():
        scope = {"extensions": {BODY_READY: lambda: _body_ready(Cycle)}}
        try:
            await read_body(scope, None, 10, "body_too_large", 1)
        except BodyRefused as refused:
            return refused.error
    error = asyncio.run(go())
    assert error.status == 413 and error.code == "body_too_large"
