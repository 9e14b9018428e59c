"""bench/http.py's ceiling: a trivial application answering a fixed 200 with a receipt-sized JSON
body, run by the gateway's own server (shared_api/http/server.py: uvicorn, GatewayProtocol, uvloop,
proxy headers off) with the gateway's worker count. It does the protocol work of the gateway's
path and nothing else: a request whose body came with its headers is answered through the
protocol's native hook (`native`, as shared_api/http/front.py's shared routes are: no ASGI task, one
write), and anything else through ASGI, as the gateway would. No gateway can answer faster on
this machine."""
BODY = b'{"ok":true,"pad":"' + b"x" * 1000 + b'"}'
HEADERS = [(b"content-type", b"application/json"), (b"cache-control", b"no-store"),
           (b"content-length", str(len(BODY)).encode())]


class Ceiling:
    def native(self, scope, body, answer) -> bool:
        """The native path's answer (shared_api/http/server.py calls it with the whole request)."""
        answer(200, BODY, HEADERS)
        return True

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        while True:  # read the request body (a mutation's), as a real view does
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        await send({"type": "http.response.body", "body": BODY})


app = Ceiling()
