"""The runtime file (.aotxccir): one container holding everything the device needs except credentials.

docs/runtime-file.md describes the byte layout; this module holds it — the superblock slots, the
directory, the component kinds, the feature bits and the default profiles — and reads it
(`RuntimeFile`). A file is two superblock slots (A at 0, B at 4096) followed by 4096-aligned
extents. The valid superblock with the highest generation names the current directory extent, and
the directory names every component extent. Writing a file is runtime_file_writer.py (`create`,
`append`), under the one writer's lock of runtime_file_lock.py; no other code reads or writes the
format.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import math
import mmap
import os
import struct
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..loop.threads import enter_background

if TYPE_CHECKING:
    import torch

if sys.byteorder != "little":  # extents hold raw little-endian tensors that boot maps without conversion
    raise ImportError("gpu_worker.runtime_file requires a little-endian host")

MAGIC = b"AOTXCCIR"
FORMAT_VERSION = 1
SLOT_SIZE = 4096
SLOT_OFFSETS = (0, SLOT_SIZE)
SLOT_NAMES = ("A", "B")
DATA_START = 2 * SLOT_SIZE
ALIGN = 4096
AUDIT = "audit/"  # the name prefix of a checkpoint's audit extents, `audit/<generation>` (docs/runtime-file.md)

# magic, format_version, header_size, required_features, optional_features, file_incarnation,
# generation, directory_offset, directory_length, directory_sha256, checksum (sha256 of the
# preceding 104 bytes). The rest of the 4096-byte slot is zero.
SUPERBLOCK = struct.Struct("<8sIIQQ16sQQQ32s32s")
CHECKSUM_OFFSET = SUPERBLOCK.size - 32

FEATURE_BASE = 1 << 0
FEATURE_SHARED = 1 << 1
KNOWN_REQUIRED = FEATURE_BASE | FEATURE_SHARED
FEATURE_NAMES = {FEATURE_BASE: "base", FEATURE_SHARED: "shared"}

DIRECTORY_SCHEMA = "aotx.ccir.directory.v1"
KINDS = ("tensor", "json", "text", "bytes")
# a tensor component's dtype: torch's of that name, and its size in bytes (the file is opened, its
# directory checked and its extents verified without importing torch: a boot does it while torch loads)
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8, "uint8": 1}

DEFAULT_CAPACITIES = {
    "participants": 1024,
    "spaces": 1024,
    "conversations": 4096,
    "members": 4096,
    "receipts": 1024,
    "command_bytes": 8192,
    "result_bytes": 65536,
    "memory": 4096,  # memory rows: retained sources, interpretations, publications (docs/memory.md)
    "history_bytes": 8192,  # per conversation: the retired turns its context keeps (docs/memory.md)
}
# Treat the two profiles below as read-only templates: copy before changing.
DEFAULT_SHARED_PROFILE = {
    "schema": "aotx.shared.profile.v1",
    "capacities": dict(DEFAULT_CAPACITIES),
    "journal_file_cap_bytes": 1 << 30,
    "checkpoint_journal_bytes": 1 << 28,
}
DEFAULT_RUNTIME_PROFILE = {
    "schema": "aotx.runtime.profile.v1",
    "page_size": 16,
    "kv_pages": 2048,
    # 160 pages = 2560 tokens: a full 2048-byte input, 256 output tokens and the chat template.
    "page_grant": 160,
    "deadline_ms": 120000,
    "min_free_disk_bytes": 64 << 20,
    "max_output_tokens": 256,
}


class RuntimeFileError(Exception):
    """A runtime file that cannot be used; the message is one line and names the file."""


@dataclass(frozen=True)
class Component:
    name: str
    kind: str
    offset: int
    length: int
    sha256: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "offset": self.offset,
            "length": self.length,
            "sha256": self.sha256,
            "dtype": self.dtype,
            "shape": list(self.shape) if self.shape is not None else None,
        }


@dataclass(frozen=True)
class Superblock:
    required_features: int
    optional_features: int
    file_incarnation: bytes
    generation: int
    directory_offset: int
    directory_length: int
    directory_sha256: bytes
    format_version: int = FORMAT_VERSION
    header_size: int = SUPERBLOCK.size

    def pack(self) -> bytes:
        raw = SUPERBLOCK.pack(
            MAGIC, self.format_version, self.header_size, self.required_features,
            self.optional_features, self.file_incarnation, self.generation,
            self.directory_offset, self.directory_length, self.directory_sha256, bytes(32),
        )
        body = raw[:CHECKSUM_OFFSET]
        return (body + hashlib.sha256(body).digest()).ljust(SLOT_SIZE, b"\0")

    @classmethod
    def unpack(cls, slot: bytes) -> "Superblock":
        """Decode one slot; ValueError says why it is not a valid superblock."""
        (magic, version, header_size, required, optional, incarnation, generation,
         dir_offset, dir_length, dir_sha256, checksum) = SUPERBLOCK.unpack_from(slot)
        if magic != MAGIC:
            raise ValueError("bad magic")
        if hashlib.sha256(slot[:CHECKSUM_OFFSET]).digest() != checksum:
            raise ValueError("checksum mismatch")
        if header_size != SUPERBLOCK.size:
            raise ValueError(f"header size {header_size}")
        return cls(required, optional, incarnation, generation, dir_offset, dir_length,
                   dir_sha256, version, header_size)


def canonical_json(value: object) -> bytes:
    """The one JSON encoding the file uses, so equal values give equal bytes and digests."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def _describe_features(bits: int) -> str:
    names = [FEATURE_NAMES.get(1 << i, f"bit {i}") for i in range(64) if bits >> i & 1]
    return f"{bits:#x} ({', '.join(names)})" if names else "0x0"


