"""The KV page pool, with a prefix cache over full pages.

A sequence's block table is the list of pages it owns, in order; token `t` of the sequence lives in
page `pages[t // page_size]` at offset `t % page_size`. Pages are handed out whole at admission (a
request's full page limit), so a running sequence can never run out of pages; the scheduler decides
who may take them.

Prefix cache (as vLLM's automatic prefix caching): a full page whose keys and values are written is
registered under the hash of its tokens chained to the hash of every page before it (`page_hashes`:
SHA-256, salted with the tenant, so pages are shared only between requests of one principal and a
crafted collision cannot hand one principal another's context). A new request whose prompt starts
with registered pages takes them instead of fresh ones (several requests may hold one page: its
reference count) and prefills only the rest. Such pages are read-only: a request writes only past
its cached prefix, into fresh pages. A page whose last holder finishes stays registered, unowned
and evictable; allocation takes free pages first, then evicts the least recently used of those. So
reuse never takes a page from the pool's accounting: the scheduler budgets every request's whole
page limit as before, and an evictable page is as good as free.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Hashable, Sequence


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def page_hashes(tenant: Hashable, tokens: Sequence[int], page_size: int, pages: int,
                start: bytes | None = None, first: int = 0) -> list[bytes]:
    """The chained hashes of pages `first`..`pages - 1` of `tokens` (full pages), after the hash
    `start` of the page before `first` (None: the tenant's salt)."""
    previous = start if start is not None else hashlib.sha256(b"aotx/kv-prefix\0" + repr(tenant).encode()).digest()
    out = []
    for page in range(first, pages):
        chunk = tokens[page * page_size:(page + 1) * page_size]
        previous = hashlib.sha256(previous + b"".join(t.to_bytes(4, "little") for t in chunk)).digest()
        out.append(previous)
    return out


class BlockManager:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        self._free = deque(range(num_pages))
        self._refs: dict[int, int] = {}                       # page -> holders (allocated pages only)
        self._cached: dict[bytes, int] = {}                   # prefix hash -> page
        self._hash_of: dict[int, bytes] = {}                  # registered page -> its hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, no holder: LRU first
        self.hits = 0      # pages taken from the cache
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Pages an allocation may take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_allocated(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"KV pool has {self.num_free} free pages, {n} requested")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:  # the least recently used cached page nobody holds
                page, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of.pop(page)]
                self.evictions += 1
            self._refs[page] = 1
            pages.append(page)
        return pages

    def match(self, hashes: list[bytes]) -> list[int]:
        """Take the registered pages of the longest prefix of `hashes` (each one more holder)."""
        pages = []
        for h in hashes:
            page = self._cached.get(h)
            if page is None:
                break
            if page in self._evictable:
                del self._evictable[page]
                self._refs[page] = 1
            else:
                self._refs[page] += 1
            pages.append(page)
        self.hits += len(pages)
        return pages

    def register(self, pages: list[int], hashes: list[bytes]) -> None:
        """Pages whose keys and values are now written, under their prefix hashes (a hash already
        registered keeps its page: the other is freed as usual when its holder ends)."""
        for page, h in zip(pages, hashes):
            if h not in self._cached and page not in self._hash_of:
                self._cached[h] = page
                self._hash_of[page] = h

    def free(self, pages: list[int]) -> None:
        for page in pages:
            # A double free would hand one page to two sequences and silently mix their caches.
            refs = self._refs.get(page)
            if refs is None:
                raise RuntimeError(f"page {page} is not allocated")
            if refs > 1:
                self._refs[page] = refs - 1
                continue
            del self._refs[page]
            if page in self._hash_of:
                self._evictable[page] = None  # most recently used last
            else:
                self._free.append(page)

    def clear_cache(self) -> None:
        """Forget every unowned cached page (they return to the free list)."""
        for page in list(self._evictable):
            del self._cached[self._hash_of.pop(page)]
            self._free.append(page)
        self._evictable.clear()
