"""Server-sent event streams (Channels consumers) and their fan-out over Redis."""
