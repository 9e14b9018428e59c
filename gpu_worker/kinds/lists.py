"""List reads (SPEC: "List reads accept cursor and limit"): the cursor is the creation counter of
the last item of the previous page, so a page never repeats or skips a row that stays. And the
byte-span reads (SPEC: "Operation reads accept an offset in bytes"), which results and memory
payloads share."""
from __future__ import annotations

import base64
from typing import Any

import torch

from ..contract.errors import ServiceError


def page(table: torch.Tensor, created_col: int, mask: torch.Tensor, cursor: int | None,
         limit: int) -> tuple[list[int], str | None]:
    """Rows of table where mask holds, in creation order after cursor: (rows, next_cursor)."""
    created = table[:, created_col]
    if cursor is not None:
        mask = mask & (created > cursor)
    rows = torch.nonzero(mask).flatten()
    order = torch.argsort(created[rows])
    found: list[int] = rows[order][: limit + 1].tolist()
    more = len(found) > limit
    found = found[:limit]
    next_cursor = str(int(created[found[-1]])) if more and found else None
    return found, next_cursor


def byte_offset(offset: int, length: int) -> int:
    """The `offset` of a byte-span read (result bytes, a memory payload): 0..length."""
    if not offset <= length:
        raise ServiceError(400, "bad_offset", f"offset must be 0..{length}")
    return offset


def byte_span(data: bytes, offset: int) -> dict[str, Any]:
    """Exact bytes from `offset` as a read or a stream shows them: base64, and `text` null unless
    the span is complete UTF-8 (nothing is ever replaced); `offset`, `length` and `next_offset`
    are counters, decimal strings."""
    try:
        text: str | None = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    return {"offset": str(offset), "length": str(len(data)), "next_offset": str(offset + len(data)),
            "bytes": base64.b64encode(data).decode(), "text": text}
