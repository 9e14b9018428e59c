"""Events at the device (SPEC "Results and memory"): a conversation's inputs in input order for
every permitted reader, the retired window as a gap, and subscriptions that push saved events and
output and end when the reader loses the right."""
import base64
import collections
import json

import msgpack
import pytest

from gpu_worker.pack import pack_tiny
from gpu_worker.state import DeviceState
from gpu_worker.storage import checkpoint
from tests.gpu_worker.kinds.test_inputs import EngineWorld, slow_engine
from tests.gpu_worker.kinds.test_shared_state import code


@pytest.fixture
def runtime(tmp_path):
    path = str(tmp_path / "engine.aotxccir")
    pack_tiny(path, shared=True, runtime_profile={"kv_pages": 64, "page_grant": 16, "deadline_ms": 60000})
    return path


@pytest.fixture
def world(runtime, tmp_path):
    w = EngineWorld(runtime, tmp_path, ["a", "b", "c"])
    w.frames = collections.defaultdict(list)  # request id -> frames pushed to it
    yield w
    if w.device.runner is not None:
        w.device.runner.stop()
    w.device.close()


def subscribe(world, name, op, **args):
    """Open a subscription; its frames collect in world.frames[request id]."""
    req_id = next(world.ids)
    inbox = collections.deque([("sub", {"v": 1, "id": req_id, "op": op, "principal": world.principals[name],
                                        "args": args})])
    replies = world.device.committer.run_sync(inbox)
    assert replies == []  # a subscription answers only through its frames
    collect(world)
    return req_id


def collect(world):
    """Frames per subscription (a frame for several names them all in "ids")."""
    pushed, world.pushed = world.pushed + world.device.take_outbox(), []
    for conn, msg in pushed:
        for req_id in msg.ids or (msg.id,):
            world.frames[req_id].append(msg)


def ended(world, req_id):
    """Collects the frames pushed so far; whether the subscription got its last frame."""
    collect(world)
    frames = world.frames[req_id]
    return bool(frames) and not frames[-1].more


def bodies(world, req_id):
    """(event, cursor, data) of the frames after the `open` frame every accepted subscription starts with."""
    frames = world.frames[req_id]
    assert frames[0].event == "open", frames[0]
    return [(m.event, m.cursor, json.loads(m.body)) for m in frames[1:]]


def shared_conversation(world):
    space, conversation = world.conversation("a")
    world.member("a", space, "b", ["read", "write"])
    return space, conversation


def test_every_reader_sees_every_members_inputs_in_input_order(world):
    space, conversation = shared_conversation(world)
    first = world.say("a", conversation, "from a", max_output_tokens=4)[1]
    second = world.say("b", conversation, "from b", max_output_tokens=4, temperature=0.5)[1]
    world.pump(lambda: world.finished("a", first["operation"])() and world.finished("b", second["operation"])())
    for reader in ("a", "b"):
        page = world.read(reader, "conversations.events", conversation=conversation)[1]
        assert page["gap"] is False and page["event_floor"] == "1" and page["next_cursor"] is None
        assert [e["cursor"] for e in page["items"]] == ["1", "2"]
        assert [e["operation"] for e in page["items"]] == [first["operation"], second["operation"]]
        assert page["items"][1]["input"] == {"text": "from b", "model": "tiny-llama", "max_output_tokens": 4,
                                             "temperature": 0.5}
        assert all(e["status"] == "succeeded" and e["terminal"]["saved"] for e in page["items"])
        own = {e["participant"]: e["sequence"] for e in page["items"]}
        assert own[world.par[reader]] is not None and own[world.par["b" if reader == "a" else "a"]] is None
    assert code(world.read("c", "conversations.events", conversation=conversation)) == (404, "conversation_not_found")
    one = world.read("a", "conversations.events", conversation=conversation, limit=1)[1]
    assert [e["cursor"] for e in one["items"]] == ["1"] and one["next_cursor"] == "1"
    rest = world.read("a", "conversations.events", conversation=conversation, cursor="1")[1]
    assert [e["cursor"] for e in rest["items"]] == ["2"]


