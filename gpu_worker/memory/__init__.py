"""Shared memory, all of it (docs/memory.md): the 128-byte metadata rows (rows.py), the memory
table's tensors (table.py), owners, visibility, retention and publication writes, recall into a
prompt and the reads (shared.py), the recall scan over the embedding matrix (recall.py) and the
rendering of recalled rows (render.py)."""
