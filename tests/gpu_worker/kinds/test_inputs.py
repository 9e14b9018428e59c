"""Conversation inputs at the device with the real engine (tiny random weights): admission,
lease, output and completion transfers, result reads by offset, cancellation, deadline, and
interrupted after a restart."""
import base64
import collections
import contextlib
import queue
import time

import pytest

from gpu_worker.pipeline import execution
from gpu_worker.engine.engine import Engine
from gpu_worker.storage.journal import TransferKind
from gpu_worker.storage.journal_reader import recover
from gpu_worker.storage.leases import decode as decode_lease
from gpu_worker.pack import pack_tiny
from gpu_worker.loop.runner import Runner
from gpu_worker.kinds import chat
from gpu_worker.storage.committer import Batch
from tests.gpu_worker.kinds.test_shared_state import World, code


class EngineWorld(World):
    def __init__(self, runtime, tmp_path, names):
        super().__init__(runtime, tmp_path, names)
        self.events = queue.SimpleQueue()
        self.attach()

    def attach(self):
        self.device.runner = Runner(Engine(self.runtime, "cpu"), self.events.put)
        self.device.runner.start()

    def boot(self):
        if self.device is not None and self.device.runner is not None:
            self.device.runner.stop()
        super().boot()

    def pump(self, until, timeout=60):
        """Run ticks and feed engine events until `until()` holds."""
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "timed out pumping the device"
            try:
                self.device.engine_events(self.events.get(timeout=0.02))
            except queue.Empty:
                pass
            execution.check_deadlines(self.device)
            self.device.committer.run_sync(collections.deque())

    def conversation(self, name):
        space = self.space(name)
        status, receipt = self.mutate(name, "conversations.create", f"/spaces/{space}/conversations", {})
        assert status == 202
        return space, receipt["target"]

    def say(self, name, conversation, text, **fields):
        return self.mutate(name, "conversations.input", f"/conversations/{conversation}/inputs",
                           {"text": text, "model": "tiny-llama", **fields}, extra={"conversation": conversation})

    def finished(self, name, op):
        return lambda: self.read(name, "operations.get", operation=op)[1]["terminal"]["saved"]


@pytest.fixture
def runtime(tmp_path):
    path = str(tmp_path / "engine.aotxccir")
    pack_tiny(path, shared=True, runtime_profile={"kv_pages": 64, "page_grant": 16, "deadline_ms": 60000})
    return path


@contextlib.contextmanager
def running(w):
    """A world whose engine (when it still has one) and device are stopped when the block ends."""
    try:
        yield w
    finally:
        if w.device.runner is not None:
            w.device.runner.stop()
        w.device.close()


@pytest.fixture
def world(runtime, tmp_path):
    with running(EngineWorld(runtime, tmp_path, ["a", "b"])) as w:
        yield w


def test_an_input_runs_and_its_result_reads_back_exactly_by_offset(world):
    space, conversation = world.conversation("a")
    status, receipt = world.say("a", conversation, "hello there", max_output_tokens=20)
    assert status == 202 and receipt["kind"] == "conversation.input" and receipt["target"] == conversation
    assert receipt["terminal"]["saved"] is False and receipt["effective"]["page_limit"] == "16"
    assert receipt["effective"]["model_digest"] == world.device.model_digest
    world.pump(world.finished("a", receipt["operation"]))
    done = world.read("a", "operations.get", operation=receipt["operation"])[1]
    assert done["terminal"]["status"] == "succeeded" and done["result"]["finish"] in ("stop", "length")
    assert int(done["result"]["output_tokens"]) >= 1 and int(done["result"]["input_tokens"]) > 3
    whole = world.read("a", "operations.result", operation=receipt["operation"])[1]
    data = base64.b64decode(whole["bytes"])
    assert whole["length"] == str(len(data)) == done["result"]["length"] and whole["next_offset"] == str(len(data))
    for offset in range(len(data) + 1):
        part = world.read("a", "operations.result", operation=receipt["operation"], offset=offset)[1]
        assert base64.b64decode(part["bytes"]) == data[offset:]
        try:
            expected = data[offset:].decode("utf-8")
        except UnicodeDecodeError:
            expected = None
        assert part["text"] == expected
    transfers = recover(world.journal, world.device.fs, world.device.state.incarnation).transfers
    kinds = [t.kind for t in transfers]
    assert TransferKind.LEASE in kinds and TransferKind.OUTPUT in kinds and TransferKind.COMPLETION in kinds
    lease = next(t for t in transfers if t.kind == TransferKind.LEASE)
    revision, rows = decode_lease(lease.payload)
    assert revision == 3 and rows[0].retention_mode == 1 and rows[0].sequence == int(receipt["sequence"])
    world.member("a", space, "b", ["read"])
    other = world.read("b", "operations.result", operation=receipt["operation"])[1]
    assert other["bytes"] == whole["bytes"]
    world.boot()
    world.attach()
    again = world.read("a", "operations.get", operation=receipt["operation"])[1]
    assert again == done


