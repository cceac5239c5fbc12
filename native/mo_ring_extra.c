/*
 * mo_ring_extra.c -- implementation of mo_ring_extra.h, on mo_ring.h's API alone (no static of
 * mo_ring.c: this file is also #included after it by mo_fast.c, so its helpers have their own
 * names).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "mo_ring_extra.h"

#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* binding shortcuts                                                                           */

uint64_t mo_producer_reserved_offset(const mo_producer *p) {
  return (p->res_pos & p->r.mask) + MO_HEADER_LEN;
}

int64_t mo_producer_put(mo_producer *p, uint64_t object_id, const char *data, uint64_t len) {
  return mo_producer_write(p, object_id, 0, data, len, -1);
}

mo_status mo_consumer_take_timed(mo_consumer *c, int64_t timeout_ns) {
  if (__builtin_expect(c->slot >= c->nviews || !c->views, 0)) return MO_INVALID_STATE;
  mo_status st = mo_consumer_read(c, &c->views[c->slot], timeout_ns);
  if (__builtin_expect(st == MO_OK, 1)) c->slot++;
  return st;
}

mo_status mo_consumer_take(mo_consumer *c) { return mo_consumer_take_timed(c, -1); }

mo_status mo_consumer_take_next_timed(mo_consumer *c, int64_t timeout_ns) {
  if (c->state == MO_STATE_ATTACHED) mo_consumer_release(c);
  return mo_consumer_take_timed(c, timeout_ns);
}

mo_status mo_consumer_take_next(mo_consumer *c) { return mo_consumer_take_next_timed(c, -1); }

/* ------------------------------------------------------------------------------------------ */
/* tests and fuzzing                                                                           */

mo_status mo_producer_publish_raw(mo_producer *p, const char *bytes, uint64_t len) {
  if (p->state != MO_STATE_ATTACHED) return p->state == MO_STATE_CLOSED ? MO_CLOSED : MO_INVALID_STATE;
  if (p->res_open) return MO_INVALID_STATE;
  if (len == 0) return MO_OK;
  uint64_t cap = p->r.capacity;
  if (len > cap) return MO_OUTPUT_RING_CAPACITY_EXCEEDED;
  uint64_t padded = (len + 7) & ~(uint64_t)7; /* no overflow: len <= capacity */
  if (padded > cap) return MO_OUTPUT_RING_CAPACITY_EXCEEDED;
  struct mo_ring_ctrl *k = p->r.ctrl;
  p->cached_tail = atomic_load_explicit(&k->tail, memory_order_acquire);
  if (p->wpos + padded - p->cached_tail > cap) {
    mo_producer_publish(p); /* as a waiting producer would: never sit on committed records */
    return atomic_load_explicit(&k->consumer_closed, memory_order_acquire) ? MO_CLOSED : MO_WOULD_BLOCK;
  }
  for (uint64_t i = 0; i < padded; i++) p->r.data[(p->wpos + i) & p->r.mask] = i < len ? (uint8_t)bytes[i] : 0;
  p->wpos += padded;
  mo_producer_publish(p);
  return MO_OK;
}

uint64_t mo_consumer_discard(mo_consumer *c) {
  if (c->state != MO_STATE_ATTACHED) return 0;
  mo_consumer_release(c);
  uint64_t head = atomic_load_explicit(&c->r.ctrl->head, memory_order_acquire);
  uint64_t skipped = head - c->rpos;
  if (skipped == 0) return 0;
  c->rpos = c->cached_head = head;
  mo_consumer_release(c); /* rpos moved past released: one store-release of tail, as for records */
  return skipped;
}

void mo_record_encode(void *hdr, uint64_t object_id, uint64_t sequence, uint64_t extent, uint32_t flags) {
  mo_record_header h = mo_record_header_make(object_id, sequence, extent, flags);
  memcpy(hdr, &h, sizeof h);
}

mo_status mo_record_check(const void *rec, uint64_t avail, uint64_t max_extent, uint32_t alignment,
                          uint64_t expected_sequence, mo_view *out) {
  mo_view scratch;
  if (!out) out = &scratch;
  memset(out, 0, sizeof *out);
  out->expected_sequence = expected_sequence;
  if (!rec || alignment == 0) return MO_INVALID_ARGUMENT;
  if (avail < MO_HEADER_LEN) {
    if (avail >= 4) memcpy(&out->magic, rec, 4);
    return MO_EOF_BEFORE_FULL_HEADER;
  }
  mo_record_header h;
  memcpy(&h, rec, sizeof h);
  mo_view_fill(out, &h, expected_sequence);
  mo_status st = mo_record_header_check(&h, avail, max_extent, alignment, expected_sequence);
  if (st == MO_OK) out->payload = (const uint8_t *)rec + MO_HEADER_LEN;
  return st;
}
