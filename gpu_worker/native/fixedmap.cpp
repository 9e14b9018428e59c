// FixedMap: the device's host indexes of IDs to rows (gpu_worker/state/indexes.py), a hash table
// of fixed-width keys to rows (fixedmap.h) with the part of the dict API the indexes use.
//
//   FixedMap(layout, capacity=0)   layout: the key's parts, each "i" (an int, in int64) or "bN"
//                                  (N bytes); one part is the key itself, more are a tuple's items
//                                  ("b16b16": (lineage, id)). capacity: the entries it must hold
//                                  without growing (the rows of the table it indexes).
//   m[key], m[key] = row, del m[key], key in m, len(m), m.get(key[, default]),
//   m.pop(key[, default]), m.update(pairs),
//   m.keys(), m.values(), m.items() (lists, in slot order), iter(m), m.clear(), ==, repr
//   m.put_packed(keys, rows)       keys: a buffer of n keys packed as the layout says (ints
//                                  little-endian), rows: a buffer of n int64; m[key_i] = rows[i]
//                                  for each i, in order, no Python object made
//   m.pop_packed(keys, strict=True)  the rows of n packed keys, removed, n int64 in a bytearray
//                                  (-1: a key not there; when strict, KeyError for it instead, the
//                                  keys before it removed)
//   m.slots                        the table's size (it grew when it is more than its first)
//   FixedMap(layout, capacity, memory, used)  a map whose table is `memory` (a writable buffer of
//                                  FixedMap.table_bytes(layout, capacity) bytes, held until the map
//                                  grows or goes) with `used` entries in it already: one another
//                                  process of the same interpreter (a fork, the same hash seed)
//                                  filled in shared memory (gpu_worker/recovery/preload.py)
//
// A key that does not fit the layout (another type, another length, an int past int64) is a key
// that is not there: a lookup answers as for a missing key, and only a store refuses it
// (TypeError). Values are rows: ints 0 <= row < 2**63 - 1.
#include "fixedmap.h"

namespace {

using aotx::fixedmap::Map;
namespace fm = aotx::fixedmap;

// `o` (one part of a key) into `out`: 1 when it fits part `p`, 0 when it does not, -1 on error.
int encode_part(const Map* m, int p, PyObject* o, unsigned char* out) {
  if (m->kinds[p] == 'b') {
    if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) != m->sizes[p]) return 0;
    memcpy(out, PyBytes_AS_STRING(o), size_t(m->sizes[p]));
    return 1;
  }
  if (!PyLong_Check(o)) return 0;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow) return 0;
  if (v == -1 && PyErr_Occurred()) return -1;
  fm::put_int(out, v);
  return 1;
}

int encode(const Map* m, PyObject* key, unsigned char* out) {
  if (m->parts == 1) return encode_part(m, 0, key, out);
  if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != m->parts) return 0;
  for (int p = 0, at = 0; p < m->parts; at += m->sizes[p], ++p) {
    const int r = encode_part(m, p, PyTuple_GET_ITEM(key, p), out + at);
    if (r != 1) return r;
  }
  return 1;
}

// A store's key: 1, or -1 with an exception set.
int encode_stored(const Map* m, PyObject* key, unsigned char* out) {
  const int r = encode(m, key, out);
  if (r == 0) PyErr_Format(PyExc_TypeError, "%R is not a key of this FixedMap's layout", key);
  return r == 1 ? 1 : -1;
}

PyObject* decode_part(const Map* m, int p, const unsigned char* in) {
  if (m->kinds[p] == 'b') return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(in), m->sizes[p]);
  uint64_t v = 0;
  for (int b = 7; b >= 0; --b) v = v << 8 | in[b];
  return PyLong_FromLongLong(static_cast<long long>(v));
}

PyObject* decode(const Map* m, const unsigned char* in) {
  if (m->parts == 1) return decode_part(m, 0, in);
  PyObject* key = PyTuple_New(m->parts);
  if (key == nullptr) return nullptr;
  for (int p = 0, at = 0; p < m->parts; at += m->sizes[p], ++p) {
    PyObject* part = decode_part(m, p, in + at);
    if (part == nullptr) {
      Py_DECREF(key);
      return nullptr;
    }
    PyTuple_SET_ITEM(key, p, part);
  }
  return key;
}

bool row_of(PyObject* value, int64_t* row) {
  const long long v = PyLong_AsLongLong(value);
  if (v == -1 && PyErr_Occurred()) return false;
  *row = v;
  return true;
}