def test_inputs_are_refused_precisely_before_anything_is_admitted(world):
    _, conversation = world.conversation("a")
    before = world.read("a", "participant.get")[1]
    assert code(world.say("a", conversation, "x", pages=17)) == (409, "page_limit_exceeds_grant")
    assert code(world.say("a", conversation, "x", model="gpt-9")) == (409, "model_not_available")
    assert code(world.say("a", conversation, "", media=[])) == (400, "bad_field")
    assert code(world.say("a", conversation, "x" * 1977, media=[{"type": "image", "sha256": "a" * 64}])) == \
        (400, "input_too_large")
    assert code(world.say("a", conversation, "see", media=[{"type": "image", "sha256": "a" * 64}])) == \
        (404, "media_not_found")
    assert code(world.say("b", conversation, "not mine")) == (404, "conversation_not_found")
    assert world.read("a", "participant.get")[1] == before


def slow_engine(world, seconds=0.02):
    """Each engine step takes at least `seconds`, so a test can act while generation runs."""
    engine = world.device.runner.engine
    step = engine.step
    engine.step = lambda: (time.sleep(seconds), step())[1]


def test_cancellation_stops_generation_and_keeps_what_was_saved(world):
    _, conversation = world.conversation("a")
    slow_engine(world)
    status, receipt = world.say("a", conversation, "count", max_output_tokens=120, temperature=1.0)
    world.pump(lambda: world.device.executions.live and world.device.runner.engine.pool.owned)
    status, cancel = world.mutate("a", "cancellations.record", "/cancellations",
                                  {"target_sequence": receipt["sequence"]})
    assert status == 202 and cancel["target"] == receipt["operation"] and cancel["kind"] == "cancellation"
    world.pump(world.finished("a", receipt["operation"]))
    done = world.read("a", "operations.get", operation=receipt["operation"])[1]
    assert done["terminal"]["status"] == "cancelled" and done["result"]["finish"] == "cancelled"
    world.pump(lambda: world.device.runner.engine.pool.owned == 0)  # its pages go back to the pool
    assert code(world.mutate("a", "cancellations.record", "/cancellations",
                             {"target_sequence": receipt["sequence"]})) == (409, "already_finished")


def test_a_passed_deadline_stops_the_input_and_its_result_reads_504(world):
    _, conversation = world.conversation("a")
    slow_engine(world)
    _, receipt = world.say("a", conversation, "slow", max_output_tokens=120, temperature=1.0)
    world.pump(lambda: world.device.executions.live and world.device.runner.engine.pool.owned)
    for execution in world.device.executions.live.values():
        execution.deadline_ns = 0  # the deadline passes now
    world.pump(world.finished("a", receipt["operation"]))
    assert world.read("a", "operations.get", operation=receipt["operation"])[1]["terminal"]["status"] == \
        "deadline_exceeded"
    assert code(world.read("a", "operations.result", operation=receipt["operation"])) == (504, "deadline_exceeded")
    world.pump(lambda: world.device.runner.engine.pool.owned == 0)  # its pages go back to the pool


def test_an_unfinished_input_becomes_interrupted_after_a_restart_and_never_runs(world):
    _, conversation = world.conversation("a")
    world.device.runner.stop()
    world.device.runner = None  # admitted and saved, never leased
    status, receipt = world.say("a", conversation, "lost", max_output_tokens=8)
    assert status == 202, receipt
    world.boot()
    world.attach()
    done = world.read("a", "operations.get", operation=receipt["operation"])[1]
    assert done["terminal"]["status"] == "interrupted" and done["result"]["length"] == "0"
    world.pump(lambda: True)
    assert not world.device.executions.live and not world.device.executions.to_lease


def test_the_conversation_context_carries_earlier_turns(world):
    _, conversation = world.conversation("a")
    _, first = world.say("a", conversation, "first", max_output_tokens=8)
    world.pump(world.finished("a", first["operation"]))
    _, second = world.say("a", conversation, "second", max_output_tokens=8)
    world.pump(world.finished("a", second["operation"]))
    one = world.read("a", "operations.get", operation=first["operation"])[1]["result"]["input_tokens"]
    two = world.read("a", "operations.get", operation=second["operation"])[1]["result"]["input_tokens"]
    assert int(two) > int(one) + 8


