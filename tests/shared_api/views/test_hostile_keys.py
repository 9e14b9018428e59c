"""Bad input is never a 5xx (issue 36): a refusal that echoes the caller's input — the keys named
by `unknown_field` — must be encodable whatever the input held. A body whose unknown key is a
lone surrogate (`{"\\ud800": 1, ...}`, valid JSON that no UTF-8 text can hold) once made the
refusal's message unencodable, and the gateway answered a plain-text 500. Tested through the
gateway's one path and, with Hypothesis, over every mutation route and arbitrary keys."""
import json
import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared_api.routes.openapi.operations import OPERATIONS, full_path
from shared_api.routes.openapi.schemas import SCHEMAS

from .conftest import (BASE, assert_error, conversation_id, envelope, memory_id, operation_id, participant_id,
                       space_id)

SURROGATE_KEY_BODY = b'{"\\ud800": 1, ' + json.dumps(envelope(scope="private")).encode()[1:]

# every field any mutation route takes: a key outside them is unknown to every route
KNOWN_FIELDS = frozenset(name for schema in SCHEMAS.values() if schema.get("type") == "object"
                         for name in schema.get("properties", {}))
PATH_VALUES = {"{space}": space_id, "{conversation}": conversation_id, "{operation}": operation_id,
               "{participant}": participant_id, "{memory}": memory_id}


def mutation_paths():
    """The path of every POST route, its path parameter a well-formed ID."""
    out = []
    for key, spec in OPERATIONS.items():
        if spec["method"] == "POST":
            path = full_path(key)
            for name, make in PATH_VALUES.items():
                path = path.replace(name, make())
            out.append(path)
    return out


MUTATION_PATHS = mutation_paths()


def assert_one_error_body(content: bytes) -> dict:
    """The answer's bytes are strict UTF-8 JSON holding exactly the one error body."""
    doc = json.loads(content.decode("utf-8", "strict"))
    assert set(doc) == {"error"} and isinstance(doc["error"]["message"], str), doc
    return doc["error"]


def test_a_lone_surrogate_key_is_400_unknown_field_on_the_asgi_path(gateway, device, people):
    """It was a plain-text 500 (UnicodeEncodeError rendering the message); the key is named with
    its unencodable code point written as an escape (`\\ud800`), in the message and in `fields`."""
    response = gateway.post(f"{BASE}/spaces", people["writer"], raw=SURROGATE_KEY_BODY)
    error = assert_error(response, 400, "unknown_field")
    assert error["fields"] == ["\\ud800"] and "\\ud800" in error["message"]
    assert_one_error_body(response.content)
    assert device.requests == []


# keys: any text, lone surrogates and other odd code points included; JSON values of a few kinds
LONE_SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
KEYS = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=()), max_size=12),
    st.lists(st.one_of(LONE_SURROGATES, st.sampled_from(string.printable)), min_size=1, max_size=6).map("".join),
)
VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 60, 2 ** 60) | st.text(max_size=8),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                      max_leaves=6)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(MUTATION_PATHS),
       unknown=st.dictionaries(KEYS.filter(lambda k: k not in KNOWN_FIELDS), VALUES, min_size=1, max_size=4),
       envelope_too=st.booleans())
def test_any_object_with_an_unknown_key_on_any_mutation_route_is_400_unknown_field_never_5xx(
        gateway, device, people, path, unknown, envelope_too):
    """Sent as JSON with `\\u` escapes such as `\\ud800` (so lone surrogates arrive as such), with
    or without a valid envelope beside them: always 400 `unknown_field` in the one error body, valid UTF-8,
    naming as many keys as were unknown, and nothing reaches the device."""
    body = {**(envelope() if envelope_too else {}), **unknown}
    raw = json.dumps(body, ensure_ascii=True).encode()
    response = gateway.post(path, people["manager"], raw=raw)
    assert response.status_code == 400, (path, raw, response.status_code, response.content[:300])
    error = assert_one_error_body(response.content)
    assert error["code"] == "unknown_field" and len(error["fields"]) == len(unknown), error
    assert device.requests == []


ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=10) | \
    st.lists(st.one_of(LONE_SURROGATES, st.sampled_from(string.printable)), min_size=1, max_size=6).map("".join)
ANY_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | ANY_TEXT,
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3),
                          max_leaves=6)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(MUTATION_PATHS),
       fields=st.dictionaries(st.sampled_from(sorted(KNOWN_FIELDS)) | KEYS, ANY_VALUES, max_size=6),
       envelope_too=st.booleans())
def test_any_object_of_known_or_unknown_keys_and_any_values_is_never_a_5xx(gateway, device, people, path, fields,
                                                                          envelope_too):
    """Keys a route takes or not, values of any JSON type (lone surrogates, huge integers, floats
    included), over a valid envelope or none: the gateway never answers 5xx, and a refusal is the
    one error body in valid UTF-8 with nothing sent to the device. (What passes every check goes
    to the device, which the fake answers 200.)"""
    device.requests.clear()
    body = {**(envelope() if envelope_too else {}), **fields}
    raw = json.dumps(body, ensure_ascii=True).encode()
    response = gateway.post(path, people["manager"], raw=raw)
    assert response.status_code < 500, (path, raw, response.status_code, response.content[:300])
    if response.status_code >= 400:
        assert 400 <= response.status_code < 500
        assert_one_error_body(response.content)
        assert device.requests == []
