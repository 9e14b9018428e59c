// Journal records of one transfer (docs/journal.md, "Records"), encoded natively: the busiest
// device encodes one transfer per admission, and in Python the header packing, slicing and two
// checksums per record were a measurable part of each admission (docs/performance.md).
//
//   records(kind, transfer_seq, payload, max_data) -> [bytes]
//   check(data, pos, first_seq_lo, first_seq_hi, kinds, max_data, digest, after_seq[, limit])
//       -> (found, stop, last_seq, digest)
//   make(data, found, kind_objects, transfer_type, segment, base) -> [transfer_type(...)]
//   scatter(table, cols, rows, lengths, blob) -> bytes used (a checkpoint's row bytes, below)
//   space_creates(payloads, version, kind) -> the columns of a run of spaces.create admissions (below)
//   conversation_creates, member_sets: the same for runs of conversations.create and members.set
//   replay_stretch(...) -> applied: a replay's stretch of those three kinds, applied to the tables (below)
//
// Each record: a 32-byte part header (type 37, class 0x41, kind, part index, part count, data
// length, reserved 0, payload length, transfer seq, CRC-32, reserved 0; little endian) and at
// most max_data bytes of the payload. The CRC-32 (zlib's) covers the header with its checksum
// field zero, then the data. An empty payload is one record with no data. gpu_worker/storage/journal.py
// checks the kind and wraps this as encode_transfer.
//
// `check` and `make` are recovery's fast path. `check` finds the whole, intact transfers of a
// segment's bytes from `pos` (a transfer boundary) on, each one's seq following the last (the
// first's within [lo, hi]), kinds among the bits of `kinds`. It stops at the first transfer that is
// not whole or not exactly as the writer makes it (cut short, a checksum, a field) and returns where
// that transfer starts: the Python reader goes on from there with every rule and message of
// docs/journal.md (a torn tail, or the corruption it names), so the fast path changes what is read
// in no case. It chains the commit digests of those past `after_seq` from `digest` (journal.py
// chain_digest: SHA-256 of the previous digest, kind u16 LE, seq u64 LE, payload; OpenSSL's,
// through one reused context: its one-shot SHA256() looks the algorithm up at each call) and
// returns them as `found` (bytes: where each lies and its digest), with the last digest; those at or
// below are read and checked only. last_seq is the seq of the last whole transfer read (0: none);
// `limit` (> 0) stops after that many whole transfers (a reader handing them on in pieces). It runs
// entirely without the GIL, and makes no Python object per transfer. `make` makes the Transfers of
// `found`, with the GIL, on whichever thread takes them: a boot's reading thread checks while the
// main thread imports torch and replays, and the replaying thread makes each piece as it takes it
// (storage/journal_reader.py `Unmade`): made on the reading thread, the objects held the GIL as
// long as a second of a 1M-transfer boot, and slowed the import and the replay beside them.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/evp.h>

#include "fixedmap.h"
#include <zlib.h>

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

namespace {

constexpr unsigned char TYPE_SHARED = 37;
constexpr unsigned char CLASS_A = 0x41;
constexpr size_t HEADER = 32;
constexpr size_t CHECKSUM_AT = 24;
constexpr uint64_t MAX_PARTS = 0xFFFF;
constexpr Py_ssize_t DIGEST = 32;  // a transfer's commit digest (SHA-256)

inline void le16(unsigned char* p, uint16_t v) {
  p[0] = uint8_t(v);
  p[1] = uint8_t(v >> 8);
}
inline void le32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
inline void le64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}

PyObject* records(PyObject*, PyObject* args) {
  int kind;
  unsigned long long seq;
  Py_buffer payload;
  Py_ssize_t max_data;
  if (!PyArg_ParseTuple(args, "iKy*n", &kind, &seq, &payload, &max_data)) return nullptr;
  const size_t length = size_t(payload.len);
  PyObject* list = nullptr;
  if (kind < 0 || kind > 0xFFFF || max_data <= 0 || max_data > 0xFFFF) {
    PyErr_SetString(PyExc_ValueError, "kind must be 0..65535 and max_data 1..65535");
  } else if (length > MAX_PARTS * uint64_t(max_data)) {
    PyErr_Format(PyExc_ValueError, "transfer of %zu bytes exceeds %llu", length,
                 (unsigned long long)(MAX_PARTS * uint64_t(max_data)));
  } else if (seq < 1) {
    PyErr_Format(PyExc_ValueError, "transfer_seq %llu out of range", seq);
  } else {
    const size_t per = size_t(max_data);
    const size_t count = length ? (length + per - 1) / per : 1;
    const unsigned char* data = static_cast<const unsigned char*>(payload.buf);
    list = PyList_New(Py_ssize_t(count));
    for (size_t i = 0; list && i < count; ++i) {
      const size_t n = i * per + per <= length ? per : length - i * per;
      PyObject* record = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(HEADER + n));
      if (!record) {
        Py_CLEAR(list);
        break;
      }
      unsigned char* r = reinterpret_cast<unsigned char*>(PyBytes_AS_STRING(record));
      memset(r, 0, HEADER);
      r[0] = TYPE_SHARED;
      r[1] = CLASS_A;
      le16(r + 2, uint16_t(kind));
      le16(r + 4, uint16_t(i));
      le16(r + 6, uint16_t(count));
      le16(r + 8, uint16_t(n));
      le32(r + 12, uint32_t(length));
      le64(r + 16, seq);
      memcpy(r + HEADER, data + i * per, n);
      uLong crc = crc32(crc32(0L, Z_NULL, 0), r, HEADER);  // checksum field still zero
      le32(r + CHECKSUM_AT, uint32_t(crc32(crc, r + HEADER, uInt(n))));
      PyList_SET_ITEM(list, Py_ssize_t(i), record);
    }
  }
  PyBuffer_Release(&payload);
  return list;
}

inline uint16_t rd16(const unsigned char* p) { return uint16_t(p[0] | (p[1] << 8)); }
inline uint32_t rd32(const unsigned char* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}
inline uint64_t rd64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// One record at d[at..n): its fields when it is intact and as the writer makes it for part
// `index` of a transfer of `length` bytes and `kind`, `seq`; false otherwise.
struct Part {
  uint16_t kind, index, count, size;
  uint32_t length;
  uint64_t seq;
};

