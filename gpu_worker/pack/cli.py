"""`python -m gpu_worker pack`: the arguments, their checks (one-line usage errors), and the
choice between packing a new file (default, --gguf/--embedding, --vlm, --tiny) and enabling shared
operation on an existing one, under the runtime file's one-writer lock.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from gpu_worker.storage import runtime_file_lock
from gpu_worker.storage.runtime_file import RuntimeFile, RuntimeFileError

from .defaults import pack_default, pack_vlm
from .tiny import pack_tiny
from .writer import _summary, enable_shared, parse_capacity


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, not argparse's usage block
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m gpu_worker pack",
                     description="Pack a runtime file, or enable shared operation on an existing one.")
    parser.add_argument("--runtime", required=True, metavar="F", help="runtime file (.aotxccir) to write")
    parser.add_argument("--shared", action="store_true", help="include (or add) the shared profile")
    parser.add_argument("--capacity", metavar="K=V,...", help="shared capacities, e.g. participants=2048")
    parser.add_argument("--journal-limits", metavar="K=V,...",
                        help="journal_file_cap_bytes=N,checkpoint_journal_bytes=N for a new shared profile")
    parser.add_argument("--tiny", action="store_true", help="random-weight tiny models (tests)")
    parser.add_argument("--seed", type=int, help="random seed for --tiny (default 0)")
    parser.add_argument("--no-embedding", action="store_true", help="omit the embedding model (--tiny only)")
    parser.add_argument("--gguf", metavar="PATH", help="LLaMA-family GGUF instead of SmolLM2-135M-Instruct")
    parser.add_argument("--embedding", metavar="DIR", help="sentence-transformers BERT directory")
    parser.add_argument("--vlm", metavar="DIR",
                        help="an Idefics3 (SmolVLM) checkpoint directory as the generation model: images as input")
    parser.add_argument("--automatic-memory", action="store_true",
                        help="qualify the generation model for automatic memory (retention mode 2)")
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    parser.add_argument("--progress", action="store_true",
                        help="show progress when stderr is not a terminal too (a line at every tenth)")
    return parser


def _run(args) -> str:
    if args.tiny and (args.gguf or args.embedding or args.vlm):
        raise _UsageError("--tiny cannot be combined with --gguf, --embedding or --vlm")
    if args.vlm and (args.gguf or args.automatic_memory):
        raise _UsageError("--vlm cannot be combined with --gguf or --automatic-memory")
    if not args.tiny and (args.no_embedding or args.seed is not None):
        raise _UsageError("--no-embedding and --seed apply only to --tiny")
    if args.capacity is not None and not args.shared:
        raise _UsageError("--capacity requires --shared")
    capacity = parse_capacity(args.capacity) if args.capacity is not None else None
    limits = None
    if args.journal_limits is not None:
        if not args.shared:
            raise _UsageError("--journal-limits requires --shared")
        try:
            limits = {k: int(v) for k, v in (item.split("=", 1) for item in args.journal_limits.split(","))}
        except ValueError:
            raise _UsageError("--journal-limits takes K=V pairs with integer values") from None
    started = time.monotonic()
    # An existing file is written (or replaced) only by its one writer: refuse while a device or
    # another pack holds it (runtime_file_lock.FileLock), for the whole run.
    lock = runtime_file_lock.FileLock(args.runtime) if os.path.exists(args.runtime) else None
    try:
        return _pack(args, capacity, limits, started)
    finally:
        if lock is not None:
            lock.release()


def _pack(args, capacity: dict | None, limits: dict | None, started: float) -> str:
    repack = args.tiny or args.gguf or args.embedding or args.automatic_memory or args.vlm
    if os.path.exists(args.runtime) and not args.force:
        if not args.shared or repack:
            raise _UsageError(f"{args.runtime} exists; use --shared alone to enable shared operation on it, "
                              "or --force to replace it")
        status = "updated" if enable_shared(args.runtime, capacity=capacity) else "unchanged"
        summary = _summary(args.runtime, started)
    else:
        status = "packed"
        if args.tiny:
            summary = pack_tiny(args.runtime, shared=args.shared, capacity=capacity, seed=args.seed or 0,
                                with_embedding=not args.no_embedding, journal_limits=limits,
                                automatic_memory=args.automatic_memory)
        elif args.vlm:
            summary = pack_vlm(args.runtime, args.vlm, embedding_dir=args.embedding, shared=args.shared,
                               capacity=capacity, progress=args.progress or sys.stderr.isatty(),
                               journal_limits=limits)
        else:
            summary = pack_default(args.runtime, shared=args.shared, capacity=capacity,
                                   progress=args.progress or sys.stderr.isatty(), gguf_path=args.gguf,
                                   embedding_dir=args.embedding,
                                   journal_limits=limits, automatic_memory=args.automatic_memory)
    if args.shared:
        with RuntimeFile.open(args.runtime, verify=False) as packed:
            if not packed.has("emb/card"):
                print(f"warning: {args.runtime} has no embedding model; boot will refuse its shared profile",
                      file=sys.stderr)
    return f"{status} {summary['path']}: {summary['bytes'] / 2**20:.1f} MiB in {summary['seconds']:.1f} s"


def main(argv: list[str]) -> int:
    """`python -m gpu_worker pack ...`; argv holds the arguments after `pack`."""
    os.umask(0o077)  # a runtime file's checkpoints hold the inputs' text: it is its owner's alone
    try:
        print(_run(_parser().parse_args(argv)))
    except SystemExit as exc:  # --help
        return exc.code or 0  # type: ignore[return-value]  # argparse exits with an int code
    except (_UsageError, ValueError, RuntimeFileError, OSError) as exc:
        print(f"pack: error: {exc}", file=sys.stderr)
        return 2
    return 0
