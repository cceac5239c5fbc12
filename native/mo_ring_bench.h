/*
 * mo_ring_bench.h -- the C benchmark loops over MO01 rings: the same work as the Python API's
 * write / read, with no FFI at all, so the ceiling the bindings are measured against.
 *
 * Not part of the ring's library: nothing shipped carries these (pyruntime._ring and
 * pyruntime._ringfast are mo_ring.c and mo_ring_extra.c).  native/ringbench.py builds them with
 * mo_ring.c into their own cffi extension, _ringbench, on first use, for bench/ring.py and the
 * tests; its handles are its own, attached to the same shared memory.  Written on mo_ring.h's API
 * alone (reserve, commit_deferred, publish; read_many, release), so nothing here can drift from
 * the core.
 *
 *   producer   numbered records, a copy of one of a few source buffers each (or a fill in place)
 *   consumer   batches of records, checked to be numbered consecutively, copied out or touched
 */
#ifndef MO_RING_BENCH_H
#define MO_RING_BENCH_H

#include "mo_ring.h"

#ifdef __cplusplus
extern "C" {
#endif

/* MO_CDEF_BEGIN -- as in mo_ring.h: plain declarations, handed to cffi after mo_ring.h's. */

/* Records *done..n-1 (start with *done = 0), object_id = the record number, batch records per
 * publish, waiting without limit.  The payload of record i is a copy of
 * sources[(i >> shift) & (nsources - 1)] (size bytes each; nsources a power of two) -- the work of
 * a producer that sends data it holds, as a binding's write(bytes) does; with sources NULL, every
 * payload byte is set to i & 0xff and the first 8 to i (a fill in place: stores only, no reads).
 * Returns MO_OK, or the status that stopped it with *done updated; on MO_INTERRUPTED run the
 * signal handlers and call again. */
mo_status mo_bench_produce(mo_producer *p, uint64_t n, uint64_t size, uint32_t batch, const void *const *sources,
                           uint32_t nsources, uint32_t shift, uint64_t *done);
/* Read records *done..n-1 in batches of up to batch (max 256) per read_many and per release;
 * copy each payload into copy_to (NULL: touch one byte in place); add payload bytes to *bytes.
 * MO_INVALID_STATE if object ids within a batch are not consecutive. */
mo_status mo_bench_consume(mo_consumer *c, uint64_t n, uint32_t batch, char *copy_to, uint64_t *done,
                           uint64_t *bytes);

/* MO_CDEF_END */

#ifdef __cplusplus
}
#endif
#endif /* MO_RING_BENCH_H */
