"""python -m gpu_worker {pack,boot,checkpoint,audit,link-tls} ..."""
import os
import sys

USAGE = "usage: python -m gpu_worker {pack,boot,checkpoint,audit,link-tls} [options]  (--help after a command for its options)"


def main(argv):
    if not argv or argv[0] not in ("pack", "boot", "checkpoint", "audit", "link-tls"):
        print(USAGE, file=sys.stderr)
        return 2
    # What any command creates (runtime file, journal, media, owner marker, checkpoints, audit
    # exports) holds the inputs' text: its user's alone, whatever umask it was started with
    os.umask(0o077)
    if argv[0] == "pack":
        from .pack import main as command
    elif argv[0] == "checkpoint":
        from .checkpoint_cli import main as command
    elif argv[0] == "audit":
        from .storage.audit import main as command
    elif argv[0] == "link-tls":
        from .replication.tls import main as command
    else:
        from .recovery.boot import main as command
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
