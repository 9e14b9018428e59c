"""Conversation inputs: admission, lease, execution, output, completion, cancellation, deadline
and result reads (SPEC "Mutations and retries", "Results and memory", "Recorded state and
recovery"), mixed into the Device.

The life of an input, each step a journal transfer made saved before the next starts:
  ADMISSION   the caller's canonical bytes, the accepted model digest and effective limits
  LEASE       lease rows (leases.py, revision 3, retention mode 1) once the admission is saved;
              the execution deadline starts when this lease is applied (saved)
  OUTPUT      result bytes at an offset, flushed every few hundred bytes or 100 ms
  COMPLETION  terminal status, finish reason and token counts
Readers see result bytes only once their OUTPUT transfer is saved. An input whose admission was
saved but which has no COMPLETION when the device restarts becomes `interrupted` at boot and is
never run again.
"""
import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass, field

import msgpack

from . import ids, leases
from .journal import JournalCorrupt, TransferKind, record_count, segment_name
from .kinds import Kind
from .protocol import DeviceError
from .spaces import Right
from .tables import Finish, P, R, Terminal

OUTPUT_CHUNK = 480            # bytes per OUTPUT transfer: 4 records with its header
FLUSH_SECONDS = 0.1           # how stale unjournaled output may get
ENGINE_RECORDS_PER_TICK = 10  # engine work never takes the whole tick from admissions
INPUT_BYTES = 2048
MEDIA_LINK_BYTES = 73         # "\n" + "media://" + 64 hex digits
MAX_MEDIA = 8
# Media control tokens of the model families this service may run: text may not carry them
# (the device adds media links itself); refused before anything is retained.
RESERVED_TOKENS = ("<|image|>", "<|audio|>", "<image>", "<audio>", "<|media|>", "<|vision_start|>",
                   "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|audio_bos|>", "<|audio_eos|>",
                   "<start_of_image>", "<end_of_image>", "<|begin_of_image|>", "<|end_of_image|>")
FINISHES = {"stop": Finish.STOP, "length": Finish.LENGTH, "cancelled": Finish.CANCELLED,
            "deadline": Finish.DEADLINE}
TERMINAL_NAMES = {t: t.name.lower() for t in Terminal if t != Terminal.NONE}
FINISH_NAMES = {Finish.STOP: "stop", Finish.LENGTH: "length", Finish.CANCELLED: "cancelled",
                Finish.DEADLINE: "deadline", Finish.INTERRUPTED: "interrupted", Finish.FAILED: "failed"}
TERMINAL_OF = {Finish.STOP: Terminal.SUCCEEDED, Finish.LENGTH: Terminal.SUCCEEDED,
               Finish.CANCELLED: Terminal.CANCELLED, Finish.DEADLINE: Terminal.DEADLINE_EXCEEDED,
               Finish.INTERRUPTED: Terminal.INTERRUPTED, Finish.FAILED: Terminal.FAILED}


@dataclass
class Execution:
    """Live state of one leased input (host side; its saved bytes are in the tables)."""
    rrow: int
    deadline_ns: int
    buffered: bytearray = field(default_factory=bytearray)
    offset: int = 0                # result bytes journaled so far (saved or in flight)
    flushed_at: float = 0.0
    finish: Finish = Finish.NONE   # set when the engine ended it; journaled as COMPLETION
    input_tokens: int = 0
    output_tokens: int = 0
    completing: bool = False       # its COMPLETION transfer is in flight


def media_link(sha256):
    return "\nmedia://" + sha256


