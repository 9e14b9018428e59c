import errno
import hashlib
import os
import random
import struct
import subprocess
import sys
import tempfile
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_worker.storage.filelayer import FaultyAppendFile, FaultyFileLayer, OsFileLayer
from gpu_worker.storage.journal import (
    CLASS_A,
    MAX_DATA,
    PART_HEADER,
    PART_HEADER_SIZE,
    SEGMENT_HEADER,
    SEGMENT_HEADER_SIZE,
    TYPE_SHARED,
    JournalCorrupt,
    JournalError,
    Transfer,
    TransferKind,
    encode_segment_header,
    record_count,
    segment_name,
)
from gpu_worker.storage.journal_lock import JournalLock, JournalLocked
from gpu_worker.storage.journal_reader import ReadAhead, Tail, recover
from gpu_worker.storage.journal_writer import MAX_RECORDS_PER_TICK, JournalIOError, JournalWriter, encode_transfer

from tests.conftest import ROOT

INC = bytes(range(16))
OTHER_INC = bytes(range(1, 17))
REPO = str(ROOT)


def open_writer(directory, fs, **kwargs):
    return JournalWriter(str(directory), fs, INC, recover(str(directory), fs, INC, **kwargs))


def commit_all(writer):
    done = []
    while writer.queued_records:
        done += writer.commit_tick()
    return done


def summary(transfers):
    return [(t.kind, t.seq, t.payload, t.digest, t.segment, t.offset) for t in transfers]


def segment_path(directory, number=1):
    return os.path.join(str(directory), segment_name(number))


def payload(n, seed=0):
    return random.Random(seed * 7919 + n).randbytes(n)


def hand_record(kind, index, count, data, length, seq, *, reserved=0):
    """A record built from the documented layout, independently of encode_transfer."""
    fields = [TYPE_SHARED, CLASS_A, kind, index, count, len(data), reserved, length, seq]
    checksum = zlib.crc32(PART_HEADER.pack(*fields, 0, 0) + data)
    return PART_HEADER.pack(*fields, checksum, 0) + data


def write_segment(directory, number, body, incarnation=INC):
    with open(segment_path(directory, number), "wb") as f:
        f.write(encode_segment_header(number, incarnation) + body)


# --- layouts -----------------------------------------------------------------------------------


def test_part_header_fields_sit_at_the_documented_offsets():
    raw = PART_HEADER.pack(37, 0x41, 0x0203, 0x0405, 0x0607, 0x0809, 0, 0x0D0C0B0A,
                           0x1716151413121110, 0x1B1A1918, 0)
    assert len(raw) == PART_HEADER_SIZE == 32
    assert raw[0] == 37 and raw[1] == 0x41
    assert raw[2:4] == b"\x03\x02" and raw[4:6] == b"\x05\x04" and raw[6:8] == b"\x07\x06"
    assert raw[8:10] == b"\x09\x08" and raw[10:12] == bytes(2)
    assert raw[12:16] == bytes([10, 11, 12, 13])
    assert raw[16:24] == bytes(range(0x10, 0x18))
    assert raw[24:28] == bytes(range(0x18, 0x1C)) and raw[28:32] == bytes(4)
    assert PART_HEADER.unpack(raw)[7] == 0x0D0C0B0A


def test_segment_header_round_trips_with_documented_offsets():
    raw = encode_segment_header(0x01020304, INC)
    assert len(raw) == SEGMENT_HEADER_SIZE == 32
    assert raw[:8] == b"AOTXJNL1" and raw[8:10] == b"\x01\x00" and raw[10:12] == b"\x20\x00"
    assert raw[12:16] == b"\x04\x03\x02\x01" and raw[16:32] == INC
    assert SEGMENT_HEADER.unpack(raw) == (b"AOTXJNL1", 1, 32, 0x01020304, INC)


def test_transfer_kinds_have_their_documented_values():
    assert [(k.name, int(k)) for k in TransferKind] == [
        ("BOOT", 1), ("ADMISSION", 2), ("LEASE", 3), ("OUTPUT", 4), ("COMPLETION", 5),
        ("RETIREMENT", 6), ("CHECKPOINT", 7), ("MEDIA", 8), ("HOLD", 9),
        ("MEMORY", 10), ("REPLICATION", 11), ("EXPIRY", 12),
    ]


@pytest.mark.parametrize("n, count", [(0, 1), (1, 1), (160, 1), (161, 2), (320, 2), (321, 3)])
def test_record_count_is_one_record_per_160_bytes_and_at_least_one(n, count):
    assert record_count(n) == count
    assert len(encode_transfer(TransferKind.OUTPUT, 1, bytes(n))) == count


def test_records_match_the_layout_built_by_hand():
    data = payload(400)
    records = encode_transfer(TransferKind.LEASE, 9, data)
    assert records == [
        hand_record(3, 0, 3, data[:160], 400, 9),
        hand_record(3, 1, 3, data[160:320], 400, 9),
        hand_record(3, 2, 3, data[320:], 400, 9),
    ]
    assert [len(r) for r in records] == [192, 192, 112]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(TransferKind)), st.integers(1, (1 << 64) - 1), st.binary(max_size=700))
def test_native_records_match_the_layout_built_by_hand_for_any_transfer(kind, seq, data):
    """encode_transfer is native (jcodec.cpp): every kind, seq (to 2**64 - 1) and payload size,
    including part boundaries, gives the records the documented layout describes."""
    count = max(1, -(-len(data) // MAX_DATA))
    assert encode_transfer(kind, seq, data) == [
        hand_record(int(kind), i, count, data[i * MAX_DATA:(i + 1) * MAX_DATA], len(data), seq) for i in range(count)]


def test_encode_takes_any_bytes_like_payload_and_refuses_a_seq_past_64_bits():
    data = payload(200)
    assert encode_transfer(TransferKind.OUTPUT, 5, bytearray(data)) == encode_transfer(TransferKind.OUTPUT, 5, data)
    assert encode_transfer(TransferKind.OUTPUT, 5, memoryview(data)) == encode_transfer(TransferKind.OUTPUT, 5, data)
    with pytest.raises(ValueError):
        encode_transfer(TransferKind.OUTPUT, 1 << 64, b"x")
    with pytest.raises(TypeError):
        encode_transfer(TransferKind.OUTPUT, 1, "text")


def test_an_empty_payload_is_one_record_with_no_data():
    (record,) = encode_transfer(TransferKind.BOOT, 1, b"")
    assert record == hand_record(1, 0, 1, b"", 0, 1)
    assert PART_HEADER.unpack(record)[5] == 0


def test_encode_refuses_unknown_kinds_and_oversize_payloads():
    with pytest.raises(ValueError):
        encode_transfer(99, 1, b"x")
    with pytest.raises(ValueError):
        encode_transfer(TransferKind.OUTPUT, 1, bytes(0xFFFF * MAX_DATA + 1))
    with pytest.raises(ValueError):
        encode_transfer(TransferKind.OUTPUT, 0, b"x")


# --- round trip ----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(list(TransferKind)), st.integers(0, 3000)),
                min_size=1, max_size=12),
       st.integers(0, 2**32))