bool parse_layout(Map* m, const char* layout) {
  m->parts = 0, m->width = 0;
  for (const char* c = layout; *c;) {
    if (m->parts == fm::MAX_PARTS) break;
    int size;
    const char kind = *c;
    if (kind == 'i') {
      size = 8, ++c;
    } else if (kind == 'b' && c[1] >= '1' && c[1] <= '9') {
      char* end;
      const long parsed = strtol(c + 1, &end, 10);
      if (parsed > fm::MAX_WIDTH) break;
      size = int(parsed), c = end;
    } else {
      break;
    }
    m->kinds[m->parts] = kind;
    m->sizes[m->parts++] = size;
    m->width += size;
    if (m->width > fm::MAX_WIDTH) break;
    if (*c == 0) return true;
  }
  PyErr_Format(PyExc_ValueError, "FixedMap layout %s: parts \"i\" or \"bN\", at most %d of %d bytes in all",
               layout, fm::MAX_PARTS, fm::MAX_WIDTH);
  return false;
}

// A slot's bytes for keys of `width` bytes: the stored value, then the key padded to 8.
int stride_of(int width) { return 8 + (width + 7) / 8 * 8; }

// The slots a map of `capacity` entries starts with: a power of two, at least twice the entries.
uint64_t first_slots(Py_ssize_t capacity) {
  uint64_t slots = 8;
  while (slots < uint64_t(capacity) * 2) slots *= 2;
  return slots;
}

bool parse_capacity(Py_ssize_t capacity) {
  if (capacity >= 0 && capacity <= (Py_ssize_t(1) << 40)) return true;
  PyErr_Format(PyExc_ValueError, "FixedMap capacity %zd out of range", capacity);
  return false;
}

int map_init(PyObject* self, PyObject* args, PyObject* kwargs) {
  Map* m = reinterpret_cast<Map*>(self);
  static const char* names[] = {"layout", "capacity", "memory", "used", nullptr};
  const char* layout;
  Py_ssize_t capacity = 0, used = 0;
  PyObject* memory = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|nOn", const_cast<char**>(names), &layout, &capacity, &memory,
                                   &used))
    return -1;
  if (m->slots != nullptr) {
    PyErr_SetString(PyExc_TypeError, "a FixedMap is made once");
    return -1;
  }
  if (!parse_capacity(capacity) || !parse_layout(m, layout)) return -1;
  m->stride = stride_of(m->width);
  const uint64_t slots = first_slots(capacity);
  if (memory == Py_None) {
    if (used != 0) {
      PyErr_SetString(PyExc_ValueError, "FixedMap used: only with the memory its entries are in");
      return -1;
    }
    m->slots = fm::allocate(m, slots);
    if (m->slots == nullptr) return -1;
  } else {
    if (PyObject_GetBuffer(memory, &m->memory, PyBUF_WRITABLE) < 0) return -1;
    if (uint64_t(m->memory.len) != slots * uint64_t(m->stride) || used < 0 || uint64_t(used) * 2 > slots) {
      PyErr_Format(PyExc_ValueError, "FixedMap memory: %zd bytes holding %zd entries, not a table of %llu slots "
                   "of %d bytes (FixedMap.table_bytes) at most half used", m->memory.len, used,
                   static_cast<unsigned long long>(slots), m->stride);
      PyBuffer_Release(&m->memory);
      return -1;
    }
    m->slots = static_cast<unsigned char*>(m->memory.buf);
    m->borrowed = true;
  }
  m->mask = slots - 1;
  m->used = used;
  return 0;
}

void map_dealloc(PyObject* self) {
  Map* m = reinterpret_cast<Map*>(self);
  if (m->borrowed)
    PyBuffer_Release(&m->memory);
  else
    free(m->slots);
  Py_TYPE(self)->tp_free(self);
}

PyObject* map_table_bytes(PyObject*, PyObject* args) {
  Map probe{};
  const char* layout;
  Py_ssize_t capacity;
  if (!PyArg_ParseTuple(args, "sn", &layout, &capacity) || !parse_capacity(capacity) || !parse_layout(&probe, layout))
    return nullptr;
  return PyLong_FromUnsignedLongLong(first_slots(capacity) * uint64_t(stride_of(probe.width)));
}

bool ready(const Map* m) {
  if (m->slots != nullptr) return true;
  PyErr_SetString(PyExc_TypeError, "FixedMap not initialised");
  return false;
}