class RuntimeFile:
    """A read-only view of one runtime file, mapped into memory."""

    def __init__(self, path: str, mapping: mmap.mmap, slot: int, superblock: Superblock,
                 components: dict[str, Component], inode: int = 0):
        self.path = path
        self.inode = inode  # of the file opened (a copy of the file is another inode)
        self.slot = slot
        self.incarnation = superblock.file_incarnation
        self.generation = superblock.generation
        self.required_features = superblock.required_features
        self.optional_features = superblock.optional_features
        self.components = components
        self._superblock = superblock
        self._mapping = mapping
        self._view = memoryview(mapping)
        self._verifying: tuple[threading.Thread, list[BaseException | None]] | None = None  # `start_verify`

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, known_required: int = KNOWN_REQUIRED,
             verify: bool = True) -> "RuntimeFile":
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size < DATA_START:
                    raise RuntimeFileError(f"{path}: too short to be a runtime file")
                # A private (copy-on-write) mapping of a read-only descriptor: the file can never be
                # changed through it, and a stray in-place op on a weight tensor copies one page
                # instead of crashing the process the way a PROT_READ mapping would.
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as exc:
            raise RuntimeFileError(f"{path}: cannot open: {exc.strerror or exc}") from None
        try:
            slot, superblock, directory = _choose_superblock(path, mapping)
            unknown = superblock.required_features & ~known_required
            if unknown:
                raise RuntimeFileError(
                    f"{path}: requires feature bits {_describe_features(unknown)} unknown to this "
                    f"reader (it knows {_describe_features(known_required)})")
            if not superblock.required_features & FEATURE_BASE:
                raise RuntimeFileError(f"{path}: base feature bit is not set")
            components = _parse_directory(path, directory, len(mapping))
            runtime = cls(path, mapping, slot, superblock, components, st.st_ino)
        except BaseException:
            mapping.close()
            raise
        if verify:
            runtime.verify()
        return runtime

    def start_verify(self, nice: int = 0) -> None:
        """`verify` of what a serving device reads (every extent but the audit's: `served=True`), on
        a thread of its own (sha256 runs without the GIL) while the caller goes on: boot loads the
        state beside it, and asks `verified` before it writes or serves anything. `nice`: the
        thread's nice value (boot's --background-nice: on a machine of few cores it yields to the
        imports boot waits for first, and takes the CPU they leave)."""
        answer: list[BaseException | None] = []

        def check() -> None:
            enter_background("runtime-verify", nice)
            try:
                self.verify(served=True)
                answer.append(None)
            except BaseException as exc:  # handed to `verified`
                answer.append(exc)
        thread = threading.Thread(target=check, name="runtime-verify", daemon=True)
        thread.start()
        self._verifying = (thread, answer)

    def verified(self) -> None:
        """Wait for `start_verify`'s check, if one runs (its waker: the thread's end; its bound:
        one sha256 pass over the file's extents), and raise what it found."""
        if self._verifying is None:
            return
        thread, answer = self._verifying
        thread.join()
        self._verifying = None
        if answer[0] is not None:
            raise answer[0]

    def verify(self, served: bool = False) -> None:
        """Check every extent against its recorded sha256. `served`: all but the checkpoints'
        audit extents (AUDIT), which no device reads: only audit's readers (export, verify, a
        forget's redaction) do, each through `read_verified`, which checks it then. Every audit
        extent stays for the life of the file (docs/checkpoint.md), so a boot that checked them
        would take longer with every checkpoint the device ever made."""
        for component in sorted(self.components.values(), key=lambda c: c.offset):
            if served and component.name.startswith(AUDIT):
                continue
            extent = self._view[component.offset:component.offset + component.length]
            if hashlib.sha256(extent).hexdigest() != component.sha256:
                raise RuntimeFileError(
                    f"{self.path}: component {component.name!r} fails its sha256 check")

    def _component(self, name: str, kind: str | None = None) -> Component:
        component = self.components.get(name)
        if component is None:
            raise RuntimeFileError(f"{self.path}: no component {name!r}")
        if kind is not None and component.kind != kind:
            raise RuntimeFileError(f"{self.path}: component {name!r} is {component.kind}, not {kind}")
        return component

    def bytes(self, name: str) -> memoryview:
        component = self._component(name)
        return self._view[component.offset:component.offset + component.length].toreadonly()

    def read_verified(self, name: str) -> builtins.bytes:  # (plain `bytes` here would name the method)
        """A copy of one extent, checked against its sha256: the one check of an audit extent a
        serving device makes (a boot leaves them to their readers: `verify`). For a reader beside
        the file's writer (an audit export beside a running device) an extent the generation it
        opened has since superseded may also have been reused by a later append (`append`)."""
        component = self._component(name)
        data = self._view[component.offset:component.offset + component.length].tobytes()
        if hashlib.sha256(data).hexdigest() != component.sha256:
            raise RuntimeFileError(f"{self.path}: component {name!r} of generation {self.generation} fails its sha256 "
                                   "check: damaged, or a newer generation reused its space (open the file again)")
        return data

    def json(self, name: str) -> Any:
        self._component(name, "json")
        return json.loads(self.bytes(name).tobytes())

    def text(self, name: str) -> str:
        self._component(name, "text")
        return self.bytes(name).tobytes().decode("utf-8")

    def tensor(self, name: str) -> torch.Tensor:
        """A zero-copy CPU tensor over the mapping (copy it to the device or to keep it mutable)."""
        component = self._component(name, "tensor")
        assert component.dtype is not None and component.shape is not None  # _check_entry: tensors have both
        import torch  # (the one reader of the file that needs it)
        dtype = getattr(torch, component.dtype)
        count = math.prod(component.shape)
        if count == 0:
            return torch.empty(component.shape, dtype=dtype)
        # torch keeps a reference to the object it is given but not a buffer export; handing it
        # its own slice of the mapping is what keeps the pages mapped after close().
        extent = self._view[component.offset:component.offset + component.length]
        return torch.frombuffer(extent, dtype=dtype, count=count).view(component.shape)

    def names(self, prefix: str = "") -> list[str]:
        return sorted(name for name in self.components if name.startswith(prefix))

    def has(self, name: str) -> bool:
        return name in self.components

    def model_digest(self, prefix: str = "gen") -> str:
        """Identifies a model by its components' digests, independent of where the extents lie."""
        lines = "".join(f"{name}:{self.components[name].sha256}\n" for name in self.names(prefix + "/"))
        return hashlib.sha256(lines.encode("utf-8")).hexdigest()

    @property
    def shared_profile(self) -> dict | None:
        return self.json("shared_profile") if self.has("shared_profile") else None

    @property
    def capacities(self) -> dict[str, int]:
        """The tables' capacities: the shared profile's, over the defaults (a profile written before
        a capacity existed leaves it at its default)."""
        return {**DEFAULT_CAPACITIES, **(self.shared_profile or {}).get("capacities", {})}

    @property
    def runtime_profile(self) -> dict:
        return self.json("runtime_profile")

    def check_bootable(self) -> None:
        for name in ("gen/card", "gen/tokenizer", "gen/chat_template", "runtime_profile"):
            self._component(name)
        if self.has("shared_profile"):
            if not self.required_features & FEATURE_SHARED:
                raise RuntimeFileError(f"{self.path}: shared profile present but its feature bit is not set")
            if not self.has("emb/card"):
                raise RuntimeFileError(f"{self.path}: shared profile requires an embedding model")

    def close(self) -> None:
        try:
            self._view.release()
            self._mapping.close()
        except BufferError:
            # Tensors or views handed out earlier still point into the mapping; it is unmapped
            # when the last of them is garbage collected.
            pass

    def __enter__(self) -> "RuntimeFile":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"RuntimeFile({self.path!r}, generation={self.generation}, "
                f"slot={SLOT_NAMES[self.slot]}, components={len(self.components)})")


