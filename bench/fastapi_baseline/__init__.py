"""bench/http.py's strongest baseline: what a team would build instead of the gateway, FastAPI on
uvicorn with asyncpg, doing the same idempotent insert (app.py)."""
