"""bench/http.py's ceiling: a trivial RSGI application answering a fixed 200 with a receipt-sized
JSON body, run by the gateway's own server with its settings and worker count (shared_api/http/
server.py: granian, uvloop, HTTP/1.1). It does the protocol work of the gateway's path and
nothing else: it reads a request's body when one follows its head (a mutation's), as the
gateway's front reads a small one, answers with one `response_bytes`, and writes the gateway's
access log line. No gateway can answer faster on this machine."""
import time

from shared_api.http.server import AccessLog, Logged

BODY = b'{"ok":true,"pad":"' + b"x" * 1000 + b'"}'
HEADERS = [("content-type", "application/json"), ("cache-control", "no-store"), ("x-content-type-options", "nosniff")]


class Ceiling:
    def __init__(self):
        self.access_log = AccessLog()

    async def __rsgi__(self, scope, proto):
        started = time.perf_counter()
        logged = Logged(proto)
        if scope.headers.get("content-length", "0") != "0":
            await logged()  # the body, in one read
        logged.response_bytes(200, HEADERS, BODY)
        self.access_log.add(scope, logged.status, started)


app = Ceiling()
