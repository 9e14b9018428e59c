"""Conversation inputs (SPEC "Mutations and retries", "Results and memory"): the admission of an
input and the reads of its result bytes. What happens after the admission is saved (lease,
engine, output, completion) is gpu_worker/pipeline/execution.py.

The admission records the accepted model digest, the effective page limit and output limit, and
the retention mode and context revision its lease will carry, apart from the caller's bytes (the
receipt's `effective` shows the model digest, page limit and output limit); defaults are the
profile's (256 output tokens, the page grant, temperature 0, top_p 1), retention `source` and
context `compact`.

An omitted `max_output_tokens` is the profile's default only as far as the page limit allows:
min(256, pages x page_size / 2), at least 1 (`default_output_tokens`). The page limit holds the
prompt and the output together, and at admission the device cannot count the prompt's tokens:
earlier turns, recalled memory and the chat template are chosen and tokenized when the input is
leased, off the tick thread. So the default leaves the prompt half the page limit, and the lease
fits the most recent turns into that room (prompt.fit_prompt). A caller's own value is taken as
it is, up to the whole page limit (pages x page_size).
"""
from __future__ import annotations

import json
from typing import Any

import msgspec

from ..pipeline import images
from ..contract import ids
from ..contract.commands import Input
from ..contract.errors import ServiceError
from ..state.tables import C, R, Right, Terminal
from ..storage import leases
from ..memory import shared as memory
from . import access, events, quotas
from .chat import model_card
from .conversations import target_id, visible_to
from .kind import Admission, Admitting, Caller, Extra, Kind, Notifying, OperationKind, Tables




def media_link(sha256: str) -> str:
    return "\nmedia://" + sha256


def _command(d: Tables, rrow: int) -> bytes:
    """The input's saved command (canonical JSON)."""
    t = d.state.tables
    return t.get_bytes(t.command_bytes, rrow, t.value(t.receipts, rrow, R.COMMAND_LEN))


def input_body(d: Tables, rrow: int) -> dict[str, Any]:
    """The input's saved command body (its text, media, settings)."""
    body: dict[str, Any] = json.loads(_command(d, rrow))["body"]
    return body


def media_links(body: dict[str, Any]) -> str:
    """The device's links to an input's media sources, as text."""
    return "".join(media_link(m["sha256"]) for m in body.get("media", []))


class _Media(msgspec.Struct):
    sha256: str


class _Body(msgspec.Struct):
    text: str
    media: list[_Media] = []


class _Command(msgspec.Struct):
    body: _Body


# a saved input command's text and media, the rest of it skipped (a replay reads an input's text
# for its memory row and again as its turn is folded into history: json.loads of the whole command
# took 2.5 µs, this 0.45 µs; docs/performance.md, "Replay")
_TEXT_AND_MEDIA = msgspec.json.Decoder(_Command)


def input_text(d: Tables, rrow: int) -> str:
    """The input's text with the device's media links appended (what the model reads, and what
    retention mode 1 keeps: the links stay text in memory)."""
    body = _TEXT_AND_MEDIA.decode(_command(d, rrow)).body
    return body.text + "".join(media_link(m.sha256) for m in body.media)


