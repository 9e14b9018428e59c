"""A conversation's retained history (docs/memory.md, "Conversation context"): the turns whose
receipts were retired, kept in the conversation's own row of the history table so the context of
later inputs does not depend on live receipts.

A retirement folds each succeeded input it frees into its conversation's history, in event
order. The history row holds at most the profile's `history_bytes` (default 8192) as records

    order|2^31 u32 | author u32 | user length u32 | user bytes | answer length u32 | answer bytes

oldest first, where the author is the participant row of the input's submitter, so that an input
whose submitter may not read the space is given its own retired turns only (DESIGN §8). A record
without bit 31 in its first word has no author word (a checkpoint's history from before authors
were kept): its author is unknown, and only readers of the space are given it. When a new record
does not fit, the oldest records go, and one turn alone larger than the row keeps the end of its
answer that fits. Replay folds the same receipts at the same retirement, so the history is
rebuilt exactly; a checkpoint saves the used bytes.
"""
from __future__ import annotations

import bisect
import struct

from ..state.tables import C, R, Terminal
from .inputs import input_text
from .kind import Tables


_U32 = struct.Struct("<I")
AUTHORED = 1 << 31  # the first word's flag: an author word follows (event orders stay below it)
UNKNOWN = -1        # the author of a record written before authors were kept


def _records(data: bytes) -> list[tuple[int, int, bytes, bytes]]:
    """(order, author, user, answer) of each record, oldest first."""
    out, pos = [], 0
    while pos < len(data):
        (order,) = _U32.unpack_from(data, pos)
        pos += _U32.size
        author = UNKNOWN
        if order & AUTHORED:
            order &= ~AUTHORED
            (author,) = _U32.unpack_from(data, pos)
            pos += _U32.size
        (user_len,) = _U32.unpack_from(data, pos)
        pos += _U32.size
        user = data[pos:pos + user_len]
        pos += user_len
        (answer_len,) = _U32.unpack_from(data, pos)
        pos += _U32.size
        out.append((order, author, user, data[pos:pos + answer_len]))
        pos += answer_len
    return out


def _encode(order: int, author: int, user: bytes, answer: bytes) -> bytes:
    head = _U32.pack(order) if author == UNKNOWN else _U32.pack(order | AUTHORED) + _U32.pack(author)
    return head + _U32.pack(len(user)) + user + _U32.pack(len(answer)) + answer


def turns(d: Tables, crow: int) -> list[tuple[int, int, str, str]]:
    """The retained turns of a conversation: (event order, author's participant row or UNKNOWN,
    user text, answer), oldest first."""
    t = d.state.tables
    data = t.get_bytes(t.history, crow, t.value(t.conversations, crow, C.HISTORY_LEN))
    return [(order, author, user.decode("utf-8", "replace"), answer.decode("utf-8", "replace"))
            for order, author, user, answer in _records(data)]


def copy_turns(d: Tables, source: int, crow: int, at: int) -> None:
    """A fork's history (kinds/forks.py): conversation `source`'s turns through event order `at`,
    retired (its history row) and live (its succeeded inputs' receipts), as the retired turns of
    conversation `crow`, oldest first, the oldest dropped where they do not fit the row."""
    t = d.state.tables
    records = [r for r in _records(t.get_bytes(t.history, source, t.value(t.conversations, source, C.HISTORY_LEN)))
               if r[0] <= at]
    for rrow in d.state.conversations.inputs_of(source):
        row = t.row(t.receipts, rrow)
        if row[R.ORDER] <= at and row[R.TERMINAL] == Terminal.SUCCEEDED:
            records.append((row[R.ORDER], row[R.PARTICIPANT], *_turn(d, rrow, t.history.shape[1])))
    _write(d, crow, sorted(records))


