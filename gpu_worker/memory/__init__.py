"""Shared memory: the 128-byte metadata rows (rows.py) and recall over the embedding matrix
(recall.py); docs/memory.md."""
