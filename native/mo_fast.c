/*
 * mo_fast.c -- pyruntime._ringfast: the per-record hot calls of the ring as a small CPython
 * extension, over the same C handles (mo_producer / mo_consumer) that the cffi binding
 * (pyruntime._ring) allocates.
 *
 * Why: a cffi call costs 140-270 ns (argument packing, GIL release and retake, errno save) and
 * the per-record path makes one or two of them per record.  These METH_FASTCALL methods keep the
 * GIL and try the operation without waiting first; only when the ring is full (producer) or
 * empty (consumer) do they release the GIL and wait in C.  Large copies (>= FAST_COPY_NOGIL
 * bytes) also run without the GIL, as they did under cffi.
 *
 * Ownership: a Producer/Consumer holds the address of a handle and a reference to the Python
 * object that owns its memory (the cffi cdata), so the handle outlives every call.  Statuses are
 * returned, not raised: a negative int -(mo_status) for calls that return a sequence or an
 * offset, a mo_status for the others; pyruntime/ring.py turns them into its named errors, the
 * same way for both bindings.  The only exceptions raised here are Python's own: TypeError /
 * BufferError for a payload that is not a contiguous buffer, OverflowError for an integer out of
 * its C type's range.
 *
 * The library is compiled into this module (one translation unit: the hot paths inline) with
 * hidden visibility, so it does not clash with the copy inside pyruntime._ring.  Both copies
 * work on the same handle structs declared in mo_ring.h: the layout has one source.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "mo_ring.c"

#define FAST_COPY_NOGIL 65536 /* payloads this large are copied with the GIL released */

/* --- argument helpers ------------------------------------------------------------------------ */

static int arg_u64(PyObject *o, uint64_t *out) {
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
  *out = (uint64_t)v;
  return 0;
}

static int arg_i64(PyObject *o, int64_t *out) {
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) return -1;
  *out = (int64_t)v;
  return 0;
}

static int arg_u32(PyObject *o, uint32_t *out) {
  uint64_t v;
  if (arg_u64(o, &v) < 0) return -1;
  if (v > UINT32_MAX) {
    PyErr_SetString(PyExc_OverflowError, "value does not fit in 32 bits");
    return -1;
  }
  *out = (uint32_t)v;
  return 0;
}

static int nargs_ok(const char *name, Py_ssize_t n, Py_ssize_t want) {
  if (n == want) return 1;
  PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, n);
  return 0;
}

/* A contiguous view of a payload: bytes without the buffer protocol, anything else with it. */
typedef struct {
  const char *ptr;
  uint64_t len;
  Py_buffer view;
  int has_view;
} payload_ref;

static int payload_get(PyObject *o, payload_ref *pr) {
  pr->has_view = 0;
  if (PyBytes_CheckExact(o)) {
    pr->ptr = PyBytes_AS_STRING(o);
    pr->len = (uint64_t)PyBytes_GET_SIZE(o);
    return 0;
  }
  if (PyObject_GetBuffer(o, &pr->view, PyBUF_C_CONTIGUOUS) < 0) return -1;
  pr->has_view = 1;
  pr->ptr = pr->view.buf;
  pr->len = (uint64_t)pr->view.len;
  return 0;
}

static void payload_put(payload_ref *pr) {
  if (pr->has_view) PyBuffer_Release(&pr->view);
}

/* --- Producer -------------------------------------------------------------------------------- */

typedef struct {
  PyObject_HEAD
  mo_producer *p;
  PyObject *owner; /* keeps the handle's memory alive */
} Producer;

static int handle_init(PyObject *args, void **handle, PyObject **owner) {
  PyObject *addr, *own;
  if (!PyArg_ParseTuple(args, "OO", &addr, &own)) return -1;
  void *h = PyLong_AsVoidPtr(addr);
  if (!h) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null handle");
    return -1;
  }
  Py_INCREF(own);
  Py_XSETREF(*owner, own);
  *handle = h;
  return 0;
}

static int Producer_init(Producer *self, PyObject *args, PyObject *kw) {
  (void)kw;
  return handle_init(args, (void **)&self->p, &self->owner);
}