def _choose_superblock(path: str, mapping: mmap.mmap) -> tuple[int, Superblock, bytes]:
    valid, reasons = [], []
    for slot, offset in enumerate(SLOT_OFFSETS):
        try:
            superblock = Superblock.unpack(mapping[offset:offset + SLOT_SIZE])
            start, end = superblock.directory_offset, superblock.directory_offset + superblock.directory_length
            if start < DATA_START or end > len(mapping):
                raise ValueError("directory outside the file")
            directory = mapping[start:end]
            if hashlib.sha256(directory).digest() != superblock.directory_sha256:
                raise ValueError("directory digest mismatch")
        except ValueError as exc:
            reasons.append(f"{SLOT_NAMES[slot]}: {exc}")
            continue
        valid.append((superblock.generation, slot, superblock, directory))
    if not valid:
        raise RuntimeFileError(f"{path}: no valid superblock ({'; '.join(reasons)})")
    _, slot, superblock, directory = max(valid, key=lambda v: (v[0], v[1]))
    if superblock.format_version != FORMAT_VERSION:
        raise RuntimeFileError(f"{path}: format version {superblock.format_version} is not supported")
    return slot, superblock, directory


def _parse_directory(path: str, raw: bytes, file_size: int) -> dict[str, Component]:
    try:
        directory = json.loads(raw)
        if directory.get("schema") != DIRECTORY_SCHEMA:
            raise ValueError(f"schema {directory.get('schema')!r}")
        components = {}
        for entry in directory["components"]:
            shape = tuple(entry["shape"]) if entry["shape"] is not None else None
            component = Component(entry["name"], entry["kind"], entry["offset"], entry["length"],
                                  entry["sha256"], entry["dtype"], shape)
            _check_entry(component, file_size)
            if component.name in components:
                raise ValueError(f"duplicate component {component.name!r}")
            components[component.name] = component
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RuntimeFileError(f"{path}: bad directory: {exc}") from None
    return components


def _check_entry(c: Component, file_size: int) -> None:
    if c.kind not in KINDS:
        raise ValueError(f"{c.name!r} has unknown kind {c.kind!r}")
    if c.offset < DATA_START or c.offset % ALIGN or c.length < 0 or c.offset + c.length > file_size:
        raise ValueError(f"{c.name!r} extent {c.offset}+{c.length} is outside the data area")
    if c.kind == "tensor":
        if c.dtype not in DTYPE_SIZES or c.shape is None:
            raise ValueError(f"{c.name!r} has dtype {c.dtype!r} and shape {c.shape!r}")
        if math.prod(c.shape) * DTYPE_SIZES[c.dtype] != c.length:
            raise ValueError(f"{c.name!r} length {c.length} does not match {c.dtype}{list(c.shape)}")
