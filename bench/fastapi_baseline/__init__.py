"""bench/http.py's strongest baseline: what a team would build instead of the gateway, FastAPI with
asyncpg (served by granian's ASGI interface, the gateway's server), doing the same idempotent
insert (app.py)."""