def test_round_trip_recovers_what_commit_tick_reported(specs, seed):
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as d:
        fs = FaultyFileLayer()
        writer = open_writer(d, fs)
        sent, done = [], []
        for kind, n in specs:
            data = rng.randbytes(n)
            sent.append((kind, writer.append(kind, data), data))
            if rng.random() < 0.5:
                done += writer.commit_tick()
        done += commit_all(writer)
        assert [(t.kind, t.seq, t.payload) for t in done] == sent
        for record in (r for _, seq, data in sent for r in encode_transfer(1, seq, data)):
            assert len(record) <= PART_HEADER_SIZE + MAX_DATA
        result = recover(d, fs, INC)
        assert summary(result.transfers) == summary(done)
        assert result.next_seq == len(sent) + 1 == writer.next_seq
        assert result.last_digest == writer.last_digest == done[-1].digest
        assert result.dropped is None
        assert result.durable_bytes == writer.durable_bytes == os.path.getsize(segment_path(d))


def test_round_trip_on_real_files(tmp_path):
    fs = OsFileLayer()
    writer = open_writer(tmp_path, fs)
    for n in (0, 1, 159, 160, 161, 2500):
        writer.append(TransferKind.OUTPUT, payload(n))
    done = commit_all(writer)
    writer.close()
    assert summary(recover(str(tmp_path), fs, INC).transfers) == summary(done)


def test_commit_digest_is_the_documented_hash_chain(tmp_path):
    fs = FaultyFileLayer()
    writer = open_writer(tmp_path, fs)
    items = [(TransferKind.ADMISSION, b"a"), (TransferKind.OUTPUT, payload(700)),
             (TransferKind.COMPLETION, b"")]
    for kind, data in items:
        writer.append(kind, data)
    done = commit_all(writer)
    digest = bytes(32)
    for seq, (kind, data) in enumerate(items, 1):
        digest = hashlib.sha256(
            digest + struct.pack("<H", kind) + struct.pack("<Q", seq) + data
        ).digest()
        assert done[seq - 1].digest == digest
    writer.close()
    # recovery (the native reader, OpenSSL's SHA-256) derives the same chain from the files
    assert [t.digest for t in recover(str(tmp_path), fs, INC).transfers] == [t.digest for t in done]


def test_transfer_offsets_point_at_their_first_record(tmp_path):
    fs = FaultyFileLayer()
    writer = open_writer(tmp_path, fs)
    for n in (10, 400, 0):
        writer.append(TransferKind.OUTPUT, payload(n))
    done = commit_all(writer)
    data = open(segment_path(tmp_path), "rb").read()
    for t in done:
        fields = PART_HEADER.unpack_from(data, t.offset)
        assert (fields[2], fields[3], fields[8]) == (TransferKind.OUTPUT, 0, t.seq)


# --- ticks ---------------------------------------------------------------------------------------


class CountingLayer(FaultyFileLayer):
    def __init__(self):
        super().__init__()
        self.writes = []

    def open_append(self, path):
        handle = super().open_append(path)
        real_write = handle.write

        def write(data):
            self.writes.append(len(data))
            real_write(data)

        handle.write = write
        return handle


def test_a_tick_writes_at_most_16_records_with_one_write_and_one_fdatasync(tmp_path):
    fs = CountingLayer()
    writer = open_writer(tmp_path, fs)
    for _ in range(40):
        writer.append(TransferKind.ADMISSION, b"x" * 20)  # one 52-byte record each
    fs.writes.clear()
    syncs = fs.fdatasync_calls
    done = writer.commit_tick()
    assert [t.seq for t in done] == list(range(1, 17))
    assert fs.writes == [16 * 52] and fs.fdatasync_calls == syncs + 1
    assert writer.queued_records == 24
    assert len(writer.commit_tick()) == 16 and len(writer.commit_tick()) == 8
    assert writer.commit_tick() == [] and fs.fdatasync_calls == syncs + 3


def test_an_idle_tick_touches_nothing(tmp_path):
    fs = CountingLayer()
    writer = open_writer(tmp_path, fs)
    syncs, writes = fs.fdatasync_calls, list(fs.writes)
    assert writer.commit_tick() == []
    assert fs.fdatasync_calls == syncs and fs.writes == writes


def test_a_20_part_transfer_is_durable_only_after_the_second_tick_and_reported_once(tmp_path):
    fs = CountingLayer()
    writer = open_writer(tmp_path, fs)
    big = payload(20 * MAX_DATA)
    seq = writer.append(TransferKind.OUTPUT, big)
    later = writer.append(TransferKind.COMPLETION, b"done")
    assert writer.queued_records == 21
    fs.writes.clear()
    assert writer.commit_tick() == []
    assert fs.writes == [16 * 192] and writer.queued_records == 5
    assert not writer.at_transfer_boundary
    second = writer.commit_tick()
    assert [(t.seq, t.payload) for t in second] == [(seq, big), (later, b"done")]
    assert fs.writes == [16 * 192, 4 * 192 + 36]
    assert writer.commit_tick() == []
    assert summary(recover(str(tmp_path), fs, INC).transfers) == summary(second)