class InputCommands:
    def init_inputs(self):
        self.conversation_inputs = {}  # conversation row -> input receipt rows in admission order
        self.executions = {}           # receipt row -> Execution (leased, not yet completed)
        self.to_lease = []             # receipt rows whose admission is saved, awaiting their lease
        self.media = {}                # media sha256 hex -> {length, type, owners: participant rows}
        t = self.tables
        for rrow in sorted(self.by_op.values(), key=lambda r: t.value(t.receipts, r, R.CREATED)):
            if t.value(t.receipts, rrow, R.KIND) == Kind.INPUT:
                self.conversation_inputs.setdefault(t.value(t.receipts, rrow, R.TARGET), []).append(rrow)

    # ---- admission ---------------------------------------------------------------------

    def _model_index(self, name):
        card = self.runtime.json("gen/card")
        if name in (card["name"], self.model_digest):
            return card
        raise DeviceError(409, "model_not_available",
                          f"model {name!r} is not served here; see /capabilities for the models")

    def _prepare_input(self, principal, prow, args, key, sequence):
        self._conversation_row(args.get("conversation"), principal, prow, Right.WRITE)  # 404 / 403 first
        text, media = args.get("text"), args.get("media") or []
        if not isinstance(text, str) or not isinstance(media, list):
            raise DeviceError(400, "bad_field", "text must be a string and media an array")
        if not text and not media:
            raise DeviceError(400, "bad_field", "text can be empty only when media is present")
        reserved = [token for token in RESERVED_TOKENS if token in text]
        if reserved:
            raise DeviceError(400, "reserved_token", f"text contains the reserved media control token {reserved[0]}")
        if len(media) > MAX_MEDIA:
            raise DeviceError(400, "too_many_media", f"at most {MAX_MEDIA} media references")
        size = len(text.encode("utf-8")) + MEDIA_LINK_BYTES * len(media)
        if size > INPUT_BYTES:
            raise DeviceError(400, "input_too_large", f"text and media links take {size} bytes; the limit is "
                                                      f"{INPUT_BYTES} ({MEDIA_LINK_BYTES} per media link)")
        card = self._model_index(args.get("model"))
        for row in media:
            owners = self.media_owner(row.get("sha256")) if isinstance(row, dict) else set()
            if prow not in owners:
                raise DeviceError(404, "media_not_found",
                                  f"no media source {row.get('sha256') if isinstance(row, dict) else row!r} "
                                  "owned by this participant")
        if media and not set(r["type"] for r in media) <= set(card["capabilities"]["media_types"]):
            raise DeviceError(409, "model_lacks_media",
                              f"model {card['name']} takes no {', '.join(sorted(set(r['type'] for r in media)))} input")
        profile = self.runtime.runtime_profile
        grant, pool = profile["page_grant"], profile["kv_pages"]
        pages = args.get("pages", grant)
        if not isinstance(pages, int) or pages < 1:
            raise DeviceError(400, "bad_field", "pages must be a positive integer")
        if pages > pool:
            raise DeviceError(409, "page_limit_exceeds_pool", f"{pages} pages exceed the KV pool of {pool}")
        if pages > grant:
            raise DeviceError(409, "page_limit_exceeds_grant", f"{pages} pages exceed the page grant of {grant}")
        max_output = args.get("max_output_tokens", profile["max_output_tokens"])
        if not isinstance(max_output, int) or not 1 <= max_output <= pages * profile["page_size"]:
            raise DeviceError(400, "bad_field", f"max_output_tokens must be 1..{pages * profile['page_size']} "
                                                f"for {pages} pages")
        temperature, top_p = args.get("temperature", 0.0), args.get("top_p", 1.0)
        if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            raise DeviceError(400, "bad_field", "temperature must be a number in [0, 2]")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise DeviceError(400, "bad_field", "top_p must be a number in (0, 1]")
        conversation = ids.CONVERSATION_ID.match(args["conversation"])
        return {"conversation": [bytes.fromhex(conversation.group(1)), bytes.fromhex(conversation.group(2))],
                "model": self.model_digest, "pages": pages, "max_output_tokens": max_output,
                "temperature": float(temperature), "top_p": float(top_p),
                "media": [[r["type"], r["sha256"]] for r in media]}

    def _apply_input(self, a, prow, transfer_seq, rrow):
        crow = self.by_conversation[tuple(a.extra["conversation"])]
        self.conversation_inputs.setdefault(crow, []).append(rrow)
        return crow

    def _input_columns(self, a):
        return {R.TERMINAL: Terminal.NONE, R.PAGE_LIMIT: a.extra["pages"],
                R.MAX_OUTPUT: a.extra["max_output_tokens"]}

    # ---- lease and execution -------------------------------------------------------------

    def _input_text(self, rrow):
        t = self.tables
        canonical = t.get_bytes(t.command_bytes, rrow, t.value(t.receipts, rrow, R.COMMAND_LEN))
        body = json.loads(canonical)["body"]
        return body["text"] + "".join(media_link(m["sha256"]) for m in body.get("media", []))

    def _prompt(self, rrow, page_limit, max_output):
        """The conversation's earlier turns and this input, oldest turns dropped until it fits."""
        t = self.tables
        crow = t.value(t.receipts, rrow, R.TARGET)
        turns = []
        for earlier in self.conversation_inputs.get(crow, []):
            if earlier == rrow:
                break
            if t.value(t.receipts, earlier, R.TERMINAL) != Terminal.SUCCEEDED:
                continue
            answer = t.get_bytes(t.result_bytes, earlier, t.value(t.receipts, earlier, R.RESULT_LEN))
            turns.append([{"role": "user", "content": self._input_text(earlier)},
                          {"role": "assistant", "content": answer.decode("utf-8", "replace")}])
        current = [{"role": "user", "content": self._input_text(rrow)}]
        room = page_limit * self.runtime.runtime_profile["page_size"] - max_output
        tokenizer = self.runner.engine.tokenizer
        while True:
            prompt = tokenizer.encode_chat([m for turn in turns for m in turn] + current)
            if len(prompt) <= room or not turns:
                return prompt if len(prompt) <= room else None
            turns.pop(0)

    def _lease_saved(self, rrows, transfer, live):
        t = self.tables
        for rrow in rrows:
            t.write_row(t.receipts, rrow, {R.LEASE: transfer.seq})
        if not live:
            return
        deadline = time.time_ns() + self.runtime.runtime_profile["deadline_ms"] * 1_000_000
        for rrow in rrows:
            execution = self.executions[rrow] = Execution(rrow, deadline, flushed_at=time.monotonic())
            if rrow in self._cancel_when_leased:
                self._cancel_when_leased.discard(rrow)
                execution.finish = Finish.CANCELLED
                continue
            row = t.row(t.receipts, rrow)
            prompt = self._prompt(rrow, row[R.PAGE_LIMIT], row[R.MAX_OUTPUT])
            if prompt is None:
                execution.finish = Finish.FAILED
                continue
            execution.input_tokens = len(prompt)
            settings = self._input_settings(rrow)
            self.runner.submit(("input", rrow), prompt, max_new_tokens=row[R.MAX_OUTPUT],
                               page_limit=row[R.PAGE_LIMIT], **settings)

    def _input_settings(self, rrow):
        t = self.tables
        canonical = json.loads(t.get_bytes(t.command_bytes, rrow, t.value(t.receipts, rrow, R.COMMAND_LEN)))
        body = canonical["body"]
        return {"temperature": float(body.get("temperature", 0.0)), "top_p": float(body.get("top_p", 1.0))}

    def engine_events(self, events):
        """Called on the tick loop's thread with the engine thread's events."""
        for request_id, token, data, finish in events:
            if request_id is None:
                raise RuntimeError("the engine thread failed; restart the device")
            if request_id[0] == "chat":
                self.chat_event(request_id, token, data, finish)
                continue
            execution = self.executions.get(request_id[1])
            if execution is None or execution.finish:
                continue
            if token is not None:
                execution.output_tokens += 1
            room = self.capacities["result_bytes"] - execution.offset - len(execution.buffered)
            execution.buffered += data[:max(room, 0)]
            if len(data) > room and finish is None:
                self.runner.cancel(request_id, "length")  # the result table row is full
            if finish is not None:
                execution.finish = FINISHES.get(finish, Finish.FAILED)

    def engine_work(self):
        return bool(self.to_lease and self.runner is not None) or any(
            e.buffered and (e.finish or len(e.buffered) >= OUTPUT_CHUNK
                            or time.monotonic() - e.flushed_at >= FLUSH_SECONDS)
            or (e.finish and not e.completing) for e in self.executions.values())

    def journal_engine_work(self, budget):
        """Append lease, output and completion transfers within budget; returns records used."""
        used = 0
        if self.to_lease and self.runner is not None:
            rrows = []
            while self.to_lease and record_count(leases.HEADER.size + leases.ROW.size * (len(rrows) + 1)) <= budget:
                rrows.append(self.to_lease.pop(0))
            if rrows:
                payload = self._lease_payload(rrows)
                seq = self.writer.append(TransferKind.LEASE, payload)
                self._on_saved[seq] = lambda transfer, rrows=rrows: self._lease_saved(rrows, transfer, True)
                used += record_count(len(payload))
        now = time.monotonic()
        for execution in list(self.executions.values()):
            while execution.buffered and (execution.finish or len(execution.buffered) >= OUTPUT_CHUNK
                                          or now - execution.flushed_at >= FLUSH_SECONDS):
                chunk = bytes(execution.buffered[:OUTPUT_CHUNK])
                payload = self._output_payload(execution.rrow, execution.offset, chunk)
                if used + record_count(len(payload)) > budget:
                    return used
                seq = self.writer.append(TransferKind.OUTPUT, payload)
                self._on_saved[seq] = lambda transfer, p=payload: self._apply_output(msgpack.unpackb(p), transfer)
                del execution.buffered[:len(chunk)]
                execution.offset += len(chunk)
                execution.flushed_at = now
                used += record_count(len(payload))
            if execution.finish and not execution.buffered and not execution.completing:
                payload = self._completion_payload(execution.rrow, execution.finish, execution.input_tokens,
                                                   execution.output_tokens)
                if used + record_count(len(payload)) > budget:
                    return used
                seq = self.writer.append(TransferKind.COMPLETION, payload)
                self._on_saved[seq] = lambda transfer, p=payload: self._apply_completion(msgpack.unpackb(p), transfer)
                execution.completing = True
                used += record_count(len(payload))
        return used

    def _actor(self, rrow):
        t = self.tables
        row = t.row(t.receipts, rrow)
        return self.participant_ids[row[R.PARTICIPANT]][2], row[R.SEQUENCE]

    def _lease_payload(self, rrows):
        t = self.tables
        rows = []
        for i, rrow in enumerate(rrows):
            actor, sequence = self._actor(rrow)
            rows.append(leases.LeaseRow(i, t.value(t.receipts, rrow, R.TARGET), sequence, actor, leases.RETAIN_SOURCE))
        return leases.encode(leases.COMPACT, rows)

    def _output_payload(self, rrow, offset, data):
        actor, sequence = self._actor(rrow)
        return msgpack.packb([actor, sequence, offset, data], use_bin_type=True)

    def _completion_payload(self, rrow, finish, input_tokens, output_tokens):
        actor, sequence = self._actor(rrow)
        return msgpack.packb([actor, sequence, int(finish), input_tokens, output_tokens], use_bin_type=True)

    def _input_row(self, actor, sequence, transfer, what):
        """The input a lease/output/completion transfer names; anything else fails closed."""
        prow = self.by_participant.get(actor)
        rrow = self.by_sequence.get((prow, sequence)) if prow is not None else None
        if rrow is None or self.tables.value(self.tables.receipts, rrow, R.KIND) != Kind.INPUT:
            raise self._inconsistent(transfer, f"{what} transfer seq {transfer.seq} names no input at sequence "
                                               f"{sequence}")
        return rrow

    def _inconsistent(self, transfer, reason):
        return JournalCorrupt(os.path.join(self.journal_dir, segment_name(transfer.segment)), transfer.offset, reason)

    def replay_lease(self, transfer):
        try:
            revision, rows = leases.decode(transfer.payload)  # every row checked before any is applied
        except leases.LeaseError as exc:
            raise self._inconsistent(transfer, f"lease transfer seq {transfer.seq}: {exc}") from None
        rrows = [self._input_row(row.actor, row.sequence, transfer, "lease") for row in rows]
        self._lease_saved(rrows, transfer, live=False)

    def _apply_output(self, fields, transfer):
        actor, sequence, offset, data = fields
        rrow = self._input_row(actor, sequence, transfer, "output")
        t = self.tables
        if offset != t.value(t.receipts, rrow, R.RESULT_LEN) or offset + len(data) > self.capacities["result_bytes"]:
            raise self._inconsistent(transfer, f"output transfer seq {transfer.seq} at result offset {offset} does "
                                               "not follow the saved result")
        t.put_bytes(t.result_bytes, rrow, data, offset)
        t.write_row(t.receipts, rrow, {R.RESULT_LEN: offset + len(data)})

    def _apply_completion(self, fields, transfer):
        actor, sequence, finish, input_tokens, output_tokens = fields
        rrow = self._input_row(actor, sequence, transfer, "completion")
        t = self.tables
        finish = Finish(finish)
        t.write_row(t.receipts, rrow, {
            R.TERMINAL: TERMINAL_OF[finish], R.FINISH: finish, R.INPUT_TOKENS: input_tokens,
            R.OUTPUT_TOKENS: output_tokens})
        self._mark_terminal_saved(rrow, transfer)
        self.executions.pop(rrow, None)

    def interrupt_unfinished(self):
        """At boot: saved admissions with no completion never run again (SPEC)."""
        t = self.tables
        for rrows in self.conversation_inputs.values():
            for rrow in rrows:
                if t.value(t.receipts, rrow, R.TERMINAL) == Terminal.NONE:
                    payload = self._completion_payload(rrow, Finish.INTERRUPTED, 0, 0)
                    seq = self.writer.append(TransferKind.COMPLETION, payload)
                    self._on_saved[seq] = lambda transfer, p=payload: self._apply_completion(msgpack.unpackb(p), transfer)

    def check_deadlines(self):
        now = time.time_ns()
        for rrow, execution in self.executions.items():
            if not execution.finish and now >= execution.deadline_ns:
                execution.finish = Finish.DEADLINE
                if self.runner is not None:
                    self.runner.cancel(("input", rrow), "deadline")

    # ---- cancellation ------------------------------------------------------------------

    def _prepare_cancellation(self, principal, prow, args, key, sequence):
        target = args.get("target_sequence")
        if not isinstance(target, int) or target < 1:
            raise DeviceError(400, "bad_field", "target_sequence must be a positive decimal counter")
        floor = self.tables.value(self.tables.participants, prow, P.RETRY_FLOOR)
        if target < floor:
            raise DeviceError(410, "below_retry_floor", f"target_sequence {target} is below the retry floor {floor}")
        rrow = self.by_sequence.get((prow, target))
        if rrow is None:
            raise DeviceError(404, "operation_not_found", f"no operation at sequence {target}")
        t = self.tables
        row = t.row(t.receipts, rrow)
        if row[R.KIND] != Kind.INPUT:
            from .kinds import KIND_NAMES
            raise DeviceError(409, "not_cancellable", f"the operation at sequence {target} ({KIND_NAMES[Kind(row[R.KIND])]})"
                                                      " finished at admission and cannot be cancelled",
                              target_sequence=str(target))
        if row[R.TERMINAL] != Terminal.NONE or (rrow in self.executions and self.executions[rrow].finish):
            raise DeviceError(409, "already_finished", f"the input at sequence {target} has already finished",
                              target_sequence=str(target))
        return {"target_sequence": target}

    def _apply_cancellation(self, a, prow, transfer_seq, rrow_of_cancellation):
        rrow = self.by_sequence[(prow, a.extra["target_sequence"])]
        if transfer_seq is not None:  # live: stop generation now; replay: the completion says how it ended
            execution = self.executions.get(rrow)
            if execution is not None:
                if not execution.finish and self.runner is not None:
                    self.runner.cancel(("input", rrow))
                execution.finish = execution.finish or Finish.CANCELLED
            elif rrow in self.to_lease:
                self.to_lease.remove(rrow)
                self.executions[rrow] = Execution(rrow, 0, finish=Finish.CANCELLED)
            else:  # saved but the lease is still in flight, or not yet saved: cancel once it starts
                self._cancel_when_leased.add(rrow)
        return prow

    # ---- result reads ------------------------------------------------------------------

    def read_result(self, msg):
        principal = self._principal(msg, "shared_read")
        args = self._args(msg)
        rrow, _ = self.visible_receipt(principal, str(args.get("operation", "")))
        t = self.tables
        row = t.row(t.receipts, rrow)
        if row[R.KIND] != Kind.INPUT:
            raise DeviceError(409, "no_result", "this operation has no result bytes")
        if row[R.TERMINAL] == Terminal.DEADLINE_EXCEEDED:
            raise DeviceError(504, "deadline_exceeded", "the operation exceeded its execution deadline")
        offset = args.get("offset", 0)
        length = row[R.RESULT_LEN]
        if not isinstance(offset, int) or not 0 <= offset <= length:
            raise DeviceError(400, "bad_offset", f"offset must be 0..{length}")
        data = t.get_bytes(t.result_bytes, rrow, length - offset, offset)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        ended = row[R.TERM_TRANSFER] != 0
        return 200, {
            "operation": self.operation_id(rrow, row), "offset": offset, "length": len(data),
            "next_offset": offset + len(data), "bytes": base64.b64encode(data).decode(), "text": text,
            "complete": ended,
            "status": TERMINAL_NAMES[Terminal(row[R.TERMINAL])] if ended else ("running" if row[R.LEASE] else "admitted"),
            "finish": FINISH_NAMES.get(Finish(row[R.FINISH])) if ended else None,
            "input_tokens": row[R.INPUT_TOKENS] if ended else None,
            "output_tokens": row[R.OUTPUT_TOKENS] if ended else None,
        }