Py_ssize_t map_len(PyObject* self) { return reinterpret_cast<Map*>(self)->used; }

PyObject* map_subscript(PyObject* self, PyObject* key) {
  Map* m = reinterpret_cast<Map*>(self);
  unsigned char k[fm::MAX_WIDTH];
  if (!ready(m)) return nullptr;
  const int r = encode(m, key, k);
  if (r < 0) return nullptr;
  const int64_t v = r ? fm::get(m, k) : -1;
  if (v < 0) {
    PyErr_SetObject(PyExc_KeyError, key);
    return nullptr;
  }
  return PyLong_FromLongLong(v);
}

int map_ass(PyObject* self, PyObject* key, PyObject* value) {
  Map* m = reinterpret_cast<Map*>(self);
  unsigned char k[fm::MAX_WIDTH];
  if (!ready(m)) return -1;
  if (value == nullptr) {  // del
    const int r = encode(m, key, k);
    if (r < 0) return -1;
    if (r == 0 || fm::erase(m, k) < 0) {
      PyErr_SetObject(PyExc_KeyError, key);
      return -1;
    }
    return 0;
  }
  int64_t row;
  if (encode_stored(m, key, k) < 0 || !row_of(value, &row)) return -1;
  return fm::put(m, k, row) ? 0 : -1;
}

int map_contains(PyObject* self, PyObject* key) {
  Map* m = reinterpret_cast<Map*>(self);
  unsigned char k[fm::MAX_WIDTH];
  if (!ready(m)) return -1;
  const int r = encode(m, key, k);
  return r <= 0 ? r : fm::get(m, k) >= 0;
}

PyObject* map_get(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  Map* m = reinterpret_cast<Map*>(self);
  unsigned char k[fm::MAX_WIDTH];
  if (!_PyArg_CheckPositional("get", n, 1, 2) || !ready(m)) return nullptr;
  const int r = encode(m, args[0], k);
  if (r < 0) return nullptr;
  const int64_t v = r ? fm::get(m, k) : -1;
  if (v >= 0) return PyLong_FromLongLong(v);
  PyObject* fallback = n > 1 ? args[1] : Py_None;
  Py_INCREF(fallback);
  return fallback;
}

PyObject* map_pop(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  Map* m = reinterpret_cast<Map*>(self);
  unsigned char k[fm::MAX_WIDTH];
  if (!_PyArg_CheckPositional("pop", n, 1, 2) || !ready(m)) return nullptr;
  const int r = encode(m, args[0], k);
  if (r < 0) return nullptr;
  const int64_t v = r ? fm::erase(m, k) : -1;
  if (v >= 0) return PyLong_FromLongLong(v);
  if (n > 1) {
    Py_INCREF(args[1]);
    return args[1];
  }
  PyErr_SetObject(PyExc_KeyError, args[0]);
  return nullptr;
}

PyObject* map_update(PyObject* self, PyObject* pairs) {
  Map* m = reinterpret_cast<Map*>(self);
  if (!ready(m)) return nullptr;
  PyObject* it = PyObject_GetIter(pairs);
  if (it == nullptr) return nullptr;
  PyObject* item;
  bool ok = true;
  unsigned char k[fm::MAX_WIDTH];
  while (ok && (item = PyIter_Next(it)) != nullptr) {
    PyObject* pair = PySequence_Tuple(item);
    int64_t row;
    ok = pair != nullptr;
    if (ok && PyTuple_GET_SIZE(pair) != 2) {
      PyErr_Format(PyExc_ValueError, "a pair of 2 expected, got %zd values", PyTuple_GET_SIZE(pair));
      ok = false;
    }
    ok = ok && encode_stored(m, PyTuple_GET_ITEM(pair, 0), k) == 1 && row_of(PyTuple_GET_ITEM(pair, 1), &row)
         && fm::put(m, k, row);
    Py_XDECREF(pair);
    Py_DECREF(item);
  }
  Py_DECREF(it);
  if (!ok || PyErr_Occurred()) return nullptr;
  Py_RETURN_NONE;
}

