"""The KV page pool: a free list of page ids. A sequence's block table is the list of pages it owns,
in order; token `t` of the sequence lives in page `pages[t // page_size]` at offset `t % page_size`.

Pages are handed out whole at admission (a request's full page limit), so a running sequence can
never run out of pages and nothing is ever evicted; the scheduler decides who may take them.
"""

from __future__ import annotations

from collections import deque


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class BlockManager:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        self._free = deque(range(num_pages))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV pool has {len(self._free)} free pages, {n} requested")
        pages = [self._free.popleft() for _ in range(n)]
        self._allocated.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            # A double free would hand one page to two sequences and silently mix their caches.
            if page not in self._allocated:
                raise RuntimeError(f"page {page} is not allocated")
            self._allocated.remove(page)
        self._free.extend(pages)
