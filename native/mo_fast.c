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
 * Records: `Record` is a record slot (a mo_view the consumer fills) with its header fields as C
 * getters and the buffer protocol over its payload, so `rec.payload` / `rec.object_id` cost no
 * cffi call.  Consumer.read / next_record and Producer.write are vectorcall entry points that do
 * the common case (no arguments but the record) entirely in C and hand anything else -- keyword
 * arguments, a timeout, a status that is not MO_OK -- to a Python function given at bind time,
 * which owns the semantics (timeouts, signals, named errors).  Those hold the Writer/Reader only
 * through a weak reference: no reference cycle, so the Python objects die when their last user drops them.
 *
 * The library (mo_ring.c and mo_ring_extra.c) is compiled into this module (one translation
 * unit: the hot paths inline) with
 * hidden visibility, so it does not clash with the copy inside pyruntime._ring.  Both copies
 * work on the same handle structs declared in mo_ring.h: the layout has one source.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "mo_ring.c"
#include "mo_ring_extra.c"

/* What pyruntime/ring.py expects of this module (FAST_API there): bump on any change to the
 * methods or types it uses, so that a stale build is ignored rather than half-used. */
#define FAST_API 4

#ifndef FAST_COPY_NOGIL /* -D for experiments */
#define FAST_COPY_NOGIL 65536 /* payloads this large are copied with the GIL released */
#endif
/* An empty ring is first watched this long with the GIL held (at most the handle's spin_ns):
 * a record that comes within it is taken without releasing and re-taking the GIL (a cost on
 * the critical path of a ping-pong).  Other Python threads of the process wait at most this
 * long; past it the wait continues in C without the GIL. */
#ifndef FAST_GIL_SPIN_NS /* -D for experiments */
#define FAST_GIL_SPIN_NS 5000
#endif

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

/* A timeout argument as ring.py's _timeout_ns converts it: None -> -1 (no limit), seconds >= 0 ->
 * nanoseconds (saturating at INT64_MAX; a positive timeout never rounds down to 0, "do not wait").
 * -1 for anything else, with no error set: the Python fallback raises the API's own error. */
static int timeout_ns_of(PyObject *o, int64_t *out) {
  if (o == Py_None) {
    *out = -1;
    return 0;
  }
  double t = PyFloat_AsDouble(o);
  if (t == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    return -1;
  }
  if (!(t >= 0)) return -1; /* NaN too */
  double ns = t * 1e9;
  *out = ns >= 9223372036854775807.0 ? INT64_MAX : (int64_t)ns;
  if (*out == 0 && t != 0) *out = 1;
  return 0;
}

/* The optional arguments of an entry point, positional (after `skip` required ones) or by keyword:
 * out[k] is the one named names[k], or NULL.  -1 for too many, unknown or repeated ones (the
 * Python fallback raises TypeError for them). */
static int opt_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t skip,
                    const char *const *names, Py_ssize_t nnames, PyObject **out) {
  for (Py_ssize_t k = 0; k < nnames; k++) out[k] = NULL;
  if (nargs < skip || nargs - skip > nnames) return -1;
  for (Py_ssize_t i = skip; i < nargs; i++) out[i - skip] = args[i];
  Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t j = 0; j < nkw; j++) {
    PyObject *name = PyTuple_GET_ITEM(kwnames, j);
    Py_ssize_t k = 0;
    while (k < nnames && PyUnicode_CompareWithASCIIString(name, names[k]) != 0) k++;
    if (k == nnames || out[k]) return -1;
    out[k] = args[nargs + j];
  }
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


/* --- hand-off to Python ----------------------------------------------------------------------- */

/* Call fn(owner, status, *args, **kw) where owner is the object behind weak reference `wr`
 * (the Writer/Reader) and args/kwnames are the vectorcall arguments received.  The Python
 * function does what the C entry point did not: it owns timeouts, retries and error raising. */
