"""The words of the contract at the device (issue 36): counters in every response are decimal
strings (SPEC "Counters use decimal strings"); an omitted `max_output_tokens` shrinks to what the
page limit leaves (SPEC "Defaults are 256 output tokens, the current page grant, ...") and is
recorded in the receipt's `effective` part; capabilities name that default apart from the real
maximum; the command-byte cap (SPEC "Each receipt permits 8192 canonical command bytes") is exact
and refused 413; reserved media control tokens are refused before anything is retained; a members
page holds at most `limit` items."""
import base64
import collections
import hashlib

import pytest
import rfc8785

from gpu_worker.contract.commands import RESERVED_TOKENS
from gpu_worker.pack import pack_tiny
from tests.gpu_worker.kinds.test_events import bodies, ended, subscribe
from tests.gpu_worker.kinds.test_inputs import EngineWorld
from tests.gpu_worker.kinds.test_shared_state import BASE, World, code

PAGE_GRANT = 16


@pytest.fixture
def runtime(tmp_path):
    path = str(tmp_path / "engine.aotxccir")
    pack_tiny(path, shared=True, runtime_profile={"kv_pages": 64, "page_grant": PAGE_GRANT, "deadline_ms": 60000})
    return path


@pytest.fixture
def world(runtime, tmp_path):
    w = EngineWorld(runtime, tmp_path, ["a", "b"])
    w.frames = collections.defaultdict(list)  # subscription request id -> its frames (test_events.collect)
    yield w
    if w.device.runner is not None:
        w.device.runner.stop()
    w.device.close()


@pytest.fixture
def plain(tiny_runtime, tmp_path):
    """A device without an engine (admissions only), on the default tiny runtime."""
    w = World(tiny_runtime, tmp_path, ["a", "b", "c", "d"])
    yield w
    w.device.close()


def numbers(doc, path="$"):
    """The paths of JSON numbers in a response document (booleans are not numbers), except inside
    an event's `input`: the caller's own fields as submitted, which the rule leaves as they came."""
    if isinstance(doc, bool) or doc is None or isinstance(doc, str):
        return []
    if isinstance(doc, (int, float)):
        return [path]
    if isinstance(doc, list):
        return [p for i, item in enumerate(doc) for p in numbers(item, f"{path}[{i}]")]
    return [p for key, value in doc.items() if key != "input" for p in numbers(value, f"{path}.{key}")]


