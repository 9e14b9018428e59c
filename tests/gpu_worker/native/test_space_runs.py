"""The native decoder of runs of space creations (jcodec.space_creates, through
kinds/spaces.decode_run) against the Python decoder of each admission (Admission.decode): the same
fields for every payload Admission.encode makes, and None — the replay then decodes each by
itself — for any payload in another layout."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.kinds.kind import Admission, Kind
from gpu_worker.kinds.spaces import decode_run

IDS = st.binary(min_size=16, max_size=16)
CREATION = st.builds(
    lambda principal, sequence, key, op, canonical, raw, scope: Admission(
        int(Kind.SPACE_CREATE), principal, sequence, key, op, canonical, {"id": raw, "scope": scope}),
    IDS, st.integers(0, (1 << 63) - 1), IDS, IDS,
    st.one_of(st.binary(max_size=300),
              st.sampled_from([255, 256, 65535, 65536]).map(lambda n: b"c" * n)),  # bin 8, 16 and 32
    IDS, st.integers(0, (1 << 63) - 1))


def halves(data):
    return np.frombuffer(data, dtype="<i8").reshape(2)


@settings(max_examples=60, deadline=None)
@given(st.lists(CREATION, max_size=6))
def test_each_creation_decodes_to_the_fields_the_python_decoder_reads(admissions):
    run = decode_run([a.encode() for a in admissions])
    assert run is not None and len(run.sequences) == len(admissions)
    ids, scopes = run.extra
    at = 0
    for i, a in enumerate(map(Admission.decode, [a.encode() for a in admissions])):
        assert run.sequences[i] == a.sequence and scopes[i] == a.extra["scope"]
        assert (run.keys[i] == halves(a.key)).all() and (run.ops[i] == halves(a.op)).all()
        assert (ids[i] == halves(a.extra["id"])).all()
        assert run.lengths[i] == len(a.canonical) and run.commands[at:at + len(a.canonical)] == a.canonical
        at += len(a.canonical)
    assert at == len(run.commands)


def test_a_payload_in_any_other_layout_is_left_to_the_python_decoder():
    good = Admission(int(Kind.SPACE_CREATE), b"p" * 16, 7, b"k" * 16, b"o" * 16, b"{}",
                     {"id": b"i" * 16, "scope": 1})
    others = [
        good.encode() + b"\x00",  # more after it
        good.encode()[:-1],  # cut short
        good._replace(kind=int(Kind.CONVERSATION_CREATE)).encode(),
        good._replace(extra={"scope": 1, "id": b"i" * 16}).encode(),  # the keys in the other order
        good._replace(extra={"id": b"i" * 16, "scope": 1, "more": 0}).encode(),
        good._replace(extra={"id": b"i" * 15, "scope": 1}).encode(),
        good._replace(extra={"id": b"i" * 16, "scope": -1}).encode(),
        good._replace(sequence=-7).encode(),
        good._replace(principal=b"p" * 17).encode(),
        good._replace(canonical="{}").encode(),  # a str, not bytes
        b"\x98" + good.encode()[1:2] + b"\x02",
        b"",
    ]
    assert decode_run([good.encode()]) is not None
    for other in others:
        assert decode_run([good.encode(), other]) is None, other