static PyObject *call_slow(PyObject *fn, PyObject *wr, long status, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames) {
  if (!fn || !wr) {
    PyErr_SetString(PyExc_RuntimeError, "pyruntime._ringfast: handle used before bind()");
    return NULL;
  }
  PyObject *owner = PyWeakref_GetObject(wr); /* borrowed */
  if (!owner || owner == Py_None) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "pyruntime._ringfast: the Writer/Reader is gone");
    return NULL;
  }
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  PyObject *small[8];
  PyObject **stack = small;
  if (nargs + nkw + 2 > (Py_ssize_t)(sizeof small / sizeof small[0])) {
    stack = PyMem_Malloc((size_t)(nargs + nkw + 2) * sizeof(PyObject *));
    if (!stack) return PyErr_NoMemory();
  }
  PyObject *st = PyLong_FromLong(status);
  if (!st) {
    if (stack != small) PyMem_Free(stack);
    return NULL;
  }
  Py_INCREF(owner);
  stack[0] = owner;
  stack[1] = st;
  for (Py_ssize_t i = 0; i < nargs + nkw; i++) stack[2 + i] = args[i];
  PyObject *r = PyObject_Vectorcall(fn, stack, (size_t)(nargs + 2), kwnames);
  Py_DECREF(owner);
  Py_DECREF(st);
  if (stack != small) PyMem_Free(stack);
  return r;
}

/* bind(owner, slow...): keep a weak reference to owner and the Python fallbacks. */
static int bind_slow(PyObject *owner, PyObject **wr, PyObject **slots[], PyObject *const *fns, Py_ssize_t n) {
  PyObject *ref = PyWeakref_NewRef(owner, NULL);
  if (!ref) return -1;
  Py_XSETREF(*wr, ref);
  for (Py_ssize_t i = 0; i < n; i++) {
    if (!PyCallable_Check(fns[i])) {
      PyErr_SetString(PyExc_TypeError, "bind(): the fallbacks must be callable");
      return -1;
    }
    Py_INCREF(fns[i]);
    Py_XSETREF(*slots[i], fns[i]);
  }
  return 0;
}

/* --- Producer -------------------------------------------------------------------------------- */

typedef struct {
  PyObject_HEAD
  mo_producer *p;
  Py_buffer hold;       /* the handle's memory, held (hold_struct) */
  PyObject *wr;         /* weak reference to the Writer (bind) */
  PyObject *write_slow; /* fn(writer, status, *args, **kw): everything fast_write does not do */
} Producer;

/* Hold an export of `obj` (a cffi buffer over the struct, `ffi.buffer(ptr)`) at least `size` bytes long: the
 * address comes from the buffer, never from a Python int, so no call from Python can hand us a bad pointer, and
 * the export keeps the memory where it is for the object's life. */
static int hold_struct(PyObject *obj, Py_ssize_t size, int flags, Py_buffer *out, const char *what) {
  if (PyObject_GetBuffer(obj, out, flags) < 0) return -1;
  if (out->len < size || ((uintptr_t)out->buf % _Alignof(uint64_t)) != 0) {
    PyBuffer_Release(out);
    PyErr_Format(PyExc_ValueError, "%s: needs an aligned buffer of at least %zd bytes", what, size);
    return -1;
  }
  return 0;
}

/* Producer(buffer) and Consumer(buffer): the handle, a cffi buffer over the mo_producer / mo_consumer. */
static PyObject *handle_new(PyTypeObject *type, PyObject *args, Py_ssize_t size, Py_ssize_t hold_at, const char *what) {
  PyObject *obj;
  if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
  PyObject *self = type->tp_alloc(type, 0);
  if (!self) return NULL;
  if (hold_struct(obj, size, PyBUF_WRITABLE, (Py_buffer *)((char *)self + hold_at), what) < 0) {
    Py_DECREF(self);
    return NULL;
  }
  return self;
}

static PyObject *Producer_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  (void)kw;
  Producer *self = (Producer *)handle_new(type, args, sizeof(mo_producer), offsetof(Producer, hold), "Producer");
  if (self) self->p = self->hold.buf;
  return (PyObject *)self;
}

