/*
 * mo_ring_extra.h -- what the MO01 ring library carries besides the ring: the shortcuts its
 * bindings call and the entry points its tests and fuzzers call.  (The C benchmark loops are not
 * in the library: mo_ring_bench.h.)
 *
 * None of this is needed to use a ring (mo_ring.h is the whole ring and its contract); every
 * function here is written on mo_ring.h's API, its handle fields and its record codec
 * (mo_record_header_make / mo_record_header_check), so nothing here can drift from the core.
 * It lives in its own translation unit, mo_ring_extra.c, built into the same extensions
 * (pyruntime._ring and pyruntime._ringfast), so the Python API sees one library.
 *
 *   binding shortcuts   every argument an FFI call drops makes it cheaper: put, take*,
 *                       reserved_offset
 *   tests and fuzzing   raw bytes into a ring, skip what a ring holds, the record codec on its own
 */
#ifndef MO_RING_EXTRA_H
#define MO_RING_EXTRA_H

#include "mo_ring.h"

#ifdef __cplusplus
extern "C" {
#endif

/* MO_CDEF_BEGIN -- as in mo_ring.h: plain declarations, handed to cffi after mo_ring.h's. */

/* --- binding shortcuts -------------------------------------------------------------------- */
/* Payload offset of the open reservation within the data region (a binding that wraps the data
 * region once indexes it instead of converting a pointer per record). */
uint64_t mo_producer_reserved_offset(const mo_producer *p);
/* mo_producer_write(p, object_id, 0, data, len, -1): flags 0, no time limit. */
int64_t mo_producer_put(mo_producer *p, uint64_t object_id, const char *data, uint64_t len);
/* Read into c->views[c->slot] and advance slot (MO_INVALID_STATE when slot == nviews: give more
 * views); mo_consumer_release() resets slot.  take waits without limit; take_next releases first
 * (so it fills slot 0). */
mo_status mo_consumer_take(mo_consumer *c);
mo_status mo_consumer_take_timed(mo_consumer *c, int64_t timeout_ns);
mo_status mo_consumer_take_next(mo_consumer *c);
mo_status mo_consumer_take_next_timed(mo_consumer *c, int64_t timeout_ns);

/* --- tests and fuzzing -------------------------------------------------------------------- */
/* Copy len raw bytes (zero-padded to a multiple of 8) at the write position, wrapping if needed,
 * and publish them with no framing: what a broken or hostile producer would write.  Never waits:
 * MO_WOULD_BLOCK if they do not fit now. */
mo_status mo_producer_publish_raw(mo_producer *p, const char *bytes, uint64_t len);
/* (Also last-resort recovery.)  Release outstanding records, then skip every published byte
 * without looking at it; the expected sequence is unchanged.  Returns the bytes skipped. */
uint64_t mo_consumer_discard(mo_consumer *c);
/* Write an MO01 header (MO_HEADER_LEN bytes) at hdr: mo_record_header_make(), unaligned. */
void mo_record_encode(void *hdr, uint64_t object_id, uint64_t sequence, uint64_t extent, uint32_t flags);
/* Validate the record at rec, of which avail bytes are readable: the consumer's check
 * (mo_record_header_check) on its own, for fuzzing.  Fills *out (may be NULL).  Never reads
 * past rec + avail. */
mo_status mo_record_check(const void *rec, uint64_t avail, uint64_t max_extent, uint32_t alignment,
                          uint64_t expected_sequence, mo_view *out);

/* MO_CDEF_END */

#ifdef __cplusplus
}
#endif
#endif /* MO_RING_EXTRA_H */