def test_records_are_never_split_across_ticks(tmp_path):
    fs = CountingLayer()
    writer = open_writer(tmp_path, fs)
    for n in (3000, 5, 1000, 161):
        writer.append(TransferKind.OUTPUT, payload(n))
    fs.writes.clear()
    commit_all(writer)
    data = open(segment_path(tmp_path), "rb").read()
    pos = SEGMENT_HEADER_SIZE
    for size in fs.writes:
        end, count = pos + size, 0
        while pos < end:  # every tick ends exactly at a record boundary
            pos += PART_HEADER_SIZE + PART_HEADER.unpack_from(data, pos)[5]
            count += 1
        assert pos == end and count <= MAX_RECORDS_PER_TICK


# --- torn tails ----------------------------------------------------------------------------------


def build_tail_journal(directory):
    """Some early transfers, then two final ticks; returns (reported transfers, the tick start
    offset of the last two ticks)."""
    directory.mkdir()
    fs = FaultyFileLayer()
    writer = open_writer(directory, fs)
    for n in (5, 300, 0):
        writer.append(TransferKind.ADMISSION, payload(n, 1))
    done = commit_all(writer)
    tail_start = writer.offset
    for n in (40, 900, 170):  # tick one: 1 + 6 + 2 records (9); tick two: none left over
        writer.append(TransferKind.OUTPUT, payload(n, 2))
    writer.append(TransferKind.LEASE, payload(1500, 3))  # 10 records: split over both ticks
    done += writer.commit_tick()
    done += writer.commit_tick()
    assert writer.queued_records == 0
    writer.close()
    return done, tail_start


def expected_after_cut(done, cut):
    return [t for t in done if t.offset + len(record_bytes(t)) <= cut]


def test_truncation_at_every_byte_of_the_last_two_ticks_drops_only_the_torn_transfer(tmp_path):
    done, tail_start = build_tail_journal(tmp_path / "orig")
    data = open(segment_path(tmp_path / "orig"), "rb").read()
    assert len(data) - tail_start > 2 * 1500
    work = tmp_path / "work"
    work.mkdir()
    for cut in range(tail_start, len(data) + 1):
        write_raw(work, data[:cut])
        fs = FaultyFileLayer()
        result = recover(str(work), fs, INC)
        kept = expected_after_cut(done, cut)
        assert summary(result.transfers) == summary(kept), cut
        boundary = result.end_offset
        assert boundary == (kept[-1].offset + len(record_bytes(kept[-1])) if kept else 32)
        assert (result.dropped is None) == (boundary == cut), cut
        if cut - boundary >= PART_HEADER_SIZE:  # enough left to say which transfer was torn
            assert result.dropped == (
                f"dropped incomplete final transfer seq {len(kept) + 1} "
                f"at {segment_path(work)} offset {boundary}"
            )
        elif cut > boundary:
            assert result.dropped == (
                f"dropped torn tail of {cut - boundary} bytes at {segment_path(work)} "
                f"offset {boundary}"
            )
        writer = JournalWriter(str(work), fs, INC, result)
        assert os.path.getsize(segment_path(work)) == boundary
        assert fs.durable[segment_path(work)] == boundary
        new_seq = writer.append(TransferKind.COMPLETION, b"after the crash")
        assert new_seq == len(kept) + 1
        more = writer.commit_tick()
        writer.close()
        again = recover(str(work), FaultyFileLayer(), INC)
        assert summary(again.transfers) == summary(kept + more), cut
        assert again.dropped is None


def record_bytes(transfer):
    return b"".join(encode_transfer(transfer.kind, transfer.seq, transfer.payload))


def write_raw(directory, data, number=1):
    with open(segment_path(directory, number), "wb") as f:
        f.write(data)


@pytest.mark.parametrize("fill", [bytes(4096), bytes(1)])
def test_zero_fill_after_the_last_record_is_a_torn_tail(tmp_path, fill):
    fs = FaultyFileLayer()
    writer = open_writer(tmp_path, fs)
    writer.append(TransferKind.BOOT, b"boot")
    done = commit_all(writer)
    writer.close()
    end = os.path.getsize(segment_path(tmp_path))
    with open(segment_path(tmp_path), "ab") as f:
        f.write(fill)
    result = recover(str(tmp_path), fs, INC)
    assert summary(result.transfers) == summary(done) and result.end_offset == end
    assert result.dropped == (
        f"dropped torn tail of {len(fill)} bytes at {segment_path(tmp_path)} offset {end}"
    )


def test_a_new_writer_cuts_the_dropped_tail_before_appending(tmp_path):
    fs = FaultyFileLayer()
    writer = open_writer(tmp_path, fs)
    writer.append(TransferKind.OUTPUT, payload(20 * MAX_DATA))
    assert writer.commit_tick() == []  # 16 of 20 parts durable, then the device dies
    writer.close()
    result = recover(str(tmp_path), fs, INC)
    assert result.transfers == [] and result.next_seq == 1
    assert result.dropped == (
        f"dropped incomplete final transfer seq 1 at {segment_path(tmp_path)} offset 32"
    )
    writer = JournalWriter(str(tmp_path), fs, INC, result)
    assert os.path.getsize(segment_path(tmp_path)) == 32
    assert writer.append(TransferKind.BOOT, b"again") == 1
    done = commit_all(writer)
    assert summary(recover(str(tmp_path), fs, INC).transfers) == summary(done)


# --- corruption ----------------------------------------------------------------------------------


def build_middle_journal(directory):
    fs = FaultyFileLayer()
    writer = open_writer(directory, fs)
    for n in (10, 450, 30, 700, 60):
        writer.append(TransferKind.OUTPUT, payload(n, 5))
    done = commit_all(writer)
    writer.close()
    return done


def record_offsets(data):
    offsets, pos = [], SEGMENT_HEADER_SIZE
    while pos < len(data):
        offsets.append(pos)
        pos += PART_HEADER_SIZE + PART_HEADER.unpack_from(data, pos)[5]
    return offsets