bool read_part(const unsigned char* d, size_t n, size_t at, size_t max_data, Part& part) {
  if (n - at < HEADER) return false;
  const unsigned char* h = d + at;
  if (h[0] != TYPE_SHARED || h[1] != CLASS_A) return false;
  part.kind = rd16(h + 2);
  part.index = rd16(h + 4);
  part.count = rd16(h + 6);
  part.size = rd16(h + 8);
  part.length = rd32(h + 12);
  part.seq = rd64(h + 16);
  if (rd16(h + 10) != 0 || rd32(h + 28) != 0 || part.size > max_data) return false;
  if (n - at - HEADER < part.size) return false;
  const uint64_t count = part.length ? (uint64_t(part.length) + max_data - 1) / max_data : 1;
  if (part.count != count || part.index >= count) return false;
  const uint64_t size = std::min<uint64_t>(max_data, uint64_t(part.length) - uint64_t(part.index) * max_data);
  if (part.length && part.size != size) return false;
  if (!part.length && part.size != 0) return false;
  static const unsigned char zero[4] = {0, 0, 0, 0};
  uLong crc = crc32(crc32(0L, Z_NULL, 0), h, CHECKSUM_AT);
  crc = crc32(crc, zero, 4);
  crc = crc32(crc, h + CHECKSUM_AT + 4, uInt(HEADER - CHECKSUM_AT - 4 + part.size));
  return uint32_t(crc) == rd32(h + CHECKSUM_AT);
}

// A whole transfer found by `transfers`' first pass: where its records lie and its chained digest.
struct Found {
  uint16_t kind, count;
  uint32_t length;
  uint64_t seq;
  size_t start;
  unsigned char digest[DIGEST];
};

// The payload of a transfer `check` found in `d` (n bytes): its records' data, in order, into
// `into` (found.length bytes). False where the records at found.start do not hold exactly that (a
// `found` that is not this data's): nothing is read past the data nor written past the payload.
bool gather(const unsigned char* d, size_t n, const Found& found, unsigned char* into) {
  size_t at = found.start, filled = 0;
  for (uint16_t i = 0; i < found.count; ++i) {
    if (at > n || n - at < HEADER) return false;
    const size_t size = rd16(d + at + 8);
    if (n - at - HEADER < size || found.length - filled < size) return false;
    memcpy(into + filled, d + at + HEADER, size);
    filled += size;
    at += HEADER + size;
  }
  return filled == found.length;
}

PyObject* check(PyObject*, PyObject* args) {
  Py_buffer data;
  Py_ssize_t pos;
  unsigned long long lo, hi, kinds;
  Py_ssize_t max_data;
  Py_buffer previous;
  unsigned long long after;
  Py_ssize_t limit = 0;
  if (!PyArg_ParseTuple(args, "y*nKKKny*K|n", &data, &pos, &lo, &hi, &kinds, &max_data, &previous, &after, &limit))
    return nullptr;
  unsigned char digest[DIGEST];
  const bool sized = previous.len == DIGEST;
  if (sized) memcpy(digest, previous.buf, DIGEST);
  PyBuffer_Release(&previous);
  if (!sized) {
    PyBuffer_Release(&data);
    PyErr_SetString(PyExc_ValueError, "the previous digest is not 32 bytes");
    return nullptr;
  }
  static EVP_MD* sha256 = EVP_MD_fetch(nullptr, "SHA256", nullptr);  // once per process
  EVP_MD_CTX* hashing = sha256 ? EVP_MD_CTX_new() : nullptr;
  if (!hashing) {
    PyBuffer_Release(&data);
    PyErr_SetString(PyExc_RuntimeError, "OpenSSL has no SHA-256 for the journal's digests");
    return nullptr;
  }
  const unsigned char* d = static_cast<const unsigned char*>(data.buf);
  const size_t n = size_t(data.len);
  size_t at = pos < 0 ? n : std::min(size_t(pos), n);
  unsigned long long last = 0;  // the seq of the last whole transfer read
  bool hash_failed = false;
  std::vector<Found> found;
  // All of it without the GIL (the bytes object is held by `data`): check the records, chain the
  // digests. A thread reading the journal ahead of the one replaying it (recovery/reading.py,
  // Replay._load_state (recovery/replay.py)) runs this beside it.
  Py_BEGIN_ALLOW_THREADS
  size_t whole = 0;
  while (max_data > 0 && (limit <= 0 || whole < size_t(limit))) {
    const size_t start = at;
    Part first;
    if (!read_part(d, n, at, size_t(max_data), first) || first.index != 0 || first.seq < lo || first.seq > hi ||
        first.kind >= 64 || !((kinds >> first.kind) & 1))
      break;
    const bool kept = first.seq > after;  // (one a checkpoint holds is read and checked, not returned nor chained)
    if (kept && !(EVP_DigestInit_ex(hashing, sha256, nullptr) && EVP_DigestUpdate(hashing, digest, DIGEST))) {
      hash_failed = true;
      break;
    }
    if (kept) {
      unsigned char head[10];  // kind u16 LE, seq u64 LE
      for (int b = 0; b < 2; ++b) head[b] = (unsigned char)(first.kind >> (8 * b));
      for (int b = 0; b < 8; ++b) head[2 + b] = (unsigned char)(first.seq >> (8 * b));
      hash_failed = !EVP_DigestUpdate(hashing, head, sizeof head);
    }
    size_t filled = 0;
    bool ok = !hash_failed;
    for (uint16_t i = 0; ok && i < first.count; ++i) {
      Part part;
      if (i && (!read_part(d, n, at, size_t(max_data), part) || part.index != i || part.kind != first.kind ||
                part.count != first.count || part.length != first.length || part.seq != first.seq)) {
        ok = false;
        break;
      }
      const size_t size = i ? part.size : first.size;
      if (kept && !EVP_DigestUpdate(hashing, d + at + HEADER, size)) {
        hash_failed = true;
        ok = false;
        break;
      }
      filled += size;
      at += HEADER + size;
    }
    if (hash_failed) break;
    if (!ok || filled != first.length) {  // (read_part checks each size against the length)
      at = start;
      break;
    }
    last = first.seq;
    lo = hi = first.seq + 1;
    ++whole;
    if (!kept) continue;
    if (!EVP_DigestFinal_ex(hashing, digest, nullptr)) {
      hash_failed = true;
      at = start;
      break;
    }
    Found f;
    f.kind = first.kind;
    f.count = first.count;
    f.length = first.length;
    f.seq = first.seq;
    f.start = start;
    memcpy(f.digest, digest, DIGEST);
    found.push_back(f);
  }
  Py_END_ALLOW_THREADS
  EVP_MD_CTX_free(hashing);
  PyBuffer_Release(&data);
  if (hash_failed) {
    PyErr_SetString(PyExc_RuntimeError, "OpenSSL's SHA-256 failed on a journal transfer");
    return nullptr;
  }
  return Py_BuildValue("(y#nKy#)", reinterpret_cast<const char*>(found.data()), Py_ssize_t(found.size() * sizeof(Found)),
                       Py_ssize_t(at), last, reinterpret_cast<const char*>(digest), Py_ssize_t(DIGEST));
}