// what: 0 keys, 1 values, 2 (key, value) pairs
PyObject* listed(Map* m, int what) {
  if (!ready(m)) return nullptr;
  PyObject* out = PyList_New(m->used);
  if (out == nullptr) return nullptr;
  Py_ssize_t at = 0;
  for (uint64_t i = 0; i <= m->mask && at < m->used; ++i) {
    const unsigned char* s = fm::slot(m, i);
    const uint64_t v = fm::stored(s);
    if (v == 0) continue;
    PyObject* item;
    if (what == 0) {
      item = decode(m, s + 8);
    } else if (what == 1) {
      item = PyLong_FromLongLong(int64_t(v) - 1);
    } else {
      PyObject *key = decode(m, s + 8), *value = PyLong_FromLongLong(int64_t(v) - 1);
      item = key && value ? PyTuple_Pack(2, key, value) : nullptr;
      Py_XDECREF(key);
      Py_XDECREF(value);
    }
    if (item == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, at++, item);
  }
  return out;
}

PyObject* map_keys(PyObject* self, PyObject*) { return listed(reinterpret_cast<Map*>(self), 0); }
PyObject* map_values(PyObject* self, PyObject*) { return listed(reinterpret_cast<Map*>(self), 1); }
PyObject* map_items(PyObject* self, PyObject*) { return listed(reinterpret_cast<Map*>(self), 2); }

PyObject* map_iter(PyObject* self) {
  PyObject* keys = listed(reinterpret_cast<Map*>(self), 0);
  if (keys == nullptr) return nullptr;
  PyObject* it = PyObject_GetIter(keys);
  Py_DECREF(keys);
  return it;
}

PyObject* map_clear(PyObject* self, PyObject*) {
  Map* m = reinterpret_cast<Map*>(self);
  if (!ready(m)) return nullptr;
  memset(m->slots, 0, size_t(m->mask + 1) * size_t(m->stride));
  m->used = 0;
  Py_RETURN_NONE;
}

PyObject* map_put_packed(PyObject* self, PyObject* args) {
  Map* m = reinterpret_cast<Map*>(self);
  Py_buffer keys, rows;
  if (!ready(m) || !PyArg_ParseTuple(args, "y*y*", &keys, &rows)) return nullptr;
  const Py_ssize_t n = rows.len / 8;
  bool ok = rows.len % 8 == 0 && keys.len == n * m->width;
  if (!ok)
    PyErr_Format(PyExc_ValueError, "put_packed: %zd bytes of keys and %zd of rows are not n keys of %d bytes and n "
                 "int64", keys.len, rows.len, m->width);
  const unsigned char* r = static_cast<const unsigned char*>(rows.buf);
  ok = ok && fm::each_hashed(m, static_cast<const unsigned char*>(keys.buf), size_t(n),
                             [&](size_t i, const unsigned char* key, uint64_t hash) {
                               int64_t row;
                               memcpy(&row, r + i * 8, 8);
                               return fm::put_hashed(m, key, hash, row);
                             });
  PyBuffer_Release(&keys);
  PyBuffer_Release(&rows);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

PyObject* map_pop_packed(PyObject* self, PyObject* args) {
  Map* m = reinterpret_cast<Map*>(self);
  Py_buffer keys;
  int strict = 1;
  if (!ready(m) || !PyArg_ParseTuple(args, "y*|p", &keys, &strict)) return nullptr;
  const Py_ssize_t n = keys.len / m->width;
  PyObject* out = keys.len % m->width == 0 ? PyByteArray_FromStringAndSize(nullptr, n * 8) : nullptr;
  if (keys.len % m->width != 0)
    PyErr_Format(PyExc_ValueError, "pop_packed: %zd bytes are not keys of %d bytes", keys.len, m->width);
  if (out != nullptr
      && !fm::each_hashed(m, static_cast<const unsigned char*>(keys.buf), size_t(n),
                          [&](size_t i, const unsigned char* key, uint64_t hash) {
                            const int64_t v = fm::erase_hashed(m, key, hash);
                            if (v < 0 && strict) {
                              PyObject* missing = decode(m, key);
                              if (missing != nullptr) PyErr_SetObject(PyExc_KeyError, missing);
                              Py_XDECREF(missing);
                              return false;
                            }
                            memcpy(PyByteArray_AS_STRING(out) + i * 8, &v, 8);
                            return true;
                          }))
    Py_CLEAR(out);
  PyBuffer_Release(&keys);
  return out;
}

PyObject* map_slots(PyObject* self, void*) {
  return PyLong_FromUnsignedLongLong(reinterpret_cast<Map*>(self)->mask + 1);
}

PyObject* map_richcompare(PyObject* self, PyObject* other, int op) {
  if ((op != Py_EQ && op != Py_NE) || !(PyDict_Check(other) || Py_TYPE(other) == Py_TYPE(self)))
    Py_RETURN_NOTIMPLEMENTED;
  Map* m = reinterpret_cast<Map*>(self);
  if (!ready(m)) return nullptr;
  int equal = PyObject_Length(other) == m->used;
  if (PyErr_Occurred()) return nullptr;
  PyObject* items = equal ? listed(m, 2) : nullptr;
  if (equal && items == nullptr) return nullptr;
  for (Py_ssize_t i = 0; equal && i < PyList_GET_SIZE(items); ++i) {
    PyObject* pair = PyList_GET_ITEM(items, i);
    PyObject* theirs = PyObject_GetItem(other, PyTuple_GET_ITEM(pair, 0));
    if (theirs == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_KeyError)) {
        Py_DECREF(items);
        return nullptr;
      }
      PyErr_Clear();
      equal = 0;
      break;
    }
    equal = PyObject_RichCompareBool(theirs, PyTuple_GET_ITEM(pair, 1), Py_EQ);
    Py_DECREF(theirs);
    if (equal < 0) {
      Py_DECREF(items);
      return nullptr;
    }
  }
  Py_XDECREF(items);
  return PyBool_FromLong(op == Py_EQ ? equal : !equal);
}

