"""The gateway's production database path: PostgreSQL (pooled) instead of the embedded SQLite."""
import json
import secrets

import psycopg
import pytest

from tests.harness import Stack

pytestmark = pytest.mark.e2e
PG = "postgresql://postgres@127.0.0.1:5432"
BASE = "/aotx/v1/shared"


@pytest.fixture
def database():
    name = f"aotx_test_{secrets.token_hex(4)}"
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield f"{PG}/{name}"
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_the_gateway_runs_on_postgresql(tiny_runtime, tmp_path, database):
    stack = Stack(tmp_path, tiny_runtime, database_url=database)
    try:
        token = stack.principal("pg")
        stack.boot_device()
        stack.serve()
        me = json.loads(stack.http("GET", f"{BASE}/participant", token=token)[2])
        body = {"schema": "aotx.shared.mutation.v1", "lineage": me["lineage"], "operation_key": secrets.token_hex(16),
                "sequence": "1"}
        assert stack.http("POST", f"{BASE}/participant", body, token=token)[0] == 202
        assert stack.http("POST", f"{BASE}/participant", body, token=token)[0] == 200
        stack.manage("principal", "revoke", "pg", "--config", str(stack.config))
        assert stack.http("GET", f"{BASE}/participant", token=token)[0] == 401
    finally:
        stack.stop()
    with psycopg.connect(database) as conn:
        assert conn.execute("SELECT count(*) FROM shared_api_principal").fetchone()[0] == 1
