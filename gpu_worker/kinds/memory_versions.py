"""Correcting a memory object (`POST /memory/{mem}/versions {text, version}`; docs/memory.md
"Corrections"): the object's next version, its payload replaced by `text`, in the same row under
the same ID; recall, search and reads use it from then on.

Who may: a caller that sees the object and holds `write` on the space it was retained or
published in, `manage` for an object another participant wrote (memory/shared.editable_slot).
Only retained text (a source, an interpretation, their published copies) is corrected; `version`
must be the object's current one, else 409 `stale_version` naming it, as for a publication.

The new text's embedding is what recall ranks, and embedding is proportional to the text: it is
computed on a helper thread before admission (`prepare`, run by pipeline/preparing.py), and
recorded in the admission transfer with the rest of what `check` returned, so a replay writes the
same vector without the model. An exact retry is embedded again and answered with the first
receipt by admission.

The version it replaced stays readable (`GET /memory/{mem}?version=V`) while the correction's
receipt is live: its result bytes keep the object's ID, the version and its payload
(`SUPERSEDED`), which no other read returns (a memory kind has no result: 409 `no_result`). A
retirement frees it with the receipt; forgetting the object (kinds/memory_deletions.py) erases it
at once. Each kept version counts against its corrector's `memory_rows` quota.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..contract.commands import MemoryVersion
from ..contract.errors import ServiceError
from ..memory import shared as memory
from ..memory.rows import SUPERSEDED, memory_id
from ..state.tables import R
from . import embeddings, quotas
from .kind import Admission, Admitting, Applying, Caller, Extra, Kind, OperationKind, Tables


def prepare(d: Admitting, principal: bytes, prow: int | None, args: MemoryVersion) -> Callable[[], bytes]:
    """Before the embedding is paid for: what can refuse now (the object, the caller's rights,
    the model's control tokens in the text); then the text's embedding, on a helper thread."""
    model = embeddings.embedding_model(d)
    check(d, principal, prow, args, b"", 0)
    token = d.control_tokens.find(args.text)
    if token is not None:
        raise ServiceError(400, "reserved_token", f"text contains the model's control token {token}")
    text = args.text
    return lambda: model.encode([text])[0].to("cpu", torch.float32).numpy().astype("<f4").tobytes()


def check(d: Caller, principal: bytes, prow: int | None, args: MemoryVersion, key: bytes,
          sequence: int) -> Extra:
    slot = memory.editable_slot(d, principal, prow, args.memory)
    row = d.state.memory.row(slot)
    if int(row.kind) not in memory.TEXT_KINDS:
        raise ServiceError(409, "unsupported_kind", f"a {memory.KIND_NAMES[int(row.kind)]} memory object cannot be "
                                                    "corrected; only retained text (source, interpretation)")
    memory.current_version(row, int(args.version), args.memory)
    quotas.check(d, principal, prow, "memory_rows")  # (the version it replaces is kept: it counts)
    return {"memory": [row.lineage, row.object], "text": args.text, "length": row.byte_length}


def apply(d: Applying, a: Admission, prow: int, transfer_seq: int | None, rrow: int) -> int:
    table = d.state.memory
    t = d.state.tables
    lineage, obj = a.extra["memory"]
    slot = table.by_id[obj]
    row = table.row(slot)
    kept = SUPERSEDED.pack(lineage, obj, row.version) + table.payload_of(slot)
    t.put_bytes(t.result_bytes, rrow, kept)
    text = a.extra["text"].encode("utf-8", "surrogatepass")
    vector = torch.from_numpy(np.frombuffer(a.extra["prepared"], dtype="<f4").copy())
    table.rewrite(slot, row.corrected(len(text)), text, vector)
    return rrow  # its target is named by its own result bytes (target_id)


def columns(d: Tables, a: Admission) -> dict[int, int]:
    return {R.RESULT_LEN: SUPERSEDED.size + a.extra["length"]}


def target_id(d: Tables, row: list[int], lineage: bytes) -> str:
    """The object corrected, from the receipt's own result bytes (the object may have been
    forgotten since, its row taken by another)."""
    t = d.state.tables
    object_lineage, obj, _ = SUPERSEDED.unpack(t.get_bytes(t.result_bytes, row[R.TARGET], SUPERSEDED.size))
    return memory_id(object_lineage, obj)


RECORD: OperationKind = OperationKind(Kind.MEMORY_VERSION, "memory.versions", check=check, apply=apply,
                                      target_id=target_id, columns=columns, prepare=prepare)
