"""bench/http.py's ceiling: a trivial application answering a fixed 200 with a receipt-sized JSON
body, run by the gateway's own server (shared_api/http/server.py: uvicorn, GatewayProtocol, uvloop,
proxy headers off) with the gateway's worker count. It does the protocol work of the gateway's
path and nothing else: one ASGI task per request that reads the body and sends the two response
messages, as shared_api/http/front.py's shared routes do. No gateway can answer faster on this machine."""
BODY = b'{"ok":true,"pad":"' + b"x" * 1000 + b'"}'
HEADERS = [(b"content-type", b"application/json"), (b"cache-control", b"no-store"),
           (b"content-length", str(len(BODY)).encode())]


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while True:  # read the request body (a mutation's), as a real view does
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})
