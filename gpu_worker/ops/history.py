"""A conversation's retained history (docs/memory.md, "Conversation context"): the turns whose
receipts were retired, kept in the conversation's own row of the history table so the context of
later inputs does not depend on live receipts.

A retirement folds each succeeded input it frees into its conversation's history, in event
order. The history row holds at most the profile's `history_bytes` (default 8192) as records

    order u32 | user length u32 | user bytes | answer length u32 | answer bytes

oldest first; when a new record does not fit, the oldest records go, and one turn alone larger
than the row keeps the end of its answer that fits. Replay folds the same receipts at the same
retirement, so the history is rebuilt exactly; a checkpoint saves the used bytes.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from ..state.tables import C, R, Terminal
from .inputs import input_text

if TYPE_CHECKING:
    from ..device import Device

_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<II")  # order, user length


def _records(data: bytes) -> list[tuple[int, bytes, bytes]]:
    out, pos = [], 0
    while pos < len(data):
        order, user_len = _HEAD.unpack_from(data, pos)
        pos += _HEAD.size
        user = data[pos:pos + user_len]
        pos += user_len
        (answer_len,) = _U32.unpack_from(data, pos)
        pos += _U32.size
        out.append((order, user, data[pos:pos + answer_len]))
        pos += answer_len
    return out


def _encode(order: int, user: bytes, answer: bytes) -> bytes:
    return _HEAD.pack(order, len(user)) + user + _U32.pack(len(answer)) + answer


def turns(d: Device, crow: int) -> list[tuple[int, str, str]]:
    """The retained turns of a conversation: (event order, user text, answer), oldest first."""
    t = d.state.tables
    data = t.get_bytes(t.history, crow, t.value(t.conversations, crow, C.HISTORY_LEN))
    return [(order, user.decode("utf-8", "replace"), answer.decode("utf-8", "replace"))
            for order, user, answer in _records(data)]


def fold(d: Device, rrow: int) -> None:
    """Keep a retiring input's turn (a succeeded one: the context holds no others)."""
    t = d.state.tables
    row = t.row(t.receipts, rrow)
    if row[R.TERMINAL] != Terminal.SUCCEEDED:
        return
    crow = row[R.TARGET]
    if t.value(t.conversations, crow, C.STATE) != 1:
        return
    limit = t.history.shape[1]
    user = input_text(d, rrow).encode("utf-8")
    answer = t.get_bytes(t.result_bytes, rrow, row[R.RESULT_LEN])
    overhead = _HEAD.size + _U32.size
    if overhead + len(user) + len(answer) > limit:  # alone too large: the user text, then the answer's end
        user = user[:max(0, limit - overhead)]
        room = limit - overhead - len(user)
        answer = answer[len(answer) - room:] if room > 0 else b""
    old = _records(t.get_bytes(t.history, crow, t.value(t.conversations, crow, C.HISTORY_LEN)))
    records = sorted(old + [(row[R.ORDER], user, answer)])
    encoded = [_encode(*r) for r in records]
    while sum(map(len, encoded)) > limit:
        encoded.pop(0)
    data = b"".join(encoded)
    t.put_bytes(t.history, crow, data)
    t.write_row(t.conversations, crow, {C.HISTORY_LEN: len(data)})
