"""The operation kinds: one module per operation kind, the reads and commands beside them
(docs/adding-an-operation-kind.md), and the one registry that finds them (registry.py), which the
device and its tick (pipeline/tick.py) import. An operation sees the device only through the context its kind declares
(kind.py: `Tables`, `Context`) and looks other kinds up there (`kinds`), so no module here
imports the registry or the device."""