// make(data, found, kind_objects, transfer_type, segment, base) -> [Transfer]: the transfers `check`
// found in the same `data` (its `found`), each made a transfer_type of (kind_objects[kind], seq,
// payload, commit digest, segment, base + start). `transfer_type` is a tuple subclass with no
// fields of its own (journal.py's Transfer NamedTuple): made here, not as a tuple copied into one
// in Python (that copy held the GIL for 1.5 s of reading 1M transfers).
PyObject* make(PyObject*, PyObject* args) {
  Py_buffer data, packed;
  PyObject* kind_objects;
  PyTypeObject* transfer_type;
  PyObject* segment;
  Py_ssize_t base;
  if (!PyArg_ParseTuple(args, "y*y*O!O!On", &data, &packed, &PyTuple_Type, &kind_objects, &PyType_Type,
                        &transfer_type, &segment, &base))
    return nullptr;
  PyObject* list = nullptr;
  // (a tuple subclass laid out as a tuple: no __dict__, no slots of its own)
  if (!PyType_IsSubtype(transfer_type, &PyTuple_Type) || transfer_type->tp_basicsize != PyTuple_Type.tp_basicsize ||
      transfer_type->tp_itemsize != PyTuple_Type.tp_itemsize || transfer_type->tp_dictoffset != 0)
    PyErr_SetString(PyExc_TypeError, "transfer_type must be a tuple subclass with no fields of its own");
  else if (size_t(packed.len) % sizeof(Found) || PyTuple_GET_SIZE(kind_objects) != 64)
    PyErr_SetString(PyExc_ValueError, "found is not what check returned, or the kinds are not 64");
  else
    list = PyList_New(Py_ssize_t(size_t(packed.len) / sizeof(Found)));
  const unsigned char* d = static_cast<const unsigned char*>(data.buf);
  for (Py_ssize_t i = 0; list && i < PyList_GET_SIZE(list); ++i) {
    Found f;
    memcpy(&f, static_cast<const char*>(packed.buf) + size_t(i) * sizeof(Found), sizeof(Found));
    PyObject* item = transfer_type->tp_alloc(transfer_type, 6);
    PyObject* payload = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(f.length));
    PyObject* seq = PyLong_FromUnsignedLongLong(f.seq);
    PyObject* hash = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(f.digest), DIGEST);
    PyObject* offset = PyLong_FromSsize_t(base + Py_ssize_t(f.start));
    bool ok = item && payload && seq && hash && offset;
    unsigned char* into = ok ? reinterpret_cast<unsigned char*>(PyBytes_AS_STRING(payload)) : nullptr;
    if (ok && (f.kind >= 64 || !gather(d, size_t(data.len), f, into))) {
      PyErr_SetString(PyExc_ValueError, "found runs past the data or does not match it");
      ok = false;
    }
    if (!ok) {
      Py_XDECREF(item);
      Py_XDECREF(payload);
      Py_XDECREF(seq);
      Py_XDECREF(hash);
      Py_XDECREF(offset);
      Py_CLEAR(list);
      break;
    }
    PyObject* kind = PyTuple_GET_ITEM(kind_objects, f.kind);
    Py_INCREF(kind);
    Py_INCREF(segment);
    PyTuple_SET_ITEM(item, 0, kind);
    PyTuple_SET_ITEM(item, 1, seq);
    PyTuple_SET_ITEM(item, 2, payload);
    PyTuple_SET_ITEM(item, 3, hash);
    PyTuple_SET_ITEM(item, 4, segment);
    PyTuple_SET_ITEM(item, 5, offset);
    PyList_SET_ITEM(list, i, item);
  }
  PyBuffer_Release(&packed);
  PyBuffer_Release(&data);
  return list;
}

// scatter(table, cols, rows, lengths, blob) -> bytes used: row rows[i] of `table` (writable, rows
// of `cols` bytes) gets the next lengths[i] bytes of `blob` at its start; rows and lengths are
// native int64 arrays. How a checkpoint's receipt bytes, kept one row after another, go back into
// their rows at boot (state/tables.py put_packed): a million rows in one call.
PyObject* scatter(PyObject*, PyObject* args) {
  Py_buffer table, rows, lengths, blob;
  Py_ssize_t cols;
  if (!PyArg_ParseTuple(args, "w*ny*y*y*", &table, &cols, &rows, &lengths, &blob)) return nullptr;
  const char* problem = nullptr;
  size_t at = 0;
  const size_t count = size_t(rows.len) / 8;
  if (cols <= 0 || rows.len % 8 || lengths.len != rows.len) problem = "rows and lengths must be int64 arrays of one length";
  const int64_t* row = static_cast<const int64_t*>(rows.buf);
  const int64_t* length = static_cast<const int64_t*>(lengths.buf);
  unsigned char* out = static_cast<unsigned char*>(table.buf);
  const unsigned char* in = static_cast<const unsigned char*>(blob.buf);
  Py_BEGIN_ALLOW_THREADS  // (buffers only: a boot's journal reading runs beside it)
  for (size_t i = 0; !problem && i < count; ++i) {
    const int64_t r = row[i], n = length[i];
    if (r < 0 || (r + 1) * int64_t(cols) > int64_t(table.len)) problem = "a row is outside the table";
    else if (n < 0 || n > cols) problem = "a length does not fit a row";
    else if (at + size_t(n) > size_t(blob.len)) problem = "the blob is shorter than the lengths";
    else {
      memcpy(out + r * cols, in + at, size_t(n));
      at += size_t(n);
    }
  }
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&table);
  PyBuffer_Release(&rows);
  PyBuffer_Release(&lengths);
  PyBuffer_Release(&blob);
  if (problem) {
    PyErr_SetString(PyExc_ValueError, problem);
    return nullptr;
  }
  return PyLong_FromSize_t(at);
}

// gather(table, width, rows) -> bytearray: each of `rows`' `width` bytes of `table`, back to back.
// Rows are prefetched AHEAD_ROWS ahead of the one copied: a replay's retirement reads dozens of old
// receipt rows at once, each a cache and TLB miss that numpy's fancy indexing took one after
// another (docs/performance.md, "Replay").
constexpr size_t AHEAD_ROWS = 8;