def test_a_flipped_byte_anywhere_in_an_early_transfer_names_the_file_and_record(tmp_path):
    done = build_middle_journal(tmp_path)
    path = segment_path(tmp_path)
    data = open(path, "rb").read()
    offsets = record_offsets(data)
    early_end = done[2].offset  # transfers 1 and 2: four records
    rng = random.Random(1)
    for pos in range(SEGMENT_HEADER_SIZE, early_end):
        record_start = max(o for o in offsets if o <= pos)
        damaged = bytearray(data)
        damaged[pos] ^= rng.randrange(1, 256)
        write_raw(tmp_path, bytes(damaged))
        with pytest.raises(JournalCorrupt) as info:
            recover(str(tmp_path), FaultyFileLayer(), INC)
        assert info.value.file == path and info.value.offset == record_start, pos
        assert str(info.value).startswith(f"journal damaged: {path}: offset {record_start}: ")
        assert segment_name(1) in str(info.value)


def test_a_flipped_byte_in_the_segment_header_is_corruption_at_offset_0(tmp_path):
    build_middle_journal(tmp_path)
    data = open(segment_path(tmp_path), "rb").read()
    for pos in range(SEGMENT_HEADER_SIZE):
        damaged = bytearray(data)
        damaged[pos] ^= 0x40
        write_raw(tmp_path, bytes(damaged))
        with pytest.raises(JournalCorrupt) as info:
            recover(str(tmp_path), FaultyFileLayer(), INC)
        assert info.value.offset == 0


def test_a_zeroed_sector_in_the_middle_is_corruption(tmp_path):
    done = build_middle_journal(tmp_path)
    data = bytearray(open(segment_path(tmp_path), "rb").read())
    sector = 512
    assert len(data) > 3 * sector
    data[sector:2 * sector] = bytes(sector)
    write_raw(tmp_path, bytes(data))
    with pytest.raises(JournalCorrupt) as info:
        recover(str(tmp_path), FaultyFileLayer(), INC)
    expected = max(o for o in record_offsets(bytes(data[:sector])) if o <= sector)
    assert info.value.offset == expected and done


def test_damage_followed_by_a_later_segment_is_corruption(tmp_path):
    fs = FaultyFileLayer()
    writer = open_writer(tmp_path, fs)
    writer.append(TransferKind.OUTPUT, b"one")
    commit_all(writer)
    writer.start_new_segment()
    writer.append(TransferKind.OUTPUT, b"two")
    commit_all(writer)
    writer.close()
    with open(segment_path(tmp_path, 1), "ab") as f:
        f.write(bytes(7))  # a torn-looking tail, but the journal went on after it
    with pytest.raises(JournalCorrupt) as info:
        recover(str(tmp_path), fs, INC)
    assert info.value.file == segment_path(tmp_path, 1) and info.value.offset == 32 + 35
    assert info.value.reason == "record header cut short by end of file, yet segment 2 follows"


def test_a_torn_first_transfer_is_named_by_its_seq(tmp_path):
    record = encode_transfer(TransferKind.BOOT, 1, b"boot")[0]
    write_segment(tmp_path, 1, record[:-1])
    result = recover(str(tmp_path), FaultyFileLayer(), INC)
    assert result.dropped == (
        f"dropped incomplete final transfer seq 1 at {segment_path(tmp_path)} offset 32"
    )


def test_an_incomplete_transfer_followed_by_another_transfer_is_corruption(tmp_path):
    first = encode_transfer(TransferKind.OUTPUT, 1, payload(480))
    second = encode_transfer(TransferKind.COMPLETION, 2, b"x")
    write_segment(tmp_path, 1, first[0] + first[1] + second[0])
    with pytest.raises(JournalCorrupt) as info:
        recover(str(tmp_path), FaultyFileLayer(), INC)
    assert info.value.offset == 32 + 2 * 192
    assert "interrupts incomplete transfer seq 1 at offset 32" in info.value.reason


@pytest.mark.parametrize("name, body, offset, reason", [
    ("part out of order",
     lambda r: r[0] + r[2] + r[1], 32 + 192, "part 2 of transfer seq 1 where part 1 belongs"),
    ("missing first part", lambda r: r[1] + r[2], 32, "part 1 of transfer seq 1 without its first"),
    ("kind changes mid-transfer",
     lambda r: r[0] + hand_record(5, 1, 3, payload(480)[160:320], 480, 1) + r[2],
     32 + 192, "disagrees with its first part"),
    ("seq gap",
     lambda r: b"".join(r) + encode_transfer(2, 3, b"z")[0], 32 + 3 * 192 + 0,
     "transfer seq 3 where seq 2 belongs"),
    ("seq repeated",
     lambda r: b"".join(r) + encode_transfer(2, 1, b"z")[0], 32 + 3 * 192,
     "transfer seq 1 where seq 2 belongs"),
    ("unknown kind with a good checksum",
     lambda r: hand_record(42, 0, 1, b"?", 1, 1), 32, "unknown transfer kind 42"),
    ("reserved field set",
     lambda r: hand_record(2, 0, 1, b"?", 1, 1, reserved=1), 32, "reserved field not zero"),
    ("part count disagrees with the length",
     lambda r: hand_record(2, 0, 2, b"?", 1, 1), 32, "part 0 of 2 for a transfer of 1 bytes"),
    ("short middle part",
     lambda r: hand_record(2, 0, 2, b"?", 200, 1) + hand_record(2, 1, 2, bytes(40), 200, 1),
     32, "part 0 holds 1 data bytes"),
    ("journal starts past seq 1", lambda r: encode_transfer(2, 2, b"z")[0], 32,
     "journal starts at transfer seq 2 after checkpoint seq 0"),
])
def test_inconsistent_transfers_fail_closed(tmp_path, name, body, offset, reason):
    records = encode_transfer(TransferKind.OUTPUT, 1, payload(480))
    write_segment(tmp_path, 1, body(records))
    with pytest.raises(JournalCorrupt) as info:
        recover(str(tmp_path), FaultyFileLayer(), INC)
    assert info.value.offset == offset, name
    assert reason in info.value.reason, name


def test_a_segment_of_another_incarnation_is_refused(tmp_path):
    write_segment(tmp_path, 1, encode_transfer(1, 1, b"boot")[0], incarnation=OTHER_INC)
    with pytest.raises(JournalCorrupt) as info:
        recover(str(tmp_path), FaultyFileLayer(), INC)
    assert info.value.offset == 0 and "incarnation" in info.value.reason
    assert INC.hex() in info.value.reason and OTHER_INC.hex() in info.value.reason


