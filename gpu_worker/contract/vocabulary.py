"""The words of the API both processes use: schemas, gateway actions, scopes, permissions,
terminal statuses, and the device commands with the action each needs (docs/protocol.md).

The gateway's views name a command and check its action before calling the device; the device
checks the same action against the current grant file; the OpenAPI table reads it from here."""
from __future__ import annotations

from dataclasses import dataclass

MUTATION_SCHEMA = "aotx.shared.mutation.v1"
RECEIPT_SCHEMA = "aotx.shared.receipt.v1"
CAPABILITIES_SCHEMA = "aotx.shared.capabilities.v1"
BASE_PATH = "/aotx/v1/shared"
ENVELOPE = ("schema", "lineage", "operation_key", "sequence")

READ, WRITE, MANAGE, CHAT = "shared_read", "shared_write", "shared_manage", "chat"
ACTIONS = (READ, WRITE, MANAGE, CHAT)
SCOPES = ("private", "room", "instance")
PERMISSIONS = ("read", "write", "manage")
MEDIA_TYPES = ("image", "audio")
# memory (docs/memory.md): an input's retention (mode 1, 2) and context rendering, the kinds of
# memory rows, and why an input's row was not retained
RETENTIONS = ("source", "interpret")
CONTEXTS = ("compact", "source_only", "managed", "plain")
MEMORY_KINDS = ("source", "interpretation", "control")
NOT_RETAINED = ("memory_full", "quota_exceeded", "no_room")
TERMINAL_STATUSES = ("succeeded", "failed", "cancelled", "interrupted", "deadline_exceeded")
HOLD_CAUSES = ("file_cap", "low_disk", "disk_full")
# Per-principal quotas of the grant file (docs/grants.md): what one principal may hold at once.
# Left out: the default, a fair share of the runtime's capacities that the device computes
# (gpu_worker/kinds/quotas.py, `defaults`); null: unlimited (within the tables' capacities and the
# global reserve).
QUOTAS = ("receipts", "spaces", "conversations", "media_bytes", "chats", "queued_inputs", "kv_pages",
          "memory_rows")
MAX_QUOTA = (1 << 63) - 1
# Per-principal rates of the grant file (docs/grants.md), beside the quotas: how fast one principal
# may send (enforced by the gateway from a request's headers, before it reads the body) and be
# given output tokens (by the engine, which pauses its sequences). Left out: DEFAULT_RATES; null:
# unlimited. Each is an integer from 1 to MAX_QUOTA, per second.
OUTPUT_TOKENS_RATE = "output_tokens_per_second"
RATES = ("requests_per_second", "body_bytes_per_second", OUTPUT_TOKENS_RATE)
# The rates of a principal whose grant leaves them out. Both processes need them (the gateway
# enforces the first two, the engine the third), and they do not depend on the runtime, so they
# live here; why these numbers: docs/performance.md, "Default principals".
DEFAULT_RATES = {"requests_per_second": 200, "body_bytes_per_second": 4 << 20, OUTPUT_TOKENS_RATE: 50}


@dataclass(frozen=True)
class Command:
    """One device command. `action` is the gateway action its principal needs (None: no principal,
    an ops command on the local socket or one about the connection itself); a mutation's
    `receipt_kind` is the `kind` its receipts show."""
    op: str
    action: str | None
    receipt_kind: str | None = None

    @property
    def mutation(self) -> bool:
        return self.receipt_kind is not None


COMMANDS = {c.op: c for c in (
    # ops (no principal)
    Command("ping", None),
    Command("checkpoint", None),
    Command("ops.receipts", None),
    Command("ops.receipt", None),
    Command("ops.result", None),
    Command("ops.command", None),
    Command("ops.memory", None),
    Command("ops.memory.forget", None),
    Command("audit.export", None),
    # reads
    Command("capabilities", READ),
    Command("participant.get", READ),
    Command("participants.get", READ),
    Command("spaces.list", READ),
    Command("spaces.get", READ),
    Command("members.list", READ),
    Command("conversations.list", READ),
    Command("conversations.get", READ),
    Command("conversations.events", READ),
    Command("operations.list", READ),
    Command("operations.get", READ),
    Command("operations.result", READ),
    Command("memory.list", READ),
    Command("memory.get", READ),
    Command("models.list", CHAT),
    # answered outside the read/mutation order; subscriptions answer with a stream of frames
    Command("chat.completions", CHAT),
    Command("embeddings", CHAT),
    Command("memory.search", READ),
    Command("media.put", WRITE),
    Command("conversations.subscribe", READ),
    Command("operations.subscribe", READ),
    Command("subscriptions.close", None),
    # mutations
    Command("participant.register", WRITE, "participant.register"),
    Command("spaces.create", WRITE, "space.create"),
    Command("members.set", MANAGE, "member.set"),
    Command("conversations.create", WRITE, "conversation.create"),
    Command("retirements.record", WRITE, "retirement"),
    Command("conversations.input", WRITE, "conversation.input"),
    Command("cancellations.record", WRITE, "cancellation"),
    Command("spaces.delete", MANAGE, "space.delete"),
    Command("conversations.delete", MANAGE, "conversation.delete"),
    Command("publications.record", MANAGE, "publication"),
    Command("memory.versions", WRITE, "memory.version"),
    Command("memory.delete", WRITE, "memory.delete"),
    Command("conversations.fork", WRITE, "conversation.fork"),
)}
