"""How the device starts and stays recoverable (docs/checkpoint.md, docs/replication.md): the
`boot` command (boot.py: a primary or a standby, its locks, leadership and server) and the
checkpoint folded beside the ticks (fold.py; its child process is gpu_worker/fold_cli.py)."""