def test_retired_inputs_leave_a_gap_and_the_floor_while_orders_stay(world):
    _, conversation = world.conversation("a")
    ops = [world.say("a", conversation, f"turn {i}", max_output_tokens=2)[1] for i in range(3)]
    world.pump(lambda: all(world.finished("a", op["operation"])() for op in ops))
    floor = int(ops[2]["sequence"])  # retire the first two inputs (and the setup before them)
    assert world.mutate("a", "retirements.record", "/retirements", {"retry_floor": str(floor)})[0] == 202
    page = world.read("a", "conversations.events", conversation=conversation)[1]
    assert page["event_floor"] == "3" and [e["cursor"] for e in page["items"]] == ["3"] and page["gap"] is True
    gap = world.read("a", "conversations.events", conversation=conversation, cursor="1")[1]
    assert gap["gap"] is True and gap["event_floor"] == "3" and [e["cursor"] for e in gap["items"]] == ["3"]
    later = world.say("a", conversation, "after", max_output_tokens=2)[1]
    world.pump(world.finished("a", later["operation"]))
    assert [e["cursor"] for e in world.read("a", "conversations.events", conversation=conversation,
                                            cursor="3")[1]["items"]] == ["4"]
    world.boot()
    world.attach()
    assert world.read("a", "conversations.events", conversation=conversation)[1]["event_floor"] == "3"


def test_every_read_that_skips_retired_events_reports_the_gap(world):
    """SPEC: "A retired event window reports a gap and its current event floor". Another member's
    retirement leaves a hole above the floor (b retires its input, order 2, between a's 1 and 3),
    and a's own retirement raises the floor: a read whose window starts below the floor, with or
    without a cursor, or that steps over a retired order, says `gap`; a window with no retired
    order in it does not."""
    _, conversation = shared_conversation(world)
    ops = [world.say(name, conversation, f"from {name}", max_output_tokens=2)[1] for name in ("a", "b", "a")]
    world.pump(lambda: all(world.finished(n, op["operation"])() for n, op in zip("aba", ops)))
    floor_b = int(ops[1]["sequence"]) + 1
    assert world.mutate("b", "retirements.record", "/retirements", {"retry_floor": str(floor_b)})[0] == 202

    def events(**args):
        page = world.read("a", "conversations.events", conversation=conversation, **args)[1]
        return [e["cursor"] for e in page["items"]], page["gap"], page["event_floor"], page["next_cursor"]

    assert events() == (["1", "3"], True, "1", None)  # no cursor: from order 1, over the hole at 2
    assert events(cursor="1") == (["3"], True, "1", None)
    assert events(limit=1) == (["1"], False, "1", "1")  # order 1 alone: nothing skipped
    assert events(cursor="1", limit=1) == (["3"], True, "1", None)
    assert events(cursor="2") == (["3"], False, "1", None)  # resuming after the hole
    assert events(cursor="3") == ([], False, "1", None)
    sub = subscribe(world, "a", "conversations.subscribe", conversation=conversation)
    assert [(kind, cursor) for kind, cursor, _ in bodies(world, sub)] == [("event", "1"), ("gap", "2"), ("event", "3")]
    assert bodies(world, sub)[1][2] == {"gap": True, "event_floor": "1"}
    # a's first input retired too: the floor rises to 3 and a read from the start is a gap
    floor_a = int(ops[0]["sequence"]) + 1
    assert world.mutate("a", "retirements.record", "/retirements", {"retry_floor": str(floor_a)})[0] == 202
    assert events() == (["3"], True, "3", None)
    assert events(cursor="2") == (["3"], False, "3", None)
    sub = subscribe(world, "b", "conversations.subscribe", conversation=conversation)
    assert [(kind, cursor) for kind, cursor, _ in bodies(world, sub)] == [("gap", "2"), ("event", "3")]
    assert bodies(world, sub)[0][2] == {"gap": True, "event_floor": "3"}


def test_a_conversation_subscription_gets_the_backlog_then_each_saved_input(world):
    _, conversation = shared_conversation(world)
    first = world.say("a", conversation, "one", max_output_tokens=2)[1]
    sub = subscribe(world, "b", "conversations.subscribe", conversation=conversation)
    [(kind, cursor, backlog)] = bodies(world, sub)
    assert (kind, cursor) == ("event", "1") and backlog["operation"] == first["operation"]
    assert backlog["sequence"] is None  # a's input, read by b
    assert all(m.more for m in world.frames[sub])
    second = world.say("b", conversation, "two", max_output_tokens=2)[1]
    collect(world)
    kind, cursor, pushed = bodies(world, sub)[1]
    assert (kind, cursor) == ("event", "2") and pushed["cursor"] == "2" and pushed["operation"] == second["operation"]
    assert pushed["sequence"] == second["sequence"] and pushed["admission"]["saved"] is True
    resumed = subscribe(world, "b", "conversations.subscribe", conversation=conversation, cursor="1")
    assert [cursor for _, cursor, _ in bodies(world, resumed)] == ["2"]