static void Producer_dealloc(Producer *self) {
  Py_XDECREF(self->owner);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* One record: try without waiting under the GIL, then wait (and copy big payloads) without it. */
static int64_t producer_write(mo_producer *p, uint64_t object_id, uint32_t flags, const char *data, uint64_t len,
                              int64_t timeout_ns) {
  int64_t r;
  if (len < FAST_COPY_NOGIL) {
    r = mo_producer_write(p, object_id, flags, data, len, 0);
    if (MO_LIKELY(r >= 0) || r != -(int64_t)MO_WOULD_BLOCK || timeout_ns == 0) return r;
  }
  Py_BEGIN_ALLOW_THREADS
  r = mo_producer_write(p, object_id, flags, data, len, timeout_ns);
  Py_END_ALLOW_THREADS
  return r;
}

/* put(object_id, payload) -> sequence or -status.  No flags, no time limit. */
static PyObject *Producer_put(Producer *self, PyObject *const *args, Py_ssize_t nargs) {
  if (!nargs_ok("put", nargs, 2)) return NULL;
  uint64_t object_id;
  if (arg_u64(args[0], &object_id) < 0) return NULL;
  payload_ref pr;
  if (payload_get(args[1], &pr) < 0) return NULL;
  int64_t r = producer_write(self->p, object_id, 0, pr.ptr, pr.len, -1);
  payload_put(&pr);
  return PyLong_FromLongLong(r);
}

/* write(object_id, payload, flags, timeout_ns) -> sequence or -status. */
static PyObject *Producer_write(Producer *self, PyObject *const *args, Py_ssize_t nargs) {
  if (!nargs_ok("write", nargs, 4)) return NULL;
  uint64_t object_id;
  uint32_t flags;
  int64_t timeout_ns;
  if (arg_u64(args[0], &object_id) < 0 || arg_u32(args[2], &flags) < 0 || arg_i64(args[3], &timeout_ns) < 0) return NULL;
  payload_ref pr;
  if (payload_get(args[1], &pr) < 0) return NULL;
  int64_t r = producer_write(self->p, object_id, flags, pr.ptr, pr.len, timeout_ns);
  payload_put(&pr);
  return PyLong_FromLongLong(r);
}

/* reserve(extent, timeout_ns) -> payload offset in the data region, or -status. */
static PyObject *Producer_reserve(Producer *self, PyObject *const *args, Py_ssize_t nargs) {
  if (!nargs_ok("reserve", nargs, 2)) return NULL;
  uint64_t extent;
  int64_t timeout_ns;
  if (arg_u64(args[0], &extent) < 0 || arg_i64(args[1], &timeout_ns) < 0) return NULL;
  mo_status st = mo_producer_reserve(self->p, extent, 0, NULL);
  if (st == MO_WOULD_BLOCK && timeout_ns != 0) {
    Py_BEGIN_ALLOW_THREADS
    st = mo_producer_reserve(self->p, extent, timeout_ns, NULL);
    Py_END_ALLOW_THREADS
  }
  if (st != MO_OK) return PyLong_FromLongLong(-(long long)st);
  return PyLong_FromUnsignedLongLong(mo_producer_reserved_offset(self->p));
}

/* commit(object_id, flags, publish) -> sequence or -status. */
static PyObject *Producer_commit(Producer *self, PyObject *const *args, Py_ssize_t nargs) {
  if (!nargs_ok("commit", nargs, 3)) return NULL;
  uint64_t object_id;
  uint32_t flags;
  if (arg_u64(args[0], &object_id) < 0 || arg_u32(args[1], &flags) < 0) return NULL;
  int publish = PyObject_IsTrue(args[2]);
  if (publish < 0) return NULL;
  int64_t r = publish ? mo_producer_commit(self->p, object_id, flags) : mo_producer_commit_deferred(self->p, object_id, flags);
  return PyLong_FromLongLong(r);
}

static PyMethodDef Producer_methods[] = {
  {"put", (PyCFunction)(void (*)(void))Producer_put, METH_FASTCALL, "put(object_id, payload) -> sequence or -status"},
  {"write", (PyCFunction)(void (*)(void))Producer_write, METH_FASTCALL,
   "write(object_id, payload, flags, timeout_ns) -> sequence or -status"},
  {"reserve", (PyCFunction)(void (*)(void))Producer_reserve, METH_FASTCALL,
   "reserve(extent, timeout_ns) -> payload offset in the data region, or -status"},
  {"commit", (PyCFunction)(void (*)(void))Producer_commit, METH_FASTCALL,
   "commit(object_id, flags, publish) -> sequence or -status"},
  {NULL, NULL, 0, NULL},
};

static PyTypeObject ProducerType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "pyruntime._ringfast.Producer",
  .tp_doc = "Producer(handle_address, owner): the per-record calls of one mo_producer handle",
  .tp_basicsize = sizeof(Producer),
  .tp_flags = Py_TPFLAGS_DEFAULT,
  .tp_new = PyType_GenericNew,
  .tp_init = (initproc)Producer_init,
  .tp_dealloc = (destructor)Producer_dealloc,
  .tp_methods = Producer_methods,
};

