"""Media sources (`PUT /aotx/v1/media/{sha256}`): content-addressed files under <journal>/media/,
each owned by the participants that uploaded it. The bytes are written and fsynced (file, then
directory) before the MEDIA transfer that records the owner is appended, so a saved owner always
has its bytes. An upload answers 201 once that transfer is saved, 200 when the caller already
owns the source."""
from __future__ import annotations

import functools
import hashlib
import os
from typing import TYPE_CHECKING, Any

import msgpack

from ..contract.errors import ServiceError
from ..contract.limits import MAX_MEDIA_BYTES
from ..contract.vocabulary import MEDIA_TYPES, WRITE
from ..contract.wire import Message, dumps, reply
from ..state import MediaSource
from ..storage.journal import JournalCorrupt, Transfer, TransferKind, record_count, segment_name

if TYPE_CHECKING:
    from ..device import Device
    from ..storage.committer import Batch


def media_dir(d: Device) -> str:
    return os.path.join(d.journal_dir, "media")


def view(d: Device, sha: str) -> dict[str, Any]:
    source = d.state.media[sha]
    return {"sha256": sha, "length": source.length, "type": source.type}


def _check(args: dict[str, Any]) -> None:
    sha, data, kind = args.get("sha256"), args.get("data"), args.get("type")
    if not isinstance(sha, str) or len(sha) != 64 or not isinstance(data, bytes):
        raise ServiceError(400, "bad_field", "media upload needs sha256 and the bytes")
    if kind not in MEDIA_TYPES:
        raise ServiceError(400, "bad_field", "media type must be image or audio")
    if len(data) > MAX_MEDIA_BYTES:
        raise ServiceError(413, "media_too_large", f"a media source is at most {MAX_MEDIA_BYTES} bytes")
    if hashlib.sha256(data).hexdigest() != sha:
        raise ServiceError(400, "digest_mismatch", "the bytes do not hash to the sha256 in the path")


def _write(d: Device, sha: str, data: bytes) -> None:
    directory = media_dir(d)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, sha)
    if os.path.exists(path):
        return
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    d.fs.fsync_dir(directory)


def put(d: Device, conn: object, msg: Message, batch: Batch) -> int:
    """A media upload in a tick: refused, already owned, or appended (answered once saved).
    Returns the journal records it used."""
    try:
        principal = d.principal(msg, WRITE)
        prow = d.caller_row(principal)
        args = d.args(msg)
        _check(args)
        if d.holds.current:
            raise d.holds.refusal(d.committer.writer.queued_bytes)
    except ServiceError as err:
        batch.replies.append((conn, reply(msg.get("id"), err.status, err.body())))
        return 0
    sha = args["sha256"]
    source = d.state.media.get(sha)
    if source is not None and prow in source.owners:
        batch.replies.append((conn, reply(msg.get("id"), 200, dumps(view(d, sha)))))
        return 0
    _write(d, sha, args["data"])
    payload = msgpack.packb([d.state.participants.raw[prow], bytes.fromhex(sha), len(args["data"]), args["type"]],
                            use_bin_type=True)
    d.append(TransferKind.MEDIA, payload, functools.partial(apply, d, payload))
    batch.media.append((conn, msg.get("id"), sha, prow))
    return record_count(len(payload))


def answer(d: Device, req_id: object, sha: str, prow: int) -> Message:
    """The reply to an upload whose tick was saved, or refused (ENOSPC: nothing saved)."""
    source = d.state.media.get(sha)
    if source is not None and prow in source.owners:
        return reply(req_id, 201, dumps(view(d, sha)))
    refusal = d.holds.refusal(d.committer.writer.queued_bytes, "the journal cannot save new operations right now")
    return reply(req_id, refusal.status, refusal.body())


def apply(d: Device, payload: bytes, transfer: Transfer) -> None:
    par, sha, length, kind = msgpack.unpackb(payload)
    prow = d.state.participants.by_raw.get(par)
    if prow is None:
        raise JournalCorrupt(os.path.join(d.journal_dir, segment_name(transfer.segment)), transfer.offset,
                             f"media transfer seq {transfer.seq} names no participant")
    source = d.state.media.setdefault(sha.hex(), MediaSource(length, kind))
    source.owners.add(prow)
