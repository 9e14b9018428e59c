// Where a key of gpu_worker/shards.py's Shards lives, for the native code that reads and writes
// one (shards.cpp's bulk operations, jcodec.cpp's replay of a stretch of admissions).
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

namespace aotx {

// The dict of `shards` (a Shards' list of dicts) that holds `key`: the one at hash(key) mod the
// shard count, Python's floored modulo. A borrowed reference, or nullptr with an exception set.
inline PyObject* shard_of(PyObject* shards, PyObject* key) {
  const Py_ssize_t n = PyList_GET_SIZE(shards);
  if (n == 0) {
    PyErr_SetString(PyExc_ValueError, "no shards");
    return nullptr;
  }
  const Py_hash_t hash = PyObject_Hash(key);
  if (hash == -1 && PyErr_Occurred()) return nullptr;
  Py_ssize_t at = Py_ssize_t(hash % n);
  if (at < 0) at += n;  // (a negative hash)
  PyObject* shard = PyList_GET_ITEM(shards, at);
  if (!PyDict_CheckExact(shard)) {
    PyErr_SetString(PyExc_TypeError, "a shard is not a dict");
    return nullptr;
  }
  return shard;
}

}  // namespace aotx
