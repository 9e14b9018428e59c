"""Canonical operation bytes: the fast writer (json with sorted keys) must give exactly rfc8785's
bytes wherever it is used, and everything else goes to rfc8785."""
import rfc8785
from hypothesis import given, settings, strategies as st

from gpu_worker.contract.canonical import MAX_EXACT_INT, NotCanonical, operation_bytes

import pytest

# every character class that matters: ASCII, controls, quotes and backslashes, BMP, astral, U+2028
TEXT = st.text(st.characters(codec="utf-8") | st.sampled_from('"\\\x00\x1f\x7f\u2028\ue000\uffff\U0001f600'),
               max_size=12)
PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(-MAX_EXACT_INT, MAX_EXACT_INT) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(PLAIN)
def test_the_fast_writer_gives_rfc8785s_bytes(value):
    body = {"field": value}
    assert operation_bytes("POST", "/aotx/v1/shared/spaces", body) == \
        rfc8785.dumps({"method": "POST", "path": "/aotx/v1/shared/spaces", "body": body})


def test_keys_outside_the_bmp_are_ordered_by_utf16_code_units():
    body = {"\U0001f600": 1, "\uffff": 2, "a": 3}  # UTF-16 puts the emoji (a surrogate pair) before U+FFFF
    assert operation_bytes("POST", "/p", body) == rfc8785.dumps({"method": "POST", "path": "/p", "body": body})
    assert operation_bytes("POST", "/p", body).index("\U0001f600".encode()) < \
        operation_bytes("POST", "/p", body).index("\uffff".encode())


@pytest.mark.parametrize("value", [float("inf"), 2 ** 53, "\ud800"])
def test_values_without_a_canonical_form_are_refused(value):
    with pytest.raises(NotCanonical):
        operation_bytes("POST", "/p", {"v": value})


def test_floats_take_rfc8785s_number_form():
    assert operation_bytes("POST", "/p", {"t": 1.0, "u": 0.1}) == b'{"body":{"t":1,"u":0.1},"method":"POST","path":"/p"}'
