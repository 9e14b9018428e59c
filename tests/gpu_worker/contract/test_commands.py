"""The device commands' declared types (gpu_worker/contract/commands.py): one type per command of
the vocabulary, the frame a client builds is the map the device reads back as the same value, and
a refusal is the same error whichever process makes it."""
import msgpack
import msgspec
import pytest

from gpu_worker.contract import commands
from gpu_worker.contract.commands import TYPES, Args, Mutation, parse, request, typed
from gpu_worker.contract.errors import ServiceError
from gpu_worker.contract.ids import MAX_COUNTER
from gpu_worker.contract.limits import MAX_MEMORY_TTL_SECONDS
from gpu_worker.contract.vocabulary import COMMANDS
from gpu_worker.contract.wire import ProtocolError

LINEAGE, KEY = "a" * 32, "b" * 32
SPACE = f"spc-{'c' * 32}-{'d' * 32}"
CONVERSATION = f"con-{'c' * 32}-{'e' * 32}"
OPERATION = f"op-{'c' * 32}-{'f' * 32}"
MEMORY = f"mem-{'c' * 32}-{'1' * 32}"
ENVELOPE = {"lineage": LINEAGE, "operation_key": KEY, "sequence": 3, "canonical": b'{"x":1}'}

# one valid argument map per command, with every optional field of the interesting ones given
VALID = {
    "ping": {}, "checkpoint": {}, "capabilities": {}, "participant.get": {}, "models.list": {},
    "ops.receipts": {"participant": "par-" + "1" * 32, "kind": "space.create", "status": "running",
                     "saved": "admission", "cursor": "7", "limit": 3},
    "ops.receipt": {"operation": OPERATION}, "ops.result": {"operation": OPERATION, "offset": 4},
    "ops.command": {"operation": OPERATION}, "ops.memory": {"space": SPACE, "cursor": "3", "limit": 20},
    "ops.memory.forget": {"memory": MEMORY, "reason": "asked to by its subject", "staff": "root"},
    "audit.export": {"path": "/tmp/audit"},
    "participants.get": {"participant": "par-" + "1" * 32}, "spaces.list": {"limit": 10},
    "spaces.get": {"space": SPACE}, "members.list": {"space": SPACE, "cursor": "0"},
    "conversations.list": {"space": SPACE}, "conversations.get": {"conversation": CONVERSATION},
    "conversations.events": {"conversation": CONVERSATION, "cursor": "12", "limit": 200},
    "operations.list": {}, "operations.get": {"operation": OPERATION},
    "operations.result": {"operation": OPERATION}, "memory.list": {"space": SPACE},
    "memory.get": {"memory": MEMORY, "offset": 2, "version": 1},
    "memory.search": {"space": SPACE, "q": "where is the meeting", "limit": 5},
    "chat.completions": {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                                 {"type": "image"}]}],
                         "images": [b"\x89PNG"], "stream": True, "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
                         "stop": ["\n"], "n": 2, "seed": 7, "logprobs": 3, "presence_penalty": -1.5,
                         "frequency_penalty": 2.0},
    "embeddings": {"model": "e", "input": ["one", "two"]},
    "media.put": {"sha256": "9" * 64, "data": b"bytes", "type": "image"},
    "conversations.subscribe": {"conversation": CONVERSATION, "cursor": "3"},
    "operations.subscribe": {"operation": OPERATION, "offset": 0},
    "subscriptions.close": {"id": 41},
    "participant.register": dict(ENVELOPE),
    "spaces.create": {**ENVELOPE, "id": "2" * 32, "scope": "room", "memory_ttl_seconds": 3600},
    "members.set": {**ENVELOPE, "space": SPACE, "participant": "par-" + "3" * 32, "permissions": ["read", "write"]},
    "conversations.create": {**ENVELOPE, "space": SPACE, "id": "4" * 32},
    "retirements.record": {**ENVELOPE, "retry_floor": 2},
    "conversations.input": {**ENVELOPE, "conversation": CONVERSATION, "text": "hello", "model": "m",
                            "max_output_tokens": 9, "pages": 2, "temperature": 1.5, "top_p": 0.5,
                            "media": [{"type": "image", "sha256": "5" * 64}], "retention": "interpret",
                            "context": "managed", "memory_ttl_seconds": 60},
    "cancellations.record": {**ENVELOPE, "target_sequence": 2},
    "spaces.delete": {**ENVELOPE, "space": SPACE},
    "conversations.delete": {**ENVELOPE, "conversation": CONVERSATION},
    "publications.record": {**ENVELOPE, "space": SPACE, "source": MEMORY, "source_version": "4"},
    "memory.versions": {**ENVELOPE, "memory": MEMORY, "text": "corrected", "version": "2"},
    "memory.delete": {**ENVELOPE, "memory": MEMORY, "reason": "asked to"},
    "conversations.fork": {**ENVELOPE, "conversation": CONVERSATION, "at": "3"},
}


