"""The Celery broker of a stack without Redis (settings.py): kombu's filesystem transport, with
each message written whole before it can be taken.

kombu's own `_put` opens `<ms>_<uuid>.<queue>.msg` in the folder the worker reads and then writes
the message into it; a worker listing the folder in between moves the empty file away, reads
nothing and dies on the JSON it cannot decode (`make run` then stops, its other processes with
it: honcho). Here the message is written under a name the worker's queue match skips
(`....msg.part`), then renamed into place: a rename within one folder is atomic, so
the worker finds a message whole or not at all. Registered as the transport `aotx-filesystem`.
`_put` is kombu's private method: kombu is pinned in requirements.txt for it, and
tests/shared_api/test_broker.py sends and takes messages through this transport.
"""
from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

PART = ".part"  # a message being written (filesystem.Channel._get takes names ending in ".<queue>.msg")


class Channel(filesystem.Channel):
    # (the signature of kombu's filesystem Channel, which its own base class names otherwise)
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Put `payload` onto `queue`, whole: written under a temporary name, then renamed."""
        name = os.path.join(self.data_folder_out, f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg")
        try:
            with open(os.open(name + PART, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.rename(name + PART, name)
        except OSError as exc:
            raise filesystem.ChannelError(f"Cannot add file {name!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel


TRANSPORT_ALIASES["aotx-filesystem"] = f"{__name__}:Transport"