MAX_MEDIA_BYTES = 8 << 20
MEDIA_TYPES = ("image", "audio")


class MediaCommands:
    """Media sources (`PUT /aotx/v1/media/{sha256}`): content-addressed files under
    <journal>/media/, each owned by the participants that uploaded it. The bytes are written and
    fsynced (file, then directory) before the MEDIA transfer that records the owner is appended,
    so a saved owner always has its bytes."""

    def media_dir(self):
        return os.path.join(self.journal_dir, "media")

    def media_owner(self, sha256):
        return self.media.get(sha256, {}).get("owners", set())

    def _prepare_media(self, principal, prow, args):
        sha, data, kind = args.get("sha256"), args.get("data"), args.get("type")
        if not isinstance(sha, str) or len(sha) != 64 or not isinstance(data, bytes):
            raise DeviceError(400, "bad_field", "media upload needs sha256 and the bytes")
        if kind not in MEDIA_TYPES:
            raise DeviceError(400, "bad_field", "media type must be image or audio")
        if len(data) > MAX_MEDIA_BYTES:
            raise DeviceError(413, "media_too_large", f"a media source is at most {MAX_MEDIA_BYTES} bytes")
        if hashlib.sha256(data).hexdigest() != sha:
            raise DeviceError(400, "digest_mismatch", "the bytes do not hash to the sha256 in the path")

    def put_media(self, conn, msg):
        """Returns (status, body) now, or None when the MEDIA transfer is appended (reply once saved)."""
        principal = self._principal(msg, "shared_write")
        prow = self._caller_row(principal)
        args = self._args(msg)
        self._prepare_media(principal, prow, args)
        if self.hold:
            raise DeviceError(429, "journal_hold", f"persistent admission is paused ({self.hold['cause']})")
        sha = args["sha256"]
        if prow in self.media_owner(sha):
            return 200, self._media_view(sha)
        os.makedirs(self.media_dir(), exist_ok=True)
        path = os.path.join(self.media_dir(), sha)
        if not os.path.exists(path):
            tmp = f"{path}.tmp"
            with open(tmp, "wb") as f:
                f.write(args["data"])
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self.fs.fsync_dir(self.media_dir())
        return msgpack.packb([self.participant_ids[prow][2], bytes.fromhex(sha), len(args["data"]), args["type"]],
                             use_bin_type=True)

    def apply_media(self, payload, transfer=None):
        par, sha, length, kind = msgpack.unpackb(payload)
        prow = self.by_participant.get(par)
        if prow is None:
            raise JournalCorrupt(os.path.join(self.journal_dir, segment_name(transfer.segment)), transfer.offset,
                                 f"media transfer seq {transfer.seq} names no participant")
        entry = self.media.setdefault(sha.hex(), {"length": length, "type": kind, "owners": set()})
        entry["owners"].add(prow)

    def _media_view(self, sha):
        entry = self.media[sha]
        return {"sha256": sha, "length": entry["length"], "type": entry["type"]}