def test_inputs_beyond_the_page_budget_wait_and_share_the_pool_with_chat(world):
    conversations = [world.conversation("a")[1] for _ in range(4)]  # one conversation runs one input at a time
    slow_engine(world, 0.01)
    # kv_pages 64; every request reserves its whole page limit up front (an input: 16)
    batch = Batch()
    chat.start(world.device, "chat-conn", {"id": 99, "principal": world.principals["a"], "args": {
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}}, batch)
    assert not batch.replies  # not refused: the engine answers it
    receipts = [world.say("a", conversation, f"input {i}", max_output_tokens=100, temperature=1.0)[1]
                for i, conversation in enumerate(conversations)]
    engine = world.device.runner.engine
    seen = []
    world.pump(lambda: seen.append(engine.pool) or (engine.pool.running == 4 and engine.pool.waiting >= 1))
    # the chat and three inputs own the pool; the fourth input's 16 pages do not fit, so it waits
    assert engine.pool.pending == 16 and engine.pool.owned + 16 > engine.pool.total
    world.pump(lambda: all(world.read("a", "operations.get", operation=r["operation"])[1]["terminal"]["saved"]
                           for r in receipts), timeout=120)
    assert max(p.running for p in seen) == 4 and engine.pool.owned == 0
    assert any(reply.id == 99 for _, reply in world.pushed + world.device.take_outbox())


def test_media_sources_are_owned_by_their_uploader_and_survive_a_checkpoint(world):
    import hashlib
    _, conversation = world.conversation("a")
    data = b"\x89PNG not really" * 10
    sha = hashlib.sha256(data).hexdigest()
    assert code(world.read("a", "media.put", sha256=sha, data=data + b"x", type="image")) == (400, "digest_mismatch")
    status, body = world.read("a", "media.put", sha256=sha, data=data, type="image")
    assert status == 201 and body == {"sha256": sha, "length": str(len(data)), "type": "image"}
    assert world.read("a", "media.put", sha256=sha, data=data, type="image")[0] == 200
    media = [{"type": "image", "sha256": sha}]
    # the tiny model takes no media: ownership passes, model compatibility refuses
    assert code(world.say("a", conversation, "look", media=media)) == (409, "model_lacks_media")
    world.device.checkpoint()
    world.boot()
    world.attach()
    assert code(world.say("a", conversation, "look", media=media)) == (409, "model_lacks_media")
    space_b, conversation_b = world.conversation("b")
    assert code(world.say("b", conversation_b, "look", media=media)) == (404, "media_not_found")


def test_the_journal_the_lock_and_media_files_are_readable_by_their_owner_only(world):
    import hashlib
    import os
    import stat
    data = b"\x89PNG" * 10
    world.read("a", "media.put", sha256=hashlib.sha256(data).hexdigest(), data=data, type="image")
    journal = world.journal
    files = [os.path.join(journal, name) for name in os.listdir(journal) if name.endswith(".journal")]
    files += [os.path.join(journal, "lock"), os.path.join(journal, "media", hashlib.sha256(data).hexdigest())]
    assert {path: stat.S_IMODE(os.stat(path).st_mode) for path in files} == {path: 0o600 for path in files}