static void Producer_dealloc(Producer *self) {
  if (self->hold.obj) PyBuffer_Release(&self->hold);
  Py_XDECREF(self->wr);
  Py_XDECREF(self->write_slow);
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

/* bind(writer, write_slow) */
static PyObject *Producer_bind(Producer *self, PyObject *const *args, Py_ssize_t nargs) {
  if (!nargs_ok("bind", nargs, 2)) return NULL;
  PyObject **slots[] = {&self->write_slow};
  if (bind_slow(args[0], &self->wr, slots, args + 1, 1) < 0) return NULL;
  Py_RETURN_NONE;
}

/* fast_write(object_id, payload, flags=0, timeout=None) -> sequence: Writer.write itself, done
 * here; an argument C does not take (a failed conversion) or a status other than MO_OK goes to
 * write_slow(writer, -status or 0, *args, **kw), which raises the named error or finishes the
 * write (after MO_INTERRUPTED: the rest of the timeout, from the handle's deadline). */
static PyObject *Producer_fast_write(Producer *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"flags", "timeout"};
  PyObject *opt[2];
  uint64_t object_id;
  uint32_t flags = 0;
  int64_t timeout_ns = -1;
  payload_ref pr;
  if (MO_LIKELY(opt_args(args, nargs, kwnames, 2, names, 2, opt) == 0 && (!opt[0] || arg_u32(opt[0], &flags) == 0) &&
                (!opt[1] || timeout_ns_of(opt[1], &timeout_ns) == 0) && arg_u64(args[0], &object_id) == 0 &&
                payload_get(args[1], &pr) == 0)) {
    int64_t r = producer_write(self->p, object_id, flags, pr.ptr, pr.len, timeout_ns);
    payload_put(&pr);
    if (MO_LIKELY(r >= 0)) return PyLong_FromLongLong(r);
    return call_slow(self->write_slow, self->wr, (long)-r, args, (size_t)nargs, kwnames);
  }
  PyErr_Clear(); /* the Python side raises the API's own error for it */
  return call_slow(self->write_slow, self->wr, 0, args, (size_t)nargs, kwnames);
}

static PyMethodDef Producer_methods[] = {
  {"bind", (PyCFunction)(void (*)(void))Producer_bind, METH_FASTCALL, "bind(writer, write_slow)"},
  {"fast_write", (PyCFunction)(void (*)(void))Producer_fast_write, METH_FASTCALL | METH_KEYWORDS,
   "fast_write(object_id, payload, flags=0, timeout=None) -> sequence (Writer.write)"},
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
  .tp_doc = "Producer(buffer): the per-record calls of the mo_producer handle `buffer` exports (ffi.buffer(handle))",
  .tp_basicsize = sizeof(Producer),
  .tp_flags = Py_TPFLAGS_DEFAULT,
  .tp_new = Producer_new,
  .tp_dealloc = (destructor)Producer_dealloc,
  .tp_methods = Producer_methods,
};

/* --- Consumer -------------------------------------------------------------------------------- */

typedef struct {
  PyObject_HEAD
  mo_consumer *c;
  Py_buffer hold;      /* the handle's memory, held (hold_struct) */
  PyObject *recs;      /* list: recs[k] is the Record over c->views[k] (set_records) */
  PyObject *wr;        /* weak reference to the Reader (bind) */
  PyObject *read_slow; /* fn(reader, status, *args, **kw) */
  PyObject *next_slow;
} Consumer;

static PyObject *Consumer_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  (void)kw;
  Consumer *self = (Consumer *)handle_new(type, args, sizeof(mo_consumer), offsetof(Consumer, hold), "Consumer");
  if (self) self->c = self->hold.buf;
  return (PyObject *)self;
}

