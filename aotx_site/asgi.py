import gc
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "aotx_site.settings")
from django.core.asgi import get_asgi_application  # noqa: E402

application = get_asgi_application()
# Everything loaded so far lives as long as the process: move it out of the collector's reach so
# full collections stay short (they otherwise show up in request tail latency).
gc.freeze()
