"""The host indexes' maps of IDs to rows, so that no insert ever stops the tick thread for long.

A CPython dict grows by rebuilding its whole table when it fills, which at a million entries stops
the thread that inserts for tens of milliseconds (docs/performance.md, "A checkpoint beside the
ticks"), and each of its entries is a Python object or two. A `FixedMap`
(gpu_worker/native/fixedmap.cpp) maps keys of one fixed layout (16 bytes, a pair of ints, a pair
of 16-byte IDs) to rows: a native open-addressing table sized from the table it indexes, so it
never grows in service, whose entries are no Python objects (docs/architecture.md, "Host
indexes"). Every map of IDs to rows is one.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeVar, overload

from . import native

K = TypeVar("K")
D = TypeVar("D")

NativeFixedMap: Any = native.load("fixedmap").FixedMap  # the type (isinstance)


class FixedMap(Protocol[K]):
    """What a native FixedMap (gpu_worker/native/fixedmap.cpp) answers: a hash table of keys of
    one fixed layout to rows, sized from the table it indexes so that no insert ever rebuilds it
    its entries kept without a Python object each.
    Made by `fixed_map`."""

    slots: int

    def __getitem__(self, key: K) -> int: ...
    def __setitem__(self, key: K, row: int) -> None: ...
    def __delitem__(self, key: K) -> None: ...
    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[K]: ...
    @overload
    def get(self, key: K) -> int | None: ...
    @overload
    def get(self, key: K, default: D) -> int | D: ...
    @overload
    def pop(self, key: K) -> int: ...
    @overload
    def pop(self, key: K, default: D) -> int | D: ...
    def update(self, pairs: Iterable[tuple[K, int]]) -> None: ...
    def put_packed(self, keys: Any, rows: Any) -> None: ...
    def pop_packed(self, keys: Any, strict: bool = ...) -> bytearray: ...
    def keys(self) -> list[K]: ...
    def values(self) -> list[int]: ...
    def items(self) -> list[tuple[K, int]]: ...
    def clear(self) -> None: ...


def fixed_map(layout: str, capacity: int, memory: Any = None, used: int = 0) -> FixedMap[Any]:
    """A FixedMap of keys laid out as `layout` ("b16": 16 bytes; "ii": a tuple of two ints, each
    kept in int64; "b16b16": a tuple of two 16-byte strings), room for `capacity` entries without
    growing: the rows of the table it indexes. A key of another shape is one that is not there.
    `memory`: its table is that writable buffer (`table_bytes` of it), in which another map of the
    same layout and capacity put `used` entries: a child process, forked from this one (the same
    hash seed), that built it in shared memory (gpu_worker/recovery/preload.py)."""
    made: FixedMap[Any] = NativeFixedMap(layout, capacity, memory, used)
    return made


def table_bytes(layout: str, capacity: int) -> int:
    """The bytes of the table a FixedMap of that layout and capacity is made with (its `memory`)."""
    size: int = NativeFixedMap.table_bytes(layout, capacity)
    return size