def test_an_operation_subscription_pushes_saved_output_then_one_terminal_event(world):
    _, conversation = world.conversation("a")
    slow_engine(world, 0.01)
    receipt = world.say("a", conversation, "tell me", max_output_tokens=24)[1]
    sub = subscribe(world, "a", "operations.subscribe", operation=receipt["operation"], offset=0)
    world.pump(lambda: ended(world, sub))
    frames = bodies(world, sub)
    *spans, (kind, cursor, terminal) = frames
    assert all(k == "output" and c == str(f["next_offset"]) for k, c, f in spans) and kind == "terminal"
    assert world.frames[sub][-1].more is False and world.frames[sub][-1].status == 200
    assert terminal["status"] == "succeeded" and terminal["terminal"]["saved"] is True
    data = b"".join(base64.b64decode(f["bytes"]) for _, _, f in spans)
    offsets = [f["offset"] for _, _, f in spans]
    assert offsets == [str(sum(int(f["length"]) for _, _, f in spans[:i])) for i in range(len(spans))]
    whole = world.read("a", "operations.result", operation=receipt["operation"])[1]
    assert data == base64.b64decode(whole["bytes"]) and terminal["result"]["length"] == str(len(data))
    assert cursor == str(len(data))
    offset = len(data) // 2
    again = subscribe(world, "a", "operations.subscribe", operation=receipt["operation"], offset=offset)
    (_, _, span), (end, _, _) = bodies(world, again)
    assert base64.b64decode(span["bytes"]) == data[offset:] and span["next_offset"] == str(len(data))
    assert end == "terminal" and world.frames[again][-1].more is False


def test_a_deadline_exceeded_operation_answers_504_on_its_event_stream_as_on_its_result(world):
    """SPEC: a request that exceeds its execution deadline returns 504, on both reads of its
    result. A stream open when the deadline passes gets the spans saved before it, then a last
    frame 504 `deadline_exceeded` (the gateway's `event: error`); one opened afterwards is refused
    with 504 (the gateway's status), as `GET /operations/{op}/result` is."""
    _, conversation = world.conversation("a")
    slow_engine(world)
    receipt = world.say("a", conversation, "slow", max_output_tokens=120, temperature=1.0)[1]
    live = subscribe(world, "a", "operations.subscribe", operation=receipt["operation"], offset=0)
    world.pump(lambda: world.device.executions.live and world.device.runner.engine.pool.owned)
    for execution in world.device.executions.live.values():
        execution.deadline_ns = 0  # the deadline passes now
    world.pump(lambda: ended(world, live))
    last = world.frames[live][-1]
    assert (last.status, json.loads(last.body)["error"]["code"]) == (504, "deadline_exceeded")
    assert all(frame.event in ("open", "output") for frame in world.frames[live][:-1])
    assert code(world.read("a", "operations.result", operation=receipt["operation"])) == (504, "deadline_exceeded")
    later = subscribe(world, "a", "operations.subscribe", operation=receipt["operation"], offset=0)
    [refused] = world.frames[later]
    assert refused.more is False
    assert (refused.status, json.loads(refused.body)["error"]["code"]) == (504, "deadline_exceeded")


def test_an_operation_that_never_executes_ends_at_once_and_bad_requests_get_one_error(world):
    space = world.space("a")
    receipt = world.read("a", "operations.list")[1]["items"][-1]
    assert receipt["target"] == space
    sub = subscribe(world, "a", "operations.subscribe", operation=receipt["operation"], offset=0)
    [(kind, _, terminal)] = bodies(world, sub)
    assert kind == "terminal" and terminal["status"] == "succeeded"
    refused = subscribe(world, "c", "operations.subscribe", operation=receipt["operation"], offset=0)
    assert world.frames[refused][0].status == 404 and world.frames[refused][0].more is False
    bad = subscribe(world, "a", "operations.subscribe", operation=receipt["operation"], offset=5)
    assert world.frames[bad][0].status == 400 and b"bad_offset" in world.frames[bad][0].body