PyObject* map_repr(PyObject* self) {
  PyObject* items = listed(reinterpret_cast<Map*>(self), 2);
  if (items == nullptr) return nullptr;
  PyObject* text = PyUnicode_FromFormat("FixedMap(%R)", items);
  Py_DECREF(items);
  return text;
}

PyMethodDef map_methods[] = {
    {"get", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(map_get)), METH_FASTCALL,
     "get(key[, default]) -> the key's row, else default (None)"},
    {"pop", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(map_pop)), METH_FASTCALL,
     "pop(key[, default]) -> the key's row, removed; KeyError without a default"},
    {"update", map_update, METH_O, "update(pairs): self[key] = row for each (key, row), in order"},
    {"put_packed", map_put_packed, METH_VARARGS, "put_packed(keys, rows): keys packed per the layout, int64 rows"},
    {"pop_packed", map_pop_packed, METH_VARARGS,
     "pop_packed(keys, strict=True) -> bytearray: each packed key's row as int64, removed (-1: not there, unless "
     "strict: KeyError)"},
    {"keys", map_keys, METH_NOARGS, "the keys, in slot order"},
    {"values", map_values, METH_NOARGS, "the rows, in slot order"},
    {"items", map_items, METH_NOARGS, "(key, row) pairs, in slot order"},
    {"clear", map_clear, METH_NOARGS, "removes every entry"},
    {"table_bytes", map_table_bytes, METH_VARARGS | METH_STATIC,
     "table_bytes(layout, capacity) -> the bytes of the table a map of that capacity starts with (its memory)"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef map_getset[] = {{"slots", map_slots, nullptr, "the table's size", nullptr},
                            {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMappingMethods map_mapping = {map_len, map_subscript, map_ass};
PySequenceMethods map_sequence = {};

PyTypeObject map_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "aotx_fixedmap", "Fixed-width keys to rows, natively.", -1,
                          nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_aotx_fixedmap(void) {
  map_sequence.sq_contains = map_contains;
  map_type.tp_name = fm::TYPE_NAME;
  map_type.tp_basicsize = sizeof(Map);
  map_type.tp_flags = Py_TPFLAGS_DEFAULT;
  map_type.tp_doc = "Fixed-width keys to rows: gpu_worker/native/fixedmap.cpp";
  map_type.tp_new = PyType_GenericNew;
  map_type.tp_init = map_init;
  map_type.tp_dealloc = map_dealloc;
  map_type.tp_as_mapping = &map_mapping;
  map_type.tp_as_sequence = &map_sequence;
  map_type.tp_iter = map_iter;
  map_type.tp_methods = map_methods;
  map_type.tp_getset = map_getset;
  map_type.tp_richcompare = map_richcompare;
  map_type.tp_repr = map_repr;
  map_type.tp_hash = PyObject_HashNotImplemented;
  if (PyType_Ready(&map_type) < 0) return nullptr;
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  Py_INCREF(&map_type);
  if (PyModule_AddObject(module, "FixedMap", reinterpret_cast<PyObject*>(&map_type)) < 0) {
    Py_DECREF(&map_type);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
