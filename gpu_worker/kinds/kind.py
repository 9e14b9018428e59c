"""What an operation kind is: the small interface every mutation implements, the kind codes the
journal records, the admission each one's transfer records, and what an operation sees of the
device (docs/adding-an-operation-kind.md).

What an operation sees is declared here, not the device itself: `Tables` (the authoritative
tables and the kinds that render their receipts) is all most kinds' functions take; a function
that needs more takes one facet beside the tables — `Caller` (the caller's grant and quotas),
`Journaling` (a journal transfer, `append`, and the committer's state), `Publishing` (the
subscriptions events are pushed to), `Executing` (the engine and its inputs in execution),
`Reporting` (the runtime file) — or, when it needs several, the named combination of just those
(`Rendering`, `Admitting`, ...), `Context` (every facet) only when it needs them all. A hook type
takes what its implementations need together (`Check`: `Admitting`, `Apply`: `Applying`). The
device (gpu_worker/device.py) provides them all; nothing under kinds/ imports it, so the device,
its admission and execution modules and the operations form no import circle.

A kind's functions take that context first. `check` validates a new operation against the
current state and changes nothing (a refusal is a ServiceError); what it returns is recorded in
the admission transfer (IDs, never rows, so replay re-resolves them). `apply` cannot fail: it
changes the tables live and at replay alike and returns the row of the operation's target.
`target_id` renders that target in the receipt, `visible_to` says whether another participant
may read the receipt, `columns` fills receipt columns of the kind's own, `saved` runs once a live
admission is saved (an input starts executing and its event is pushed), `memory` renders the
memory objects it wrote into its receipt, `prepare` makes what a helper thread must compute before
the admission (a correction's embedding, recorded in the admission).
"""
from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Protocol, TypeVar

import msgpack
import numpy as np

from ..contract.commands import TYPES, A, Mutation
from ..contract.vocabulary import COMMANDS
from ..contract.wire import pack

if TYPE_CHECKING:
    from ..contract.grantfile import Grants
    from ..contract.wire import Message
    from ..engine.embedding import EmbeddingModel
    from ..pipeline.prompt import ControlTokens
    from ..loop.runner import Runner
    from ..storage.checkpoint import CheckpointSummary
    from ..loop.subscriptions import Subscriptions
    from ..state import DeviceState
    from ..state.executions import Executions
    from ..state.holds import Holds
    from ..state.usage import Chats, Usage
    from ..storage.committer import Batch, Committer
    from ..storage.filelayer import FileLayer
    from ..storage.journal import Transfer
    from ..storage.runtime_file import RuntimeFile

ADMISSION_VERSION = 1
_unpack = msgpack.unpackb
_as_admission = tuple.__new__  # (Admission's fields in order: one C call)
T = TypeVar("T")  # what a helper thread's work returns (Executing.off_thread)
# an upload whose bytes are being written (kinds/media.py): (connection, request id, sha256, participant row, bytes)
MediaWaiting = tuple[object, int | None, str, int, int]


class Tables(Protocol):
    """The authoritative tables (gpu_worker/state/) and the operation kinds that render their
    receipt rows (kinds/registry.py), read-only: what most kinds' functions need."""

    @property
    def state(self) -> DeviceState: ...

    @property
    def kinds(self) -> Mapping[int, OperationKind]: ...


class Caller(Tables, Protocol):
    """The caller: its grant, its participant row, its command's typed arguments, its quotas (the
    defaults a grant leaves out, its chats' pages)."""

    @property
    def grants(self) -> Grants: ...

    @property
    def usage(self) -> Usage: ...

    def principal(self, msg: Message, action: str) -> bytes: ...

    def caller_row(self, principal: bytes) -> int: ...

    def args(self, msg: Message, kind: type[A]) -> A: ...

    def quota_defaults(self) -> dict[str, int]: ...

    def chat_pages(self, principal: bytes) -> list[int]: ...


