"""What a request releases as output bytes, token by token."""
from gpu_worker.engine.sequence import Sequence, Status

EOS = 2


def sequence(stop_strings=(), max_new_tokens=100):
    seq = Sequence("r", [5, 6, 7], max_new_tokens=max_new_tokens, page_limit=10, token_capacity=160,
                   stop_token_ids=frozenset({EOS}), stop_strings=tuple(s.encode() for s in stop_strings))
    seq.status = Status.RUNNING
    return seq


def feed(seq, *pieces):
    return [seq.append(100 + i, piece) for i, piece in enumerate(pieces)]


def test_without_stop_strings_every_token_releases_its_bytes():
    seq = sequence()
    assert feed(seq, b"Hel", b"lo", b"\xf0\x9f") == [(b"Hel", None), (b"lo", None), (b"\xf0\x9f", None)]
    assert bytes(seq.output_bytes) == b"Hello\xf0\x9f"


def test_a_stop_string_split_over_tokens_is_held_back_and_never_released():
    seq = sequence(["END"])
    assert feed(seq, b"abc E", b"N", b"D and more") == [(b"abc ", None), (b"", None), (b"", "stop")]
    assert bytes(seq.output_bytes) == b"abc " and seq.finish_reason == "stop"


def test_held_bytes_are_released_once_they_cannot_begin_a_stop_string():
    seq = sequence(["END"])
    assert feed(seq, b"xE", b"Nx") == [(b"x", None), (b"ENx", None)]


def test_the_earliest_of_several_stop_strings_wins():
    seq = sequence(["cd", "bcdef"])
    assert feed(seq, b"abcdefg") == [(b"a", "stop")]  # "bcdef" begins before "cd"


def test_a_stop_token_releases_no_bytes_of_its_own_but_what_was_held():
    seq = sequence(["END"])
    feed(seq, b"xE")
    assert seq.append(EOS, b"<|im_end|>") == (b"E", "stop")
    assert bytes(seq.output_bytes) == b"xE" and seq.is_finished


def test_length_releases_held_bytes():
    seq = sequence(["END"], max_new_tokens=2)
    assert feed(seq, b"aE", b"N") == [(b"a", None), (b"EN", "length")]


def test_output_is_limited_by_token_capacity():
    seq = Sequence("r", [1] * 10, max_new_tokens=100, page_limit=1, token_capacity=16)
    assert seq.max_output_tokens == 7