@pytest.mark.parametrize("header, reason", [
    (b"AOTXJNL2" + encode_segment_header(1, INC)[8:], "segment magic"),
    (encode_segment_header(2, INC), "segment header says segment 2"),
    (encode_segment_header(1, INC)[:8] + b"\x02\x00" + encode_segment_header(1, INC)[10:],
     "segment version 2"),
])
def test_a_bad_segment_header_is_refused(tmp_path, header, reason):
    write_raw(tmp_path, header + encode_transfer(1, 1, b"boot")[0])
    with pytest.raises(JournalCorrupt) as info:
        recover(str(tmp_path), FaultyFileLayer(), INC)
    assert info.value.offset == 0 and reason in info.value.reason


def test_a_missing_segment_is_refused(tmp_path):
    write_segment(tmp_path, 1, b"")
    write_segment(tmp_path, 3, b"")
    with pytest.raises(JournalCorrupt) as info:
        recover(str(tmp_path), FaultyFileLayer(), INC)
    assert info.value.file == segment_path(tmp_path, 3)
    assert "segment 2 is missing" in str(info.value)


def test_a_transfer_cut_off_by_a_segment_end_is_corruption(tmp_path):
    records = encode_transfer(TransferKind.OUTPUT, 1, payload(480))
    write_segment(tmp_path, 1, records[0])
    write_segment(tmp_path, 2, records[1] + records[2])
    with pytest.raises(JournalCorrupt) as info:
        recover(str(tmp_path), FaultyFileLayer(), INC)
    assert info.value.file == segment_path(tmp_path, 1) and info.value.offset == 32


# --- segments, checkpoints -----------------------------------------------------------------------


def test_seqs_and_digests_continue_across_segments(tmp_path):
    fs = FaultyFileLayer()
    writer = open_writer(tmp_path, fs)
    writer.append(TransferKind.BOOT, b"boot")
    done = commit_all(writer)
    writer.start_new_segment()
    assert (writer.segment, writer.offset) == (2, 32)
    writer.append(TransferKind.OUTPUT, payload(500))
    done += commit_all(writer)
    writer.close()
    result = recover(str(tmp_path), fs, INC)
    assert summary(result.transfers) == summary(done)
    assert [(t.segment, t.offset) for t in done] == [(1, 32), (2, 32)]
    assert result.segment == 2 and result.next_seq == 3
    assert result.durable_bytes == sum(
        os.path.getsize(segment_path(tmp_path, n)) for n in (1, 2)
    ) == writer.durable_bytes
    writer = JournalWriter(str(tmp_path), fs, INC, result)
    writer.append(TransferKind.COMPLETION, b"c")
    done += commit_all(writer)
    assert summary(recover(str(tmp_path), fs, INC).transfers) == summary(done)


def test_a_new_segment_waits_for_a_partly_written_transfer(tmp_path):
    writer = open_writer(tmp_path, FaultyFileLayer())
    writer.append(TransferKind.OUTPUT, payload(20 * MAX_DATA))
    writer.commit_tick()
    with pytest.raises(JournalError):
        writer.start_new_segment()
    writer.commit_tick()
    writer.start_new_segment()
    assert writer.segment == 2


def test_two_ticks_in_flight_finish_in_order_with_the_records_of_one_tick_each(tmp_path):
    """The device hands a second tick to its I/O thread behind the running one: begin_tick takes
    the records after those in flight, finish_tick publishes the oldest first, and what is saved
    and recovered is exactly what one tick at a time would give."""
    fs = OsFileLayer()
    writer = open_writer(tmp_path, fs)
    payloads = [payload(200, i) for i in range(12)]  # 2 records each: 8 transfers fill a tick
    for data in payloads:
        writer.append(TransferKind.ADMISSION, data)
    first = writer.begin_tick()
    second = writer.begin_tick()
    assert (first.records, second.records) == (16, 8) and writer.untaken_records == 0
    writer.append(TransferKind.ADMISSION, payload(200, 99))
    with pytest.raises(JournalError, match="2 ticks are already in flight"):
        writer.begin_tick()
    with pytest.raises(JournalError, match="oldest"):
        writer.finish_tick(second)
    first.run()
    second.run()
    done = writer.finish_tick(first)
    third = writer.begin_tick()  # room again: the transfer queued meanwhile, and nothing twice
    assert third.records == 2 and writer.untaken_records == 0
    third.run()
    done += writer.finish_tick(second) + writer.finish_tick(third)
    assert [t.payload for t in done] == payloads + [payload(200, 99)] and writer.durable_seq == 13
    assert summary(recover(str(tmp_path), fs, INC).transfers) == summary(done)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_a_failed_tick_ends_the_one_in_flight_behind_it(tmp_path, err):
    """Nothing queued behind a failed tick counts (its fdatasync could vouch for the failed
    write): the writer cuts back to the durable end and both ticks' records stay queued."""
    fs = FaultyFileLayer()
    writer = open_writer(tmp_path, fs)
    writer.append(TransferKind.BOOT, b"saved")
    writer.commit_tick()
    payloads = [payload(200, i) for i in range(12)]
    for data in payloads:
        writer.append(TransferKind.ADMISSION, data)
    first = writer.begin_tick()
    assert writer.begin_tick().records == 8  # the second, behind it
    first.write()
    first.error = OSError(err, os.strerror(err))  # as the I/O thread reports it; second never runs
    with pytest.raises(JournalIOError) as failure:
        writer.finish_tick(first)
    assert failure.value.ended_ticks == 1  # the second, never run
    assert writer.ticks_in_flight == 0 and writer.durable_seq == 1
    assert os.path.getsize(segment_path(tmp_path)) == SEGMENT_HEADER_SIZE + 32 + 5  # the cut
    if err == errno.EIO:
        with pytest.raises(JournalIOError):
            writer.begin_tick()
        return
    assert writer.untaken_records == 24  # ENOSPC: the queue is intact, from its first record
    done = commit_all(writer)
    assert [t.payload for t in done] == payloads
    assert [t.payload for t in recover(str(tmp_path), fs, INC).transfers] == [b"saved"] + payloads