class Journaling(Tables, Protocol):
    """The journal: a transfer (`on_saved` runs once it is saved), the committer, holds, the
    media sources' directory beside it, and an admission the device makes on its own behalf
    (`admit_as`: a principal and a kind's typed arguments through the whole admission protocol,
    past the grant check; (status, receipt row, journal records), or a ServiceError)."""

    def append(self, kind: int, payload: bytes, on_saved: Callable[[Transfer], None] | None = None) -> int: ...

    @property
    def committer(self) -> Committer: ...

    @property
    def holds(self) -> Holds: ...

    @property
    def journal_dir(self) -> str: ...

    @property
    def fs(self) -> FileLayer: ...

    @property
    def media_waiting(self) -> dict[int, MediaWaiting]: ...

    def journal_state(self) -> dict[str, str | bool | None]: ...

    def checkpoint(self) -> CheckpointSummary | None: ...

    def admit_as(self, principal: bytes, code: int, args: Mutation) -> tuple[int, int, int]: ...


class Publishing(Tables, Protocol):
    """Events to subscribers."""

    @property
    def subscriptions(self) -> Subscriptions: ...


class Executing(Tables, Protocol):
    """The engine: its runner, the embedding model, inputs in execution, chats, helper threads."""

    @property
    def runner(self) -> Runner | None: ...

    @property
    def embedder(self) -> EmbeddingModel: ...

    @property
    def executions(self) -> Executions: ...

    @property
    def chats(self) -> Chats: ...

    def off_thread(self, work: Callable[[], T], then: Callable[[T | None, BaseException | None], None]) -> None: ...

    def stop_input(self, rrow: int) -> None: ...


class Reporting(Tables, Protocol):
    """The runtime file and what the device reports of itself."""

    @property
    def runtime(self) -> RuntimeFile: ...

    @property
    def control_tokens(self) -> ControlTokens: ...

    @property
    def model_digest(self) -> str: ...

    @property
    def incarnation_hex(self) -> str: ...

    @property
    def grant_problem(self) -> str | None: ...

    @property
    def pipeline_state(self) -> Callable[[], dict[str, object]] | None: ...


class Rendering(Executing, Journaling, Reporting, Protocol):
    """What a receipt's rendering reads beside its row (receipts.py): an executing input's output
    not yet saved, the journal's hold, the model digest and the runtime file's incarnation. An
    input's interpretation (pipeline/retention.py) uses the same three: the engine, the journal
    for its memory record, the runtime's page size."""


class Admitting(Caller, Rendering, Protocol):
    """The caller beside what renders receipts: what a kind's `check` may read (the caller's grant
    and quotas; an input's model card and media sources; a cancellation's executions), and what
    reads a caller's receipts and events or an input's lease (its prompt, the memory it recalls)
    take."""


class Applying(Caller, Executing, Protocol):
    """What a kind's `apply` may change beside the tables: the caller's quotas (an input counts
    against them) and the engine (a cancellation stops its input)."""


class Running(Executing, Journaling, Protocol):
    """The engine beside the journal: whether its work is journaled now (none under a hold), and
    an input's media sources read for its prompt (pipeline/images.py)."""


class Sourcing(Journaling, Reporting, Protocol):
    """The media sources' bytes: files under the journal directory, and the runtime file's copies
    of them (media.py) and profile (an image's tokens in the page limit)."""


class Retaining(Caller, Journaling, Protocol):
    """Memory retained from an input (pipeline/retention.py): its record journaled, within the
    principal's memory quota."""


class Streaming(Executing, Publishing, Protocol):
    """The engine's output pushed to subscribers: a chat's frames, its deadline, its cancellation
    (chat.py)."""


class Serving(Caller, Streaming, Protocol):
    """A caller served by the engine and answered through subscriptions: an embedding, a
    subscription closed, and the rechecks that end a reader's streams and chats when its rights
    change or the state is rebuilt (events.py)."""


class Chatting(Serving, Reporting, Protocol):
    """A chat completion started (chat.py): a caller served, and the model card and control tokens
    it is checked and prompted with."""


