"""POST /m and GET /operations/{op}: the gateway's space creation and receipt read as a FastAPI +
asyncpg service would write them, on the local PostgreSQL (BASELINE_PG, default database `test`).

POST /m: the bearer token's SHA-256 looked up (one indexed SELECT; then cached in the process for
5 s, as the gateway caches its principals), the envelope parsed as
strictly as the gateway parses it (UTF-8 JSON object, no duplicate keys, no unknown fields, schema,
32-hex lineage and nonzero key, decimal sequence, scope), the RFC 8785 canonical bytes of
{method, path, body} computed, then one INSERT keyed unique by (lineage, sequence), committed
synchronously (PostgreSQL's default synchronous_commit=on) before the answer: 202 with a
receipt-shaped body of the gateway's size and Location; an exact retry 200 with the stored bytes;
changed bytes 409. GET /operations/{op}: the token lookup, then the stored receipt (404 if none).
Tables: bench/http.py creates them (TABLES) and drops them after the run."""
import hashlib
import json
import os
import re
import time
from typing import Any

import asyncpg
import rfc8785
from fastapi import FastAPI, Request, Response

SCHEMA = "aotx.shared.mutation.v1"
ENVELOPE = ("schema", "lineage", "operation_key", "sequence")
HEX32 = re.compile(r"[0-9a-f]{32}\Z")
DECIMAL = re.compile(r"[1-9][0-9]{0,18}\Z")
SCOPES = ("private", "room", "instance")
INCARNATION = hashlib.sha256(b"baseline").hexdigest()[:32]
PREFIX = os.environ.get("BASELINE_TABLE_PREFIX", "bench_fastapi")
TABLES = f"""
CREATE TABLE {PREFIX}_tokens (token_hash text PRIMARY KEY, lineage text NOT NULL);
CREATE TABLE {PREFIX}_operations (lineage text NOT NULL, sequence bigint NOT NULL, operation text NOT NULL UNIQUE,
                                  canonical bytea NOT NULL, response bytea NOT NULL, PRIMARY KEY (lineage, sequence));
"""
HEADERS = {"Cache-Control": "no-store"}

app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
pool: asyncpg.Pool | None = None


async def db() -> asyncpg.Pool:
    global pool
    if pool is None:  # opened on first use (no lifespan hook, as the gateway has none)
        pool = await asyncpg.create_pool(os.environ.get("BASELINE_PG", "postgresql://postgres@127.0.0.1:5432/test"),
                                         min_size=4, max_size=int(os.environ.get("BASELINE_POOL", "32")))
    return pool


def error(status: int, code: str, message: str) -> Response:
    return Response(json.dumps({"error": {"code": code, "message": message}}), status_code=status,
                    media_type="application/json", headers=HEADERS)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def receipt(lineage: str, key: str, sequence: str, canonical: bytes) -> bytes:
    """The gateway's receipt fields, so both systems send about the same bytes back."""
    save = {"boot": "1", "commit_digest": hashlib.sha256(canonical).hexdigest(), "file_incarnation": INCARNATION,
            "generation": sequence, "source": "postgresql"}
    return json.dumps({
        "admission": {"save": save, "saved": True}, "device": {"committed": True}, "disk_error": None,
        "effective": {"model_digest": None, "page_limit": None}, "kind": "space.create",
        "operation": f"op-{lineage}-{key}", "operation_key": key, "participant": f"par-{lineage}",
        "pending_bytes": 0, "result": {"finish": None, "input_tokens": None, "length": 0, "output_tokens": None},
        "schema": "aotx.shared.receipt.v1", "sequence": sequence, "target": f"spc-{lineage}-{key}",
        "terminal": {"save": save, "saved": True, "status": "succeeded"}, "transport": {"accepted": True},
    }, sort_keys=True, separators=(",", ":")).encode()


# token hash -> (lineage, until): principals cached for CACHE_SECONDS, as the gateway caches them
# (shared_api/http/auth.py, AOTX_PRINCIPAL_CACHE_SECONDS, 5 s by default); unknown tokens never
CACHE_SECONDS = float(os.environ.get("BASELINE_PRINCIPAL_CACHE_SECONDS", "5"))
PRINCIPALS: dict[str, tuple[str, float]] = {}


async def principal(request: Request, conn: asyncpg.Connection) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    digest = hashlib.sha256(token.encode()).hexdigest()
    now = time.monotonic()
    cached = PRINCIPALS.get(digest)
    if cached is not None and cached[1] > now:
        return cached[0]
    lineage: str | None = await conn.fetchval(f"SELECT lineage FROM {PREFIX}_tokens WHERE token_hash = $1", digest)
    if lineage is not None:
        PRINCIPALS[digest] = (lineage, now + CACHE_SECONDS)
    return lineage


@app.post("/m")
async def mutate(request: Request) -> Response:
    async with (await db()).acquire() as conn:
        owner = await principal(request, conn)
        if owner is None:
            return error(401, "unauthenticated", "unknown or missing token")
        raw = await request.body()
        if len(raw) > 65536:
            return error(413, "body_too_large", "body exceeds 65536 bytes")
        try:
            body = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, ValueError) as exc:
            return error(400, "invalid_json", f"body is not JSON: {exc}")
        if not isinstance(body, dict):
            return error(400, "invalid_json", "body must be a JSON object")
        unknown = sorted(set(body) - set(ENVELOPE) - {"scope"})
        missing = [f for f in ENVELOPE if f not in body]
        if unknown or missing:
            return error(400, "bad_fields", f"unknown {unknown}, missing {missing}")
        lineage, key, sequence = body["lineage"], body["operation_key"], body["sequence"]
        if (body["schema"] != SCHEMA or not isinstance(lineage, str) or not HEX32.match(lineage)
                or not isinstance(key, str) or not HEX32.match(key) or int(key, 16) == 0
                or not isinstance(sequence, str) or not DECIMAL.match(sequence)
                or body.get("scope", "private") not in SCOPES):
            return error(400, "bad_field", "malformed envelope")
        if lineage != owner:
            return error(409, "stale_lineage", "lineage does not belong to this token")
        canonical = rfc8785.dumps({"method": "POST", "path": request.url.path, "body": body})
        response = receipt(lineage, key, sequence, canonical)
        operation = f"op-{lineage}-{key}"
        inserted = await conn.fetchval(
            f"INSERT INTO {PREFIX}_operations (lineage, sequence, operation, canonical, response) "
            "VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING RETURNING 1",
            lineage, int(sequence), operation, canonical, response)
        if inserted is None:
            stored = await conn.fetchrow(f"SELECT canonical, response FROM {PREFIX}_operations "
                                         "WHERE lineage = $1 AND sequence = $2", lineage, int(sequence))
            if stored is not None and bytes(stored["canonical"]) == canonical:
                return Response(bytes(stored["response"]), status_code=200, media_type="application/json",
                                headers=HEADERS)
            return error(409, "changed_input", "this sequence was used with different bytes (or its key elsewhere)")
    return Response(response, status_code=202, media_type="application/json",
                    headers={**HEADERS, "Location": f"/operations/{operation}"})


@app.get("/operations/{operation}")
async def read(operation: str, request: Request) -> Response:
    async with (await db()).acquire() as conn:
        owner = await principal(request, conn)
        if owner is None:
            return error(401, "unauthenticated", "unknown or missing token")
        stored = await conn.fetchval(f"SELECT response FROM {PREFIX}_operations WHERE operation = $1 AND lineage = $2",
                                     operation, owner)
    if stored is None:
        return error(404, "not_found", "no such operation")
    return Response(bytes(stored), status_code=200, media_type="application/json", headers=HEADERS)
