"""How the device starts and stays recoverable (docs/checkpoint.md, docs/replication.md): the
`boot` command (boot.py: a primary or a standby, its locks, leadership and server), and the
device's parts on that path: the replay that (re)builds its state (replay.py), its checkpoints
(checkpoints.py; folded beside the ticks by fold.py, whose child process is
gpu_worker/fold_cli.py) and its boot's place in the line of history, with a hot standby's
following (succession.py)."""


class DeviceBootError(Exception):
    """A device that cannot boot as configured (its runtime file, grants or journal): boot says why."""
