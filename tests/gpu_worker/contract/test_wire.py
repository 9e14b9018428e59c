"""Frames: the native splitter (sockio.split, the code the device's socket thread runs on every
read) and the clients' FrameReader yield the same frames however the stream is cut; payloads that
are not msgpack maps are refused, and so are requests whose id is not an integer; the device's
replies go out as the maps docs/protocol.md describes."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker import native
from gpu_worker.contract.wire import (LENGTH, MAX_FRAME, FrameReader, ProtocolError, decode_payload, decode_reply,
                                     decode_request, encode_frame, encode_reply, reply)
from gpu_worker.loop.subscriptions import Subscriptions

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


def _sent(reply):
    """The map a reader finds in the frame the device's loop sends for `reply` (encode_reply)."""
    frame = encode_reply(reply)
    assert LENGTH.unpack_from(frame)[0] == len(frame) - LENGTH.size
    assert decode_reply(frame[LENGTH.size:]) == reply  # the gateway's reader: the same Reply
    return decode_payload(frame[LENGTH.size:])


def test_the_device_sends_each_reply_as_the_map_the_protocol_describes():
    """docs/protocol.md: `body` and `status` always, `id` or `ids`, the rest only when set, `more`
    only when true, `index` only when not 0; the loop's generation as `g`."""
    assert _sent(reply(5, 200, b"{}")) == {"id": 5, "status": 200, "body": b"{}"}
    located = reply(6, 202, b'{"a":1}', {"Location": "/x"})
    located.g = 3
    assert _sent(located) == {"id": 6, "status": 202, "body": b'{"a":1}', "headers": {"Location": "/x"}, "g": 3}
    assert _sent(reply(7, 400, b"{}", {})) == {"id": 7, "status": 400, "body": b"{}"}  # no headers: none sent
    subs = Subscriptions()
    a, b = subs.open("c", 1, ("op", 1), None), subs.open("c", 2, ("op", 1), None)
    subs.push(a, b"", event="accepted")
    subs.push(a, b"tok", index=2, logprobs=[{"token": "t", "logprob": -0.5, "bytes": [116]}])
    subs.push(a, b"tok0")  # choice 0 of several: its index left out (0)
    subs.push_all([a, b], b"{}", event="output", cursor="9")
    subs.end_all([a, b], 200, b"{}", event="terminal", cursor="9")
    assert [_sent(r) for _, r in subs.take_outbox()] == [
        {"id": 1, "status": 200, "more": True, "body": b"", "event": "accepted"},
        {"id": 1, "status": 200, "more": True, "body": b"tok", "index": 2,
         "logprobs": [{"token": "t", "logprob": -0.5, "bytes": [116]}]},
        {"id": 1, "status": 200, "more": True, "body": b"tok0"},
        {"ids": [1, 2], "status": 200, "more": True, "body": b"{}", "event": "output", "cursor": "9"},
        {"ids": [1, 2], "status": 200, "body": b"{}", "event": "terminal", "cursor": "9"}]
    c = subs.open("d", 3, ("con", 1), None)
    subs.end(c, 403, b"{}")
    assert [_sent(r) for _, r in subs.take_outbox()] == [{"id": 3, "status": 403, "body": b"{}"}]
    assert subs.count() == 0


@pytest.mark.parametrize("request_id", ["1", None, 1.0, True, [1]])
def test_a_request_whose_id_is_not_an_integer_is_refused(request_id):
    payload = encode_frame({"v": 1, "id": request_id, "op": "ping"})[4:]
    with pytest.raises(ProtocolError, match="not an integer"):
        decode_request(payload)
    with pytest.raises(ProtocolError, match="not an integer"):
        decode_request(encode_frame({"v": 1, "op": "ping"})[4:])  # or none at all
    assert decode_request(encode_frame({"v": 1, "id": 2, "op": "ping"})[4:])["id"] == 2