def test_n_choices_share_the_prompts_pages_and_end_together(world):
    """n = 3: choice 0 prefills the prompt, choices 1 and 2 start once it has and find its full pages in
    the prefix cache; seeded, choice i samples with seed + i; one answer lists them all."""
    engine = world.device.runner.engine
    submitted = []
    submit = engine.submit
    engine.submit = lambda request_id, prompt, **settings: submitted.append(submit(request_id, prompt, **settings)) \
        or submitted[-1]
    batch = Batch()
    question = "tell me a long story about " + "shared conversations " * 8
    chat.start(world.device, "chat-conn", {"id": 77, "principal": world.principals["a"], "args": {
        "model": "tiny-llama", "messages": [{"role": "user", "content": question}], "max_tokens": 6, "n": 3,
        "temperature": 1.0, "seed": 5, "logprobs": 1}}, batch)
    assert not batch.replies
    replies = []

    def answered():
        replies.extend(r for _, r in world.pushed + world.device.take_outbox() if r.id == 77)
        world.pushed.clear()
        return any(not r.more for r in replies)

    world.pump(answered)
    final = next(r for r in replies if not r.more)
    assert final.status == 200
    import json
    body = json.loads(final.body)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["completion_tokens"] == sum(len(c["logprobs"]) + (c["finish_reason"] == "stop")
                                            for c in body["choices"])
    assert body["text"] == body["choices"][0]["text"]
    assert [s.request_id[2] for s in submitted] == [0, 1, 2]
    assert [s.seed for s in submitted] == [5, 6, 7]
    full_pages = len(submitted[0].prompt_ids) // engine.page_size * engine.page_size
    assert full_pages >= engine.page_size
    assert submitted[0].cached_tokens == 0
    assert all(s.cached_tokens == full_pages for s in submitted[1:])  # the prompt's full pages, reused
    assert engine.pool.owned == 0
    bad = Batch()
    chat.start(world.device, "chat-conn", {"id": 78, "principal": world.principals["a"], "args": {
        "model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "n": 17}}, bad)
    assert json.loads(bad.replies[0][1].body)["error"]["code"] == "invalid_n"


def record_prompts(monkeypatch):
    """{input text: the chat messages its prompt was built from} (execution.fit_prompt's argument),
    filled in as the device builds each input's prompt."""
    prompts = {}
    fit = execution.fit_prompt

    def recording(tokenizer, messages, room, system=None):
        prompts.setdefault(messages[-1]["content"], messages)
        return fit(tokenizer, messages, room, system)
    monkeypatch.setattr(execution, "fit_prompt", recording)
    return prompts


def answer_of(world, name, op):
    """An input's saved result as the next prompt's assistant turn reads it."""
    result = world.read(name, "operations.result", operation=op)[1]
    return base64.b64decode(result["bytes"]).decode("utf-8", "replace")


def test_inputs_sent_back_to_back_run_in_conversation_order_and_the_second_prompt_holds_the_first_turn(
        world, monkeypatch):
    """DESIGN §8, one conversation, one input at a time: the second input is leased only once the
    first has its saved terminal, so its prompt holds the first's turn (before, both ran at once
    and the second was prompted without it)."""
    prompts = record_prompts(monkeypatch)
    _, conversation = world.conversation("a")
    _, first = world.say("a", conversation, "first", max_output_tokens=8)
    _, second = world.say("a", conversation, "second", max_output_tokens=8)
    overlaps = []

    def both_done():
        one = world.read("a", "operations.get", operation=first["operation"])[1]
        two = world.read("a", "operations.result", operation=second["operation"])[1]
        if two["status"] != "admitted" and not one["terminal"]["saved"]:
            overlaps.append(two["status"])  # leased while the first had no saved terminal
        return two["complete"]
    world.pump(both_done)
    assert overlaps == []
    assert world.read("a", "operations.get", operation=first["operation"])[1]["terminal"]["status"] == "succeeded"
    assert prompts["second"] == [{"role": "user", "content": "first"},
                                 {"role": "assistant", "content": answer_of(world, "a", first["operation"])},
                                 {"role": "user", "content": "second"}]


def test_a_waiting_input_is_cancellable_and_the_next_one_follows_the_turns_before_it(world, monkeypatch):
    """An input waiting for its conversation's turn (admitted, not leased: its deadline has not
    started, SPEC) is cancelled at once; the input after it waits for the first, and its prompt
    holds the first's turn and not the cancelled one's."""
    prompts = record_prompts(monkeypatch)
    _, conversation = world.conversation("a")
    slow_engine(world)
    _, first = world.say("a", conversation, "first", max_output_tokens=40, temperature=1.0)
    _, second = world.say("a", conversation, "second", max_output_tokens=8)
    _, third = world.say("a", conversation, "third", max_output_tokens=8)
    world.pump(lambda: world.device.executions.live and world.device.runner.engine.pool.owned)
    assert world.read("a", "operations.result", operation=second["operation"])[1]["status"] == "admitted"
    status, cancel = world.mutate("a", "cancellations.record", "/cancellations",
                                  {"target_sequence": second["sequence"]})
    assert status == 202, cancel
    world.pump(world.finished("a", second["operation"]))
    done = world.read("a", "operations.get", operation=second["operation"])[1]
    assert done["terminal"]["status"] == "cancelled" and done["result"]["length"] == "0"
    world.pump(world.finished("a", third["operation"]))
    statuses = [world.read("a", "operations.get", operation=r["operation"])[1]["terminal"]["status"]
                for r in (first, third)]
    assert statuses == ["succeeded", "succeeded"] and "second" not in prompts
    assert prompts["third"] == [{"role": "user", "content": "first"},
                                {"role": "assistant", "content": answer_of(world, "a", first["operation"])},
                                {"role": "user", "content": "third"}]


def test_the_deadline_covers_result_publication(world):
    """SPEC: the deadline includes result publication. Generation has ended but its output is not
    yet journaled when the deadline passes: the input ends deadline_exceeded (before, the
    completion said succeeded), and its result reads 504."""
    _, conversation = world.conversation("a")
    _, receipt = world.say("a", conversation, "publish", max_output_tokens=8)
    world.pump(lambda: world.device.executions.live)
    [live] = world.device.executions.live.values()
    while not live.finish:  # the engine's events, with no tick to journal what they bring
        world.device.engine_events(world.events.get(timeout=60))
    assert live.finish in (execution.Finish.STOP, execution.Finish.LENGTH) and live.buffered
    live.deadline_ns = 0  # the deadline passes before its output is published
    world.pump(world.finished("a", receipt["operation"]))
    done = world.read("a", "operations.get", operation=receipt["operation"])[1]
    assert done["terminal"]["status"] == "deadline_exceeded" and done["result"]["finish"] == "deadline"
    assert code(world.read("a", "operations.result", operation=receipt["operation"])) == (504, "deadline_exceeded")
    world.boot()
    world.attach()
    assert world.read("a", "operations.get", operation=receipt["operation"])[1] == done


def test_a_retirement_whose_floor_covers_an_unfinished_input_answers_409_and_changes_nothing(world):
    """SPEC: every receipt below the floor must have a saved terminal result. The device refuses
    the retirement (409 unfinished_operations) and nothing moves: the floor, the next sequence,
    the receipts."""
    _, conversation = world.conversation("a")
    world.device.runner.stop()
    world.device.runner = None  # admitted and saved, never leased: unfinished
    _, receipt = world.say("a", conversation, "unfinished", max_output_tokens=8)
    before = world.read("a", "participant.get")[1], world.read("a", "operations.list")[1]
    floor = int(receipt["sequence"]) + 1
    status, body = world.mutate("a", "retirements.record", "/retirements", {"retry_floor": str(floor)})
    assert (status, body["error"]["code"], body["error"]["sequence"]) == (409, "unfinished_operations",
                                                                          receipt["sequence"])
    assert (world.read("a", "participant.get")[1], world.read("a", "operations.list")[1]) == before


ORDER = {"type": "object", "properties": {"status": {"enum": ["open", "paid"]},
                                          "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                                          "tags": {"type": "array", "maxItems": 2,
                                                   "items": {"type": "string", "maxLength": 5}}},
         "required": ["status", "qty"], "additionalProperties": False}


def test_an_input_with_a_response_format_answers_json_of_its_schema_and_its_receipt_records_the_digest(world):
    import hashlib
    import json

    import jsonschema
    import rfc8785
    _, conversation = world.conversation("a")
    response_format = {"type": "json_schema", "schema": ORDER}
    status, receipt = world.say("a", conversation, "an order please", max_output_tokens=120,
                                response_format=response_format, temperature=1.0)
    assert status == 202, receipt
    digest = hashlib.sha256(rfc8785.dumps(response_format)).hexdigest()
    assert receipt["effective"]["response_format_digest"] == digest
    world.pump(world.finished("a", receipt["operation"]))
    done = world.read("a", "operations.get", operation=receipt["operation"])[1]
    assert done["terminal"]["status"] == "succeeded" and done["result"]["finish"] == "stop", done
    data = base64.b64decode(world.read("a", "operations.result", operation=receipt["operation"])[1]["bytes"])
    jsonschema.validate(json.loads(data), ORDER)
    status, plain = world.say("a", conversation, "and now in words", max_output_tokens=4)
    assert status == 202 and plain["effective"]["response_format_digest"] is None
    world.pump(world.finished("a", plain["operation"]))
    world.boot()  # the journal's replay holds the body, and so the digest
    world.attach()
    again = world.read("a", "operations.get", operation=receipt["operation"])[1]
    assert again["effective"]["response_format_digest"] == digest and again["result"] == done["result"]


@pytest.mark.parametrize("response_format, named", [
    ({"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"type": "json_schema", "schema": {"type": "widget"}}, "widget"),
    ({"type": "json_schema"}, "response_format"), ({"type": "yaml"}, "response_format")])
def test_a_response_format_it_cannot_enforce_is_refused_before_admission(world, response_format, named):
    _, conversation = world.conversation("a")
    before = world.read("a", "conversations.get", conversation=conversation)[1]
    status, body = world.say("a", conversation, "x", response_format=response_format)
    assert (status, body["error"]["code"]) == (400, "bad_field") and named in body["error"]["message"]
    assert world.read("a", "conversations.get", conversation=conversation)[1] == before  # nothing admitted