def test_every_command_of_the_vocabulary_has_one_declared_type_and_nothing_else_has():
    assert set(TYPES) == set(COMMANDS) == set(VALID)
    for op, kind in TYPES.items():
        assert issubclass(kind, Args)
        # a mutation's type carries the envelope, and only a mutation's does
        assert issubclass(kind, Mutation) == COMMANDS[op].mutation, op


def _frame_args(op, args):
    """The `args` map the device decodes from the frame a client sends."""
    frame = request(7, op, "0" * 32, args)
    payload = msgpack.unpackb(frame[4:], raw=False)
    assert (payload["v"], payload["id"], payload["op"]) == (1, 7, op)
    return payload["args"]


@pytest.mark.parametrize("op", sorted(VALID))
def test_a_valid_map_crosses_the_socket_as_the_same_value(op):
    sent = typed(op, VALID[op])
    received = _frame_args(op, VALID[op])
    assert parse(TYPES[op], received) == sent
    assert set(received) <= set(VALID[op])  # nothing added on the way


def test_left_out_options_are_not_in_the_frame_and_read_back_as_the_documented_defaults():
    args = {**ENVELOPE, "conversation": CONVERSATION, "text": "t", "model": "m"}
    assert set(_frame_args("conversations.input", args)) == set(args)
    parsed = parse(commands.Input, _frame_args("conversations.input", args))
    assert (parsed.pages, parsed.max_output_tokens, parsed.temperature, parsed.top_p, parsed.media,
            parsed.retention, parsed.context) == (None, None, 0.0, 1.0, [], "source", "compact")


