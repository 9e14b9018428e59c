"""The native decoders of runs of conversation creations and member rows (jcodec
conversation_creates and member_sets, through kinds/conversations.py and kinds/members.py decode_run)
against the Python decoder of each admission (Admission.decode): the same fields for every payload
Admission.encode makes, and None — the replay then decodes each by itself — for any payload in
another layout."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.kinds import conversations, members
from gpu_worker.kinds.kind import Admission, Kind

IDS = st.binary(min_size=16, max_size=16)
COUNTER = st.integers(0, (1 << 63) - 1)
CANONICAL = st.one_of(st.binary(max_size=300), st.sampled_from([255, 256, 65535, 65536]).map(lambda n: b"c" * n))
CREATION = st.builds(
    lambda principal, sequence, key, op, canonical, lineage, space, raw: Admission(
        int(Kind.CONVERSATION_CREATE), principal, sequence, key, op, canonical, {"space": [lineage, space], "id": raw}),
    IDS, COUNTER, IDS, IDS, CANONICAL, IDS, IDS, IDS)
MEMBER = st.builds(
    lambda principal, sequence, key, op, canonical, lineage, space, participant, rights: Admission(
        int(Kind.MEMBER_SET), principal, sequence, key, op, canonical,
        {"space": [lineage, space], "participant": participant, "rights": rights}),
    IDS, COUNTER, IDS, IDS, CANONICAL, IDS, IDS, IDS, st.integers(0, 7))


def halves(data):
    return np.frombuffer(data, dtype="<i8").reshape(2)


def same_heads(run, admissions):
    at = 0
    for i, a in enumerate(admissions):
        assert run.sequences[i] == a.sequence and run.lengths[i] == len(a.canonical)
        assert (run.keys[i] == halves(a.key)).all() and (run.ops[i] == halves(a.op)).all()
        assert run.commands[at:at + len(a.canonical)] == a.canonical
        at += len(a.canonical)
    assert at == len(run.commands)


@settings(max_examples=60, deadline=None)
@given(st.lists(CREATION, max_size=6))
def test_each_conversation_creation_decodes_to_the_fields_the_python_decoder_reads(made):
    run = conversations.decode_run([a.encode() for a in made])
    decoded = [Admission.decode(a.encode()) for a in made]
    assert run is not None and len(run.sequences) == len(made)
    same_heads(run, decoded)
    lineages, spaces, ids = run.extra
    assert [[lineage, space] for lineage, space in zip(lineages, spaces)] == [a.extra["space"] for a in decoded]
    assert ids == b"".join(a.extra["id"] for a in decoded)


@settings(max_examples=60, deadline=None)
@given(st.lists(MEMBER, max_size=6))
def test_each_member_row_decodes_to_the_fields_the_python_decoder_reads(made):
    run = members.decode_run([a.encode() for a in made])
    decoded = [Admission.decode(a.encode()) for a in made]
    assert run is not None and len(run.sequences) == len(made)
    same_heads(run, decoded)
    lineages, spaces, participants, rights = run.extra
    assert [[lineage, space] for lineage, space in zip(lineages, spaces)] == [a.extra["space"] for a in decoded]
    assert participants == [a.extra["participant"] for a in decoded]
    assert rights == [a.extra["rights"] for a in decoded]


def test_a_payload_in_any_other_layout_is_left_to_the_python_decoder():
    conversation = Admission(int(Kind.CONVERSATION_CREATE), b"p" * 16, 7, b"k" * 16, b"o" * 16, b"{}",
                             {"space": [b"l" * 16, b"s" * 16], "id": b"i" * 16})
    member = Admission(int(Kind.MEMBER_SET), b"p" * 16, 7, b"k" * 16, b"o" * 16, b"{}",
                       {"space": [b"l" * 16, b"s" * 16], "participant": b"q" * 16, "rights": 3})
    for good, decode, others in (
            (conversation, conversations.decode_run, [
                conversation._replace(kind=int(Kind.SPACE_CREATE)),
                conversation._replace(extra={"id": b"i" * 16, "space": [b"l" * 16, b"s" * 16]}),  # the other order
                conversation._replace(extra={"space": [b"l" * 16, b"s" * 16], "id": b"i" * 16, "more": 0}),
                conversation._replace(extra={"space": [b"l" * 16], "id": b"i" * 16}),
                conversation._replace(extra={"space": [b"l" * 16, b"s" * 15], "id": b"i" * 16}),
                conversation._replace(sequence=-7)]),
            (member, members.decode_run, [
                member._replace(kind=int(Kind.CONVERSATION_CREATE)),
                member._replace(extra={"space": [b"l" * 16, b"s" * 16], "rights": 3, "participant": b"q" * 16}),
                member._replace(extra={"space": [b"l" * 16, b"s" * 16], "participant": b"q" * 16, "rights": -1}),
                member._replace(extra={"space": [b"l" * 16, b"s" * 16], "participant": b"q" * 17, "rights": 3}),
                member._replace(canonical="{}")])):
        payloads = [o.encode() for o in others] + [good.encode() + b"\x00", good.encode()[:-1], b""]
        assert decode([good.encode()]) is not None
        for other in payloads:
            assert decode([good.encode(), other]) is None, other