def default_output_tokens(profile: dict[str, Any], pages: int) -> int:
    """The output limit of an input that names none: the profile's default (256), within half of
    what its page limit holds (the other half is the prompt's room)."""
    return max(1, min(int(profile["max_output_tokens"]), pages * int(profile["page_size"]) // 2))


def check(d: Admitting, principal: bytes, prow: int | None, args: Input, key: bytes,
          sequence: int) -> Extra:
    access.conversation_row(d, args.conversation, principal, prow, Right.WRITE)  # 404 / 403 first
    media = [{"type": row.type, "sha256": row.sha256} for row in args.media]
    card = model_card(d, args.model)
    for row in media:
        sha = row["sha256"]
        source = d.state.media.get(sha)
        if source is None or prow not in source.owners:
            raise ServiceError(404, "media_not_found", f"no media source {sha} owned by this participant")
        if source.missing:  # listed by the saved state, its bytes lost (kinds/media.recover_bytes)
            raise ServiceError(409, "media_unavailable",
                               f"media source {sha} is saved but its bytes are not (restored from a checkpoint "
                               f"that did not carry them); upload it again: PUT /aotx/v1/media/{sha}", sha256=sha)
    types = set(r["type"] for r in media)
    if media and not types <= set(card["capabilities"]["media_types"]):
        raise ServiceError(409, "model_lacks_media", f"model {card['name']} takes no {', '.join(sorted(types))} input")
    profile = d.runtime.runtime_profile
    grant, pool = profile["page_grant"], profile["kv_pages"]
    pages = grant if args.pages is None else args.pages
    if pages > pool:
        raise ServiceError(409, "page_limit_exceeds_pool", f"{pages} pages exceed the KV pool of {pool}")
    if pages > grant:
        raise ServiceError(409, "page_limit_exceeds_grant", f"{pages} pages exceed the page grant of {grant}")
    max_output = default_output_tokens(profile, pages) if args.max_output_tokens is None else args.max_output_tokens
    if not max_output <= pages * profile["page_size"]:
        raise ServiceError(400, "bad_field", f"max_output_tokens must be 1..{pages * profile['page_size']} "
                                             f"for {pages} pages")
    images.check(d, card, media, pages, max_output)  # each image's bytes, and its tokens in the page limit
    token = d.control_tokens.find(args.text)  # the packed model's own (the gateway refused the families' already)
    if token is not None:
        raise ServiceError(400, "reserved_token", f"text contains the model's control token {token}")
    mode = leases.RETENTION_OF[args.retention]
    if mode == leases.RETAIN_AND_INTERPRET and not card["capabilities"]["automatic_memory"]:
        mode = leases.RETAIN_SOURCE  # recorded as mode 1: this model cannot interpret (SPEC)
    quotas.check(d, principal, prow, "queued_inputs")
    quotas.check(d, principal, prow, "kv_pages", pages)
    conversation = ids.CONVERSATION_ID.match(args.conversation)
    assert conversation is not None
    return {"conversation": list(ids.split_id(conversation)),
            "model": d.model_digest, "pages": pages, "max_output_tokens": max_output,
            "temperature": float(args.temperature), "top_p": float(args.top_p),
            "media": [[r["type"], r["sha256"]] for r in media], "retention": mode,
            "revision": leases.REVISION_OF[args.context]}


def apply(d: Caller, a: Admission, prow: int, transfer_seq: int | None, rrow: int) -> int:
    conversations = d.state.conversations
    recorded = a.extra["conversation"]
    crow = conversations.by_id[(recorded[0], recorded[1])]
    conversations.add_input(crow, rrow)
    quotas.input_admitted(d, prow, rrow, a.extra["pages"])  # unfinished until its completion
    t = d.state.tables
    t.write_row(t.conversations, crow, {C.INPUTS: t.value(t.conversations, crow, C.INPUTS) + 1})
    return crow


def columns(d: Tables, a: Admission) -> dict[int, int]:
    """Its effective limits, and its event order (apply, which runs first, counted it)."""
    t = d.state.tables
    recorded = a.extra["conversation"]
    crow = d.state.conversations.by_id[(recorded[0], recorded[1])]
    return {R.TERMINAL: Terminal.NONE, R.PAGE_LIMIT: a.extra["pages"], R.MAX_OUTPUT: a.extra["max_output_tokens"],
            R.ORDER: t.value(t.conversations, crow, C.INPUTS),
            # what its lease will record (admissions from before memory: mode 1, revision 3)
            R.RETENTION: a.extra.get("retention", leases.RETAIN_SOURCE),
            R.REVISION: a.extra.get("revision", leases.COMPACT) + 1}


def saved(d: Notifying, rrow: int) -> None:
    """Saved: it waits for its lease (its conversation's turn, then its principal's:
    state/executions.py LeaseQueue), and its event goes to the conversation's subscribers."""
    t = d.state.tables
    row = t.row(t.receipts, rrow)
    d.executions.to_lease.append(rrow, row[R.PARTICIPANT], row[R.TARGET])
    events.input_saved(d, rrow)


SUBMIT: OperationKind = OperationKind(Kind.INPUT, "conversations.input", check=check, apply=apply, target_id=target_id,
                       visible_to=visible_to, columns=columns, executes=True, saved=saved,
                       memory=memory.input_receipt)