/* --- Consumer -------------------------------------------------------------------------------- */

typedef struct {
  PyObject_HEAD
  mo_consumer *c;
  PyObject *owner;
} Consumer;

static int Consumer_init(Consumer *self, PyObject *args, PyObject *kw) {
  (void)kw;
  return handle_init(args, (void **)&self->c, &self->owner);
}

static void Consumer_dealloc(Consumer *self) {
  Py_XDECREF(self->owner);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Take the next record into c->views[c->slot]: try under the GIL, wait without it. */
static mo_status consumer_take(mo_consumer *c, int64_t timeout_ns) {
  mo_status st = mo_consumer_take_timed(c, 0);
  if (MO_LIKELY(st != MO_WOULD_BLOCK) || timeout_ns == 0) return st;
  Py_BEGIN_ALLOW_THREADS
  st = mo_consumer_take_timed(c, timeout_ns);
  Py_END_ALLOW_THREADS
  return st;
}

static int timeout_arg(const char *name, PyObject *const *args, Py_ssize_t nargs, int64_t *timeout_ns) {
  if (!nargs_ok(name, nargs, 1)) return -1;
  return arg_i64(args[0], timeout_ns);
}

/* take(timeout_ns) -> status; the record is in views[slot - 1]. */
static PyObject *Consumer_take(Consumer *self, PyObject *const *args, Py_ssize_t nargs) {
  int64_t t;
  if (timeout_arg("take", args, nargs, &t) < 0) return NULL;
  return PyLong_FromLong((long)consumer_take(self->c, t));
}

/* take_next(timeout_ns) -> status: release every record held, then take one into views[0]. */
static PyObject *Consumer_take_next(Consumer *self, PyObject *const *args, Py_ssize_t nargs) {
  int64_t t;
  if (timeout_arg("take_next", args, nargs, &t) < 0) return NULL;
  mo_consumer_release(self->c);
  return PyLong_FromLong((long)consumer_take(self->c, t));
}

/* release() -> records released. */
static PyObject *Consumer_release(Consumer *self, PyObject *unused) {
  (void)unused;
  return PyLong_FromUnsignedLongLong(mo_consumer_release(self->c));
}

static PyMethodDef Consumer_methods[] = {
  {"take", (PyCFunction)(void (*)(void))Consumer_take, METH_FASTCALL, "take(timeout_ns) -> status"},
  {"take_next", (PyCFunction)(void (*)(void))Consumer_take_next, METH_FASTCALL,
   "take_next(timeout_ns) -> status (release, then take into views[0])"},
  {"release", (PyCFunction)Consumer_release, METH_NOARGS, "release() -> records released"},
  {NULL, NULL, 0, NULL},
};

static PyTypeObject ConsumerType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "pyruntime._ringfast.Consumer",
  .tp_doc = "Consumer(handle_address, owner): the per-record calls of one mo_consumer handle",
  .tp_basicsize = sizeof(Consumer),
  .tp_flags = Py_TPFLAGS_DEFAULT,
  .tp_new = PyType_GenericNew,
  .tp_init = (initproc)Consumer_init,
  .tp_dealloc = (destructor)Consumer_dealloc,
  .tp_methods = Consumer_methods,
};

/* --- module ---------------------------------------------------------------------------------- */

static struct PyModuleDef fastmodule = {
  PyModuleDef_HEAD_INIT, "pyruntime._ringfast",
  "Per-record fast path of the MO01 ring (see native/mo_fast.c); pyruntime.ring uses it when present.", -1,
  NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ringfast(void) {
  if (PyType_Ready(&ProducerType) < 0 || PyType_Ready(&ConsumerType) < 0) return NULL;
  PyObject *m = PyModule_Create(&fastmodule);
  if (!m) return NULL;
  /* sizes of the handle structs as compiled here: ring.py checks them against cffi's */
  if (PyModule_AddIntConstant(m, "SIZEOF_PRODUCER", (long)sizeof(mo_producer)) < 0 ||
      PyModule_AddIntConstant(m, "SIZEOF_CONSUMER", (long)sizeof(mo_consumer)) < 0 ||
      PyModule_AddIntConstant(m, "SIZEOF_VIEW", (long)sizeof(mo_view)) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  Py_INCREF(&ProducerType);
  if (PyModule_AddObject(m, "Producer", (PyObject *)&ProducerType) < 0) {
    Py_DECREF(&ProducerType);
    Py_DECREF(m);
    return NULL;
  }
  Py_INCREF(&ConsumerType);
  if (PyModule_AddObject(m, "Consumer", (PyObject *)&ConsumerType) < 0) {
    Py_DECREF(&ConsumerType);
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