def test_every_counter_in_every_response_is_a_decimal_string(world):
    """Receipts (pending bytes, result length, token counts, a hold's start), byte reads (offset,
    length, next_offset), result token counts, stream spans, media, memory rows, lists, events,
    capabilities and error details: no JSON number anywhere, and each counter reads back as the
    decimal string of the value it counts."""
    seen = {}

    def keep(name, result):
        status, body = result
        seen[name] = body
        return status, body

    space, conversation = world.conversation("a")
    world.member("a", space, "b", ["read"])
    data = b"\x89PNG counted" * 5
    sha = hashlib.sha256(data).hexdigest()
    assert keep("media.put", world.read("a", "media.put", sha256=sha, data=data, type="image"))[0] == 201
    status, receipt = keep("receipt (new)", world.say("a", conversation, "hello", max_output_tokens=6))
    assert status == 202 and receipt["pending_bytes"] == "0" and receipt["result"]["length"] == "0"
    op = receipt["operation"]
    sub = subscribe(world, "a", "operations.subscribe", operation=op, offset=0)
    world.pump(world.finished("a", op))
    world.pump(lambda: ended(world, sub))
    done = keep("receipt (ended)", world.read("a", "operations.get", operation=op))[1]
    whole = keep("result", world.read("a", "operations.result", operation=op))[1]
    data_out = base64.b64decode(whole["bytes"])
    assert (whole["offset"], whole["length"], whole["next_offset"]) == ("0", str(len(data_out)), str(len(data_out)))
    assert done["result"]["length"] == str(len(data_out)) and int(done["result"]["output_tokens"]) >= 1
    assert whole["input_tokens"] == done["result"]["input_tokens"] and int(whole["input_tokens"]) > 0
    assert whole["output_tokens"] == done["result"]["output_tokens"]
    assert done["effective"]["max_output_tokens"] == "6"
    keep("result (offset 1)", world.read("a", "operations.result", operation=op, offset=1))
    frames = bodies(world, sub)
    for n, (_, _, frame) in enumerate(frames):
        seen[f"operation stream frame {n}"] = frame
    spans = [frame for kind, _, frame in frames if kind == "output"]
    assert spans and spans[0]["offset"] == "0" and spans[-1]["next_offset"] == str(len(data_out))
    con_sub = subscribe(world, "b", "conversations.subscribe", conversation=conversation)
    for n, (_, _, frame) in enumerate(bodies(world, con_sub)):
        seen[f"conversation stream frame {n}"] = frame
    keep("events", world.read("b", "conversations.events", conversation=conversation))
    keep("receipt (foreign)", world.read("b", "operations.get", operation=op))
    for name, op_name, args in (("capabilities", "capabilities", {}), ("participant", "participant.get", {}),
                                ("participants.get", "participants.get", {"participant": world.par["b"]}),
                                ("spaces.list", "spaces.list", {}), ("spaces.get", "spaces.get", {"space": space}),
                                ("members.list", "members.list", {"space": space}),
                                ("conversations.list", "conversations.list", {"space": space}),
                                ("conversations.get", "conversations.get", {"conversation": conversation}),
                                ("operations.list", "operations.list", {}),
                                ("memory.list", "memory.list", {"space": space})):
        assert keep(name, world.read("a", op_name, **args))[0] == 200, name
    row = seen["memory.list"]["items"][0]
    detail = keep("memory.get", world.read("a", "memory.get", memory=row["object"], offset=2))[1]
    assert (detail["offset"], detail["next_offset"]) == ("2", row["byte_length"])
    # error details: a journal hold's pending bytes, and a receipt and capabilities while it lasts
    holds = world.device.holds
    cap, holds.file_cap = holds.file_cap, 0  # the journal is past its file cap: a hold starts
    world.device.check_hold()
    status, held = keep("journal_hold error", world.mutate("a", "spaces.create", "/spaces", {}))
    assert (status, held["error"]["code"]) == (429, "journal_hold") and held["error"]["pending_bytes"].isdigit()
    during = keep("receipt (held)", world.read("a", "operations.get", operation=op))[1]
    assert during["journal_hold"]["since_ns"] == str(world.device.holds.current["since_ns"])
    journal = keep("capabilities (held)", world.read("a", "capabilities"))[1]["journal"]
    assert journal["since_ns"] == during["journal_hold"]["since_ns"] and journal["pending_bytes"].isdigit()
    holds.file_cap = cap
    world.device.check_hold()
    assert holds.current is None
    assert {name: numbers(body) for name, body in seen.items() if numbers(body)} == {}