PyObject* gather(PyObject*, PyObject* args) {
  Py_buffer table, rows;
  Py_ssize_t width;
  if (!PyArg_ParseTuple(args, "y*ny*", &table, &width, &rows)) return nullptr;
  const size_t count = size_t(rows.len) / 8;
  const int64_t* row = static_cast<const int64_t*>(rows.buf);
  const char* problem = width <= 0 || rows.len % 8 ? "rows must be an int64 array and width above 0" : nullptr;
  for (size_t i = 0; !problem && i < count; ++i)
    if (row[i] < 0 || (row[i] + 1) * int64_t(width) > int64_t(table.len)) problem = "a row is outside the table";
  PyObject* out = problem ? nullptr : PyByteArray_FromStringAndSize(nullptr, Py_ssize_t(count) * width);
  if (out != nullptr) {
    const unsigned char* in = static_cast<const unsigned char*>(table.buf);
    unsigned char* to = reinterpret_cast<unsigned char*>(PyByteArray_AS_STRING(out));
    const size_t w = size_t(width);
    auto fetch = [&](size_t i) {
      for (size_t b = 0; b < w; b += 64) __builtin_prefetch(in + size_t(row[i]) * w + b);
    };
    for (size_t i = 0; i < AHEAD_ROWS && i < count; ++i) fetch(i);
    for (size_t i = 0; i < count; ++i) {
      if (i + AHEAD_ROWS < count) fetch(i + AHEAD_ROWS);
      memcpy(to + i * w, in + size_t(row[i]) * w, w);
    }
  }
  PyBuffer_Release(&table);
  PyBuffer_Release(&rows);
  if (problem) PyErr_SetString(PyExc_ValueError, problem);
  return out;
}

// A reader of one msgpack value at a time from an admission payload (the layout Admission.encode
// makes with msgpack-python); every read checks the bounds and the type byte, and false ends the
// payload's fast path (the Python decoder then reads it, with its own errors).
struct Reader {
  const unsigned char* p;
  const unsigned char* end;
  bool byte(unsigned char b) {
    if (p >= end || *p != b) return false;
    ++p;
    return true;
  }
  bool fixed(const char* bytes, size_t n) {  // exactly these bytes (a short str key, with its type byte)
    if (size_t(end - p) < n || memcmp(p, bytes, n) != 0) return false;
    p += n;
    return true;
  }
  bool big(size_t n, uint64_t* out) {  // an n-byte big-endian unsigned after the type byte
    if (size_t(end - p) < n) return false;
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v = v << 8 | p[i];
    p += n;
    *out = v;
    return true;
  }
  bool uint(int64_t* out) {  // a non-negative int as msgpack-python packs it (fixint, uint 8..64)
    if (p >= end) return false;
    const unsigned char t = *p++;
    uint64_t v = 0;
    if (t <= 0x7f) v = t;
    else if (t == 0xcc) { if (!big(1, &v)) return false; }
    else if (t == 0xcd) { if (!big(2, &v)) return false; }
    else if (t == 0xce) { if (!big(4, &v)) return false; }
    else if (t == 0xcf) { if (!big(8, &v) || v > uint64_t(INT64_MAX)) return false; }
    else return false;
    *out = int64_t(v);
    return true;
  }
  bool bin16(unsigned char* out) {  // a 16-byte bin (an identifier)
    if (size_t(end - p) < 18 || p[0] != 0xc4 || p[1] != 16) return false;
    memcpy(out, p + 2, 16);
    p += 18;
    return true;
  }
  bool bin(const unsigned char** data, size_t* n) {  // bin 8, 16 or 32
    if (p >= end) return false;
    const unsigned char t = *p++;
    uint64_t len = 0;
    if (!(t == 0xc4 ? big(1, &len) : t == 0xc5 ? big(2, &len) : t == 0xc6 ? big(4, &len) : false)) return false;
    if (uint64_t(end - p) < len) return false;
    *data = p;
    *n = size_t(len);
    p += len;
    return true;
  }
};

// The head of an admission payload as Admission.encode packs it, up to its extra map: a fixarray of
// 8, version, kind, the principal, the sequence, the operation key and ID and the canonical bytes.
struct Head {
  int64_t sequence = 0;
  unsigned char principal[16], key[16], op[16];
  const unsigned char* canonical = nullptr;
  size_t length = 0;
};

bool admission_head(Reader& r, long version, long kind, Head& h) {
  return r.byte(0x98) && r.byte(static_cast<unsigned char>(version)) && r.byte(static_cast<unsigned char>(kind))
         && r.bin16(h.principal) && r.uint(&h.sequence) && r.bin16(h.key) && r.bin16(h.op)
         && r.bin(&h.canonical, &h.length);
}

// The columns every run of admissions has (admission.replay_run): sequences and lengths as native
// int64, keys and ops 16 bytes each, the canonical bytes back to back.
struct Columns {
  std::vector<int64_t> sequences, lengths;
  std::vector<unsigned char> keys, ops, commands;
  void add(const Head& h) {
    sequences.push_back(h.sequence);
    lengths.push_back(int64_t(h.length));
    keys.insert(keys.end(), h.key, h.key + 16);
    ops.insert(ops.end(), h.op, h.op + 16);
    commands.insert(commands.end(), h.canonical, h.canonical + h.length);
  }
};

PyObject* as_bytes(const void* p, size_t size) {
  return PyBytes_FromStringAndSize(static_cast<const char*>(p), Py_ssize_t(size));
}

template <typename T>
PyObject* as_bytes(const std::vector<T>& v) {
  return as_bytes(v.data(), v.size() * sizeof(T));
}

bool fixints(long version, long kind) {
  if (version < 0 || version > 0x7f || kind < 0 || kind > 0x7f) {
    PyErr_SetString(PyExc_ValueError, "version and kind must be positive fixints");
    return false;
  }
  return true;
}

// The arguments every run decoder takes (payloads, version, kind); false with an error set.
bool run_args(PyObject* args, PyObject** payloads, long* version, long* kind) {
  return PyArg_ParseTuple(args, "O!ll", &PyList_Type, payloads, version, kind) && fixints(*version, *kind);
}

