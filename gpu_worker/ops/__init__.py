"""The operations: one module per operation kind, the reads and commands beside them, and the one
registry that finds them (registry.py). Importing any of them imports the registry first, so the
modules that look kinds up in it at call time (receipts, events, operations) always find it whole,
whichever module a caller imports first."""
from . import registry  # noqa: F401
