"""bench/http.py's ceiling: a trivial RSGI application answering a fixed 200 with a receipt-sized
JSON body, run by the gateway's own server with its settings and worker count (shared_api/http/
server.py: granian, uvloop, HTTP/1.1, the access log). It does the protocol work of the gateway's
path and nothing else: it reads a request's body when one follows its head (a mutation's), as the
gateway's front does, and answers with one `response_bytes`. No gateway can answer faster on this
machine."""
BODY = b'{"ok":true,"pad":"' + b"x" * 1000 + b'"}'
HEADERS = [("content-type", "application/json"), ("cache-control", "no-store"), ("x-content-type-options", "nosniff")]


class Ceiling:
    async def __rsgi__(self, scope, proto):
        headers = scope.headers
        if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
            async for _ in proto:  # the body, chunk by chunk, as the front reads it
                pass
        proto.response_bytes(200, HEADERS, BODY)


app = Ceiling()