def test_no_new_segment_starts_while_a_tick_is_in_flight(tmp_path):
    """The device's tick I/O thread writes the current segment's descriptor until finish_tick:
    closing that file under it would lose the tick (or write into a reused descriptor)."""
    writer = open_writer(tmp_path, OsFileLayer())
    writer.append(TransferKind.OUTPUT, b"x")
    tick = writer.begin_tick()
    with pytest.raises(JournalError, match="in flight"):
        writer.start_new_segment()
    tick.run()
    assert [t.payload for t in writer.finish_tick(tick)] == [b"x"]
    writer.start_new_segment()
    assert writer.segment == 2


@pytest.mark.parametrize("leftover", [b"", b"AOTXJ", bytes(32), bytes(100)])
def test_a_torn_new_segment_at_the_end_is_rewritten(tmp_path, leftover):
    fs = FaultyFileLayer()
    writer = open_writer(tmp_path, fs)
    writer.append(TransferKind.BOOT, b"boot")
    done = commit_all(writer)
    writer.close()
    write_raw(tmp_path, leftover, number=2)  # a crash while segment 2 was being created
    result = recover(str(tmp_path), fs, INC)
    assert summary(result.transfers) == summary(done)
    assert (result.segment, result.end_offset) == (2, 0)
    writer = JournalWriter(str(tmp_path), fs, INC, result)
    writer.append(TransferKind.OUTPUT, b"next")
    done += commit_all(writer)
    assert done[-1].segment == 2
    assert summary(recover(str(tmp_path), fs, INC).transfers) == summary(done)


def test_after_seq_skips_checkpointed_transfers_and_chains_from_the_start_digest(tmp_path):
    fs = FaultyFileLayer()
    writer = open_writer(tmp_path, fs)
    for i in range(5):
        writer.append(TransferKind.OUTPUT, payload(100 * i))
    done = commit_all(writer)
    start = hashlib.sha256(b"checkpoint").digest()
    result = recover(str(tmp_path), fs, INC, start_digest=start, after_seq=3)
    assert [t.seq for t in result.transfers] == [4, 5]
    digest = start
    for t in result.transfers:
        digest = hashlib.sha256(digest + struct.pack("<HQ", t.kind, t.seq) + t.payload).digest()
        assert t.digest == digest
    assert result.next_seq == 6 and result.last_digest == digest
    everything = recover(str(tmp_path), fs, INC, start_digest=start, after_seq=5)
    assert everything.transfers == [] and everything.last_digest == start
    assert everything.next_seq == 6 and done


def test_a_journal_that_ends_before_the_checkpoint_is_corruption(tmp_path):
    fs = FaultyFileLayer()
    writer = open_writer(tmp_path, fs)
    writer.append(TransferKind.OUTPUT, b"x")
    commit_all(writer)
    with pytest.raises(JournalCorrupt) as info:
        recover(str(tmp_path), fs, INC, after_seq=2)
    assert "before checkpoint seq 2" in info.value.reason


def test_a_journal_may_start_after_checkpointed_seqs(tmp_path):
    write_segment(tmp_path, 4, encode_transfer(2, 8, b"eight")[0])
    result = recover(str(tmp_path), FaultyFileLayer(), INC, after_seq=7)
    assert [(t.seq, t.segment) for t in result.transfers] == [(8, 4)]
    assert recover(str(tmp_path), FaultyFileLayer(), INC, after_seq=8).next_seq == 9
    with pytest.raises(JournalCorrupt):
        recover(str(tmp_path), FaultyFileLayer(), INC, after_seq=6)  # seq 7 is nowhere


def test_an_empty_or_missing_journal_starts_at_segment_1(tmp_path):
    fs = FaultyFileLayer()
    result = recover(str(tmp_path / "none"), fs, INC, after_seq=4)
    assert (result.segment, result.end_offset, result.next_seq, result.transfers) == (0, 0, 5, [])
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "lock").write_bytes(b"123\n")  # other files in the directory are ignored
    writer = open_writer(tmp_path / "j", fs)
    assert (writer.segment, writer.offset, writer.next_seq) == (1, 32, 1)
    writer.close()
    fs.lose_unsynced()  # the new segment survives a power cut: header synced, directory synced
    assert open(segment_path(tmp_path / "j"), "rb").read() == encode_segment_header(1, INC)


# --- faults --------------------------------------------------------------------------------------


def test_enospc_mid_write_cuts_back_and_keeps_the_transfer_queued(tmp_path):
    fs = FaultyFileLayer()
    writer = open_writer(tmp_path, fs)
    writer.append(TransferKind.ADMISSION, b"saved")
    done = commit_all(writer)
    durable = writer.offset
    fs.space = 100
    seq = writer.append(TransferKind.OUTPUT, payload(500))
    with pytest.raises(JournalIOError) as info:
        writer.commit_tick()
    assert info.value.errno == errno.ENOSPC
    assert os.path.getsize(segment_path(tmp_path)) == durable == writer.offset
    assert writer.queued_records == 4 and writer.last_digest == done[-1].digest
    assert summary(recover(str(tmp_path), FaultyFileLayer(), INC).transfers) == summary(done)
    with pytest.raises(JournalIOError):  # still full: the same answer, nothing written
        writer.commit_tick()
    assert os.path.getsize(segment_path(tmp_path)) == durable
    fs.space = None
    later = writer.commit_tick()
    assert [(t.seq, t.payload) for t in later] == [(seq, payload(500))]
    assert summary(recover(str(tmp_path), fs, INC).transfers) == summary(done + later)


def test_enospc_on_fdatasync_is_also_held_not_fatal(tmp_path):
    fs = FaultyFileLayer()
    writer = open_writer(tmp_path, fs)
    writer.append(TransferKind.ADMISSION, b"a")
    fs.fail_fdatasync(errno.ENOSPC)
    with pytest.raises(JournalIOError) as info:
        writer.commit_tick()
    assert info.value.errno == errno.ENOSPC and os.path.getsize(segment_path(tmp_path)) == 32
    assert [t.seq for t in writer.commit_tick()] == [1]


