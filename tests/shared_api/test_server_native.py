"""shared_api/http/server.py's native path under the real uvicorn protocol: a request whose body arrives
with its headers goes to the application's `native`, which answers it (now or later) without an
ASGI task, or declines it to the ASGI path; bodies still arriving, pipelined requests and closing
connections keep HTTP's rules."""
import asyncio
import socket

import uvicorn

from tests.conftest import free_port, wait_for
from tests.shared_api.test_server_body_ready import serve


class App:
    """An ASGI app with a native path: `mode` says what native does with each request ("now",
    "later": 0.2 s later, "held": when the test calls `release`, "decline", "raise")."""

    def __init__(self, mode):
        self.mode = mode
        self.native_calls = []
        self.asgi_started = []  # paths, as each ASGI call begins (before it reads the body)
        self.asgi_calls = []
        self.held = []  # (loop, answer, reply, headers) of the "held" requests
        self.released = []  # what each released answer raised (None: nothing)

    def native(self, scope, body, answer):
        self.native_calls.append((scope["path"], body))
        mode = self.mode(scope["path"])
        if mode == "decline":
            return False
        if mode == "raise":
            raise RuntimeError("a bug")
        reply = b"native:" + body
        headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(reply))]
        if mode == "later":
            asyncio.get_running_loop().call_later(0.2, answer, 200, reply, headers)
        elif mode == "held":
            self.held.append((asyncio.get_running_loop(), answer, reply, headers))
        else:
            answer(200, reply, headers)
        return True

    def release(self):
        """Answer the oldest held request now, on the server's loop; what it raised goes to `released`."""
        loop, answer, reply, headers = self.held.pop(0)

        def go():
            try:
                answer(200, reply, headers)
                self.released.append(None)
            except Exception as exc:  # (recorded for the test to see, not lost in the loop's handler)
                self.released.append(exc)
        loop.call_soon_threadsafe(go)

    async def __call__(self, scope, receive, send):
        self.asgi_started.append(scope["path"])
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.asgi_calls.append((scope["path"], body))
        reply = b"asgi:" + body
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(reply))]})
        await send({"type": "http.response.body", "body": reply})


def request(path, body, extra=b""):
    return b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s" % (path.encode(), extra, len(body), body)


def replies(sock, count):
    """`count` responses read off the socket: [(head, body)]."""
    data, out = b"", []
    while len(out) < count:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return out
            data += chunk
        head, _, data = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(data) < length:
            data += sock.recv(65536)
        out.append((head, data[:length]))
        data = data[length:]
    return out


def run(app, check):
    server, thread, port = serve(app)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            check(sock)
    finally:
        server.should_exit = True
        thread.join(10)


def test_whole_requests_are_answered_natively_on_a_kept_alive_connection():
    app = App(lambda path: "now")

    def check(sock):
        for i in range(3):
            sock.sendall(request("/a", b"%d" % i))
            [(head, body)] = replies(sock, 1)
            assert head.startswith(b"HTTP/1.1 200 OK") and body == b"native:%d" % i
            assert b"\r\ndate: " in head.lower() and b"connection: close" not in head
    run(app, check)
    assert app.asgi_calls == [] and [b for _, b in app.native_calls] == [b"0", b"1", b"2"]


def test_a_declined_or_failing_request_goes_to_the_asgi_application_and_the_connection_goes_on():
    app = App(lambda path: {"/no": "decline", "/bug": "raise"}.get(path, "now"))

    def check(sock):
        for path, expected in (("/no", b"asgi:x"), ("/a", b"native:x"), ("/bug", b"asgi:x"), ("/a", b"native:x")):
            sock.sendall(request(path, b"x"))
            assert replies(sock, 1)[0][1] == expected
    run(app, check)
    assert app.asgi_calls == [("/no", b"x"), ("/bug", b"x")]


def test_a_body_still_arriving_at_the_end_of_a_read_goes_to_the_asgi_application():
    app = App(lambda path: "now")

    def check(sock):
        sock.sendall(request("/a", b"x" * 1000)[:-500])
        # the rest is sent once the server has read the first part and started it on the ASGI path
        wait_for(lambda: app.asgi_started, 30, what="the request started as an ASGI task")
        sock.sendall(b"x" * 500)
        assert replies(sock, 1)[0][1] == b"asgi:" + b"x" * 1000
    run(app, check)
    assert app.native_calls == []


def test_pipelined_requests_are_answered_in_order_behind_a_native_answer_that_comes_later():
    app = App(lambda path: "later" if path == "/slow" else "now")

    def check(sock):
        sock.sendall(request("/slow", b"1") + request("/a", b"2") + request("/a", b"3"))
        assert [body for _, body in replies(sock, 3)] == [b"native:1", b"asgi:2", b"asgi:3"]
    run(app, check)


def test_connection_close_closes_after_the_native_answer_and_a_client_gone_first_is_no_error():
    app = App(lambda path: "later")

    def check(sock):
        sock.sendall(request("/a", b"1", b"Connection: close\r\n"))
        [(head, body)] = replies(sock, 1)
        assert body == b"native:1" and b"connection: close" in head.lower()
        assert sock.recv(10) == b""  # closed by the server
    run(app, check)
    # a client that closes before the answer is written: the answer comes once the server has seen
    # the connection end, and is no error
    gone = App(lambda path: "held")
    server, thread, port = serve(gone)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request("/a", b"1"))
            wait_for(lambda: gone.held, 30, what="the request held on the native path")
        wait_for(lambda: not server.server_state.connections, 30, what="the server to see the client gone")
        gone.release()
        wait_for(lambda: gone.released, 30, what="the held answer given")
    finally:
        server.should_exit = True
        thread.join(10)
    assert len(gone.native_calls) == 1 and gone.released == [None]


def test_the_gateways_server_settings_leave_the_front_unwrapped_so_its_native_path_is_used(db):
    from aotx_site.asgi import application
    from shared_api.http.server import APPLICATION, options
    config = uvicorn.Config(APPLICATION, **{**options({"host": "127.0.0.1", "port": free_port(), "workers": 1,
                                                       "idle_timeout": 15}), "log_config": None})
    config.load()
    assert config.loaded_app is application and callable(config.loaded_app.native)
