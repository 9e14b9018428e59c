"""The gateway's application (served through RSGI by granian: shared_api/http/server.py): the HTTP
front (shared_api/http/front.py) answers the shared and OpenAI-compatible routes itself, hands event
streams to their Channels consumers (shared_api/streams/events.py) and every other request to
Django's ASGI handler."""
import gc
import os
from typing import cast

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "aotx_site.settings")
from django.core.asgi import get_asgi_application  # noqa: E402

django_application = get_asgi_application()  # sets Django up before the consumers are imported

from shared_api.http.front import Front  # noqa: E402
from shared_api.http.server import ASGIApp, Scope  # noqa: E402
from shared_api.streams.events import STREAMS, wants_stream  # noqa: E402

_consumers = {cls: cls.as_asgi() for cls in STREAMS}


def _stream_consumer(scope: Scope) -> ASGIApp | None:
    consumer = wants_stream(scope)
    return _consumers[consumer] if consumer is not None else None


application = Front(cast("ASGIApp", django_application), _stream_consumer)  # (its stubs' Mapping messages)

# Everything loaded so far lives as long as the process: move it out of the collector's reach so
# full collections stay short (they otherwise show up in request tail latency).
gc.freeze()
