// What the native modules' Python types share (sockio.cpp's Loop, tick_io.cpp's Syncer): a Python
// object owning one native object, its type's set-up, and the entry tick_io.cpp gives sockio.cpp's
// module init.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <exception>

namespace aotx {

// A Python object owning one native object (Loop, Syncer): deleted without the interpreter lock,
// since deleting joins its thread.
template <class T>
struct Handle {
  PyObject_HEAD
  T* ptr;
};

template <class T>
void release(Handle<T>* self) {
  T* ptr = self->ptr;
  self->ptr = nullptr;
  if (ptr) {
    Py_BEGIN_ALLOW_THREADS
    delete ptr;
    Py_END_ALLOW_THREADS
  }
}

template <class T>
void dealloc(Handle<T>* self) {
  release(self);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

template <class T>
T* unwrap(Handle<T>* self, const char* missing) {
  if (!self->ptr) PyErr_SetString(PyExc_RuntimeError, missing);
  return self->ptr;
}

// tp_init: the native object made once; a constructor's failure (a thread or an eventfd the
// system refused) becomes OSError.
template <class T, class... Args>
int construct(Handle<T>* self, const char* name, Args... args) {
  if (self->ptr) {
    PyErr_Format(PyExc_RuntimeError, "%s already initialised", name);
    return -1;
  }
  try {
    self->ptr = new T(args...);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_OSError, e.what());
    return -1;
  }
  return 0;
}

// Fills `type` as the Python type `qualname` of Handle<T> objects, made by `init`, with `methods`,
// and adds it to `module` as `name`; -1 with an exception set on failure.
template <class T>
int add_type(PyObject* module, PyTypeObject& type, const char* name, const char* qualname, const char* doc,
             initproc init, PyMethodDef* methods) {
  type.tp_name = qualname;
  type.tp_basicsize = sizeof(Handle<T>);
  type.tp_flags = Py_TPFLAGS_DEFAULT;
  type.tp_doc = doc;
  type.tp_new = PyType_GenericNew;
  type.tp_init = init;
  type.tp_dealloc = (destructor)dealloc<T>;
  type.tp_methods = methods;
  if (PyType_Ready(&type) < 0) return -1;
  Py_INCREF(&type);
  if (PyModule_AddObject(module, name, reinterpret_cast<PyObject*>(&type)) < 0) {
    Py_DECREF(&type);
    return -1;
  }
  return 0;
}

// Adds the Syncer type (tick_io.cpp) to the aotx_sockio module; -1 with an exception set on failure.
int add_tick_io(PyObject* module);

}  // namespace aotx