@pytest.mark.parametrize("where", ["fdatasync", "write"])
def test_eio_fails_the_writer_for_good(tmp_path, where):
    fs = FaultyFileLayer()
    writer = open_writer(tmp_path, fs)
    writer.append(TransferKind.ADMISSION, b"saved")
    done = commit_all(writer)
    writer.append(TransferKind.OUTPUT, b"lost")
    if where == "fdatasync":
        fs.fail_fdatasync(errno.EIO)
    else:
        fs.fail_write(errno.EIO)
    syncs = fs.fdatasync_calls
    with pytest.raises(JournalIOError) as info:
        writer.commit_tick()
    assert info.value.errno == errno.EIO
    assert fs.fdatasync_calls == syncs  # never retried
    assert os.path.getsize(segment_path(tmp_path)) == writer.offset
    for call in (writer.commit_tick, lambda: writer.append(1, b""), writer.start_new_segment):
        with pytest.raises(JournalIOError) as info:
            call()
        assert info.value.errno == errno.EIO
    writer.close()
    assert summary(recover(str(tmp_path), fs, INC).transfers) == summary(done)


def test_enospc_while_starting_a_segment_stays_on_the_old_one(tmp_path):
    fs = FaultyFileLayer()
    writer = open_writer(tmp_path, fs)
    fs.space = 10
    with pytest.raises(JournalIOError) as info:
        writer.start_new_segment()
    assert info.value.errno == errno.ENOSPC and writer.segment == 1
    assert not os.path.exists(segment_path(tmp_path, 2))
    fs.space = None
    writer.append(TransferKind.BOOT, b"b")
    done = commit_all(writer)
    assert summary(recover(str(tmp_path), fs, INC).transfers) == summary(done)


class Crash(BaseException):
    """The process dies: nothing after this point runs, no cleanup."""


def crash_at_next_fdatasync(monkeypatch, after=0):
    calls = {"n": 0}
    real = FaultyAppendFile.fdatasync

    def fdatasync(self):
        calls["n"] += 1
        if calls["n"] > after:
            raise Crash
        real(self)

    monkeypatch.setattr(FaultyAppendFile, "fdatasync", fdatasync)


@pytest.mark.parametrize("mode", FaultyFileLayer.LOSS_MODES)
def test_power_loss_keeps_every_transfer_commit_tick_returned(tmp_path, monkeypatch, mode):
    fs = FaultyFileLayer(seed=11)
    writer = open_writer(tmp_path, fs)
    appended = {}
    for i in range(30):
        data = payload(37 * i, 9)
        appended[writer.append(TransferKind.OUTPUT, data)] = data
    done = [t for _ in range(3) for t in writer.commit_tick()]
    assert done
    crash_at_next_fdatasync(monkeypatch)
    with pytest.raises(Crash):
        writer.commit_tick()  # written, never synced
    monkeypatch.undo()
    fs.lose_unsynced(mode)
    result = recover(str(tmp_path), fs, INC)
    assert summary(result.transfers[:len(done)]) == summary(done)
    for t in result.transfers[len(done):]:  # synced by luck: complete and in order, never acked
        assert t.payload == appended[t.seq]
    if mode != "prefix":
        assert summary(result.transfers) == summary(done)
    writer = JournalWriter(str(tmp_path), fs, INC, result)
    writer.append(TransferKind.BOOT, b"rebooted")
    more = commit_all(writer)
    assert summary(recover(str(tmp_path), fs, INC).transfers) == summary(result.transfers + more)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 2000), min_size=1, max_size=25), st.integers(0, 10),
       st.sampled_from(FaultyFileLayer.LOSS_MODES), st.integers(0, 2**32))
def test_any_crash_point_keeps_every_acknowledged_transfer(sizes, crash_after, mode, seed):
    with tempfile.TemporaryDirectory() as d:
        fs = FaultyFileLayer(seed=seed)
        writer = open_writer(d, fs)
        acked = []
        real = FaultyAppendFile.fdatasync
        syncs = {"n": 0}

        def fdatasync(self):
            syncs["n"] += 1
            if syncs["n"] > crash_after:
                raise Crash
            real(self)

        FaultyAppendFile.fdatasync = fdatasync
        try:
            for n in sizes:
                writer.append(TransferKind.OUTPUT, payload(n, seed))
            while writer.queued_records:
                acked += writer.commit_tick()
        except Crash:
            pass
        finally:
            FaultyAppendFile.fdatasync = real
        fs.lose_unsynced(mode)
        result = recover(d, fs, INC)
        assert summary(result.transfers[:len(acked)]) == summary(acked)
        JournalWriter(d, fs, INC, result).close()
        assert summary(recover(d, fs, INC).transfers) == summary(result.transfers)


def test_a_closed_writer_refuses_work(tmp_path):
    writer = open_writer(tmp_path, FaultyFileLayer())
    writer.close()
    with pytest.raises(JournalError):
        writer.append(TransferKind.BOOT, b"")


# --- lock ----------------------------------------------------------------------------------------


def test_a_second_lock_in_the_same_process_is_refused(tmp_path):
    lock = JournalLock(str(tmp_path))
    with pytest.raises(JournalLocked) as info:
        JournalLock(str(tmp_path))
    assert str(info.value) == f"journal {tmp_path} is locked by another device (pid {os.getpid()})"
    lock.release()
    with JournalLock(str(tmp_path)):
        pass


def test_a_lock_held_by_another_process_is_refused_until_it_exits(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from gpu_worker.storage.journal_lock import JournalLock\n"
         f"lock = JournalLock({str(tmp_path)!r}); print('locked', flush=True); sys.stdin.read()"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(JournalLocked) as info:
            JournalLock(str(tmp_path))
        assert f"(pid {holder.pid})" in str(info.value)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    JournalLock(str(tmp_path)).release()


def test_a_lock_held_here_is_refused_to_another_process(tmp_path):
    with JournalLock(str(tmp_path)):
        child = subprocess.run(
            [sys.executable, "-c",
             "from gpu_worker.storage.journal_lock import JournalLock, JournalLocked\n"
             f"try:\n    JournalLock({str(tmp_path)!r})\nexcept JournalLocked as e:\n"
             "    print(e)\n    raise SystemExit(3)"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )
    assert child.returncode == 3
    assert f"locked by another device (pid {os.getpid()})" in child.stdout


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 700), min_size=1, max_size=30), roll=st.sets(st.integers(1, 29)),
       cuts=st.lists(st.integers(0, 4000), max_size=12), seed=st.integers(0, 1000))