static void Consumer_dealloc(Consumer *self) {
  if (self->hold.obj) PyBuffer_Release(&self->hold);
  Py_XDECREF(self->recs);
  Py_XDECREF(self->wr);
  Py_XDECREF(self->read_slow);
  Py_XDECREF(self->next_slow);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Take the next record into c->views[c->slot]: try under the GIL, watch the ring for up to
 * FAST_GIL_SPIN_NS (and the handle's spin_ns) still holding it, then wait without it. */
static mo_status consumer_take(mo_consumer *c, int64_t timeout_ns) {
  mo_status st = mo_consumer_take_timed(c, 0);
  if (MO_LIKELY(st != MO_WOULD_BLOCK) || timeout_ns == 0) return st;
  uint64_t spin = c->spin_ns < FAST_GIL_SPIN_NS ? c->spin_ns : FAST_GIL_SPIN_NS;
  if (spin && timeout_ns < 0) { /* a bounded wait keeps its deadline in C */
    int64_t end = now_ns() + (int64_t)spin;
    for (uint32_t i = 1;; i++) {
      cpu_relax();
      /* the producer's cursor, as the library's own spin watches it; take() loads it with acquire */
      if (atomic_load_explicit(&c->r.ctrl->head, RELAXED) != c->rpos) {
        st = mo_consumer_take_timed(c, 0);
        if (st != MO_WOULD_BLOCK) return st; /* else: only padding was published */
      }
      if ((i & 63) == 0 && now_ns() >= end) break;
    }
  }
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

/* bind(reader, read_slow, next_slow) */
static PyObject *Consumer_bind(Consumer *self, PyObject *const *args, Py_ssize_t nargs) {
  if (!nargs_ok("bind", nargs, 3)) return NULL;
  PyObject **slots[] = {&self->read_slow, &self->next_slow};
  if (bind_slow(args[0], &self->wr, slots, args + 1, 2) < 0) return NULL;
  Py_RETURN_NONE;
}

/* set_records(list): recs[k] is the Record over views[k]; called whenever views change. */
static PyObject *Consumer_set_records(Consumer *self, PyObject *recs) {
  if (!PyList_CheckExact(recs)) {
    PyErr_SetString(PyExc_TypeError, "set_records() needs a list");
    return NULL;
  }
  Py_INCREF(recs);
  Py_XSETREF(self->recs, recs);
  Py_RETURN_NONE;
}

/* recs[k], new reference, or NULL (no error set) when there is no such Record. */
static PyObject *record_at(Consumer *self, uint32_t k) {
  if (MO_UNLIKELY(!self->recs || (Py_ssize_t)k >= PyList_GET_SIZE(self->recs))) return NULL;
  PyObject *r = PyList_GET_ITEM(self->recs, k);
  Py_INCREF(r);
  return r;
}

static const char *const TIMEOUT_NAME[] = {"timeout"};

/* fast_read(timeout=None) -> Record: Reader.read itself.  Done here while a view slot is free;
 * else read_slow(reader, status or 0, *args, **kw). */
static PyObject *Consumer_fast_read(Consumer *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
  mo_consumer *c = self->c;
  PyObject *timeout;
  int64_t timeout_ns = -1;
  if (MO_LIKELY(opt_args(args, nargs, kwnames, 0, TIMEOUT_NAME, 1, &timeout) == 0 &&
                (!timeout || timeout_ns_of(timeout, &timeout_ns) == 0) && c->slot < c->nviews && self->recs &&
                (Py_ssize_t)c->slot < PyList_GET_SIZE(self->recs))) {
    uint32_t k = c->slot;
    mo_status st = consumer_take(c, timeout_ns);
    if (MO_LIKELY(st == MO_OK)) {
      PyObject *r = record_at(self, k);
      if (r) return r;
    }
    return call_slow(self->read_slow, self->wr, (long)st, args, (size_t)nargs, kwnames);
  }
  return call_slow(self->read_slow, self->wr, 0, args, (size_t)nargs, kwnames);
}

/* fast_next(timeout=None) -> Record: Reader.next_record itself (release, then read into slot 0). */
static PyObject *Consumer_fast_next(Consumer *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
  PyObject *timeout;
  int64_t timeout_ns = -1;
  if (MO_LIKELY(opt_args(args, nargs, kwnames, 0, TIMEOUT_NAME, 1, &timeout) == 0 &&
                (!timeout || timeout_ns_of(timeout, &timeout_ns) == 0) && self->recs && PyList_GET_SIZE(self->recs) > 0)) {
    mo_consumer_release(self->c);
    mo_status st = consumer_take(self->c, timeout_ns);
    if (MO_LIKELY(st == MO_OK)) {
      PyObject *r = record_at(self, 0);
      if (r) return r;
    }
    return call_slow(self->next_slow, self->wr, (long)st, args, (size_t)nargs, kwnames);
  }
  return call_slow(self->next_slow, self->wr, 0, args, (size_t)nargs, kwnames);
}

/* read_many(out, max, timeout_ns) -> records taken into out (a writable buffer of at least max
 * mo_view), or -status.  Tries under the GIL, waits without it. */
static PyObject *Consumer_read_many(Consumer *self, PyObject *const *args, Py_ssize_t nargs) {
  if (!nargs_ok("read_many", nargs, 3)) return NULL;
  uint32_t max;
  int64_t timeout_ns;
  if (arg_u32(args[1], &max) < 0 || arg_i64(args[2], &timeout_ns) < 0) return NULL;
  Py_buffer out;
  if (PyObject_GetBuffer(args[0], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
  if ((uint64_t)out.len < (uint64_t)max * sizeof(mo_view)) {
    PyBuffer_Release(&out);
    PyErr_SetString(PyExc_ValueError, "read_many(): out holds fewer than max views");
    return NULL;
  }
  uint32_t n = 0;
  mo_status st = mo_consumer_read_many(self->c, out.buf, max, 0, &n);
  if (st == MO_WOULD_BLOCK && timeout_ns != 0) {
    Py_BEGIN_ALLOW_THREADS
    st = mo_consumer_read_many(self->c, out.buf, max, timeout_ns, &n);
    Py_END_ALLOW_THREADS
  }
  PyBuffer_Release(&out);
  if (st != MO_OK) return PyLong_FromLong(-(long)st);
  return PyLong_FromUnsignedLong(n);
}

static PyMethodDef Consumer_methods[] = {
  {"bind", (PyCFunction)(void (*)(void))Consumer_bind, METH_FASTCALL, "bind(reader, read_slow, next_slow)"},
  {"set_records", (PyCFunction)Consumer_set_records, METH_O, "set_records(list): recs[k] is the Record over views[k]"},
  {"fast_read", (PyCFunction)(void (*)(void))Consumer_fast_read, METH_FASTCALL | METH_KEYWORDS,
   "fast_read(timeout=None) -> Record (Reader.read)"},
  {"fast_next", (PyCFunction)(void (*)(void))Consumer_fast_next, METH_FASTCALL | METH_KEYWORDS,
   "fast_next(timeout=None) -> Record (Reader.next_record)"},
  {"read_many", (PyCFunction)(void (*)(void))Consumer_read_many, METH_FASTCALL,
   "read_many(out, max, timeout_ns) -> records taken into out, or -status"},
  {"take", (PyCFunction)(void (*)(void))Consumer_take, METH_FASTCALL, "take(timeout_ns) -> status"},
  {"take_next", (PyCFunction)(void (*)(void))Consumer_take_next, METH_FASTCALL,
   "take_next(timeout_ns) -> status (release, then take into views[0])"},
  {"release", (PyCFunction)Consumer_release, METH_NOARGS, "release() -> records released"},
  {NULL, NULL, 0, NULL},
};

static PyTypeObject ConsumerType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "pyruntime._ringfast.Consumer",
  .tp_doc = "Consumer(buffer): the per-record calls of the mo_consumer handle `buffer` exports (ffi.buffer(handle))",
  .tp_basicsize = sizeof(Consumer),
  .tp_flags = Py_TPFLAGS_DEFAULT,
  .tp_new = Consumer_new,
  .tp_dealloc = (destructor)Consumer_dealloc,
  .tp_methods = Consumer_methods,
};

/* --- Record ---------------------------------------------------------------------------------- */

/* One record slot: the mo_view at `v` (filled by the consumer), read through C getters, and the
 * buffer protocol over its payload (read-only; `np.frombuffer(rec)`, `bytes(rec)` copy or view
 * without an intermediate memoryview).  While any buffer over a payload is alive the Record
 * holds one export of `data` (the Reader's view of the ring's data region), so the mapping
 * outlives the arena's close exactly as a slice of that view would. */
typedef struct {
  PyObject_HEAD
  const mo_view *v;
  Py_buffer views;     /* the cffi array of views *v lies in, held (hold_struct) */
  PyObject *data;      /* read-only memoryview of the ring's data region */
  Py_ssize_t exports;  /* buffers handed out over payloads */
  Py_buffer hold;      /* export of data, held while exports > 0 */
} Record;

/* Record(views, k, data): the record over views[k], views a cffi buffer over an array of mo_view (checked: k
 * within it), data the Reader's read-only view of the ring's data region. */
static PyObject *Record_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  (void)kw;
  PyObject *views, *data;
  Py_ssize_t k;
  if (!PyArg_ParseTuple(args, "OnO", &views, &k, &data)) return NULL;
  if (k < 0 || k > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(mo_view) - 1) {
    PyErr_SetString(PyExc_IndexError, "Record: view index out of range");
    return NULL;
  }
  Record *self = (Record *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  if (hold_struct(views, (k + 1) * (Py_ssize_t)sizeof(mo_view), PyBUF_SIMPLE, &self->views, "Record") < 0) {
    Py_DECREF(self);
    return NULL;
  }
  self->v = (const mo_view *)self->views.buf + k;
  Py_INCREF(data);
  self->data = data;
  return (PyObject *)self;
}

static void Record_dealloc(Record *self) {
  if (self->views.obj) PyBuffer_Release(&self->views);
  Py_XDECREF(self->data);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Record_getbuffer(Record *self, Py_buffer *view, int flags) {
  if (!self->v || !self->data) {
    PyErr_SetString(PyExc_BufferError, "Record: not initialised");
    view->obj = NULL;
    return -1;
  }
  if (self->exports == 0 && PyObject_GetBuffer(self->data, &self->hold, PyBUF_SIMPLE) < 0) {
    view->obj = NULL;
    return -1; /* e.g. ValueError: the data view was released (arena closed) */
  }
  uint64_t o = self->v->data_offset, e = self->v->extent;
  if (o > (uint64_t)self->hold.len || e > (uint64_t)self->hold.len - o) {
    if (self->exports == 0) PyBuffer_Release(&self->hold);
    PyErr_SetString(PyExc_BufferError, "Record: the payload lies outside the ring's data region");
    view->obj = NULL;
    return -1;
  }
  if (PyBuffer_FillInfo(view, (PyObject *)self, (char *)self->hold.buf + o, (Py_ssize_t)e, 1, flags) < 0) {
    if (self->exports == 0) PyBuffer_Release(&self->hold);
    return -1;
  }
  self->exports++;
  return 0;
}

static void Record_releasebuffer(Record *self, Py_buffer *view) {
  (void)view;
  if (--self->exports == 0) PyBuffer_Release(&self->hold);
}

static PyBufferProcs Record_as_buffer = {
  .bf_getbuffer = (getbufferproc)Record_getbuffer,
  .bf_releasebuffer = (releasebufferproc)Record_releasebuffer,
};

#define RECORD_U64(field)                                                              \
  static PyObject *Record_get_##field(Record *self, void *closure) {                    \
    (void)closure;                                                                     \
    if (MO_UNLIKELY(!self->v)) Py_RETURN_NONE;                                         \
    return PyLong_FromUnsignedLongLong(self->v->field);                                \
  }
RECORD_U64(object_id)
RECORD_U64(sequence)
RECORD_U64(extent)
RECORD_U64(flags)
RECORD_U64(position)
RECORD_U64(data_offset)

/* payload: a read-only memoryview over the payload in the ring (no copy): a slice of `data`, as
 * the cffi binding makes it (one memoryview object; a memoryview over the Record itself would
 * need a managed buffer object as well, ~50 ns more). */
static PyObject *Record_get_payload(Record *self, void *closure) {
  (void)closure;
  if (MO_UNLIKELY(!self->v || !self->data)) {
    PyErr_SetString(PyExc_ValueError, "Record: not initialised");
    return NULL;
  }
  uint64_t o = self->v->data_offset, e = self->v->extent;
  if (MO_UNLIKELY(o > (uint64_t)PY_SSIZE_T_MAX || e > (uint64_t)PY_SSIZE_T_MAX - o)) {
    PyErr_SetString(PyExc_BufferError, "Record: the payload lies outside the ring's data region");
    return NULL;
  }
  return PySequence_GetSlice(self->data, (Py_ssize_t)o, (Py_ssize_t)(o + e));
}

/* tobytes() -> bytes: a copy of the payload, through the buffer protocol above, without a
 * Python frame or an intermediate memoryview (the per-record copy-out). */
static PyObject *Record_tobytes(Record *self, PyObject *unused) {
  (void)unused;
  return PyBytes_FromObject((PyObject *)self);
}

/* readinto(buffer) -> bytes copied: the payload copied to the start of a writable buffer that holds
 * it (Record.readinto; a copy-out that allocates nothing).  Large payloads are copied without the
 * GIL, as Producer.write copies them in. */
static PyObject *Record_readinto(Record *self, PyObject *buffer) {
  Py_buffer src, dst;
  if (PyObject_GetBuffer(buffer, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "readinto needs a writable C-contiguous buffer, not %.100s", Py_TYPE(buffer)->tp_name);
    return NULL;
  }
  if (PyObject_GetBuffer((PyObject *)self, &src, PyBUF_SIMPLE) < 0) { /* the payload, checked as for any export */
    PyBuffer_Release(&dst);
    return NULL;
  }
  PyObject *r = NULL;
  if (dst.len < src.len) {
    PyErr_Format(PyExc_ValueError, "the buffer holds %zd bytes, the payload has %zd", dst.len, src.len);
  } else {
    if (src.len < FAST_COPY_NOGIL) {
      memcpy(dst.buf, src.buf, (size_t)src.len);
    } else {
      Py_BEGIN_ALLOW_THREADS
      memcpy(dst.buf, src.buf, (size_t)src.len);
      Py_END_ALLOW_THREADS
    }
    r = PyLong_FromSsize_t(src.len);
  }
  PyBuffer_Release(&src);
  PyBuffer_Release(&dst);
  return r;
}

static PyMethodDef Record_methods[] = {
  {"tobytes", (PyCFunction)Record_tobytes, METH_NOARGS, "tobytes() -> bytes: a copy of the payload"},
  {"readinto", (PyCFunction)Record_readinto, METH_O, "readinto(buffer) -> int: the payload copied into buffer"},
  {NULL, NULL, 0, NULL},
};

static PyGetSetDef Record_getset[] = {
  {"object_id", (getter)Record_get_object_id, NULL, "object id from the header", NULL},
  {"sequence", (getter)Record_get_sequence, NULL, "sequence number from the header", NULL},
  {"flags", (getter)Record_get_flags, NULL, "flags from the header", NULL},
  {"extent", (getter)Record_get_extent, NULL, "payload bytes", NULL},
  {"position", (getter)Record_get_position, NULL, "free-running byte position of the header", NULL},
  {"data_offset", (getter)Record_get_data_offset, NULL, "payload offset in the data region", NULL},
  {"payload", (getter)Record_get_payload, NULL, "read-only view of the payload in shared memory (no copy)", NULL},
  {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RecordType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "pyruntime._ringfast.Record",
  .tp_doc = "Record(views, k, data): the record slot views[k] read through C (pyruntime.ring subclasses it)",
  .tp_basicsize = sizeof(Record),
  .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
  .tp_new = Record_new,
  .tp_dealloc = (destructor)Record_dealloc,
  .tp_getset = Record_getset,
  .tp_methods = Record_methods,
  .tp_as_buffer = &Record_as_buffer,
};

/* --- module ---------------------------------------------------------------------------------- */

static struct PyModuleDef fastmodule = {
  PyModuleDef_HEAD_INIT, "pyruntime._ringfast",
  "Per-record fast path of the MO01 ring (see native/mo_fast.c); pyruntime.ring uses it when present.", -1,
  NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ringfast(void) {
  if (PyType_Ready(&ProducerType) < 0 || PyType_Ready(&ConsumerType) < 0 || PyType_Ready(&RecordType) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&fastmodule);
  if (!m) return NULL;
  /* sizes of the handle structs as compiled here: ring.py checks them against cffi's */
  if (PyModule_AddIntConstant(m, "API", FAST_API) < 0 ||
      PyModule_AddIntConstant(m, "SIZEOF_PRODUCER", (long)sizeof(mo_producer)) < 0 ||
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
  Py_INCREF(&RecordType);
  if (PyModule_AddObject(m, "Record", (PyObject *)&RecordType) < 0) {
    Py_DECREF(&RecordType);
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
