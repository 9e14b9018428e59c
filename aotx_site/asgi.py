"""The gateway's ASGI application: event streams go to their Channels consumers
(shared_api/streams.py), every other request to Django."""
import gc
import os
from typing import Any, Awaitable, Callable

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "aotx_site.settings")
from django.core.asgi import get_asgi_application  # noqa: E402

django_application = get_asgi_application()  # sets Django up before the consumers are imported

from shared_api.streams import STREAMS, wants_stream  # noqa: E402

_consumers = {cls: cls.as_asgi() for cls in STREAMS}


async def application(scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                      send: Callable[[Any], Awaitable[None]]) -> None:
    consumer = wants_stream(scope) if scope["type"] == "http" else None
    if consumer is None:
        await django_application(scope, receive, send)
        return
    await _consumers[consumer](scope, receive, send)

# Everything loaded so far lives as long as the process: move it out of the collector's reach so
# full collections stay short (they otherwise show up in request tail latency).
gc.freeze()