class Notifying(Rendering, Publishing, Protocol):
    """Receipts pushed as events to subscribers: an input saved, an operation ended (events.py)."""


class Uploading(Caller, Journaling, Publishing, Protocol):
    """A media upload answered once its owner is saved, or refused (media.py): the caller's bytes
    in flight, the journal's waiting uploads and hold, the reply pushed."""


class Context(Caller, Journaling, Publishing, Executing, Reporting, Protocol):
    """Every facet: for the functions that need them all (a stream opened, ping, an input's
    completion) and the hooks whose implementations together do (`Saved`, `Read`, `Later`)."""


class Kind(IntEnum):
    """Kind codes, recorded in admission transfers and receipt rows: part of the journal format."""
    PARTICIPANT_REGISTER = 1
    SPACE_CREATE = 2
    MEMBER_SET = 3
    CONVERSATION_CREATE = 4
    RETIREMENT = 5
    INPUT = 6
    CANCELLATION = 7
    SPACE_DELETE = 8
    CONVERSATION_DELETE = 9
    PUBLICATION = 10
    MEMORY_VERSION = 11
    MEMORY_DELETE = 12
    CONVERSATION_FORK = 13


# The head of an admission payload as Admission.encode packs it: a fixarray of 8, ADMISSION_VERSION,
# the kind code (a positive fixint), the principal (a 16-byte bin). A replay reads a transfer's kind
# and principal there, without decoding the rest, to find runs of one kind (recovery/replay.py `Replay._replay_piece`).
HEAD_ARRAY, KIND_AT, PRINCIPAL_BIN, PRINCIPAL_AT = 0x98, 2, (3, 4, 0xc4, 16), slice(5, 21)


class Run(NamedTuple):
    """A run of one kind's admissions decoded as columns (its kind's `decode_run`), one entry per
    admission in journal order: what a replay writes as columns (admission.replay_run)."""
    sequences: np.ndarray  # int64
    keys: np.ndarray       # (n, 2) int64: each operation key's halves, as the tables hold them
    ops: np.ndarray        # (n, 2) int64: each operation ID's
    commands: bytes        # the canonical command bytes, back to back
    lengths: np.ndarray    # int64: each one's length
    extra: tuple[Any, ...]  # the kind's own columns (spaces.create: the ids' halves, the scopes)


# What a kind's `check` returns and its admission records (IDs and plain values, never rows: a
# replay re-resolves them), which its `apply` reads back: the admission's `extra`.
Extra = dict[str, Any]


class Admission(NamedTuple):
    """The decoded admission transfer: what the journal records for one new operation.
    `extra` holds what the kind's check returned (IDs, never rows), so replay re-resolves them.
    A tuple: a replay decodes one per admission (a million for a 1M-transfer journal), and a
    tuple is made in one step where a dataclass runs its __init__ (docs/performance.md, "Replay")."""
    kind: int
    principal: bytes
    sequence: int
    key: bytes
    op: bytes
    canonical: bytes
    extra: Extra

    def encode(self) -> bytes:
        return pack([ADMISSION_VERSION, *self])

    @classmethod
    def decode(cls, payload: bytes) -> Admission:
        fields = _unpack(payload, raw=False)
        if type(fields) is not list or len(fields) != 8 or fields[0] != ADMISSION_VERSION:
            raise ValueError("unknown admission layout")
        return _as_admission(cls, fields[1:])


