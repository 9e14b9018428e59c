"""Publication (`POST /spaces/{spc}/publications {source, source_version}`; SPEC "Results and
memory"): a manager of the destination space copies a retained text memory object it may see into
the destination's memory owner.

The copy is a distinct object (`mem-{publisher lineage}-…`, derived from the publication's
operation), version 1, with the destination's scope and owner, the `published` flag, the same
kind, payload bytes and embedding; its `source` is the publication and its `actor` the publisher.
The original keeps its scope and owner. The admission record holds the whole publication and its
provenance: destination, source object and source version; applying it (live and at replay)
keeps that provenance beside the copy's row, so the destination's readers see the copy's source
object and version (`published_from`) without seeing the source. Refusals, changing nothing: 404 for a
destination or source the caller does not see, 403 without current `manage` in the destination,
409 `stale_version` when source_version is not the object's current version (`version` says
which is), 409
`unsupported_kind` for a source that is not retained text, 507 `memory_full` for a full table.
"""
from __future__ import annotations


from ..contract import ids
from ..contract.commands import Publication
from ..contract.errors import ServiceError
from ..memory import expiry, shared as memory
from ..memory.rows import Flag, Provenance
from ..state.tables import R, Right, join16
from . import access, quotas
from .kind import Admission, Caller, Extra, Kind, OperationKind, Tables
from .spaces import space_key


COPY = 0xF0  # the memory-object tag of a publication's copy (derived.memory_object)


def check(d: Caller, principal: bytes, prow: int | None, args: Publication, key: bytes,
          sequence: int) -> Extra:
    destination = access.space_row(d, args.space, principal, prow, Right.MANAGE)
    slot = memory.visible_slot(d, principal, prow, args.source)
    table = d.state.memory
    row = table.row(slot)
    memory.current_version(row, int(args.source_version), args.source)
    if int(row.kind) not in memory.TEXT_KINDS:
        raise ServiceError(409, "unsupported_kind", f"a {memory.KIND_NAMES[int(row.kind)]} memory object cannot be "
                                                    "published; only retained text (source, interpretation)")
    if not table.free_rows:
        raise ServiceError(507, "memory_full", f"the memory table is full ({table.capacity} rows)")
    quotas.check(d, principal, prow, "memory_rows")
    space = ids.SPACE_ID.match(args.space)
    assert space is not None
    extra: Extra = {"space": list(ids.split_id(space)), "source": [row.lineage, row.object],
                             "source_version": row.version}
    ttl = expiry.space_ttl(d, destination)
    if ttl:  # the copy expires as its destination's rows do (only then: earlier records hold no key)
        extra["expires"] = expiry.ttl_expiry(ttl)
    return extra


def apply(d: Tables, a: Admission, prow: int, transfer_seq: int | None, rrow: int) -> int:
    table = d.state.memory
    srow = d.state.spaces.row(space_key(a.extra["space"]))
    slot = table.by_id[a.extra["source"][1]]
    original = table.row(slot)
    lineage = d.state.participants.lineage[prow]
    obj = memory.object_raw(d, a.op, COPY)
    copy = memory.new_row(d, srow, lineage, obj, int(original.kind), Flag.PUBLISHED | (original.flags & Flag.MANAGED),
                          original.byte_length, a.op, d.state.participants.raw[prow])
    # its provenance, as the admission recorded it: what the destination's readers see of its source
    provenance = Provenance(a.extra["source"][0], a.extra["source"][1], a.extra["source_version"])
    return table.write(copy, memory.owner_number(d, srow), table.payload_of(slot), table.embeddings[slot].clone(),
                       provenance=provenance, expires=a.extra.get("expires", 0))


def target_id(d: Tables, row: list[int], lineage: bytes) -> str:
    """The copy (named from the operation, so the receipt keeps its target after the copy's space
    is deleted)."""
    return memory.object_id(d, lineage, join16(row[R.OP_HI], row[R.OP_LO]), COPY)


def receipt_memory(d: Tables, row: list[int], lineage: bytes) -> str:
    return f'{{"context":null,"not_retained":[],"retained":["{target_id(d, row, lineage)}"],"retention":null}}'


RECORD: OperationKind = OperationKind(Kind.PUBLICATION, "publications.record", check=check, apply=apply,
                                      target_id=target_id, memory=receipt_memory)
