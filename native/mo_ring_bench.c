/*
 * mo_ring_bench.c -- implementation of mo_ring_bench.h, on mo_ring.h's API alone.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "mo_ring_bench.h"

#include <string.h>

mo_status mo_bench_produce(mo_producer *p, uint64_t n, uint64_t size, uint32_t batch, const void *const *sources,
                           uint32_t nsources, uint32_t shift, uint64_t *done) {
  if (batch == 0) batch = 1;
  if (sources && (nsources == 0 || (nsources & (nsources - 1)) || shift > 63)) return MO_INVALID_ARGUMENT;
  uint64_t i = done ? *done : 0;
  mo_status st = MO_OK;
  for (; i < n; i++) {
    void *payload;
    st = mo_producer_reserve(p, size, -1, &payload);
    if (st != MO_OK) break; /* MO_INTERRUPTED included: the caller runs its signal handlers */
    if (sources) {
      if (size) memcpy(payload, sources[(i >> shift) & (nsources - 1)], size);
    } else {
      if (size) memset(payload, (int)(i & 0xff), size);
      if (size >= 8) memcpy(payload, &i, 8);
    }
    int64_t seq = mo_producer_commit_deferred(p, i, 0);
    if (seq < 0) {
      st = (mo_status)-seq;
      break;
    }
    if ((i + 1) % batch == 0) mo_producer_publish(p);
  }
  mo_producer_publish(p);
  if (done) *done = i;
  return st;
}

mo_status mo_bench_consume(mo_consumer *c, uint64_t n, uint32_t batch, char *copy_to, uint64_t *done,
                           uint64_t *bytes) {
  enum { MAX_BATCH = 256 };
  mo_view views[MAX_BATCH];
  if (batch == 0) batch = 1;
  if (batch > MAX_BATCH) batch = MAX_BATCH;
  uint64_t i = done ? *done : 0, total = 0;
  volatile uint8_t sink = 0;
  mo_status st = MO_OK;
  mo_consumer_release(c); /* never block while holding records */
  while (i < n) {
    uint32_t want = n - i < batch ? (uint32_t)(n - i) : batch, got = 0;
    st = mo_consumer_read_many(c, views, want, -1, &got);
    if (st != MO_OK) break;
    for (uint32_t k = 0; k < got; k++) {
      if (k > 0 && views[k].object_id != views[k - 1].object_id + 1) st = MO_INVALID_STATE; /* numbered */
      if (copy_to) memcpy(copy_to, views[k].payload, views[k].extent);
      else if (views[k].extent) sink = views[k].payload[0];
      total += views[k].extent;
    }
    mo_consumer_release(c); /* one store per batch */
    i += got;
    if (st != MO_OK) break;
  }
  (void)sink;
  if (done) *done = i;
  if (bytes) *bytes += total;
  return st;
}