REFUSED = [
    # (command, change to its valid map, status, code)
    ("spaces.create", {"scope": "galaxy"}, 400, "bad_field"),
    ("spaces.create", {"scope": 5}, 400, "bad_field"),
    ("spaces.create", {"id": "ABC"}, 400, "bad_field"),
    ("spaces.create", {"colour": "red"}, 400, "bad_field"),
    ("participant.register", {"sequence": 0}, 400, "bad_field"),
    ("participant.register", {"sequence": True}, 400, "bad_field"),
    ("participant.register", {"operation_key": "0" * 32}, 400, "bad_field"),
    ("participant.register", {"lineage": "A" * 32}, 400, "bad_field"),
    ("participant.register", {"canonical": "text"}, 400, "bad_field"),
    ("spaces.get", {"space": "spc-nope"}, 400, "bad_id"),
    ("members.set", {"permissions": ["read", "read"]}, 400, "bad_field"),
    ("members.set", {"permissions": ["fly"]}, 400, "bad_field"),
    ("members.set", {"participant": "par-1"}, 400, "bad_id"),
    ("spaces.list", {"limit": 0}, 400, "bad_limit"),
    ("spaces.list", {"limit": 201}, 400, "bad_limit"),
    ("spaces.list", {"limit": "5"}, 400, "bad_limit"),
    ("spaces.list", {"cursor": "007"}, 400, "bad_field"),
    ("memory.get", {"version": 0}, 400, "bad_field"),
    ("memory.get", {"offset": -1}, 400, "bad_offset"),
    ("memory.search", {"q": " "}, 400, "bad_search_query"), ("memory.search", {"limit": 51}, 400, "bad_limit"),
    ("memory.search", {"q": 7}, 400, "bad_search_query"),
    ("conversations.input", {"text": "", "media": []}, 400, "bad_field"),
    ("conversations.input", {"text": "see <image> here"}, 400, "reserved_token"),
    ("conversations.input", {"text": "x" * 2049, "media": []}, 400, "input_too_large"),
    ("conversations.input", {"media": [{"type": "image", "sha256": "5" * 64}] * 9}, 400, "too_many_media"),
    ("conversations.input", {"media": [{"type": "video", "sha256": "5" * 64}]}, 400, "bad_field"),
    ("conversations.input", {"temperature": 2.5}, 400, "bad_field"),
    ("conversations.input", {"top_p": 0}, 400, "bad_field"),
    ("conversations.input", {"pages": 1.5}, 400, "bad_field"),
    ("conversations.input", {"retention": "forever"}, 400, "bad_field"),
    ("publications.record", {"source_version": "01"}, 400, "bad_field"),
    ("memory.versions", {"version": "0"}, 400, "bad_field"),
    ("memory.versions", {"text": ""}, 400, "bad_field"),
    ("memory.versions", {"text": "é" * 1025}, 400, "text_too_large"),
    ("memory.versions", {"text": "an <image>"}, 400, "reserved_token"),
    ("memory.versions", {"memory": "mem-x"}, 400, "bad_id"),
    ("memory.delete", {"reason": "x" * 257}, 400, "bad_field"),
    ("memory.delete", {"reason": 7}, 400, "bad_field"),
    ("memory.delete", {"staff": "root"}, 400, "bad_field"),  # (only the device's own staff forget says who)
    ("ops.memory.forget", {"reason": ""}, 400, "bad_field"),
    ("ops.memory.forget", {"reason": "  "}, 400, "bad_field"),
    ("ops.memory.forget", {"reason": "é" * 129}, 400, "bad_field"),
    ("ops.memory.forget", {"staff": ""}, 400, "bad_field"),
    ("ops.memory.forget", {"staff": "s" * 151}, 400, "bad_field"),
    ("ops.memory.forget", {"memory": "mem-x"}, 400, "bad_id"),
    ("ops.memory", {"limit": 0}, 400, "bad_limit"),
    ("conversations.fork", {"at": "0"}, 400, "bad_field"),
    ("conversations.fork", {"at": 3}, 400, "bad_field"),
    # 19 digits match the counter pattern beyond 2**63-1: refused as every counter is
    ("conversations.fork", {"at": str(1 << 63)}, 400, "bad_field"),
    ("conversations.fork", {"at": "9" * 19}, 400, "bad_field"),
    ("memory.versions", {"version": str(1 << 63)}, 400, "bad_field"),
    ("memory.versions", {"version": "9" * 19}, 400, "bad_field"),
    ("publications.record", {"source_version": str(1 << 63)}, 400, "bad_field"),
    ("publications.record", {"source_version": "9" * 19}, 400, "bad_field"),
    ("spaces.create", {"memory_ttl_seconds": 0}, 400, "bad_field"),
    ("spaces.create", {"memory_ttl_seconds": MAX_MEMORY_TTL_SECONDS + 1}, 400, "bad_field"),
    ("spaces.create", {"memory_ttl_seconds": "60"}, 400, "bad_field"),
    ("conversations.input", {"memory_ttl_seconds": -1}, 400, "bad_field"),
    ("conversations.input", {"memory_ttl_seconds": 60.0}, 400, "bad_field"),
    ("conversations.fork", {"id": "xyz"}, 400, "bad_field"),
    ("retirements.record", {"retry_floor": 0}, 400, "bad_field"),
    ("media.put", {"type": "text"}, 415, "unsupported_media_type"),
    ("media.put", {"sha256": "9" * 63}, 400, "bad_id"),
    ("media.put", {"data": b"x" * ((8 << 20) + 1)}, 413, "media_too_large"),
    ("embeddings", {"input": []}, 400, "invalid_input"),
    ("embeddings", {"input": "one"}, 400, "invalid_input"),
    ("chat.completions", {"temperature": "hot"}, 400, "invalid_temperature"),
    ("chat.completions", {"top_p": 1.5}, 400, "invalid_top_p"),
    ("chat.completions", {"n": 17}, 400, "invalid_n"),
    ("chat.completions", {"seed": -1}, 400, "invalid_seed"),
    ("chat.completions", {"frequency_penalty": 3}, 400, "invalid_frequency_penalty"),
    ("chat.completions", {"logprobs": 21}, 400, "invalid_logprobs"),
    ("chat.completions", {"stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_stop"),
    ("chat.completions", {"images": [b"one", b"two"]}, 400, "invalid_messages"),
    ("chat.completions", {"messages": [{"role": "robot", "content": "hi"}], "images": [b"x"]}, 400,
     "invalid_messages"),
    ("spaces.create", {"id": None}, 400, "bad_field"),
    ("conversations.input", {"pages": None}, 400, "bad_field"),
    ("members.set", {"participant": 3}, 400, "bad_id"),
    ("conversations.input", {"media": [{"type": "image", "sha256": "5" * 64}] * 8 + ["bad"]}, 400, "too_many_media"),
    ("chat.completions", {"prompt": "x"}, 400, "invalid_prompt"),
    ("subscriptions.close", {"id": "7"}, 400, "bad_field"),
]


@pytest.mark.parametrize("op, change, status, code", REFUSED)
def test_a_refusal_is_the_same_error_from_the_gateway_and_from_the_device(op, change, status, code):
    bad = {**VALID[op], **change}
    with pytest.raises(ServiceError) as gateway:
        typed(op, bad)  # what a client builds: refused before anything is sent
    with pytest.raises(ServiceError) as device:
        parse(TYPES[op], msgpack.unpackb(msgpack.packb(bad, use_bin_type=True), raw=False))  # what arrives
    assert (gateway.value.status, gateway.value.code) == (device.value.status, device.value.code) == (status, code)
    assert gateway.value.message == device.value.message


@pytest.mark.parametrize("op, field", [("conversations.fork", "at"), ("memory.versions", "version"),
                                       ("publications.record", "source_version")])
def test_a_decimal_counter_goes_up_to_2_to_the_63_minus_1(op, field):
    assert getattr(typed(op, {**VALID[op], field: str(MAX_COUNTER)}), field) == str(MAX_COUNTER)


@pytest.mark.parametrize("op", ["spaces.create", "conversations.input"])
def test_a_memory_time_to_live_goes_from_1_to_its_bound(op):
    for ttl in (1, MAX_MEMORY_TTL_SECONDS):
        assert typed(op, {**VALID[op], "memory_ttl_seconds": ttl}).memory_ttl_seconds == ttl


def test_a_type_error_names_the_field_and_a_missing_field_is_named_too():
    with pytest.raises(ServiceError, match=r"\$\.scope"):
        typed("spaces.create", {**VALID["spaces.create"], "scope": 5})
    with pytest.raises(ServiceError, match="required field `space`") as err:
        typed("spaces.get", {})
    assert err.value.code == "bad_id"  # an ID field's refusal is bad_id, whatever is wrong with it
    with pytest.raises(ServiceError, match="scope must not be null") as err:
        typed("spaces.create", {**VALID["spaces.create"], "scope": None})
    assert err.value.code == "bad_field"
    with pytest.raises(ServiceError, match="unknown field `colour`"):
        typed("spaces.get", {"space": SPACE, "colour": 1})


def test_a_staff_forget_needs_its_reason_and_its_staff_name():
    for field in ("reason", "staff"):
        args = {k: v for k, v in VALID["ops.memory.forget"].items() if k != field}
        with pytest.raises(ServiceError, match=f"required field `{field}`") as err:
            typed("ops.memory.forget", args)
        assert err.value.status == 400 and err.value.code == "bad_field"
    assert typed("ops.memory.forget", {**VALID["ops.memory.forget"], "reason": "é" * 128}).reason == "é" * 128


def test_a_client_refuses_a_command_the_contract_does_not_know_and_builds_no_frame():
    with pytest.raises(ProtocolError, match="unknown device command"):
        request(1, "spaces.rename", None, {})


def test_declared_types_are_frozen_values():
    args = typed("spaces.get", {"space": SPACE})
    with pytest.raises(AttributeError):
        args.space = "x"  # type: ignore[misc]
    assert msgspec.structs.replace(args, space=SPACE) == args