# check(context, principal, participant row or None, the kind's arguments (its type in
# contract/commands.py, already checked there), operation key, sequence) -> admission extra
Check = Callable[[Admitting, bytes, "int | None", Any, bytes, int], Extra]
# prepare(context, principal, participant row or None, the kind's arguments) -> work for a helper
# thread before admission (what is proportional to the command: a correction's embedding); what it
# returns is recorded in the admission's extra as "prepared" (pipeline/preparing.py)
Prepare = Callable[[Admitting, bytes, "int | None", Any], Callable[[], bytes]]
# apply(context, admission, participant row, journal transfer seq (None at replay), receipt row) -> target row
Apply = Callable[[Applying, Admission, int, "int | None", int], int]
# decode_run(payloads) -> a run of the kind's admissions as columns, or None when a payload is not
# as Admission.encode packs it (a replay then decodes each: admission.replay_run)
DecodeRun = Callable[[list[bytes]], "Run | None"]
# apply_run(context, run, participant rows, admission counters) -> target rows: `apply` of each
# admission of the run, in order, at replay (docs/performance.md, "Runs of admissions as columns")
ApplyRun = Callable[[Tables, "Run", np.ndarray, np.ndarray], np.ndarray]
# target_id(context, receipt row values, the participant's lineage) -> the receipt's "target"
TargetId = Callable[[Tables, list[int], bytes], str]
# visible_to(context, reader principal, reader participant row or None, receipt row values) -> bool
VisibleTo = Callable[[Caller, bytes, "int | None", list[int]], bool]
# columns(context, admission) -> {receipt column: value}
Columns = Callable[[Tables, Admission], dict[int, int]]
# memory(context, receipt row values, the participant's lineage) -> the receipt's "memory" (JSON text)
MemoryJson = Callable[[Tables, list[int], bytes], str]
# saved(context, receipt row): the admission is saved (live only; replay finds it saved)
Saved = Callable[[Context, int], None]
# a read: read(device, principal bytes (None for ops commands), its arguments (the command's type
# in contract/commands.py)) -> (status, body)
Read = Callable[[Context, Any, Any], tuple[int, object]]
# a command answered outside a tick's order: later(device, connection, message, the tick's batch)
# -> journal records used
Later = Callable[[Context, object, "Message", "Batch"], int]


def owner_only(device: Tables, principal: bytes, reader: int | None, row: list[int]) -> bool:
    """The default: only the participant that made the operation reads its receipt."""
    return False


class OperationKind:
    __slots__ = ("code", "op", "name", "action", "args", "check", "apply", "decode_run", "apply_run", "target_id",
                 "visible_to", "columns", "executes", "saved", "memory", "prepare")

    def __init__(self, code: Kind, op: str, *, check: Check, apply: Apply, target_id: TargetId,
                 visible_to: VisibleTo = owner_only, columns: Columns | None = None, executes: bool = False,
                 saved: Saved | None = None, memory: MemoryJson | None = None,
                 runs: tuple[DecodeRun, ApplyRun] | None = None, prepare: Prepare | None = None) -> None:
        command = COMMANDS[op]
        if command.receipt_kind is None or command.action is None:
            raise ValueError(f"{op} is not a mutation command of the contract")
        self.code = int(code)
        self.op = op
        self.name = command.receipt_kind     # the receipt's "kind"
        self.action = command.action         # the gateway action the principal needs
        args = TYPES[op]
        assert issubclass(args, Mutation), f"{op}'s arguments must carry the mutation envelope"
        self.args: type[Mutation] = args     # its arguments' declared type
        self.check = check
        self.apply = apply
        self.target_id = target_id
        self.visible_to = visible_to
        self.columns = columns
        # True: the operation runs after its admission (lease, engine, completion); every other
        # kind finishes at admission, and the transfer that saves the admission saves its result
        self.executes = executes
        self.saved = saved  # what follows once the admission is saved (start execution, push events)
        self.memory = memory  # the memory it wrote, for its receipt (None: "memory": null)
        self.prepare = prepare  # its work on a helper thread before admission (None: admitted as it comes)
        # a replay's runs of this kind's admissions as columns (admission.replay_run): for a kind that
        # finishes at admission and writes no receipt columns of its own, so a run's receipt rows
        # are written alike
        assert runs is None or (not executes and columns is None), f"{op}: runs with executes or columns"
        self.decode_run: DecodeRun | None = runs[0] if runs is not None else None
        self.apply_run: ApplyRun | None = runs[1] if runs is not None else None

    def __repr__(self) -> str:
        return f"OperationKind({self.name})"