def _turn(d: Tables, rrow: int, limit: int) -> tuple[bytes, bytes]:
    """An input's (user text, answer) as its history record keeps them: one turn alone larger than
    the row keeps its user text, then the end of its answer that fits."""
    t = d.state.tables
    user = input_text(d, rrow).encode("utf-8")
    answer = t.get_bytes(t.result_bytes, rrow, t.value(t.receipts, rrow, R.RESULT_LEN))
    overhead = 4 * _U32.size
    if overhead + len(user) + len(answer) > limit:
        user = user[:max(0, limit - overhead)]
        room = limit - overhead - len(user)
        answer = answer[len(answer) - room:] if room > 0 else b""
    return user, answer


def _write(d: Tables, crow: int, records: list[tuple[int, int, bytes, bytes]]) -> None:
    """A conversation's history row as `records` (sorted), the oldest dropped beyond its bound."""
    t = d.state.tables
    encoded = [_encode(*r) for r in records]
    while sum(map(len, encoded)) > t.history.shape[1]:
        encoded.pop(0)
    data = b"".join(encoded)
    t.put_bytes(t.history, crow, data)
    t.write_row(t.conversations, crow, {C.HISTORY_LEN: len(data)})


def fold(d: Tables, rows: list[list[int]], rrows: list[int]) -> None:
    """Keep retiring inputs' turns (succeeded ones: the context holds no others), `rows` their
    receipt rows' values, in retirement order: each conversation's history is read and written
    once, with what folding them one at a time gives (each turn inserted in event order, then the
    oldest dropped while the row is over its bound; a retirement freed hundreds of inputs, and
    rewriting a conversation's row for each was most of replaying retirements)."""
    t = d.state.tables
    limit = t.history.shape[1]
    turns: dict[int, list[tuple[int, int, int]]] = {}  # conversation row -> (order, author, receipt row)
    for row, rrow in zip(rows, rrows):
        if row[R.TERMINAL] == Terminal.SUCCEEDED:
            turns.setdefault(row[R.TARGET], []).append((row[R.ORDER], row[R.PARTICIPANT], rrow))
    for crow, new in turns.items():
        if t.value(t.conversations, crow, C.STATE) != 1:
            continue
        records = _records(t.get_bytes(t.history, crow, t.value(t.conversations, crow, C.HISTORY_LEN)))
        _write(d, crow, merge(records, [(order, author, *_turn(d, rrow, limit)) for order, author, rrow in new], limit))


def merge(records: list[tuple[int, int, bytes, bytes]], new: list[tuple[int, int, bytes, bytes]],
          limit: int) -> list[tuple[int, int, bytes, bytes]]:
    """A history row's records (sorted, within `limit` encoded bytes) with `new` folded in one after
    another: each inserted where sorted() of the records with it puts it, then the oldest dropped
    while they are over `limit` (each record alone is within it: `_turn`)."""
    records = list(records)
    sizes = [_size(r) for r in records]
    total = sum(sizes)
    for record in new:
        at = bisect.bisect_right(records, record)
        records.insert(at, record)
        sizes.insert(at, _size(record))
        total += sizes[at]
        drop = 0
        while total > limit:
            total -= sizes[drop]
            drop += 1
        del records[:drop], sizes[:drop]
    return records


def _size(record: tuple[int, int, bytes, bytes]) -> int:
    """The length of `_encode(*record)`."""
    return (3 if record[1] == UNKNOWN else 4) * _U32.size + len(record[2]) + len(record[3])


def forget_user_texts(d: Tables, crow: int, texts: list[bytes]) -> None:
    """A forgotten memory source's turn (kinds/memory_deletions.py): the user text of the records
    that hold one of `texts` is emptied (the answer stays), the row rewritten without it."""
    t = d.state.tables
    records = _records(t.get_bytes(t.history, crow, t.value(t.conversations, crow, C.HISTORY_LEN)))
    if not any(user in texts for _, _, user, _ in records):
        return
    data = b"".join(_encode(order, author, b"" if user in texts else user, answer)
                    for order, author, user, answer in records)
    t.put_bytes(t.history, crow, data + bytes(t.value(t.conversations, crow, C.HISTORY_LEN) - len(data)))
    t.write_row(t.conversations, crow, {C.HISTORY_LEN: len(data)})
