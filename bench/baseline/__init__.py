"""The HTTP benchmark's baseline: a plain DRF + PostgreSQL idempotent insert, kept as small as a
real project would be (see bench/http.py). Nothing in aotx imports it.

    settings.py  its own settings module (DATABASE_URL from BASELINE_DATABASE_URL)
    asgi.py      served by daphne, like the gateway
    ledger/      the models app: tokens (sha256 digests) and operations (lineage, sequence) unique
    schema.py    creates the tables without manage.py and loads the client tokens
"""
