"""Frame splitting (protocol.FrameBuffer): a stream cut anywhere yields the same frames."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.protocol import LENGTH, MAX_FRAME, FrameBuffer, ProtocolError, encode_frame

MESSAGES = st.lists(st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-2**63, 2**64 - 1), st.binary(max_size=300),
                                                                   st.text(max_size=50)), max_size=5),
                    min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(messages=MESSAGES, cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12))
def test_frames_survive_any_cut_of_the_stream(messages, cuts):
    stream = b"".join(encode_frame(m) for m in messages)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    buffer, got = FrameBuffer(), []
    for start, end in zip(bounds, bounds[1:]):
        got += buffer.feed(stream[start:end])
    assert got == messages
    assert buffer.feed(b"") == []


def test_a_frame_over_the_limit_is_refused_before_its_body_arrives():
    with pytest.raises(ProtocolError, match="exceeds"):
        FrameBuffer().feed(LENGTH.pack(MAX_FRAME + 1) + b"\x80")


def test_a_frame_that_is_not_a_map_is_refused():
    with pytest.raises(ProtocolError, match="not a map"):
        FrameBuffer().feed(encode_frame([1, 2]))