def test_an_input_with_a_small_page_limit_and_no_max_output_tokens_gets_half_its_pages_as_the_default(world):
    """Before, the default of 256 output tokens was checked against the page limit as if the
    caller had sent it: `pages` below 16 (page size 16) and no `max_output_tokens` was 400
    `bad_field`. Now an omitted `max_output_tokens` is min(256, pages x page_size / 2): the other
    half is the prompt's room, which the device cannot count at admission. The effective value is
    recorded with the admission (the receipt's `effective`, apart from the caller's bytes), runs,
    and reads back the same after a restart."""
    _, conversation = world.conversation("a")
    status, receipt = world.say("a", conversation, "hello", pages=12)
    assert status == 202, receipt
    assert receipt["effective"] == {"model_digest": world.device.model_digest, "page_limit": "12",
                                    "max_output_tokens": str(12 * 16 // 2), "response_format_digest": None}
    world.pump(world.finished("a", receipt["operation"]))
    done = world.read("a", "operations.get", operation=receipt["operation"])[1]
    assert done["terminal"]["status"] == "succeeded", done
    assert 1 <= int(done["result"]["output_tokens"]) <= 96
    status, grant = world.say("a", conversation, "again")
    assert status == 202 and grant["effective"]["page_limit"] == str(PAGE_GRANT)
    assert grant["effective"]["max_output_tokens"] == str(min(256, PAGE_GRANT * 16 // 2))
    world.boot()
    world.attach()
    assert world.read("a", "operations.get", operation=receipt["operation"])[1]["effective"] == done["effective"]
    # a caller's own value is taken as it is, up to the whole page limit
    status, own = world.say("a", conversation, "mine", pages=1, max_output_tokens=16)
    assert status == 202 and own["effective"]["max_output_tokens"] == "16"
    assert code(world.say("a", conversation, "too many", pages=1, max_output_tokens=17)) == (400, "bad_field")


def test_capabilities_name_256_output_tokens_as_the_default_and_the_page_grant_as_the_maximum(plain):
    """`limits.max_output_tokens` was 256, yet 1,000 was accepted: it is the default, not a limit.
    Capabilities now give `defaults` (max_output_tokens, pages) and the real maximum in `limits`:
    the page grant's tokens (within the KV pool), which admission enforces."""
    caps = plain.read("a", "capabilities")[1]
    profile = plain.device.runtime.runtime_profile
    most = min(profile["page_grant"], profile["kv_pages"]) * profile["page_size"]
    assert caps["defaults"] == {"max_output_tokens": "256", "pages": str(profile["page_grant"])}
    assert caps["limits"]["max_output_tokens"] == str(most) and most > 1000
    conversation = plain.mutate("a", "conversations.create", f"/spaces/{plain.space('a')}/conversations", {})[1]["target"]

    def say(**fields):
        return plain.mutate("a", "conversations.input", f"/conversations/{conversation}/inputs",
                            {"text": "hi", "model": "tiny-llama", **fields}, extra={"conversation": conversation})
    assert say(max_output_tokens=1000)[0] == 202
    assert say(max_output_tokens=most)[0] == 202
    assert code(say(max_output_tokens=most + 1)) == (400, "bad_field")


def canonical_input(world, conversation, size):
    """An input body whose canonical operation bytes are exactly `size` long: its text is control
    characters (six canonical bytes each, one UTF-8 byte) and letters, within the 2048 input bytes."""
    me = world.read("a", "participant.get")[1]
    body = {"schema": "aotx.shared.mutation.v1", "lineage": me["lineage"], "operation_key": "ab" * 16,
            "sequence": me["next_sequence"], "text": "", "model": "tiny-llama"}
    path = f"{BASE}/conversations/{conversation}/inputs"
    base = len(rfc8785.dumps({"method": "POST", "path": path, "body": body}))
    controls, letters = divmod(size - base, 6)
    body["text"] = "\x01" * controls + "a" * letters
    assert len(rfc8785.dumps({"method": "POST", "path": path, "body": body})) == size
    assert len(body["text"].encode()) <= 2048
    return {"text": body["text"], "model": "tiny-llama"}


def test_the_command_byte_cap_admits_exactly_its_bytes_and_refuses_one_more_with_413(plain):
    """SPEC "Each receipt permits 8192 canonical command bytes": canonical bytes of exactly the cap
    are admitted; one byte more is refused 413 `command_too_large` (a payload too large, as the
    docs say; it was 400) with nothing changed."""
    cap = plain.device.command_bytes
    assert cap == 8192 and plain.read("a", "capabilities")[1]["limits"]["command_bytes"] == "8192"
    conversation = plain.mutate("a", "conversations.create", f"/spaces/{plain.space('a')}/conversations", {})[1]["target"]
    path = f"/conversations/{conversation}/inputs"
    before = plain.read("a", "participant.get")[1]
    over = plain.mutate("a", "conversations.input", path, canonical_input(plain, conversation, cap + 1),
                        key="ab" * 16, extra={"conversation": conversation})
    assert code(over) == (413, "command_too_large") and str(cap) in over[1]["error"]["message"]
    assert plain.read("a", "participant.get")[1] == before
    status, receipt = plain.mutate("a", "conversations.input", path, canonical_input(plain, conversation, cap),
                                   key="ab" * 16, extra={"conversation": conversation})
    assert status == 202 and receipt["pending_bytes"] == "0"


def test_reserved_media_control_tokens_in_text_are_refused_before_anything_is_retained(world):
    """SPEC "Reserved media control tokens in submitted text are refused before memory retention":
    every reserved token, alone or inside other text, is 400 `reserved_token` at admission: no
    receipt, no sequence taken, no event, and no memory row; an ordinary input after them is
    admitted at the next sequence and retains its text, and only its text."""
    space, conversation = world.conversation("a")
    before = world.read("a", "participant.get")[1]
    used = world.device.state.memory.used()
    for token in RESERVED_TOKENS:
        for text in (token, f"look at this {token} please"):
            status, body = world.say("a", conversation, text, max_output_tokens=2)
            assert (status, body["error"]["code"]) == (400, "reserved_token"), (text, body)
            assert token in body["error"]["message"]
    assert world.read("a", "participant.get")[1] == before
    assert world.read("a", "conversations.events", conversation=conversation)[1]["items"] == []
    status, receipt = world.say("a", conversation, "an ordinary turn", max_output_tokens=2)
    assert status == 202 and receipt["sequence"] == before["next_sequence"]
    world.pump(world.finished("a", receipt["operation"]))
    assert world.device.state.memory.used() == used + 1
    [row] = world.read("a", "memory.list", space=space)[1]["items"]
    payload = base64.b64decode(world.read("a", "memory.get", memory=row["object"])[1]["bytes"])
    assert payload == b"an ordinary turn" and row["source"] == receipt["operation"]


def test_every_members_page_holds_at_most_limit_items_and_the_pages_hold_each_member_once(plain):
    """The owner's implicit row came on the first page on top of `limit` explicit rows: `limit`=2
    gave 3 items. Now the owner takes one of the first page's places; walking the pages at any
    limit gives the owner and every explicit row exactly once."""
    space = plain.space("a")
    for who in ("b", "c", "d"):
        assert plain.member("a", space, who, ["read"])[0] == 202
    everyone = [plain.par[n] for n in ("a", "b", "c", "d")]
    for limit in range(1, 6):
        pages, cursor = [], None
        while True:
            args = {"space": space, "limit": limit, **({"cursor": cursor} if cursor is not None else {})}
            status, page = plain.read("a", "members.list", **args)
            assert status == 200 and len(page["items"]) <= limit, (limit, page)
            pages.append(page["items"])
            cursor = page["next_cursor"]
            if cursor is None:
                break
            assert cursor.isdigit()
        walked = [item["participant"] for items in pages for item in items]
        assert walked == everyone, (limit, pages)
        assert [item["explicit"] for items in pages for item in items] == [False, True, True, True]


def test_the_packed_models_own_control_tokens_are_refused_too(world, tiny_vlm_runtime):
    """Issue 53: the reserved list was fixed; it is taken from the packed model now, every added
    token of its tokenizer spelled <...> (its special tokens, and a vision model's media tokens:
    SmolVLM's <fake_token_around_image>, <global-img>, row and column tokens), refused at admission
    before anything is retained."""
    from gpu_worker.pipeline.prompt import ControlTokens
    from gpu_worker.storage.runtime_file import RuntimeFile
    vlm = ControlTokens(RuntimeFile.open(tiny_vlm_runtime).bytes("gen/tokenizer").tobytes().decode())
    for token in ("<fake_token_around_image>", "<global-img>", "<row_1_col_1>", "<image>", "<|im_start|>"):
        assert token in vlm.tokens and vlm.find(f"a {token} b") == token
    assert vlm.find("a < b > c") is None and vlm.find("no angle brackets") is None
    own = [t for t in world.device.control_tokens.tokens if t not in RESERVED_TOKENS]
    assert "<|im_end|>" in own
    _, conversation = world.conversation("a")
    before = world.read("a", "participant.get")[1]
    used = world.device.state.memory.used()
    for token in own:
        status, body = world.say("a", conversation, f"please {token} obey", max_output_tokens=2)
        assert (status, body["error"]["code"]) == (400, "reserved_token") and token in body["error"]["message"]
    assert world.read("a", "participant.get")[1] == before and world.device.state.memory.used() == used
