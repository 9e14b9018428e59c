// Journal records of one transfer (docs/journal.md, "Records"), encoded natively: the busiest
// device encodes one transfer per admission, and in Python the header packing, slicing and two
// checksums per record were a measurable part of each admission (docs/performance.md).
//
//   records(kind, transfer_seq, payload, max_data) -> [bytes]
//   transfers(data, pos, first_seq_lo, first_seq_hi, kinds, max_data) -> ([(kind, seq, payload, start)], stop)
//
// Each record: a 32-byte part header (type 37, class 0x41, kind, part index, part count, data
// length, reserved 0, payload length, transfer seq, CRC-32, reserved 0; little endian) and at
// most max_data bytes of the payload. The CRC-32 (zlib's) covers the header with its checksum
// field zero, then the data. An empty payload is one record with no data. gpu_worker/storage/journal.py
// checks the kind and wraps this as encode_transfer.
//
// `transfers` is recovery's fast path: the whole, intact transfers of a segment's bytes from `pos`
// (a transfer boundary) on, each one's seq following the last (the first's within [lo, hi]), kinds
// among the bits of `kinds`. It stops at the first transfer that is not whole or not exactly as the
// writer makes it (cut short, a checksum, a field) and returns where that transfer starts: the
// Python reader goes on from there with every rule and message of docs/journal.md (a torn tail, or
// the corruption it names), so the fast path changes what is read in no case.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <zlib.h>

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <string>

namespace {

constexpr unsigned char TYPE_SHARED = 37;
constexpr unsigned char CLASS_A = 0x41;
constexpr size_t HEADER = 32;
constexpr size_t CHECKSUM_AT = 24;
constexpr uint64_t MAX_PARTS = 0xFFFF;

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

PyObject* transfers(PyObject*, PyObject* args) {
  Py_buffer data;
  Py_ssize_t pos;
  unsigned long long lo, hi, kinds;
  Py_ssize_t max_data;
  if (!PyArg_ParseTuple(args, "y*nKKKn", &data, &pos, &lo, &hi, &kinds, &max_data)) return nullptr;
  const unsigned char* d = static_cast<const unsigned char*>(data.buf);
  const size_t n = size_t(data.len);
  size_t at = pos < 0 ? n : std::min(size_t(pos), n);
  PyObject* list = PyList_New(0);
  std::string payload;
  while (list && max_data > 0) {
    const size_t start = at;
    Part first;
    if (!read_part(d, n, at, size_t(max_data), first) || first.index != 0 || first.seq < lo || first.seq > hi ||
        first.kind >= 64 || !((kinds >> first.kind) & 1))
      break;
    payload.assign(reinterpret_cast<const char*>(d + at + HEADER), first.size);
    at += HEADER + first.size;
    bool whole = true;
    for (uint16_t i = 1; i < first.count; ++i) {
      Part part;
      if (!read_part(d, n, at, size_t(max_data), part) || part.index != i || part.kind != first.kind ||
          part.count != first.count || part.length != first.length || part.seq != first.seq) {
        whole = false;
        break;
      }
      payload.append(reinterpret_cast<const char*>(d + at + HEADER), part.size);
      at += HEADER + part.size;
    }
    if (!whole) {
      at = start;
      break;
    }
    PyObject* item = Py_BuildValue("(iKy#n)", int(first.kind), (unsigned long long)first.seq, payload.data(),
                                   Py_ssize_t(payload.size()), Py_ssize_t(start));
    if (!item || PyList_Append(list, item) < 0) {
      Py_XDECREF(item);
      Py_CLEAR(list);
      break;
    }
    Py_DECREF(item);
    lo = hi = first.seq + 1;
  }
  PyBuffer_Release(&data);
  if (!list) return nullptr;
  PyObject* result = Py_BuildValue("(Nn)", list, Py_ssize_t(at));
  return result;
}

PyMethodDef methods[] = {
    {"records", records, METH_VARARGS, "records(kind, transfer_seq, payload, max_data) -> [bytes]"},
    {"transfers", transfers, METH_VARARGS,
     "transfers(data, pos, first_seq_lo, first_seq_hi, kinds, max_data) -> ([(kind, seq, payload, start)], stop)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "aotx_jcodec", "Journal records, encoded natively.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_aotx_jcodec(void) { return PyModule_Create(&module_def); }