def test_a_tail_reads_a_growing_copy_exactly_as_recovery_reads_the_whole(tmp_path_factory, sizes, roll, cuts, seed):
    """A hot standby's device reads its copy of the journal as bytes arrive in any pieces (a piece
    may end inside a record, inside a transfer, inside a segment header): the transfers it gets,
    with their digests and positions, are recovery's, and each only once."""
    source, copy = tmp_path_factory.mktemp("primary"), tmp_path_factory.mktemp("standby")
    fs = OsFileLayer()
    writer = open_writer(source, fs)
    for i, n in enumerate(sizes):
        if i in roll:
            writer.start_new_segment()
        writer.append(TransferKind.ADMISSION, payload(n, seed + i))
        commit_all(writer)
    writer.close()
    whole = recover(str(source), fs, INC).transfers
    files = [(number, open(segment_path(source, number), "rb").read())
             for number in range(1, writer.segment + 1)]
    stream = [(number, offset) for number, data in files for offset in range(len(data) + 1)
              if offset or number == 1]  # every position a copy can be durable at, in order
    tail = Tail(str(copy), INC, recover(str(copy), fs, INC))
    got = []
    for at in sorted({min(c, len(stream) - 1) for c in cuts}) + [len(stream) - 1]:
        number, offset = stream[at]
        for n, data in files:  # the copy holds every byte before (number, offset)
            if n <= number:
                with open(segment_path(copy, n), "wb") as f:
                    f.write(data if n < number else data[:offset])
        got += tail.read((number, offset))
    assert summary(got) == summary(whole)
    assert tail.position == (writer.segment, writer.offset)
    assert tail.next_seq == len(sizes) + 1 and tail.last_digest == whole[-1].digest


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 500), min_size=1, max_size=12), roll=st.sets(st.integers(1, 11)),
       damage=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=3),
       cut=st.integers(0, 1 << 16), after=st.integers(0, 6), seed=st.integers(0, 1000))
def test_the_native_reader_reads_exactly_what_the_python_reader_does(tmp_path_factory, monkeypatch, sizes, roll,
                                                                     damage, cut, after, seed):
    """Recovery reads whole, intact transfers natively and hands anything else to the Python
    reader (storage/journal_reader.py `_whole_transfers`): on any journal — damaged bytes, a cut end,
    transfers a checkpoint holds — what is read, or the corruption named, is the same without it,
    and the same read ahead on a thread in pieces (ReadAhead: the native reader stops after each
    piece's transfers and goes on from there)."""
    from gpu_worker.storage import journal_reader
    directory = tmp_path_factory.mktemp("j")
    fs = OsFileLayer()
    writer = open_writer(directory, fs)
    for i, n in enumerate(sizes):
        if i in roll:
            writer.start_new_segment()
        writer.append(TransferKind.ADMISSION if i % 3 else TransferKind.OUTPUT, payload(n, seed + i))
        commit_all(writer)
    writer.close()
    whole = recover(str(directory), fs, INC).transfers  # (as a checkpoint at `after` would have it)
    assert all(type(transfer) is Transfer for transfer in whole)  # (made natively: jcodec.make)
    after = min(after, len(whole))
    start = whole[after - 1].digest if after else bytes(32)
    last = segment_path(directory, writer.segment)
    data = bytearray(open(last, "rb").read())
    for at, value in damage:
        data[at % len(data)] = value
    with open(last, "wb") as f:
        f.write(bytes(data[:cut % (len(data) + 1)] if cut % 3 == 0 else data))

    def outcome():
        try:
            found = recover(str(directory), fs, INC, start_digest=start, after_seq=after)
        except JournalCorrupt as exc:
            return str(exc)
        return summary(found.transfers), found.next_seq, found.last_digest, found.segment, found.end_offset, \
            found.dropped, found.durable_bytes

    def read_ahead():  # on the reader's thread, handed over two transfers at a time
        reading = ReadAhead(str(directory), fs, INC, start_digest=start, after_seq=after)
        got = [transfer for piece in reading for transfer in piece]
        try:
            found = reading.result()
        except JournalCorrupt as exc:
            return str(exc)
        assert found.transfers == [] and found.handed_on == len(got)
        return summary(got), found.next_seq, found.last_digest, found.segment, found.end_offset, found.dropped, \
            found.durable_bytes

    native = outcome()
    monkeypatch.setattr(journal_reader, "READ_PIECE", 2)
    assert read_ahead() == native
    monkeypatch.setattr(journal_reader, "_check", lambda data, pos, lo, hi, kinds, max_data, digest, *_:
                        (b"", pos, 0, digest))
    assert outcome() == native
    assert read_ahead() == native


def test_the_native_reader_makes_transfers_only_of_what_it_found():
    """jcodec.make fills the Transfers it makes as tuples, from records `check` found in the same
    bytes: a type laid out otherwise, or found records that run past the bytes or do not match
    them, are refused before anything is made or read out of bounds."""
    from gpu_worker.storage import journal_reader
    payload_bytes = b"x" * 300
    data = b"".join(encode_transfer(TransferKind.OUTPUT, 1, payload_bytes))
    found, stop, last, digest = journal_reader._check(data, 0, 1, 1, journal_reader._KIND_MASK, MAX_DATA,
                                                      bytes(32), 0)
    assert (stop, last, len(found)) == (len(data), 1, journal_reader._jcodec.FOUND_SIZE)
    made = journal_reader.Unmade(data, found, 1, 0).make()
    assert made == [Transfer(TransferKind.OUTPUT, 1, payload_bytes, digest, 1, 0)] and type(made[0]) is Transfer

    class WithDict(tuple):  # (a __dict__ past the items)
        pass

    make = journal_reader._make
    for kind in (dict, WithDict):
        with pytest.raises(TypeError, match="tuple subclass"):
            make(data, found, journal_reader._KIND_OBJECTS, kind, 1, 0)
    with pytest.raises(ValueError, match="runs past the data"):
        make(data[:len(data) // 2], found, journal_reader._KIND_OBJECTS, Transfer, 1, 0)
    with pytest.raises(ValueError, match="not what check returned"):
        make(data, found[:-1], journal_reader._KIND_OBJECTS, Transfer, 1, 0)
