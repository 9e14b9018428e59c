"""Frames: the native splitter (sockio.split, the code the device's socket thread runs on every
read) and the clients' FrameReader yield the same frames however the stream is cut; payloads that
are not msgpack maps are refused."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker import native
from gpu_worker.contract.wire import LENGTH, MAX_FRAME, FrameReader, ProtocolError, decode_payload, encode_frame

MESSAGES = st.lists(st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-2**63, 2**64 - 1), st.binary(max_size=300),
                                                                   st.text(max_size=50)), max_size=5),
                    min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(messages=MESSAGES, cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12))
def test_frames_survive_any_cut_of_the_stream(messages, cuts):
    stream = b"".join(encode_frame(m) for m in messages)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    payloads = native.load("sockio").split([stream[start:end] for start, end in zip(bounds, bounds[1:])], MAX_FRAME)
    assert [decode_payload(p) for p in payloads] == messages


@settings(max_examples=200, deadline=None)
@given(messages=MESSAGES, cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12))
def test_the_frame_reader_yields_the_same_messages_however_the_stream_is_cut(messages, cuts):
    stream = b"".join(encode_frame(m) for m in messages)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    reader = FrameReader()
    received = []
    for start, end in zip(bounds, bounds[1:]):
        received += reader.feed(stream[start:end])
    assert received == messages and reader.pending == 0


def test_the_frame_reader_keeps_an_unfinished_frame_and_refuses_one_over_the_limit():
    frame = encode_frame({"v": 1})
    reader = FrameReader()
    assert reader.feed(frame + frame[:5]) == [{"v": 1}] and reader.pending == 5
    assert reader.feed(frame[5:]) == [{"v": 1}] and reader.pending == 0
    with pytest.raises(ProtocolError, match=f"exceeds {MAX_FRAME}"):
        FrameReader().feed(LENGTH.pack(MAX_FRAME + 1))


def test_an_unfinished_frame_is_kept_not_delivered():
    frame = encode_frame({"v": 1})
    assert native.load("sockio").split([frame + frame[:5]], MAX_FRAME) == [frame[4:]]


def test_a_frame_over_the_limit_is_refused_before_its_body_arrives():
    with pytest.raises(ValueError, match=f"exceeds {MAX_FRAME}"):
        native.load("sockio").split([LENGTH.pack(MAX_FRAME + 1) + b"\x80"], MAX_FRAME)


@pytest.mark.parametrize("payload", [encode_frame([1, 2])[4:], b"\xc1", b"\x81", b"\x81\xa1v\x01\x01",
                                     b"\x81\xa1\xff\x01", b"\x81\x91\x01\x01"])
def test_a_payload_that_is_not_one_msgpack_map_is_refused(payload):
    with pytest.raises(ProtocolError, match="not a map|not msgpack"):
        decode_payload(payload)
