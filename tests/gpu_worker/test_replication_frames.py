"""The replication link's frames as each side sends them (gpu_worker/replication/frames.py): every
frame a primary's Link sends, in the order queued, reads back through `from_primary` as the Struct
of its kind with the primary's leadership generation; a refusal and a rewind, sent outside the
stream, too; the standby's hello and acknowledgement through `hello` and `ack`. A field at its
default is left out of the map and read as that default."""
import hashlib
import socket

import pytest

from gpu_worker.contract.wire import LENGTH, FrameReader, decode_payload, encode_frame
from gpu_worker.replication import read_frames
from gpu_worker.replication.copies import rewind
from gpu_worker.replication.frames import (Ack, Beat, Bytes, CatchUpEnd, CheckpointEnd, Cut, Hello, MediaPiece, Piece,
                                           Refused, Replication, Rewind, ack, from_primary, hello)
from gpu_worker.replication.primary_link import Link
from gpu_worker.storage.journal import segment_name
from gpu_worker.storage.runtime_file import RuntimeFile

LEADER = 7


class Shipper:
    """What a Link sees of the Shipper (primary_link.Shipping)."""

    def __init__(self, journal_dir, runtime):
        self.leader = LEADER
        self.leadership = None
        self.dead_after = 0.3  # (a beat every 0.1 s while nothing is queued)
        self.journal_dir = journal_dir
        self.runtime = runtime
        self.cuts = 1

    def wake(self):
        pass


@pytest.fixture
def link(tmp_path, tiny_runtime):
    ours, theirs = socket.socketpair()
    theirs.settimeout(30)
    link = Link(Shipper(str(tmp_path), tiny_runtime), ours, (0, 0))
    yield link, theirs
    link.close()
    for thread in link.threads:
        if thread.is_alive():
            thread.join(10)
    theirs.close()


def received(sock, reader, count):
    """The next `count` frames other than beats (the sender beats whenever its queue is empty), as
    (the map on the link, the frame `from_primary` reads in it)."""
    out = []
    while len(out) < count:
        for msg in read_frames(sock, reader):
            frame = from_primary(msg)
            if isinstance(frame, Beat):
                assert msg == {"beat": 1, "g": LEADER}
            else:
                out.append((msg, frame))
    return out


def test_every_frame_a_primary_sends_reads_back_as_its_kind_with_the_leadership_generation(link, tmp_path,
                                                                                            tiny_runtime):
    link, theirs = link
    with RuntimeFile.open(tiny_runtime, verify=False) as current:
        generation = current.generation
        name = min(current.components, key=lambda n: current.components[n].length)
        component = current.components[name]
        kind, sha, content = component.kind, component.sha256, current.read_verified(name)
    media = tmp_path / "source"
    media.write_bytes(b"\x89PNG media")
    media_sha = hashlib.sha256(media.read_bytes()).hexdigest()
    (tmp_path / segment_name(1)).write_bytes(b"segment bytes")
    link.queue.put(("frame", Replication(replication="sync", cut=0, takeovers=[], sync_at=(0, 0))))
    link.queue.put(("frame", Cut(cut=1, segment=2, offset=10)))
    link.queue.put((2, 10, b"tick"))
    link.queue.put(("files", (1, 0), (1, 13)))
    link.queue.put(("media", media_sha, str(media)))
    link.queue.put(("checkpoint", generation + 1, [("state/x", "bytes", b"abc")], ["state/old"], 3))
    link.queue.put(("catchup", generation, [name], ["state/gone"]))
    link.queue.put(("adopt", generation, [name], []))
    link.start()
    reader = FrameReader()
    pieces = -(-len(content) // (1 << 20)) or 1  # (SEGMENT_CHUNK)
    got = received(theirs, reader, 9 + 2 * pieces)
    raw = [msg for msg, _ in got]
    frames = [frame for _, frame in got]
    assert all(frame.g == LEADER for frame in frames)
    assert "cut" not in raw[0] and "takeovers" not in raw[0]  # (at their defaults)
    assert frames[0] == Replication(replication="sync", g=LEADER) and frames[0].sync_at == (0, 0)
    assert frames[1:6] == [
        Cut(cut=1, segment=2, offset=10, g=LEADER), Bytes(segment=2, offset=10, data=b"tick", g=LEADER),
        Bytes(segment=1, offset=0, data=b"segment bytes", g=LEADER),
        MediaPiece(media=media_sha, size=10, offset=0, data=b"\x89PNG media", g=LEADER),
        Piece(checkpoint=generation + 1, component="state/x", kind="bytes", offset=0, data=b"abc", g=LEADER)]
    assert "catchup" not in raw[5]  # (a checkpoint's piece: the key tells it from a catch-up's)
    assert frames[6] == CheckpointEnd(checkpoint=generation + 1, components=["state/x"], drop=["state/old"], through=3,
                                      g=LEADER)
    caught = frames[7:7 + pieces]
    assert all(isinstance(p, Piece) and p.catchup == generation and p.checkpoint is None and p.component == name
               and p.kind == kind for p in caught)
    assert b"".join(p.data for p in caught) == content and "checkpoint" not in raw[7]
    assert frames[7 + pieces] == CatchUpEnd(catchup=generation, components={name: sha}, drop=["state/gone"],
                                            g=LEADER)
    assert "journal" not in raw[7 + pieces]
    adopted = frames[8 + pieces:8 + 2 * pieces]
    assert b"".join(p.data for p in adopted) == content
    assert frames[8 + 2 * pieces] == CatchUpEnd(catchup=generation, components={name: sha}, drop=[], journal="kept",
                                                g=LEADER)
    while not any(isinstance(from_primary(msg), Beat) for msg in read_frames(theirs, reader)):
        pass  # nothing is queued now: the next frame is a beat


def test_a_refusal_and_a_rewind_go_out_before_the_stream_without_a_generation(tmp_path, tiny_runtime):
    for again, expected in ((True, {"refused": "busy", "again": True}), (False, {"refused": "busy"})):
        ours, theirs = socket.socketpair()
        with theirs:
            Link(Shipper(str(tmp_path), tiny_runtime), ours, (0, 0)).refuse("busy", again=again)
            [msg] = read_frames(theirs, FrameReader())
            assert msg == expected and from_primary(msg) == Refused(refused="busy", again=again)
    ours, theirs = socket.socketpair()
    with theirs:
        assert rewind([(1, 0), (3, 5), (9, 0)], Link(Shipper(str(tmp_path), tiny_runtime), ours, (0, 0)), (4, 0))
        [msg] = read_frames(theirs, FrameReader())
        assert msg == {"rewind": [3, 5]} and from_primary(msg) == Rewind(rewind=(3, 5))


def test_the_standbys_hello_and_acknowledgement_read_back_as_theirs():
    said = Hello(hello=1, incarnation=b"i" * 16, generation=3, components={"model": "ab"}, segment=2, offset=40,
                 digest=b"d" * 32, media=[], member="m" * 32, leader=0)
    msg = decode_payload(encode_frame(said)[LENGTH.size:])
    assert "leader" not in msg and hello(msg) == said
    acked = Ack(ack=1, segment=2, offset=40, cut=0, g=0)
    msg = decode_payload(encode_frame(acked)[LENGTH.size:])
    assert msg == {"ack": 1, "segment": 2, "offset": 40, "cut": 0, "g": 0} and ack(msg) == acked
