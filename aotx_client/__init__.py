"""Python client for the AOTX Shared API: exact retries, sequences and event streams handled for
the caller (docs/client.md)."""
from ._protocol import ApiError, Event, GaveUp
from .client import AsyncClient, Client

__all__ = ["ApiError", "AsyncClient", "Client", "Event", "GaveUp"]
