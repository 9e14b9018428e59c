"""Host-side counts the device keeps beside its tables and outside them: a rebuild of the tables
(after an ENOSPC) keeps them. `Usage` is what per-principal quotas count that no table gives
(kinds/quotas.py), `Chats` numbers chat requests and counts their tokens (kinds/chat.py)."""
from __future__ import annotations

import itertools
from collections import Counter


class Chats:
    """Numbers chat requests; each live chat is a subscription ("chat", number) whose frames are
    its tokens (loop/subscriptions.py); its choices are the engine requests ("chat", number, i).
    Counts the tokens the engine generated for chats since boot (`ping`'s "chats"), those of a chat
    whose client has gone included: ops see what the model spent, and whether a cancelled chat stopped."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.output_tokens = 0

    def next_id(self) -> tuple[str, int]:
        return ("chat", next(self._ids))


class Usage:
    """Host-side counts the tables cannot give: uploads between their check and their saved
    owner, chats between their check and their end. Both live on the tick thread. It also keeps
    the device's default quotas, computed once per runtime file object (`limit` asks at every
    admission)."""

    def __init__(self) -> None:
        self.media_in_flight: Counter[int] = Counter()  # participant row -> bytes of unsaved uploads
        self.chats_tokenizing: Counter[bytes] = Counter()  # principal -> chats not yet handed to the engine
        self.defaults: tuple[object, dict[str, int]] | None = None  # (the runtime they are of, `defaults`)
        # (the DeviceState it is of, {participant row: {receipt row: page limit}}) of the inputs
        # without a terminal result: built by one scan of the receipt table when the state is new
        # (boot, a rebuild after ENOSPC), then kept by `input_admitted` and `input_finished`, so
        # that a queued_inputs check (every default principal has one) costs no scan
        self.unfinished: tuple[object, dict[int, dict[int, int]]] | None = None

    def chat_prepared(self, principal: bytes) -> None:
        """A chat's prompt is tokenized (or an embedding request done): it stops counting here."""
        self.chats_tokenizing[principal] -= 1
        if self.chats_tokenizing[principal] <= 0:
            del self.chats_tokenizing[principal]
