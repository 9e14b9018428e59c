"""What forgetting a memory object erases beyond its row (kinds/memory_deletions.py; docs/memory.md
"Forgetting"), and where: the bytes of a forgotten object live in more places than the memory
table, and each is erased by the code that owns it.

- Live state, at once (the deletion's `apply`, live and at replay alike): the row, its payload,
  embedding and provenance (MemoryTable.release zeroes them); the versions live corrections keep
  of it; the text in the command bytes of those corrections and, for a retained source, of the
  input it came from (`redact_command`: the text emptied, the command marked forgotten), or in
  its conversation's history once that input's receipt was retired.
- The journal: the transfers that carried the bytes (the input's and the corrections'
  admissions, the interpretation's or control record's MEMORY transfer) stay in the active
  journal until the next checkpoint folds it, and the folded segments are removed then.
- The runtime file, at that checkpoint: its state is the erased one; the audit of every transfer
  (`audit/<generation>` components, which later checkpoints otherwise never rewrite) is written
  again with those transfers' payloads redacted by a `Redactor` (their digests kept, the entry
  marked redacted: storage/audit.py verifies the chain across it); and every byte of the file no
  generation reaches any more (superseded state extents, the audit components just replaced) is
  overwritten with zeros (runtime_file_writer.append `wipe`).

Each deletion leaves a `Forgotten` record in the memory table until a checkpoint has done that;
a boot replaying a deletion from the journal makes the record again.
"""
from __future__ import annotations

import json

import msgpack
import rfc8785

from ..kinds.kind import Admission, Kind
from ..storage.journal import TransferKind
from .rows import Forgotten
from .rows import Kind as MemoryKind

_ADMISSION, _MEMORY = int(TransferKind.ADMISSION), int(TransferKind.MEMORY)
_INPUT, _VERSION = int(Kind.INPUT), int(Kind.MEMORY_VERSION)


def redact_command(canonical: bytes) -> bytes:
    """A command's canonical bytes with its text emptied and marked forgotten (top-level
    `"forgotten": true`, which no gateway-built command has): what a receipt keeps of an input or
    a correction whose text was forgotten. An exact retry of the original bytes still finds it
    (`same_command`)."""
    doc = json.loads(canonical)
    doc["body"]["text"] = ""
    doc["forgotten"] = True
    data: bytes = rfc8785.dumps(doc)
    return data


def same_command(stored: bytes, canonical: bytes) -> bool:
    """Whether a receipt's stored command bytes are `canonical`'s, the text of either forgotten
    since (admission's exact-retry test, after the plain comparison failed)."""
    if b'"forgotten":true' not in stored:
        return False
    try:
        return redact_command(canonical) == stored
    except (ValueError, TypeError, KeyError):  # (not a command document: not the same)
        return False


class Redactor:
    """Redacts audit entries, called in seq order over the whole audit: the payload of a transfer
    that carried a forgotten object's bytes, without them, or None for any other transfer."""

    def __init__(self, forgotten: list[Forgotten]) -> None:
        # an input's operation -> the objects forgotten that it wrote (its source, its
        # interpretation, its control record: several of one input)
        self.by_source: dict[bytes, list[Forgotten]] = {}
        for f in forgotten:
            if not f.published:
                self.by_source.setdefault(f.source, []).append(f)
        self.objects = {f.object for f in forgotten}
        self.inputs: dict[tuple[bytes, int], list[Forgotten]] = {}  # (actor, sequence) -> its forgotten rows

    def __call__(self, kind: int, payload: bytes) -> bytes | None:
        if kind == _ADMISSION:
            return self._admission(payload)
        if kind == _MEMORY and self.inputs:
            return self._memory(payload)
        return None

    def _admission(self, payload: bytes) -> bytes | None:
        try:
            a = Admission.decode(payload)
        except ValueError:
            return None
        if a.kind == _INPUT and a.op in self.by_source:
            written = self.by_source[a.op]
            self.inputs[(written[0].actor, a.sequence)] = written
            if any(f.kind == MemoryKind.SOURCE for f in written):  # (the source's text is the input's)
                return a._replace(canonical=redact_command(a.canonical)).encode()
        elif a.kind == _VERSION and a.extra.get("memory", [b"", b""])[1] in self.objects:
            extra = {**a.extra, "text": "", "prepared": bytes(len(a.extra.get("prepared", b"")))}
            return a._replace(canonical=redact_command(a.canonical), extra=extra).encode()
        return None

    def _memory(self, payload: bytes) -> bytes | None:
        fields = msgpack.unpackb(payload)
        actor, sequence, kind, flags, refused, text, vector, *expires = fields
        if not any(f.kind == kind for f in self.inputs.get((actor, sequence), [])):
            return None
        # (a source's transfer holds no text, only its embedding: the text is its input's)
        blank_text = None if text is None else b""
        blank_vector = None if vector is None else bytes(len(vector))
        data: bytes = msgpack.packb([actor, sequence, kind, flags, refused, blank_text, blank_vector, *expires],
                                    use_bin_type=True)
        return data


def redactor(forgotten: list[Forgotten]) -> Redactor | None:
    """A checkpoint's redactor of the audit: None when nothing was forgotten since the last one."""
    return Redactor(forgotten) if forgotten else None