def test_a_reader_who_loses_the_right_or_the_grant_gets_a_last_frame(world):
    space, conversation = shared_conversation(world)
    sub = subscribe(world, "b", "conversations.subscribe", conversation=conversation)
    world.member("a", space, "b", [])  # a zero-rights row: b no longer sees the space
    collect(world)
    last = world.frames[sub][-1]
    assert last.status == 404 and last.more is False
    world.member("a", space, "b", ["read"])
    again = subscribe(world, "b", "conversations.subscribe", conversation=conversation)
    world.actions["b"] = ["shared_write"]
    world.write_grants()
    world.device.idle()  # the device rereads the grant file between ticks too
    collect(world)
    last = world.frames[again][-1]
    assert last.status == 403 and b"grant_missing" in last.body
    world.say("a", conversation, "nobody listens", max_output_tokens=2)
    collect(world)
    assert world.frames[again][-1] is last  # nothing after the end


def test_closing_a_connection_or_a_subscription_ends_it_without_cancelling_the_input(world):
    _, conversation = world.conversation("a")
    slow_engine(world, 0.01)
    receipt = world.say("a", conversation, "keep going", max_output_tokens=16)[1]
    sub = subscribe(world, "a", "operations.subscribe", operation=receipt["operation"], offset=0)
    inbox = collections.deque([("sub", {"v": 1, "id": 7, "op": "subscriptions.close", "principal": None,
                                        "args": {"id": sub}})])
    [(_, closed)] = world.device.committer.run_sync(inbox)
    assert closed.status == 200 and json.loads(closed.body) == {"closed": True}
    world.device.connection_closed("sub")
    world.pump(world.finished("a", receipt["operation"]))
    assert world.read("a", "operations.get", operation=receipt["operation"])[1]["terminal"]["status"] == "succeeded"


def test_a_checkpoint_written_before_event_orders_loads_with_orders_derived(world, tmp_path):
    _, conversation = world.conversation("a")
    ops = [world.say("a", conversation, f"turn {i}", max_output_tokens=2)[1] for i in range(2)]
    world.pump(lambda: all(world.finished("a", op["operation"])() for op in ops))
    before = world.read("a", "conversations.events", conversation=conversation)[1]
    blob = checkpoint.encode_state(world.device.state, 1, bytes(32), 1)
    saved = checkpoint.decode_state(blob)  # (re-packed below as one msgpack map: version 1's layout)
    for name, width in (("conversations", 8), ("receipts", 29)):  # the widths before event orders
        rows, data = saved["tables"][name]
        n = len(rows) // 8
        full = len(data) // 8 // n
        saved["tables"][name][1] = b"".join(data[i * full * 8:(i * full + width) * 8] for i in range(n))
    state = DeviceState(world.device.capacities, "cpu", world.device.state.incarnation, 1,
                        world.device.embedding_dim)
    checkpoint.load_state(state, msgpack.packb(saved, use_bin_type=True), 6)
    state.rebuild_indexes(6)
    world.device.state, real = state, world.device.state
    try:
        after = world.read("a", "conversations.events", conversation=conversation)[1]
    finally:
        world.device.state = real
    assert [e["cursor"] for e in after["items"]] == [e["cursor"] for e in before["items"]] == ["1", "2"]


@pytest.mark.parametrize("rights", [[], ["write"]])
def test_a_member_removed_from_a_room_no_longer_reads_its_own_inputs_result_but_keeps_its_receipt(world, rights):
    """Issue 53 (SPEC: current grants intersect with stored membership on each admission and read):
    an input's result is made from the room (its turns, its memory). Its submitter, removed from
    the room (a zero-rights row, or rights without read), reads its receipt still, not its result
    bytes nor its output events; an open output stream ends. Given read again, it reads them."""
    space, conversation = shared_conversation(world)
    slow_engine(world, 0.01)
    receipt = world.say("b", conversation, "tell me", max_output_tokens=24)[1]
    op = receipt["operation"]
    sub = subscribe(world, "b", "operations.subscribe", operation=op, offset=0)
    world.member("a", space, "b", rights)
    collect(world)
    last = world.frames[sub][-1]
    assert (last.status, last.more) == (403, False) and b"right_missing" in last.body
    world.pump(lambda: world.read("b", "operations.get", operation=op)[1]["terminal"]["saved"])
    assert world.read("b", "operations.get", operation=op)[0] == 200  # its receipt: status, counts
    assert code(world.read("b", "operations.result", operation=op)) == (403, "right_missing")
    refused = subscribe(world, "b", "operations.subscribe", operation=op, offset=0)
    assert world.frames[refused][0].status == 403 and world.frames[refused][0].more is False
    world.member("a", space, "b", ["read"])
    assert world.read("b", "operations.result", operation=op)[0] == 200
