// The bulk operations of gpu_worker/shards.py's Shards, natively: a dictionary kept as a list of
// small dicts, a key in the one at index hash(key) mod len(list) (Python's floored modulo). Boot
// builds the indexes of a million rows with `update`, and a retirement removes hundreds of entries
// with `pop_all`; in Python each entry paid a loop iteration, a hash() call and a subscript, most of
// what indexing a checkpoint's receipts cost (docs/performance.md, "Replay").
//
//   update(shards, pairs) -> None: shards[hash(key) % n][key] = value for each (key, value) pair
//   pop_all(shards, keys[, default]) -> [value]: each key's value, removed; KeyError for a key that
//       is not there, unless a default is given (then the default is its value)
//
// Each does exactly what the Python loop it replaces did, in the same order: a key's hash is
// Python's hash(), so an entry lands in the shard Shards' own methods look in.
#include "shards.h"

namespace {

using aotx::shard_of;

// One (key, value) pair of `item`, as `for key, value in pairs` unpacks it; borrowed from `pair`
// (a new reference the caller releases).
bool unpack(PyObject* item, PyObject** pair, PyObject** key, PyObject** value) {
  *pair = PySequence_Tuple(item);
  if (*pair == nullptr) return false;
  if (PyTuple_GET_SIZE(*pair) != 2) {
    PyErr_Format(PyExc_ValueError, "a pair of 2 expected, got %zd values", PyTuple_GET_SIZE(*pair));
    return false;
  }
  *key = PyTuple_GET_ITEM(*pair, 0);
  *value = PyTuple_GET_ITEM(*pair, 1);
  return true;
}

PyObject* update(PyObject*, PyObject* args) {
  PyObject *shards, *pairs;
  if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &shards, &pairs)) return nullptr;
  PyObject* it = PyObject_GetIter(pairs);
  if (it == nullptr) return nullptr;
  PyObject* item;
  bool ok = true;
  while (ok && (item = PyIter_Next(it)) != nullptr) {
    PyObject *pair = nullptr, *key, *value, *shard;
    ok = unpack(item, &pair, &key, &value) && (shard = shard_of(shards, key)) != nullptr
         && PyDict_SetItem(shard, key, value) == 0;
    Py_XDECREF(pair);
    Py_DECREF(item);
  }
  Py_DECREF(it);
  if (!ok || PyErr_Occurred()) return nullptr;
  Py_RETURN_NONE;
}

PyObject* pop_all(PyObject*, PyObject* args) {
  PyObject *shards, *keys, *fallback = nullptr;
  if (!PyArg_ParseTuple(args, "O!O|O", &PyList_Type, &shards, &keys, &fallback)) return nullptr;
  PyObject* it = PyObject_GetIter(keys);
  if (it == nullptr) return nullptr;
  PyObject* values = PyList_New(0);
  if (values == nullptr) {
    Py_DECREF(it);
    return nullptr;
  }
  PyObject* key;
  bool ok = true;
  while (ok && (key = PyIter_Next(it)) != nullptr) {
    PyObject* shard = shard_of(shards, key);
    PyObject* value = shard == nullptr ? nullptr : PyDict_GetItemWithError(shard, key);  // borrowed
    if (value != nullptr) {
      Py_INCREF(value);
      ok = PyDict_DelItem(shard, key) == 0 && PyList_Append(values, value) == 0;
      Py_DECREF(value);
    } else if (shard != nullptr && !PyErr_Occurred()) {
      if (fallback != nullptr) {
        ok = PyList_Append(values, fallback) == 0;
      } else {
        PyObject* missing = PyTuple_Pack(1, key);  // (as dict's KeyError: the key itself, a tuple too)
        if (missing != nullptr) {
          PyErr_SetObject(PyExc_KeyError, missing);
          Py_DECREF(missing);
        }
        ok = false;
      }
    } else {
      ok = false;
    }
    Py_DECREF(key);
  }
  Py_DECREF(it);
  if (!ok || PyErr_Occurred()) {
    Py_DECREF(values);
    return nullptr;
  }
  return values;
}

PyMethodDef methods[] = {
    {"update", update, METH_VARARGS, "update(shards, pairs) -> None"},
    {"pop_all", pop_all, METH_VARARGS, "pop_all(shards, keys[, default]) -> [value]"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "aotx_shards", "Shards' bulk operations, natively.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_aotx_shards(void) { return PyModule_Create(&module_def); }
