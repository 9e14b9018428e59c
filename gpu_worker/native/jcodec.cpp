// Journal records of one transfer (docs/journal.md, "Records"), encoded natively: the busiest
// device encodes one transfer per admission, and in Python the header packing, slicing and two
// checksums per record were a measurable part of each admission (docs/performance.md).
//
//   records(kind, transfer_seq, payload, max_data) -> [bytes]
//
// Each record: a 32-byte part header (type 37, class 0x41, kind, part index, part count, data
// length, reserved 0, payload length, transfer seq, CRC-32, reserved 0; little endian) and at
// most max_data bytes of the payload. The CRC-32 (zlib's) covers the header with its checksum
// field zero, then the data. An empty payload is one record with no data. gpu_worker/storage/journal.py
// checks the kind and wraps this as encode_transfer; recovery decodes in Python.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <zlib.h>

#include <stdint.h>
#include <string.h>

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

PyMethodDef methods[] = {
    {"records", records, METH_VARARGS, "records(kind, transfer_seq, payload, max_data) -> [bytes]"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "aotx_jcodec", "Journal records, encoded natively.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_aotx_jcodec(void) { return PyModule_Create(&module_def); }
