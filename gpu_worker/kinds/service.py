"""Service reads: capabilities (what a client reads before anything else), and the ops commands
of the local socket (`ping`, `checkpoint`), which carry no principal."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..contract.commands import AuditExport, NoArgs
from ..contract import structured
from ..contract.limits import INPUT_BYTES, MAX_MEDIA, MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, MEDIA_LINK_BYTES
from ..contract.vocabulary import CAPABILITIES_SCHEMA, MUTATION_SCHEMA, RECEIPT_SCHEMA
from ..contract.errors import ServiceError
from ..contract.wire import Message, dumps, reply
from ..storage import audit

from . import chat, media, quotas
from .kind import Admitting, Context, Executing, Journaling, Read

if TYPE_CHECKING:
    from ..storage.committer import Batch


def capabilities(d: Admitting, principal: bytes, args: NoArgs) -> tuple[int, object]:
    runtime = d.runtime
    card = runtime.json("gen/card")
    profile = runtime.runtime_profile
    models = [{"name": card["name"], "digest": d.model_digest,
               "media_types": card["capabilities"]["media_types"],
               "automatic_memory": card["capabilities"]["automatic_memory"],
               # what an input's (and a chat's) answer may be held to: contract/structured.py
               "response_formats": list(structured.FORMATS)}]
    embedding = runtime.json("emb/card") if runtime.has("emb/card") else None
    return 200, {
        "schema": CAPABILITIES_SCHEMA,
        "schemas": {"mutation": MUTATION_SCHEMA, "receipt": RECEIPT_SCHEMA},
        "models": models,
        "embedding_model": ({"name": embedding["name"], "digest": runtime.model_digest("emb")}
                            if embedding else None),
        "limits": {**{k: str(v) for k, v in d.state.capacities.items()},
                   "input_bytes": str(INPUT_BYTES), "media_link_bytes": str(MEDIA_LINK_BYTES),
                   "media_rows": str(MAX_MEDIA),
                   "schema_bytes": str(MAX_SCHEMA_BYTES), "schema_depth": str(MAX_SCHEMA_DEPTH),
                   # the most an input may name: its page limit's tokens, at the largest page limit admitted
                   "max_output_tokens": str(min(profile["page_grant"], profile["kv_pages"]) * profile["page_size"])},
        # what an input that names none gets: 256 output tokens within half its page limit
        # (kinds/inputs.py default_output_tokens), and the page grant
        "defaults": {"max_output_tokens": str(profile["max_output_tokens"]), "pages": str(profile["page_grant"])},
        "page_size": str(profile["page_size"]),
        "page_grant": str(profile["page_grant"]),
        "grants": sorted(d.grants.actions(principal.hex())),
        "quotas": quotas.view(d, principal, d.state.participants.by_principal.get(principal)),
        "rates": quotas.rates_view(d, principal),
        "journal": d.journal_state(),
        "runtime": {"file_incarnation": d.incarnation_hex, "generation": str(d.state.generation),
                    "boot": str(d.state.boot)},
    }


FAILOVERS_REPORTED = 20  # the newest takeovers a ping reports


def ping(d: Context, principal: bytes | None, args: NoArgs) -> tuple[int, object]:
    """Ops status (no principal: the socket admits the gateway's user only, loop/server.py): what the gateway's /metrics,
    /healthz and admin pages show."""
    return 200, {"ok": True, "boot": str(d.state.boot), "generation": str(d.state.generation),
                 "usage": {**d.state.tables.usage(), "memory": d.state.memory.used()}, "capacities": d.state.capacities,
                 "journal": d.journal_state(), "hold_incidents": d.state.hold_incidents,
                 "failovers": d.state.failovers[-FAILOVERS_REPORTED:],
                 "grants": {"path": d.grants.path, "written_at_ns": d.grants.written_at_ns,
                            "problem": d.grant_problem},
                 "kv": kv_pool(d),
                 "executions": {"queued": len(d.executions.to_lease), "running": len(d.executions.live)},
                 "subscriptions": d.subscriptions.count(),
                 "chats": {"running": chat.running(d), "output_tokens": d.chats.output_tokens},
                 "ticks": d.committer.stats.report(),
                 "runtime_file_bytes": os.path.getsize(d.runtime.path),
                 "media_missing": media.missing(d),  # saved sources whose bytes a restore did not have
                 "pipeline": d.pipeline_state() if d.pipeline_state is not None else None}


def kv_pool(d: Executing) -> dict[str, int] | None:
    """The engine's page pool, read from its own thread's counters (a snapshot, not a lock)."""
    if d.runner is None:
        return None
    try:
        pool = d.runner.engine.pool
    except RuntimeError:  # the engine thread changed its lists while they were read: ask again later
        return None
    return {"pages": pool.total, "owned": pool.owned, "pending": pool.pending, "running": pool.running,
            "waiting": pool.waiting}


def checkpoint(d: Journaling, principal: bytes | None, args: NoArgs) -> tuple[int, object]:
    return 200, d.checkpoint() or {"generation": d.state.generation, "folded": 0}


def audit_export(d: Context, conn: object, msg: Message, batch: Batch) -> int:
    """`audit.export {path}`: write the logical audit prefix to path (storage/audit.py) on a thread
    of its own, since it reads the whole history; the reply comes when the file is written."""
    req_id = msg.get("id")
    try:
        path = d.args(msg, AuditExport).path
        if not os.path.isabs(path) or not os.path.isdir(os.path.dirname(path)):
            raise ServiceError(400, "bad_field", "path must be an absolute path in an existing directory")
    except ServiceError as err:
        batch.replies.append((conn, reply(req_id, err.status, err.body())))
        return 0
    runtime_path, journal_dir = d.runtime.path, d.journal_dir

    def done(summary: dict[str, object] | None, error: BaseException | None) -> None:
        if error is not None:
            failure = ServiceError(507, "audit_export_failed", f"audit export failed: {error}")
            d.subscriptions.outbox.append((conn, reply(req_id, failure.status, failure.body())))
        else:
            d.subscriptions.outbox.append((conn, reply(req_id, 200, dumps(summary))))

    d.off_thread(lambda: audit.export(runtime_path, journal_dir, path, d.fs), done)
    return 0


def defer_checkpoint(d: Journaling, conn: object, msg: Message, batch: Batch) -> int:
    """A checkpoint folds saved state only: it runs once every transfer is saved (on a sync
    primary, held by its standby too: it waits for the standby as an admission does)."""
    d.committer.when_drained(conn, msg)
    return 0


READS: dict[str, Read] = {"capabilities": capabilities, "ping": ping, "checkpoint": checkpoint}
