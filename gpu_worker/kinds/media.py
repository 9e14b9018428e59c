"""Media sources (`PUT /aotx/v1/media/{sha256}`): content-addressed files under <journal>/media/,
each owned by the participants that uploaded it. The bytes are hashed, written and fsynced (file,
then directory: the device's file layer's `write_atomically`) on a thread of their own before the
MEDIA transfer that records the owner is appended, so a saved owner always has its bytes. An
upload answers 201 once that transfer is saved, 200 when the caller already owns the source. The
caller's media_bytes quota (kinds/quotas.py) counts an upload from its check until its owner is
saved or it is refused.

A checkpoint carries the bytes of every source it lists (`media/<sha256>` components of the
runtime file: storage/checkpoint.py), so a restore onto a fresh journal directory has them:
`recover_bytes` writes them back under <journal>/media/ at boot. A source listed by the saved
state whose bytes are in neither place (a checkpoint written before checkpoints carried media, or
a file removed by hand) is marked missing, named in the boot log and in `ping`, and refused to
inputs (409 `media_unavailable`) until its owner uploads it again (docs/checkpoint.md)."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
from typing import TYPE_CHECKING

import msgpack

from ..contract.commands import MediaPut
from ..contract.errors import ServiceError
from ..contract.vocabulary import WRITE
from ..contract.wire import Message, dumps, reply
from ..state import MediaSource
from ..storage.journal import JournalCorrupt, Transfer, TransferKind, segment_name
from . import quotas
from .kind import Caller, Context, Journaling, Sourcing, Tables, Uploading

if TYPE_CHECKING:
    from ..storage.committer import Batch
    from ..storage.filelayer import FileLayer


log = logging.getLogger("gpu_worker.media")
COMPONENT = "media/"  # runtime file components: media/<sha256>, a checkpoint's copy of the bytes


def media_dir(d: Journaling) -> str:
    return os.path.join(d.journal_dir, "media")


def read_source(d: Journaling, sha: str) -> bytes | None:
    """The bytes of a source under <journal>/media/, or None when they are not there whole (a
    missing file, or one that no longer hashes to its name)."""
    try:
        with open(os.path.join(media_dir(d), sha), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return data if hashlib.sha256(data).hexdigest() == sha else None


def recover_bytes(d: Sourcing) -> None:
    """After recovery (boot, or the rebuild after ENOSPC): every source the state lists has its
    bytes under <journal>/media/, written back from the runtime file's copy when they are not
    there (a restore on a fresh journal directory), or it is marked missing and logged."""
    directory = media_dir(d)
    for sha, source in sorted(d.state.media.items()):
        path = os.path.join(directory, sha)
        try:
            source.missing = os.path.getsize(path) != source.length
        except FileNotFoundError:
            source.missing = True
        if not source.missing:
            continue
        name = COMPONENT + sha
        copy = d.runtime.components.get(name)
        if copy is not None and copy.sha256 == sha and copy.length == source.length:
            if os.path.exists(path):  # not its bytes: replaced whole by the checked copy
                os.remove(path)
            _store(directory, d.fs, sha, d.runtime.read_verified(name))
            source.missing = False
            log.info("media source %s (%d bytes) restored under %s from runtime file %s", sha, source.length,
                     directory, d.runtime.path)
        else:
            if os.path.exists(path):  # not its bytes (another length): kept aside, so an upload writes them again
                d.fs.replace(path, path + ".damaged")
            log.warning("media source %s (%d bytes, %s) is listed by the saved state but its bytes are neither "
                        "under %s nor in runtime file %s; inputs naming it answer 409 media_unavailable until "
                        "its owner uploads it again", sha, source.length, source.type, directory, d.runtime.path)


def missing(d: Tables) -> list[str]:
    """The sources whose bytes are lost (ping shows them)."""
    return sorted(sha for sha, source in d.state.media.items() if source.missing)


def view(d: Tables, sha: str) -> dict[str, str]:
    source = d.state.media[sha]
    return {"sha256": sha, "length": str(source.length), "type": source.type}


def _store(directory: str, fs: FileLayer, sha: str, data: bytes) -> None:
    """Off the tick thread: the digest, then the file put in place durably through the device's
    file layer (a temporary file written and fsynced, renamed, the directory fsynced)."""
    if hashlib.sha256(data).hexdigest() != sha:
        raise ServiceError(400, "digest_mismatch", "the bytes do not hash to the sha256 in the path")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, sha)
    if os.path.exists(path):
        return
    # two uploads of one source may run at once: each writes its own temporary file
    fs.write_atomically(path, data, mode=0o600, tmp=f"{path}.tmp.{threading.get_ident()}")


def put(d: Context, conn: object, msg: Message, batch: Batch) -> int:
    """A media upload: its bytes are hashed and, when the device has no copy yet, written on a
    thread of their own (an 8 MiB upload must not stall other clients); then it is answered 200
    when the caller already owns the source, or the MEDIA transfer that records the owner is
    appended and the upload answered once it is saved (201), or refused if the journal cannot
    save it (429)."""
    req_id = msg.get("id")
    try:
        principal = d.principal(msg, WRITE)
        prow = d.caller_row(principal)
        args = d.args(msg, MediaPut)
        if d.holds.current:
            raise d.holds.refusal(d.committer.writer.queued_bytes)
        source = d.state.media.get(args.sha256)
        if source is None or prow not in source.owners:  # an upload it already owns adds nothing
            quotas.check(d, principal, prow, "media_bytes", len(args.data))
    except ServiceError as err:
        batch.replies.append((conn, reply(req_id, err.status, err.body())))
        return 0
    sha, data, kind = args.sha256, args.data, args.type
    owner = d.state.participants.raw[prow]
    d.usage.media_in_flight[prow] += len(data)

    def stored(_: None, error: BaseException | None) -> None:
        source = d.state.media.get(sha)
        if error is None and source is not None:
            source.missing = False  # its bytes are written (again): an upload restores a lost source
        if error is not None or d.holds.current or (source is not None and prow in source.owners):
            _release(d, prow, len(data))  # answered now: its bytes no longer wait for an owner
        if error is None and source is not None and prow in source.owners:
            d.subscriptions.outbox.append((conn, reply(req_id, 200, dumps(view(d, sha)))))
            return
        if error is not None:
            err = error if isinstance(error, ServiceError) else ServiceError(
                507, "media_write_failed", f"the media source could not be written: {error}")
            d.subscriptions.outbox.append((conn, reply(req_id, err.status, err.body())))
            return
        if d.holds.current:
            refusal = d.holds.refusal(d.committer.writer.queued_bytes)
            d.subscriptions.outbox.append((conn, reply(req_id, refusal.status, refusal.body())))
            return
        payload = msgpack.packb([owner, bytes.fromhex(sha), len(data), kind], use_bin_type=True)
        if d.committer.replica is not None:  # a standby holds the bytes before it acknowledges their owner
            d.committer.replica.media(sha, os.path.join(media_dir(d), sha))
        seq = d.append(TransferKind.MEDIA, payload, functools.partial(saved, d, payload))
        d.media_waiting[seq] = (conn, req_id, sha, prow, len(data))

    d.off_thread(lambda: _store(media_dir(d), d.fs, sha, data), stored)
    return 0


def saved(d: Uploading, payload: bytes, transfer: Transfer) -> None:
    """The owner is saved: answer the upload."""
    apply(d, payload, transfer)
    waiting = d.media_waiting.pop(transfer.seq, None)
    if waiting is not None:
        conn, req_id, sha, prow, length = waiting
        _release(d, prow, length)  # now counted as an owned source
        d.subscriptions.outbox.append((conn, reply(req_id, 201, dumps(view(d, sha)))))


def refuse_waiting(d: Uploading) -> None:
    """ENOSPC: uploads whose owner was not saved are refused (their bytes stay, owned by nobody)."""
    refusal = d.holds.refusal(d.committer.writer.queued_bytes, "the journal cannot save new operations right now")
    for conn, req_id, _, prow, length in d.media_waiting.values():
        _release(d, prow, length)
        d.subscriptions.outbox.append((conn, reply(req_id, refusal.status, refusal.body())))
    d.media_waiting.clear()


def _release(d: Caller, prow: int, length: int) -> None:
    in_flight = d.usage.media_in_flight
    in_flight[prow] -= length
    if in_flight[prow] <= 0:
        del in_flight[prow]


def apply(d: Journaling, payload: bytes, transfer: Transfer) -> None:
    par, sha, length, kind = msgpack.unpackb(payload)
    prow = d.state.participants.by_raw.get(par)
    if prow is None:
        raise JournalCorrupt(os.path.join(d.journal_dir, segment_name(transfer.segment)), transfer.offset,
                             f"media transfer seq {transfer.seq} names no participant")
    source = d.state.media.setdefault(sha.hex(), MediaSource(length, kind))
    source.owners.add(prow)


def remove_forgotten(d: Journaling, shas: list[str]) -> None:
    """After a checkpoint: the files of media sources a forgotten memory object took with it
    (kinds/memory_deletions.erase) and the state still does not list (an upload since lists it
    again), removed from <journal>/media/; the checkpoint no longer carries them."""
    directory = media_dir(d)
    removed = False
    for sha in sorted(set(shas)):
        path = os.path.join(directory, sha)
        if sha not in d.state.media and os.path.exists(path):
            d.fs.remove(path)
            removed = True
    if removed:
        d.fs.fsync_dir(directory)


def checkpoint_components(d: Sourcing) -> tuple[list[tuple[str, str, bytes]], list[str]]:
    """(components to add, component names to drop) that make the file carry the bytes of every
    media source the state lists, `media/<sha256>` each (SPEC: "The complete runtime file saves
    this state"; the state extent lists sources, the bytes live under <journal>/media/ and would
    not survive a restore onto another journal directory). A source goes in once, at the first
    checkpoint that lists it (its extent is kept by every later generation); one the state no
    longer lists is dropped. A source whose bytes are not under <journal>/media/ whole is left
    out: the device already reports it missing (recover_bytes)."""
    present = set(d.runtime.names(COMPONENT))
    listed = {COMPONENT + sha for sha in d.state.media}
    added = []
    for sha in sorted(d.state.media):
        if COMPONENT + sha in present:
            continue
        data = read_source(d, sha)
        if data is not None:
            added.append((COMPONENT + sha, "bytes", data))
    return added, sorted(present - listed)