// A run decoder's answer: the columns every run has, then the kind's own, each a vector's bytes.
template <typename... Extra>
PyObject* run_columns(const Columns& c, const Extra&... extra) {
  PyObject* items[] = {as_bytes(c.sequences), as_bytes(c.keys), as_bytes(c.ops), as_bytes(c.commands),
                       as_bytes(c.lengths), as_bytes(extra)...};
  constexpr Py_ssize_t n = Py_ssize_t(sizeof(items) / sizeof(items[0]));
  PyObject* tuple = PyTuple_New(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (tuple == nullptr || items[i] == nullptr) {
      Py_XDECREF(items[i]);
      Py_CLEAR(tuple);
    } else {
      PyTuple_SET_ITEM(tuple, i, items[i]);
    }
  }
  return tuple;
}

// Each payload of a run read into `c` (its admission head) and by `extra(r, i)` (its extra map, the
// i-th): false when a payload is not bytes, not in that layout, or longer than what was read.
template <typename Extra>
bool read_run(PyObject* payloads, long version, long kind, Columns& c, Extra extra) {
  const Py_ssize_t n = PyList_GET_SIZE(payloads);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(payloads, i);
    if (!PyBytes_Check(item)) return false;
    const unsigned char* data = reinterpret_cast<const unsigned char*>(PyBytes_AS_STRING(item));
    Reader r{data, data + PyBytes_GET_SIZE(item)};
    Head h;
    if (!(admission_head(r, version, kind, h) && extra(r, size_t(i)) && r.p == r.end)) return false;
    c.add(h);
  }
  return true;
}

// The extra maps of the three kinds that create rows, exactly as their kinds/*.py `check` records
// them (16-byte bins), for the run decoders below and replay_stretch: a space's {"id", "scope"}; a
// conversation's {"space": [lineage, id], "id"}; a member row's {"space": [lineage, id],
// "participant": raw id, "rights"}.
bool space_ref(Reader& r, unsigned char* lineage, unsigned char* id) {
  static const char SPACE_KEY[] = "\xa5space";
  return r.fixed(SPACE_KEY, 6) && r.byte(0x92) && r.bin16(lineage) && r.bin16(id);
}

const char ID_KEY[] = "\xa2id";

bool space_extra(Reader& r, unsigned char* id, int64_t* scope) {
  static const char SCOPE_KEY[] = "\xa5scope";
  return r.byte(0x82) && r.fixed(ID_KEY, 3) && r.bin16(id) && r.fixed(SCOPE_KEY, 6) && r.uint(scope);
}

bool conversation_extra(Reader& r, unsigned char* space_lineage, unsigned char* space_id, unsigned char* id) {
  return r.byte(0x82) && space_ref(r, space_lineage, space_id) && r.fixed(ID_KEY, 3) && r.bin16(id);
}

bool member_extra(Reader& r, unsigned char* space_lineage, unsigned char* space_id, unsigned char* participant,
                  int64_t* rights) {
  static const char PARTICIPANT_KEY[] = "\xabparticipant", RIGHTS_KEY[] = "\xa6rights";
  return r.byte(0x83) && space_ref(r, space_lineage, space_id) && r.fixed(PARTICIPANT_KEY, 12)
         && r.bin16(participant) && r.fixed(RIGHTS_KEY, 7) && r.uint(rights);
}

// space_creates(payloads, version, kind) -> (sequences, keys, ops, commands, lengths, ids, scopes)
// or None: the columns of a run of spaces.create admissions (a replay on an accelerator writes
// them as columns: admission.replay_run). Each payload must be exactly [version, kind, principal,
// sequence, key, op, canonical, {"id": id, "scope": scope}] as Admission.encode packs it;
// sequences, lengths (of the canonical bytes) and scopes are native int64 arrays, keys, ops and
// ids 16 bytes each, the canonical bytes back to back in `commands`. None when any payload is
// otherwise: the run is then decoded one admission at a time.
PyObject* space_creates(PyObject*, PyObject* args) {
  PyObject* payloads;
  long version, kind;
  if (!run_args(args, &payloads, &version, &kind)) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(payloads);
  Columns c;
  std::vector<unsigned char> ids(size_t(n) * 16);
  std::vector<int64_t> scopes(static_cast<size_t>(n));
  if (!read_run(payloads, version, kind, c, [&](Reader& r, size_t i) { return space_extra(r, &ids[i * 16], &scopes[i]); }))
    Py_RETURN_NONE;
  return run_columns(c, ids, scopes);
}

// conversation_creates(payloads, version, kind) -> (sequences, keys, ops, commands, lengths,
// space lineages, space ids, ids) or None: a run of conversations.create admissions, each exactly
// [version, kind, principal, sequence, key, op, canonical, {"space": [lineage, id], "id": id}]
// (16-byte bins; the extra map in kinds/conversations.py check's order). None as space_creates.
PyObject* conversation_creates(PyObject*, PyObject* args) {
  PyObject* payloads;
  long version, kind;
  if (!run_args(args, &payloads, &version, &kind)) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(payloads);
  Columns c;
  std::vector<unsigned char> lineages(size_t(n) * 16), spaces(size_t(n) * 16), ids(size_t(n) * 16);
  if (!read_run(payloads, version, kind, c, [&](Reader& r, size_t i) {
        return conversation_extra(r, &lineages[i * 16], &spaces[i * 16], &ids[i * 16]);
      }))
    Py_RETURN_NONE;
  return run_columns(c, lineages, spaces, ids);
}

// member_sets(payloads, version, kind) -> (sequences, keys, ops, commands, lengths, space lineages,
// space ids, participants, rights) or None: a run of members.set admissions, each exactly [version,
// kind, principal, sequence, key, op, canonical, {"space": [lineage, id], "participant": raw id,
// "rights": rights}] (kinds/members.py check's order); rights native int64. None as space_creates.
PyObject* member_sets(PyObject*, PyObject* args) {
  PyObject* payloads;
  long version, kind;
  if (!run_args(args, &payloads, &version, &kind)) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(payloads);
  Columns c;
  std::vector<unsigned char> lineages(size_t(n) * 16), spaces(size_t(n) * 16), participants(size_t(n) * 16);
  std::vector<int64_t> rights(static_cast<size_t>(n));
  if (!read_run(payloads, version, kind, c, [&](Reader& r, size_t i) {
        return member_extra(r, &lineages[i * 16], &spaces[i * 16], &participants[i * 16], &rights[i]);
      }))
    Py_RETURN_NONE;
  return run_columns(c, lineages, spaces, participants, rights);
}

