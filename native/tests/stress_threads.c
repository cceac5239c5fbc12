/*
 * Two-thread stress of one ring, built with -fsanitize=thread by tests/test_native_sanitizers.py:
 *
 *   cc -std=gnu11 -g -O1 -fsanitize=thread -Inative native/tests/stress_threads.c native/mo_ring.c \
 *      -lpthread -o stress_threads && ./stress_threads [records]
 *
 * A producer thread writes records of random sizes (per-record, deferred batches, write_many,
 * reserve/abort) with a checksum over each payload; a consumer thread reads them (per-record and
 * batches, releasing at random points) and checks sequence, object id, size and checksum.  The
 * ring is small, so both sides keep filling/draining it, spinning and parking on the futexes.
 * Exit status 0 only if every record arrived exactly once, in order, intact.
 */
#include "mo_ring.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_EXTENT 600

static mo_ring ring;
static uint64_t total_records = 100000;
static int errors_seen;

static uint64_t xorshift(uint64_t *s) {
  uint64_t x = *s;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return *s = x;
}

/* Record i: its size and bytes follow from i alone, so the consumer can recompute them. */
static uint64_t extent_of(uint64_t i) {
  uint64_t s = i * 0x9E3779B97F4A7C15ULL + 1;
  return xorshift(&s) % (MAX_EXTENT + 1);
}

static void fill(uint8_t *dst, uint64_t i, uint64_t n) {
  uint64_t s = i + 12345;
  for (uint64_t k = 0; k < n; k++) dst[k] = (uint8_t)(xorshift(&s) >> 24);
}

static uint64_t checksum(const uint8_t *p, uint64_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (uint64_t k = 0; k < n; k++) h = (h ^ p[k]) * 1099511628211ULL;
  return h;
}

static void *producer(void *arg) {
  (void)arg;
  mo_producer p;
  if (mo_producer_attach(&p, &ring) != MO_OK) abort();
  mo_producer_set_wait(&p, 2000, 5000000); /* short spin: park often */
  uint64_t rng = 42, i = 0;
  static uint8_t scratch[MAX_EXTENT * 16];
  while (i < total_records) {
    uint64_t mode = xorshift(&rng) % 4;
    if (mode == 0) { /* one write */
      fill(scratch, i, extent_of(i));
      if (mo_producer_write(&p, i, (uint32_t)i, (const char *)scratch, extent_of(i), -1) != (int64_t)i) abort();
      i++;
    } else if (mode == 1) { /* reserve + fill + deferred commits, one publish */
      uint64_t k = 1 + xorshift(&rng) % 8;
      for (uint64_t j = 0; j < k && i < total_records; j++, i++) {
        void *pl;
        if (xorshift(&rng) % 16 == 0) { /* an aborted reservation takes no sequence */
          if (mo_producer_reserve(&p, 8, -1, &pl) != MO_OK) abort();
          memset(pl, 0xEE, 8);
          mo_producer_abort(&p);
        }
        if (mo_producer_reserve(&p, extent_of(i), -1, &pl) != MO_OK) abort();
        fill(pl, i, extent_of(i));
        if (mo_producer_commit_deferred(&p, i, (uint32_t)i) != (int64_t)i) abort();
      }
      mo_producer_publish(&p);
    } else if (mode == 2) { /* write_many */
      uint64_t k = 1 + xorshift(&rng) % 16, lens[16], ids[16], off = 0;
      uint32_t fl[16], written;
      for (uint64_t j = 0; j < k; j++) {
        if (i + j >= total_records) { k = j; break; }
        lens[j] = extent_of(i + j);
        ids[j] = i + j;
        fl[j] = (uint32_t)(i + j);
        fill(scratch + off, i + j, lens[j]);
        off += lens[j];
      }
      if (k == 0) continue;
      if (mo_producer_write_many(&p, ids, fl, (const char *)scratch, lens, 0, (uint32_t)k, -1, &written) != MO_OK ||
          written != k)
        abort();
      i += k;
    } else { /* one reserve + commit */
      void *pl;
      if (mo_producer_reserve(&p, extent_of(i), -1, &pl) != MO_OK) abort();
      fill(pl, i, extent_of(i));
      if (mo_producer_commit(&p, i, (uint32_t)i) != (int64_t)i) abort();
      i++;
    }
  }
  mo_producer_close(&p);
  return NULL;
}

static void check_record(const mo_view *v, uint64_t i) {
  static uint8_t want[MAX_EXTENT];
  uint64_t e = extent_of(i);
  fill(want, i, e);
  if (v->sequence != i || v->object_id != i || v->flags != (uint32_t)i || v->extent != e ||
      checksum(v->payload, e) != checksum(want, e)) {
    if (errors_seen++ < 5)
      fprintf(stderr, "record %llu: seq %llu id %llu extent %llu (want %llu)\n", (unsigned long long)i,
              (unsigned long long)v->sequence, (unsigned long long)v->object_id, (unsigned long long)v->extent,
              (unsigned long long)e);
  }
}

static void *consumer(void *arg) {
  uint64_t *received = arg;
  mo_consumer c;
  if (mo_consumer_attach(&c, &ring) != MO_OK) abort();
  mo_consumer_set_wait(&c, 2000, 5000000);
  uint64_t rng = 7, i = 0;
  mo_view vs[32];
  for (;;) {
    mo_status st;
    /* Never block while holding records: they may be what the producer waits for. */
    int64_t timeout = c.outstanding ? 0 : -1;
    if (xorshift(&rng) % 2) {
      st = mo_consumer_read(&c, &vs[0], timeout);
      if (st == MO_OK) check_record(&vs[0], i++);
    } else {
      uint32_t n = 0;
      st = mo_consumer_read_many(&c, vs, 1 + (uint32_t)(xorshift(&rng) % 32), timeout, &n);
      for (uint32_t k = 0; k < n; k++) check_record(&vs[k], i++);
    }
    if (st == MO_WOULD_BLOCK) {
      mo_consumer_release(&c);
      continue;
    }
    if (st == MO_CLOSED) break;
    if (st != MO_OK) {
      fprintf(stderr, "consumer: %s after %llu records\n", mo_status_name(st), (unsigned long long)i);
      errors_seen++;
      break;
    }
    if (xorshift(&rng) % 3 == 0 || c.outstanding > 20) mo_consumer_release(&c);
  }
  mo_consumer_release(&c);
  *received = i;
  return NULL;
}

int main(int argc, char **argv) {
  if (argc > 1) total_records = strtoull(argv[1], NULL, 10);
  mo_ring_config cfg = {4096, MAX_EXTENT, 1, 0};
  uint64_t size = mo_arena_size(&cfg, 1);
  void *base = aligned_alloc(MO_PAGE, size);
  if (mo_arena_init(base, size, &cfg, 1) != MO_OK || mo_arena_ring(base, size, 0, &ring) != MO_OK) return 2;
  pthread_t tp, tc;
  uint64_t received = 0;
  pthread_create(&tc, NULL, consumer, &received);
  pthread_create(&tp, NULL, producer, NULL);
  pthread_join(tp, NULL);
  pthread_join(tc, NULL);
  free(base);
  if (received != total_records || errors_seen) {
    fprintf(stderr, "FAILED: received %llu of %llu records, %d errors\n", (unsigned long long)received,
            (unsigned long long)total_records, errors_seen);
    return 1;
  }
  printf("stress_threads: %llu records delivered exactly once, in order, intact\n", (unsigned long long)received);
  return 0;
}
