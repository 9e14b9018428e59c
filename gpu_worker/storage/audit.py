"""The logical audit prefix, exported and verified (SPEC: "The complete file retains its logical
audit prefix"; docs/checkpoint.md, "Audit export").

Every saved transfer is in one of two places: folded into the runtime file by a checkpoint (the
`audit/<generation>` components, [seq, kind, payload, digest] each) or still in the journal. An
export writes them all, in seq order, as JSON lines

    {"seq": 12, "kind": 2, "payload": "<base64>", "digest": "<64 hex>"}

and `verify` replays an export: the seqs run 1, 2, ... without a hole, each digest is the hash
chain over the ones before (storage/journal.py `chain_digest`), the chain reaches the commit
digest the file's checkpoint recorded, and every transfer still in the journal has the digest the
journal gives it. A transfer that carried a forgotten memory object's bytes was redacted by the
checkpoint after (memory/forgetting.py): its entry is [seq, kind, payload, digest, true], its line
says `"redacted": true`, and its payload is no longer the one its digest was made from, so the
chain is taken on from the digest it records (the next transfer's link checks it). Both only read the runtime file and the journal, so they run beside a live
device (off its tick thread), or with none.

    python -m gpu_worker audit export --ccir F --journal DIR --out FILE
    python -m gpu_worker audit verify --export FILE --ccir F --journal DIR
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from typing import Iterator

import msgpack

from . import checkpoint
from .filelayer import FileLayer, OsFileLayer
from .journal import ZERO_DIGEST, chain_digest
from .journal_reader import recover
from .runtime_file import AUDIT, RuntimeFile, RuntimeFileError


def _folded(runtime: RuntimeFile) -> tuple[int, bytes]:
    """(last_seq, last_digest) of the file's checkpoint. Read first and checked (read_verified):
    a running device's later checkpoints may reuse the space of the state extent this reader's
    generation names, never that of an audit extent, which every later generation keeps."""
    has = runtime.has(checkpoint.STATE)
    return checkpoint.fold_point(checkpoint.decode_state(runtime.read_verified(checkpoint.STATE)) if has else None)


def transfers(runtime_path: str, journal_dir: str) -> Iterator[tuple[int, int, bytes, bytes, bool]]:
    """(seq, kind, payload, digest, redacted) of every saved transfer, oldest first."""
    runtime = RuntimeFile.open(runtime_path, verify=False)
    try:
        checkpoint_seq, checkpoint_digest = _folded(runtime)
        folded_seq, folded_digest = 0, ZERO_DIGEST
        for name in sorted(runtime.names(AUDIT)):
            for seq, kind, payload, digest, *redacted in msgpack.unpackb(runtime.read_verified(name), raw=False):
                yield seq, kind, payload, digest, bool(redacted)
                folded_seq, folded_digest = seq, digest
        if runtime.has(checkpoint.STATE):
            folded_seq, folded_digest = checkpoint_seq, checkpoint_digest
        incarnation = runtime.incarnation
    finally:
        runtime.close()
    for t in recover(journal_dir, OsFileLayer(), incarnation, start_digest=folded_digest,
                     after_seq=folded_seq).transfers:
        yield t.seq, int(t.kind), t.payload, t.digest, False


def export(runtime_path: str, journal_dir: str, out_path: str, fs: FileLayer | None = None) -> dict[str, object]:
    """Write the export atomically through the file layer `fs` (the device's): a temporary file,
    fsynced, renamed, the directory fsynced (`FileLayer.atomic_writer`); its summary."""
    count, last_seq, last_digest = 0, 0, ZERO_DIGEST
    with (fs or OsFileLayer()).atomic_writer(out_path, mode=0o666, tmp=f"{out_path}.tmp.{os.getpid()}") as f:
        chunk, at = bytearray(), 0  # lines written a megabyte at a time
        for seq, kind, payload, digest, redacted in transfers(runtime_path, journal_dir):
            line = {"seq": seq, "kind": kind, "payload": base64.b64encode(payload).decode(), "digest": digest.hex(),
                    **({"redacted": True} if redacted else {})}
            chunk += (json.dumps(line, separators=(",", ":")) + "\n").encode("ascii")
            count, last_seq, last_digest = count + 1, seq, digest
            if len(chunk) >= 1 << 20:
                f.pwrite(memoryview(chunk), at)
                chunk, at = bytearray(), at + len(chunk)
        f.pwrite(memoryview(chunk), at)
    return {"path": out_path, "transfers": count, "last_seq": last_seq, "last_digest": last_digest.hex()}


def verify(export_path: str, runtime_path: str, journal_dir: str) -> str | None:
    """None when the export is the file's and journal's audit prefix, else why not (one line)."""
    expected = {seq: digest for seq, _, _, digest, _ in transfers(runtime_path, journal_dir)}
    runtime = RuntimeFile.open(runtime_path, verify=False)
    try:
        folded = _folded(runtime) if runtime.has(checkpoint.STATE) else None  # (last_seq, last_digest)
    finally:
        runtime.close()
    digest, seq = ZERO_DIGEST, 0
    with open(export_path, encoding="ascii") as f:
        for number, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                payload, claimed = base64.b64decode(row["payload"], validate=True), bytes.fromhex(row["digest"])
            except (ValueError, KeyError, TypeError) as exc:
                return f"{export_path}:{number}: not an export line ({exc})"
            if row["seq"] != seq + 1:
                return f"{export_path}:{number}: transfer seq {row['seq']} where {seq + 1} belongs"
            seq = row["seq"]
            # (a redacted payload is not what the digest was made from: the chain goes on from its digest)
            digest = claimed if row.get("redacted") is True else chain_digest(digest, row["kind"], seq, payload)
            if digest != claimed:
                return f"{export_path}:{number}: seq {seq}: the hash chain gives {digest.hex()}, the export says " \
                       f"{claimed.hex()}"
            if seq in expected and expected[seq] != digest:
                return f"{export_path}:{number}: seq {seq}: the runtime file or journal has another digest"
            if folded is not None and seq == folded[0] and digest != folded[1]:
                return f"{export_path}:{number}: seq {seq}: not the commit digest the file's checkpoint recorded"
    if folded is not None and seq < folded[0]:
        return f"{export_path}: ends at seq {seq}, before the file's checkpoint at seq {folded[0]}"
    return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_worker audit")
    sub = parser.add_subparsers(dest="verb", required=True)
    out = sub.add_parser("export")
    out.add_argument("--ccir", required=True)
    out.add_argument("--journal", required=True)
    out.add_argument("--out", required=True)
    check = sub.add_parser("verify")
    check.add_argument("--export", required=True)
    check.add_argument("--ccir", required=True)
    check.add_argument("--journal", required=True)
    args = parser.parse_args(argv)
    try:
        if args.verb == "export":
            print(json.dumps(export(args.ccir, args.journal, args.out), sort_keys=True))
            return 0
        why = verify(args.export, args.ccir, args.journal)
    except (OSError, ValueError, RuntimeFileError) as exc:
        print(f"audit: {exc}", file=sys.stderr)
        return 2
    if why is not None:
        print(f"audit verify: {why}", file=sys.stderr)
        return 1
    print(f"audit verify: {args.export} is the audit prefix of {args.ccir}")
    return 0