// A writable buffer of a table's memory (a Tables byte view), released when it goes.
struct Table {
  Py_buffer view{};
  bool held = false;
  int64_t width = 0;  // int64 columns a row (bytes for a byte table)
  bool take(PyObject* object, int64_t columns) {
    if (PyObject_GetBuffer(object, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) return false;
    held = true;
    width = columns;
    return true;
  }
  ~Table() {
    if (held) PyBuffer_Release(&view);
  }
  int64_t rows(size_t item) const { return width > 0 ? int64_t(size_t(view.len) / (size_t(width) * item)) : 0; }
  int64_t* row(int64_t r) { return static_cast<int64_t*>(view.buf) + r * width; }
  unsigned char* bytes(int64_t r) { return static_cast<unsigned char*>(view.buf) + r * width; }
};

namespace fm = aotx::fixedmap;

// A (lineage, id) key of a "b16b16" FixedMap.
struct OwnedId {
  unsigned char key[32];
  OwnedId() = default;
  OwnedId(const unsigned char* lineage, const unsigned char* id) { memcpy(key, lineage, 16), memcpy(key + 16, id, 16); }
};

// An (a, b) key of an "ii" FixedMap.
struct IntPair {
  unsigned char key[16];
  IntPair() = default;
  IntPair(int64_t a, int64_t b) { fm::put_int(key, a), fm::put_int(key + 8, b); }
};

// The last row of a free list (what pop() hands out), -1 when it is empty; `pop` removes it.
int64_t last_free(PyObject* free) {
  const Py_ssize_t n = PyList_GET_SIZE(free);
  if (n == 0 || !PyLong_CheckExact(PyList_GET_ITEM(free, n - 1))) return -1;
  const long long row = PyLong_AsLongLong(PyList_GET_ITEM(free, n - 1));
  if (row < 0) PyErr_Clear();  // (not a row)
  return row;
}

bool pop(PyObject* free) {
  const Py_ssize_t n = PyList_GET_SIZE(free);
  return PyList_SetSlice(free, n - 1, n, nullptr) == 0;
}

struct Owned {  // a new reference, released when it goes
  PyObject* p;
  explicit Owned(PyObject* object) : p(object) {}
  ~Owned() { Py_XDECREF(p); }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
};

// How many transfers a stretch reads ahead of the one it applies (replay_stretch).
constexpr size_t STRETCH_AHEAD = 8;

// One admission of a stretch, read (`read_admission`) before it is applied: its payload decoded,
// its participant row and owner lineage found, its map keys made and hashed.
struct Ahead {
  long kind = 0;
  long long seq = 0;
  const char* digest = nullptr;  // 32 bytes (the transfer's)
  Head h;
  unsigned char id[16], space_lineage[16], space_id[16], member_raw[16];
  int64_t scope = 0, rights = 0, prow = -1;
  const unsigned char* owner = nullptr;  // the participant's lineage, 16 bytes
  IntPair sequence_key;  // (participant row, sequence): by_sequence's key
  OwnedId space_key, id_key;  // the space it names, the ID it makes
  uint64_t sequence_hash = 0, space_hash = 0, id_hash = 0;
};

// Whether `transfer` is an admission of one of the three kinds, its payload whole in the layout
// replay_stretch applies (into `a`): a stretch ends at the first that is not.
bool read_admission(PyObject* transfer, PyObject* admission, long version, long space_code, long conversation_code,
                    long member_code, size_t command_width, Ahead& a) {
  if (!PyTuple_Check(transfer) || PyTuple_GET_SIZE(transfer) < 4 || PyTuple_GET_ITEM(transfer, 0) != admission)
    return false;
  PyObject *seq_object = PyTuple_GET_ITEM(transfer, 1), *payload = PyTuple_GET_ITEM(transfer, 2),
           *digest = PyTuple_GET_ITEM(transfer, 3);
  if (!PyBytes_Check(payload) || !PyBytes_Check(digest) || PyBytes_GET_SIZE(digest) != 32) return false;
  const unsigned char* data = reinterpret_cast<const unsigned char*>(PyBytes_AS_STRING(payload));
  if (PyBytes_GET_SIZE(payload) < 3) return false;
  const long kind = data[2];
  if (kind != space_code && kind != conversation_code && kind != member_code) return false;
  a.seq = PyLong_AsLongLong(seq_object);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  Reader r{data, data + PyBytes_GET_SIZE(payload)};
  const bool read = admission_head(r, version, kind, a.h)
                    && (kind == space_code          ? space_extra(r, a.id, &a.scope)
                        : kind == conversation_code ? conversation_extra(r, a.space_lineage, a.space_id, a.id)
                                                    : member_extra(r, a.space_lineage, a.space_id, a.member_raw,
                                                                   &a.rights));
  if (!read || r.p != r.end || a.h.sequence >= (int64_t(1) << 31) || a.h.length > command_width) return false;
  a.kind = kind;
  a.digest = PyBytes_AS_STRING(digest);
  return true;
}

// replay_stretch(transfers, start, admission, version, codes, counter, fields, tables, indexes) -> applied
//
// A replay's transfers from transfers[start] on, as long as each is an admission (its kind object
// `admission`) of the three kinds that create rows (spaces.create, conversations.create,
// members.set; a mixed journal interleaves them in stretches of one to dozens) by a registered
// participant, each applied exactly as pipeline/admission.py `apply` with that kind's `apply`
// writes it at replay: the receipt row (whole: key, ID, target, admission counter, command length,
// succeeded, the admission's and the terminal's save fields `fields` = (boot, generation, source)
// with the transfer's seq), its command bytes and both commit digests, the participant's next
// sequence, the kind's row, the indexes (a receipt's sequence entry and its row noted for the
// deferred key maps; a space's and a conversation's ID entries; a member pair's row). `counter`:
// the admission counter before the first. `codes`: (spaces.create, conversations.create,
// members.set). `tables`: byte views (Tables' raw) of receipts, receipt_digests, command_bytes,
// participants, spaces, conversations, members, with the int64 column counts of the int64 ones and
// the command row's bytes; `indexes`: the participants' principal map, the receipts' free list,
// sequence map and noted list, the spaces' free list and ID map, the conversations' free list and
// ID map, the members' free list and pair map, the participants' lineage list and raw-ID map (the
// maps: FixedMaps, fixedmap.h, read and written here without a Python object). The row layouts
// are those of gpu_worker/state/tables.py, asserted where it is called (admission.replay_stretch).
//
// It stops before the first transfer it does not apply exactly so: another transfer kind or
// admission kind, a principal not registered, a payload in another layout (an extra field, as a
// space with a memory TTL), a space or participant it does not find, a free list empty, a row past
// its table. The caller applies that one by itself (whose errors are then the Python path's own)
// and goes on after it. Returns how many it applied.
PyObject* replay_stretch(PyObject*, PyObject* args) {
  PyObject *transfers, *admission, *tables, *indexes;
  Py_ssize_t start;
  long version, space_code, conversation_code, member_code;
  long long counter, boot, generation, source;
  if (!PyArg_ParseTuple(args, "O!nOl(lll)L(LLL)O!O!", &PyList_Type, &transfers, &start, &admission, &version,
                        &space_code, &conversation_code, &member_code, &counter, &boot, &generation, &source,
                        &PyTuple_Type, &tables, &PyTuple_Type, &indexes))
    return nullptr;
  if (!fixints(version, space_code) || !fixints(conversation_code, member_code)) return nullptr;
  Table receipts, digests, commands, participants, spaces, conversations, members;
  long long widths[6];
  PyObject *o_receipts, *o_digests, *o_commands, *o_participants, *o_spaces, *o_conversations, *o_members;
  if (!PyArg_ParseTuple(tables, "OOOOOOOLLLLLL", &o_receipts, &o_digests, &o_commands, &o_participants, &o_spaces,
                        &o_conversations, &o_members, &widths[0], &widths[1], &widths[2], &widths[3], &widths[4],
                        &widths[5]))
    return nullptr;
  if (!(receipts.take(o_receipts, widths[0]) && digests.take(o_digests, 64) && commands.take(o_commands, widths[1])
        && participants.take(o_participants, widths[2]) && spaces.take(o_spaces, widths[3])
        && conversations.take(o_conversations, widths[4]) && members.take(o_members, widths[5])))
    return nullptr;
  if (receipts.width < 21 || participants.width < 2 || spaces.width < 8 || conversations.width < 8
      || members.width < 5 || commands.width < 1) {
    PyErr_SetString(PyExc_ValueError, "replay_stretch: a table narrower than its row layout");
    return nullptr;
  }
  PyObject *o_by_principal, *receipt_free, *o_by_sequence, *noted, *space_free, *o_spaces_by_id, *conversation_free,
      *o_conversations_by_id, *member_free, *o_member_rows, *lineage, *o_by_raw;
  if (!PyArg_ParseTuple(indexes, "OO!OO!O!OO!OO!OO!O", &o_by_principal, &PyList_Type, &receipt_free, &o_by_sequence,
                        &PyList_Type, &noted, &PyList_Type, &space_free, &o_spaces_by_id, &PyList_Type,
                        &conversation_free, &o_conversations_by_id, &PyList_Type, &member_free, &o_member_rows,
                        &PyList_Type, &lineage, &o_by_raw))
    return nullptr;
  fm::Map *by_principal = fm::check(o_by_principal, 16), *by_sequence = nullptr, *spaces_by_id = nullptr,
          *conversations_by_id = nullptr, *member_rows = nullptr, *by_raw = nullptr;
  if (!by_principal || !(by_sequence = fm::check(o_by_sequence, 16)) || !(spaces_by_id = fm::check(o_spaces_by_id, 32))
      || !(conversations_by_id = fm::check(o_conversations_by_id, 32)) || !(member_rows = fm::check(o_member_rows, 16))
      || !(by_raw = fm::check(o_by_raw, 16)))
    return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(transfers);
  if (start < 0) {
    PyErr_SetString(PyExc_ValueError, "replay_stretch: a negative start");
    return nullptr;
  }
  const int64_t receipt_rows = receipts.rows(8), participant_rows = participants.rows(8),
                space_rows = spaces.rows(8), conversation_rows = conversations.rows(8), member_table = members.rows(8);
  // Each transfer is read STRETCH_AHEAD transfers before it is applied (`read_ahead`): its map
  // keys hashed and their home slots prefetched, and the receipt row it will take, its command
  // row and digests: a map of a million entries and the rows a retirement freed are cache (and TLB)
  // misses each, which this many in flight at once overlap. Reading one needs nothing the ones
  // before it write (the participants' principal map and lineages change in no stretch).
  Ahead ring[STRETCH_AHEAD];
  Py_ssize_t read_to = start;  // transfers[start:read_to] are read, in the ring
  bool unread = false;  // the transfer at read_to is not one a stretch applies: the stretch ends there
  auto read_ahead = [&](Py_ssize_t applying) {
    for (; !unread && read_to < n && read_to < applying + Py_ssize_t(STRETCH_AHEAD); ++read_to) {
      Ahead& a = ring[read_to % Py_ssize_t(STRETCH_AHEAD)];
      if (!read_admission(PyList_GET_ITEM(transfers, read_to), admission, version, space_code, conversation_code,
                          member_code, size_t(commands.width), a)) {
        unread = true;
        break;
      }
      a.prow = fm::get(by_principal, a.h.principal);
      if (a.prow < 0 || a.prow >= participant_rows || a.prow >= PyList_GET_SIZE(lineage)) {
        unread = true;
        break;
      }
      PyObject* owner_lineage = PyList_GET_ITEM(lineage, a.prow);
      if (!PyBytes_Check(owner_lineage) || PyBytes_GET_SIZE(owner_lineage) != 16) {
        unread = true;
        break;
      }
      a.owner = reinterpret_cast<const unsigned char*>(PyBytes_AS_STRING(owner_lineage));
      a.sequence_key = IntPair(a.prow, a.h.sequence);
      a.sequence_hash = fm::hash_of(by_sequence, a.sequence_key.key);
      fm::prefetch(by_sequence, a.sequence_hash);
      if (a.kind != space_code) {  // the space it names
        a.space_key = OwnedId(a.space_lineage, a.space_id);
        a.space_hash = fm::hash_of(spaces_by_id, a.space_key.key);
        fm::prefetch(spaces_by_id, a.space_hash);
      }
      if (a.kind != member_code) {  // the ID it makes
        fm::Map* made = a.kind == space_code ? spaces_by_id : conversations_by_id;
        a.id_key = OwnedId(a.owner, a.id);
        a.id_hash = fm::hash_of(made, a.id_key.key);
        fm::prefetch(made, a.id_hash);
      }
      // the receipt row it takes: every transfer before it takes one, from the free list's end
      const Py_ssize_t free = PyList_GET_SIZE(receipt_free), at = free - 1 - (read_to - applying);
      if (at >= 0 && PyLong_CheckExact(PyList_GET_ITEM(receipt_free, at))) {
        const long long rrow = PyLong_AsLongLong(PyList_GET_ITEM(receipt_free, at));
        if (rrow >= 0 && rrow < receipt_rows && rrow < commands.rows(1) && rrow < digests.rows(1)) {
          for (int64_t b = 0; b < receipts.width * 8; b += 64) __builtin_prefetch(receipts.bytes(rrow) + b, 1);
          for (size_t b = 0; b < a.h.length; b += 64) __builtin_prefetch(commands.bytes(rrow) + b, 1);
          __builtin_prefetch(digests.bytes(rrow), 1);
        } else {
          PyErr_Clear();
        }
      }
    }
  };
  Py_ssize_t i = start;
  for (;; ++i) {
    read_ahead(i);
    if (i >= read_to) break;
    const Ahead& a = ring[i % Py_ssize_t(STRETCH_AHEAD)];
    const long kind = a.kind;
    const Head& h = a.h;
    const int64_t prow = a.prow;
    // everything it looks up and takes, before anything is written
    const int64_t rrow = last_free(receipt_free);
    if (rrow < 0 || rrow >= receipt_rows || rrow >= commands.rows(1) || rrow >= digests.rows(1)) break;
    int64_t srow = -1, krow = -1, member = -1;
    bool new_member = false;
    if (kind == space_code) {
      krow = last_free(space_free);
      if (krow < 0 || krow >= space_rows) break;
    } else {
      srow = fm::get_hashed(spaces_by_id, a.space_key.key, a.space_hash);
      if (srow < 0 || srow >= space_rows) break;
      if (kind == conversation_code) {
        krow = last_free(conversation_free);
        if (krow < 0 || krow >= conversation_rows) break;
      } else {
        member = fm::get(by_raw, a.member_raw);
        if (member < 0) break;
        krow = fm::get(member_rows, IntPair(srow, member).key);
        if (krow < 0) {
          new_member = true;
          krow = last_free(member_free);
        }
        if (krow < 0 || krow >= member_table) break;
      }
    }
    // the kind's row and its index entry
    const int64_t admitted = counter + 1;
    if (kind == space_code) {
      int64_t* row = spaces.row(krow);
      row[0] = 1, row[1] = prow, row[2] = a.scope, memcpy(&row[3], a.id, 16), row[5] = admitted, memcpy(&row[6], h.op, 16);
      if (!pop(space_free) || !fm::put_hashed(spaces_by_id, a.id_key.key, a.id_hash, krow)) return nullptr;
    } else if (kind == conversation_code) {
      int64_t* row = conversations.row(krow);
      row[0] = 1, row[1] = srow, row[2] = prow, memcpy(&row[3], a.id, 16), row[5] = admitted, memcpy(&row[6], h.op, 16);
      if (!pop(conversation_free) || !fm::put_hashed(conversations_by_id, a.id_key.key, a.id_hash, krow)) return nullptr;
    } else if (new_member) {
      int64_t* row = members.row(krow);
      row[0] = 1, row[1] = srow, row[2] = member, row[3] = a.rights, row[4] = admitted;
      if (!pop(member_free) || !fm::put(member_rows, IntPair(srow, member).key, krow)) return nullptr;
    } else {
      members.row(krow)[3] = a.rights;
    }
    // the receipt, whole, its command bytes and digests, its sequence entry; the next sequence
    const int64_t target = kind == member_code ? srow : krow;
    int64_t* row = receipts.row(rrow);
    memset(row, 0, size_t(receipts.width) * 8);
    row[0] = 1, row[1] = prow, row[2] = h.sequence, row[3] = kind;
    memcpy(&row[4], h.key, 16), memcpy(&row[6], h.op, 16);
    row[8] = target, row[9] = admitted, row[10] = int64_t(h.length), row[11] = 0, row[12] = 1;  // succeeded
    for (int at : {13, 17}) row[at] = a.seq, row[at + 1] = boot, row[at + 2] = generation, row[at + 3] = source;
    memcpy(commands.bytes(rrow), h.canonical, h.length);
    unsigned char* both = digests.bytes(rrow);
    memcpy(both, a.digest, 32), memcpy(both + 32, a.digest, 32);
    participants.row(prow)[1] = h.sequence + 1;
    Owned rrow_object(PyLong_FromLongLong(rrow));
    if (!pop(receipt_free) || !fm::put_hashed(by_sequence, a.sequence_key.key, a.sequence_hash, rrow)
        || rrow_object.p == nullptr || PyList_Append(noted, rrow_object.p) != 0)
      return nullptr;
    counter = admitted;
  }
  return PyLong_FromSsize_t(i - start);
}

PyMethodDef methods[] = {
    {"records", records, METH_VARARGS, "records(kind, transfer_seq, payload, max_data) -> [bytes]"},
    {"check", check, METH_VARARGS,
     "check(data, pos, first_seq_lo, first_seq_hi, kinds, max_data, digest, after_seq[, limit]) -> "
     "(found, stop, last_seq, digest)"},
    {"make", make, METH_VARARGS, "make(data, found, kind_objects, transfer_type, segment, base) -> [Transfer]"},
    {"scatter", scatter, METH_VARARGS, "scatter(table, cols, rows, lengths, blob) -> bytes used"},
    {"gather", gather, METH_VARARGS, "gather(table, width, rows) -> bytearray of the rows' bytes, back to back"},
    {"space_creates", space_creates, METH_VARARGS,
     "space_creates(payloads, version, kind) -> (sequences, keys, ops, commands, lengths, ids, scopes) or None"},
    {"conversation_creates", conversation_creates, METH_VARARGS,
     "conversation_creates(payloads, version, kind) -> (sequences, keys, ops, commands, lengths, space lineages, "
     "space ids, ids) or None"},
    {"member_sets", member_sets, METH_VARARGS,
     "member_sets(payloads, version, kind) -> (sequences, keys, ops, commands, lengths, space lineages, space ids, "
     "participants, rights) or None"},
    {"replay_stretch", replay_stretch, METH_VARARGS,
     "replay_stretch(transfers, start, admission, version, codes, counter, fields, tables, indexes) -> applied"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "aotx_jcodec", "Journal records, encoded natively.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_aotx_jcodec(void) {
  PyObject* m = PyModule_Create(&module_def);
  // the bytes of one transfer in what `check` finds (its `found`, `make`'s input)
  if (m && PyModule_AddIntConstant(m, "FOUND_SIZE", long(sizeof(Found))) < 0) Py_CLEAR(m);
  return m;
}
