/*
 * Single-threaded tests of the ring library, built with -fsanitize=address,undefined by
 * tests/test_native_sanitizers.py:
 *
 *   cc -std=gnu11 -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=all \
 *      -Inative native/tests/test_ring.c native/mo_ring.c native/mo_ring_extra.c -o test_ring && ./test_ring
 *
 * The arena lives in heap memory here (no shared memory needed): the library only sees bytes.
 */
#include "mo_ring_extra.h" /* the core and the test entry points */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int failures;
#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);       \
      failures++;                                                                    \
    }                                                                                \
  } while (0)
#define CHECK_ST(expr, want)                                                         \
  do {                                                                               \
    mo_status st_ = (expr);                                                          \
    if (st_ != (want)) {                                                             \
      fprintf(stderr, "%s:%d: %s returned %s, expected %s\n", __FILE__, __LINE__,    \
              #expr, mo_status_name(st_), mo_status_name(want));                     \
      failures++;                                                                    \
    }                                                                                \
  } while (0)

typedef struct {
  void *base;
  uint64_t size;
  mo_ring ring;
  mo_producer p;
  mo_consumer c;
} fixture;

static void setup(fixture *f, uint64_t capacity, uint64_t max_extent, uint32_t alignment) {
  mo_ring_config cfg = {capacity, max_extent, alignment, 0};
  f->size = mo_arena_size(&cfg, 1);
  f->base = aligned_alloc(MO_PAGE, f->size);
  memset(f->base, 0xAB, f->size); /* init must not rely on zeroed memory */
  CHECK_ST(mo_arena_init(f->base, f->size, &cfg, 1), MO_OK);
  CHECK_ST(mo_arena_ring(f->base, f->size, 0, &f->ring), MO_OK);
  CHECK_ST(mo_producer_attach(&f->p, &f->ring), MO_OK);
  CHECK_ST(mo_consumer_attach(&f->c, &f->ring), MO_OK);
  mo_producer_set_wait(&f->p, 0, 1000000);
  mo_consumer_set_wait(&f->c, 0, 1000000);
}

static void teardown(fixture *f) { free(f->base); }

static uint8_t pattern(uint64_t seq, uint64_t i) { return (uint8_t)(seq * 131 + i * 7 + 1); }

/* --- framing: the header bytes are exactly docs/wire-format.md -------------------------------- */
static void test_framing(void) {
  fixture f;
  setup(&f, 4096, 1024, 4);
  const char payload[12] = "hello world";
  CHECK(mo_producer_write(&f.p, 0x1122334455667788ULL, 0x01, payload, 12, 0) == 0);
  const uint8_t *d = f.ring.data;
  static const uint8_t want[40] = {'M', 'O', '0', '1', 1, 0, 40, 0,
                                   0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,
                                   0, 0, 0, 0, 0, 0, 0, 0,
                                   12, 0, 0, 0, 0, 0, 0, 0,
                                   1, 0, 0, 0, 0, 0, 0, 0};
  CHECK(memcmp(d, want, 40) == 0);
  CHECK(memcmp(d + 40, payload, 12) == 0);
  uint8_t enc[40];
  mo_record_encode(enc, 0x1122334455667788ULL, 0, 12, 1);
  CHECK(memcmp(enc, want, 40) == 0);
  CHECK(mo_record_size(0) == 40 && mo_record_size(1) == 48 && mo_record_size(8) == 48 && mo_record_size(9) == 56);
  mo_view v;
  CHECK_ST(mo_consumer_peek(&f.c, &v), MO_OK);
  CHECK(v.object_id == 0x1122334455667788ULL && v.sequence == 0 && v.extent == 12 && v.flags == 1);
  CHECK(v.payload == d + 40 && memcmp(v.payload, payload, 12) == 0);
  CHECK(mo_consumer_release(&f.c) == 1);
  mo_ring_state s;
  mo_ring_snapshot(&f.ring, &s);
  CHECK(s.head == 56 && s.tail == 56 && s.head_seq == 1 && s.tail_seq == 1);
  CHECK(s.producer_pid == getpid() && s.consumer_pid == getpid());
  teardown(&f);
}

/* --- wrap-around with records of every size across the boundary ---------------------------- */
static void test_wraparound(void) {
  for (uint64_t extent = 0; extent <= 200; extent++) {
    fixture f;
    setup(&f, 256, 256, 1);
    uint64_t seq = 0;
    for (int round = 0; round < 40; round++) {
      void *pl;
      mo_status st = mo_producer_reserve(&f.p, extent, 0, &pl);
      CHECK_ST(st, MO_OK);
      if (st != MO_OK) break;
      uint8_t *b = pl;
      CHECK(b >= f.ring.data && b + extent <= f.ring.data + 256); /* one contiguous span */
      for (uint64_t i = 0; i < extent; i++) b[i] = pattern(seq, i);
      CHECK(mo_producer_commit(&f.p, seq * 3, (uint32_t)seq) == (int64_t)seq);
      mo_view v;
      CHECK_ST(mo_consumer_read(&f.c, &v, 0), MO_OK);
      CHECK(v.sequence == seq && v.object_id == seq * 3 && v.flags == seq && v.extent == extent);
      for (uint64_t i = 0; i < v.extent; i++)
        if (v.payload[i] != pattern(seq, i)) { CHECK(!"payload mismatch"); break; }
      mo_consumer_release(&f.c);
      seq++;
    }
    CHECK(f.p.wpos > 256 * 3 || extent == 0); /* really went round several times */
    teardown(&f);
  }
}

/* --- full, empty, back-pressure ---------------------------------------------------------- */
static void test_full_empty(void) {
  fixture f;
  setup(&f, 1024, 512, 8);
  mo_view v;
  CHECK_ST(mo_consumer_peek(&f.c, &v), MO_WOULD_BLOCK);
  CHECK_ST(mo_consumer_read(&f.c, &v, 0), MO_WOULD_BLOCK);
  char buf[64] = {0};
  int n = 0;
  while (mo_producer_write(&f.p, (uint64_t)n, 0, buf, 64, 0) >= 0) n++;
  CHECK(n == 1024 / 104); /* 40 + 64 = 104 bytes per record */
  CHECK(mo_producer_write(&f.p, 99, 0, buf, 64, 0) == -(int64_t)MO_WOULD_BLOCK);
  CHECK(mo_ring_occupancy(&f.ring) > 0.9);
  /* a timed write on a full ring times out */
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  CHECK(mo_producer_write(&f.p, 99, 0, buf, 64, 20000000) == -(int64_t)MO_TIMED_OUT);
  clock_gettime(CLOCK_MONOTONIC, &b);
  double ms = (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) / 1e6;
  CHECK(ms >= 19.0 && ms < 1000.0);
  for (int i = 0; i < n; i++) {
    CHECK_ST(mo_consumer_read(&f.c, &v, 0), MO_OK);
    CHECK(v.object_id == (uint64_t)i);
  }
  CHECK_ST(mo_consumer_read(&f.c, &v, 0), MO_WOULD_BLOCK);
  /* records are still outstanding: the producer has no room until release */
  CHECK(mo_producer_write(&f.p, 99, 0, buf, 64, 0) == -(int64_t)MO_WOULD_BLOCK);
  CHECK(mo_consumer_release(&f.c) == (uint64_t)n);
  CHECK(mo_producer_write(&f.p, 99, 0, buf, 64, 0) == n);
  /* timed read on an empty ring */
  CHECK_ST(mo_consumer_read(&f.c, &v, 0), MO_OK);
  mo_consumer_release(&f.c);
  CHECK_ST(mo_consumer_read(&f.c, &v, 5000000), MO_TIMED_OUT);
  CHECK(f.c.parks >= 1);
  /* bindings ask to come back at every poll wake-up (to run their signal handlers) */
  f.c.wait_flags = MO_WAIT_RETURN_ON_POLL;
  CHECK_ST(mo_consumer_read(&f.c, &v, -1), MO_INTERRUPTED);
  CHECK(f.c.deadline_ns == -1);
  CHECK_ST(mo_consumer_read(&f.c, &v, 50000000), MO_INTERRUPTED);
  CHECK(f.c.deadline_ns > 0);
  f.c.wait_flags = 0;
  teardown(&f);
}

/* --- batches: deferred commits are invisible until one publish ----------------------------- */
static void test_batch(void) {
  fixture f;
  setup(&f, 4096, 256, 4);
  mo_view v;
  for (int i = 0; i < 5; i++) {
    void *pl;
    CHECK_ST(mo_producer_reserve(&f.p, 16, 0, &pl), MO_OK);
    memset(pl, i, 16);
    CHECK(mo_producer_commit_deferred(&f.p, (uint64_t)(100 + i), 0) == i);
  }
  CHECK_ST(mo_consumer_peek(&f.c, &v), MO_WOULD_BLOCK);
  mo_ring_state s;
  mo_ring_snapshot(&f.ring, &s);
  CHECK(s.head == 0);
  CHECK(mo_producer_publish(&f.p) == 5);
  mo_ring_snapshot(&f.ring, &s);
  CHECK(s.head == 5 * 56);
  mo_view vs[8];
  uint32_t n = 0;
  CHECK_ST(mo_consumer_read_many(&f.c, vs, 8, 0, &n), MO_OK);
  CHECK(n == 5);
  for (uint32_t i = 0; i < n; i++) CHECK(vs[i].object_id == 100 + i && vs[i].sequence == i && vs[i].payload[3] == i);
  mo_ring_snapshot(&f.ring, &s);
  CHECK(s.tail == 0); /* not released yet */
  char out[80];
  CHECK(mo_consumer_gather(&f.c, vs, n, out, sizeof out) == 80);
  CHECK(out[16] == 1 && out[79] == 4);
  CHECK(mo_consumer_release(&f.c) == 5);
  mo_ring_snapshot(&f.ring, &s);
  CHECK(s.tail == 5 * 56);

  /* write_many: variable lengths, ids, flags */
  const char data[] = "aaaabbbbbbbbcccc";
  uint64_t lens[3] = {4, 8, 4}, ids[3] = {7, 8, 9};
  uint32_t fl[3] = {1, 0, 1}, written = 0;
  CHECK_ST(mo_producer_write_many(&f.p, ids, fl, data, lens, 0, 3, 0, &written), MO_OK);
  CHECK(written == 3);
  CHECK_ST(mo_consumer_read_many(&f.c, vs, 8, 0, &n), MO_OK);
  CHECK(n == 3 && vs[1].extent == 8 && vs[1].payload[0] == 'b' && vs[2].flags == 1 && vs[2].object_id == 9);
  CHECK(vs[0].sequence == 5 && vs[2].sequence == 7);
  mo_consumer_release(&f.c);
  /* write_many of fixed-size records that do not all fit: partial, all published */
  static char big[64 * 100];
  uint64_t before = f.c.rpos;
  CHECK_ST(mo_producer_write_many(&f.p, NULL, NULL, big, NULL, 64, 100, 0, &written), MO_WOULD_BLOCK);
  CHECK(written >= 4096 / 104 - 1 && written <= 4096 / 104);
  CHECK(f.p.published == f.p.wpos); /* everything committed is published */
  CHECK(mo_consumer_discard(&f.c) == f.p.wpos - before);
  CHECK(mo_producer_write(&f.p, 1, 0, big, 64, 0) == 8 + written);
  teardown(&f);
}

/* --- abort -------------------------------------------------------------------------------- */
static void test_abort(void) {
  fixture f;
  setup(&f, 1024, 256, 4);
  void *pl;
  CHECK_ST(mo_producer_reserve(&f.p, 32, 0, &pl), MO_OK);
  CHECK_ST(mo_producer_reserve(&f.p, 32, 0, &pl), MO_INVALID_STATE); /* one at a time */
  mo_producer_abort(&f.p);
  CHECK(mo_producer_commit(&f.p, 1, 0) == -(int64_t)MO_INVALID_STATE);
  mo_view v;
  CHECK_ST(mo_consumer_peek(&f.c, &v), MO_WOULD_BLOCK);
  CHECK(mo_producer_write(&f.p, 5, 0, "abcd", 4, 0) == 0); /* the aborted record took no sequence */
  CHECK_ST(mo_consumer_peek(&f.c, &v), MO_OK);
  CHECK(v.sequence == 0 && v.object_id == 5);
  teardown(&f);
}

/* --- producer refusals ---------------------------------------------------------------------- */
static void test_producer_refusals(void) {
  fixture f;
  setup(&f, 256, 1000, 4);
  void *pl;
  CHECK_ST(mo_producer_reserve(&f.p, 1004, 0, &pl), MO_OUTPUT_EXTENT_INVALID);
  CHECK_ST(mo_producer_reserve(&f.p, 6, 0, &pl), MO_OUTPUT_EXTENT_ALIGNMENT_VIOLATION);
  CHECK_ST(mo_producer_reserve(&f.p, 220, 0, &pl), MO_OUTPUT_RING_CAPACITY_EXCEEDED);
  CHECK_ST(mo_producer_reserve(&f.p, 216, 0, &pl), MO_OK); /* 40 + 216 == 256: fits exactly */
  mo_producer_abort(&f.p);
  char buf[8] = {0};
  CHECK(mo_producer_write(&f.p, 1, 0, buf, 6, 0) == -(int64_t)MO_OUTPUT_EXTENT_ALIGNMENT_VIOLATION);
  mo_ring_state s;
  mo_ring_snapshot(&f.ring, &s);
  CHECK(s.head == 0);
  teardown(&f);
}

/* --- every named consumer error; the cursor never moves ------------------------------------- */
static void raw(fixture *f, const void *bytes, uint64_t len) { CHECK_ST(mo_producer_publish_raw(&f->p, bytes, len), MO_OK); }

static void expect_error(fixture *f, mo_status want) {
  uint64_t rpos = f->c.rpos, seq = f->c.next_seq;
  mo_view v;
  for (int i = 0; i < 3; i++) { /* reported every time, never skipped */
    CHECK_ST(mo_consumer_read(&f->c, &v, 0), want);
    CHECK(f->c.rpos == rpos && f->c.next_seq == seq);
  }
  mo_ring_state s;
  mo_ring_snapshot(&f->ring, &s);
  CHECK(s.tail == f->c.released);
  mo_consumer_discard(&f->c);
}

static void test_errors(void) {
  fixture f;
  setup(&f, 1024, 64, 4);
  uint8_t h[48];

  raw(&f, "MO01\1\0(\0", 8); /* 8 bytes: a header cut short */
  expect_error(&f, MO_EOF_BEFORE_FULL_HEADER);

  mo_record_encode(h, 1, 0, 8, 0);
  memcpy(h, "XO01", 4);
  raw(&f, h, 48);
  expect_error(&f, MO_INVALID_OBJECT_MAGIC);

  mo_record_encode(h, 1, 0, 8, 0);
  h[4] = 2; /* version */
  raw(&f, h, 48);
  expect_error(&f, MO_INVALID_OBJECT_HEADER);
  mo_record_encode(h, 1, 0, 8, 0);
  h[6] = 48; /* header_len */
  raw(&f, h, 48);
  expect_error(&f, MO_INVALID_OBJECT_HEADER);
  mo_record_encode(h, 1, 0, 8, 0);
  h[36] = 1; /* reserved */
  raw(&f, h, 48);
  expect_error(&f, MO_INVALID_OBJECT_HEADER);

  mo_record_encode(h, 1, 0, 68, 0); /* > max_extent 64 */
  raw(&f, h, 48);
  expect_error(&f, MO_OBJECT_EXTENT_INVALID);
  mo_record_encode(h, 1, 0, 16, 0); /* past the 48 published bytes */
  raw(&f, h, 48);
  expect_error(&f, MO_OBJECT_EXTENT_INVALID);
  mo_record_encode(h, 1, 0, 6, 0); /* not a multiple of 4 */
  raw(&f, h, 48);
  expect_error(&f, MO_OBJECT_EXTENT_ALIGNMENT_VIOLATION);

  mo_record_encode(h, 1, 5, 8, 0); /* expected 0 */
  raw(&f, h, 48);
  mo_view v;
  CHECK_ST(mo_consumer_read(&f.c, &v, 0), MO_SEQUENCE_VIOLATION);
  CHECK(v.expected_sequence == 0 && v.sequence == 5);
  expect_error(&f, MO_SEQUENCE_VIOLATION);

  /* a padding marker whose region is not all published, and a corrupt one */
  uint8_t pad[8] = {'M', 'O', 'P', 'D', 0, 0, 0, 0};
  raw(&f, pad, 8);
  expect_error(&f, MO_EOF_BEFORE_FULL_HEADER);
  pad[5] = 1;
  raw(&f, pad, 8);
  expect_error(&f, MO_EOF_BEFORE_FULL_HEADER);

  /* after all that, good records still flow (the sequence was never consumed) */
  CHECK(mo_producer_write(&f.p, 77, 0, "abcd", 4, 0) == 0);
  CHECK_ST(mo_consumer_read(&f.c, &v, 0), MO_OK);
  CHECK(v.object_id == 77 && v.sequence == 0);
  teardown(&f);

  /* a good record followed by a bad one in a batch: the batch stops before the bad one */
  setup(&f, 1024, 64, 4);
  CHECK(mo_producer_write(&f.p, 1, 0, "abcd", 4, 0) == 0);
  mo_record_encode(h, 1, 9, 8, 0);
  raw(&f, h, 48);
  mo_view vs[4];
  uint32_t n = 9;
  CHECK_ST(mo_consumer_read_many(&f.c, vs, 4, 0, &n), MO_OK);
  CHECK(n == 1);
  CHECK_ST(mo_consumer_read_many(&f.c, vs, 4, 0, &n), MO_SEQUENCE_VIOLATION);
  CHECK(n == 0);
  teardown(&f);
}

/* --- the pure validator on random and mutated input (never reads out of bounds) ------------ */
static void test_record_check_fuzz(void) {
  uint64_t x = 88172645463325252ULL;
  uint8_t buf[128];
  int named = 0;
  for (int i = 0; i < 200000; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    uint64_t avail = x % 97;
    mo_record_encode(buf, x, x % 3, (x >> 8) % 80, 0);
    for (int k = 0; k < (int)(x % 4); k++) buf[(x >> (8 * k + 16)) % 48] ^= (uint8_t)(x >> (8 * k));
    uint8_t *copy = malloc(avail ? avail : 1); /* exact size: ASan catches any overread */
    memcpy(copy, buf, avail);
    mo_view v;
    mo_status st = mo_record_check(copy, avail, 64, 4, 1, &v);
    free(copy);
    CHECK(st == MO_OK || (st >= MO_EOF_BEFORE_FULL_HEADER && st <= MO_SEQUENCE_VIOLATION));
    if (st != MO_OK) named++;
  }
  CHECK(named > 100000);
}

/* --- arena validation --------------------------------------------------------------------- */
static void test_arena(void) {
  mo_ring_config cfg[2] = {{100, 10, 4, 0}, {5000, 4096, 8, 0}};
  uint64_t size = mo_arena_size(cfg, 2);
  CHECK(size == 4096 + (4096 + 4096) + (4096 + 8192));
  uint8_t *base = aligned_alloc(MO_PAGE, size);
  CHECK_ST(mo_arena_init(base, size, cfg, 2), MO_OK);
  const char *why = NULL;
  CHECK_ST(mo_arena_check(base, size, &why), MO_OK);
  int32_t creator = 0;
  uint64_t creator_start = 0;
  CHECK(mo_arena_ring_count(base) == 2);
  CHECK(mo_arena_creator(base, MO_SUPERBLOCK_FIXED, &creator, &creator_start) == MO_OK && creator == getpid());
  CHECK(creator_start == mo_self_start_time());
  CHECK(mo_arena_creator(base, MO_SUPERBLOCK_FIXED - 1, NULL, NULL) == MO_ARENA_INVALID);
  mo_ring r;
  CHECK_ST(mo_arena_ring(base, size, 1, &r), MO_OK);
  CHECK(r.capacity == 8192 && r.max_extent == 4096 && r.alignment == 8 && r.index == 1);
  CHECK_ST(mo_arena_ring(base, size, 2, &r), MO_INVALID_ARGUMENT);
  CHECK_ST(mo_arena_check(base, size - 4096, &why), MO_ARENA_INVALID);
  CHECK_ST(mo_arena_check(base, 10, &why), MO_ARENA_INVALID);
  base[8] = 2; /* layout version */
  CHECK_ST(mo_arena_check(base, size, &why), MO_ARENA_INVALID);
  CHECK(strstr(why, "version") != NULL);
  base[8] = 1;
  base[0] = 'X';
  CHECK_ST(mo_arena_check(base, size, &why), MO_ARENA_INVALID);
  CHECK(strstr(why, "magic") != NULL);
  base[0] = 'M';
  CHECK_ST(mo_arena_check(base, size, &why), MO_OK);
  ((struct mo_ring_ctrl *)(base + 4096))->capacity = 3000; /* ring 0: not a power of two */
  CHECK_ST(mo_arena_check(base, size, &why), MO_ARENA_INVALID);
  /* a superblock claiming more rings than the segment can describe is refused, not overread */
  uint8_t *small = aligned_alloc(MO_PAGE, 4096);
  mo_ring_config one = {64, 8, 4, 0};
  memset(small, 0, 4096);
  CHECK_ST(mo_arena_init(small, 4096, &one, 1), MO_INVALID_ARGUMENT); /* needs 12 KiB */
  CHECK_ST(mo_arena_init(base, mo_arena_size(&one, 1), &one, 1), MO_OK);
  memcpy(small, base, 4096);
  ((mo_superblock *)small)->total_size = 4096;
  ((mo_superblock *)small)->ring_count = 4000;
  ((mo_superblock *)small)->superblock_size = (uint32_t)((64 + 8 * 4000 + 4095) / 4096 * 4096);
  CHECK_ST(mo_arena_check(small, 4096, &why), MO_ARENA_INVALID);
  free(small);
  CHECK(mo_arena_size(cfg, 0) == 0);
  mo_ring_config bad = {0, 1, 1, 0};
  CHECK(mo_arena_size(&bad, 1) == 0);
  bad.capacity = 64;
  bad.alignment = 0;
  CHECK(mo_arena_size(&bad, 1) == 0);
  free(base);
}

/* --- sizes near 2^64: every computation is overflow-checked -------------------------------- */
static void test_huge_extents(void) {
  CHECK(mo_record_size(UINT64_MAX) == 0 && mo_record_size(UINT64_MAX - 8) == 0);
  CHECK(mo_record_size(UINT64_MAX - 47) == UINT64_MAX - 7);
  fixture f;
  setup(&f, 4096, UINT64_MAX, 8); /* "no limit": stored capped at what any ring can hold */
  CHECK(f.ring.max_extent == MO_MAX_EXTENT);
  void *pl;
  CHECK_ST(mo_producer_reserve(&f.p, UINT64_MAX - 7, 0, &pl), MO_OUTPUT_EXTENT_INVALID);
  CHECK_ST(mo_producer_reserve(&f.p, MO_MAX_EXTENT, 0, &pl), MO_OUTPUT_RING_CAPACITY_EXCEEDED);
  CHECK_ST(mo_producer_reserve(&f.p, 4096 - 32, 0, &pl), MO_OUTPUT_RING_CAPACITY_EXCEEDED);
  CHECK(mo_producer_write(&f.p, 1, 0, "", UINT64_MAX - 7, 0) == -(int64_t)MO_OUTPUT_EXTENT_INVALID);
  CHECK_ST(mo_producer_publish_raw(&f.p, "", UINT64_MAX), MO_OUTPUT_RING_CAPACITY_EXCEEDED);
  mo_ring_state s;
  mo_ring_snapshot(&f.ring, &s);
  CHECK(s.head == 0 && f.p.next_seq == 0); /* nothing published, no sequence used */
  /* a header claiming 2^64 - 8 bytes: refused, the cursor does not move */
  uint8_t h[48] = {0};
  mo_record_encode(h, 1, 0, UINT64_MAX - 7, 0);
  raw(&f, h, sizeof h);
  expect_error(&f, MO_OBJECT_EXTENT_INVALID);
  /* the standalone check, with no max_extent to hide behind */
  mo_view v;
  CHECK_ST(mo_record_check(h, sizeof h, UINT64_MAX, 8, 0, &v), MO_OBJECT_EXTENT_INVALID);
  CHECK_ST(mo_record_check(h, UINT64_MAX, UINT64_MAX, 8, 0, &v), MO_OBJECT_EXTENT_INVALID);
  mo_record_encode(h, 1, 0, UINT64_MAX - 39, 0); /* 40 + extent == 2^64: wraps to 0 unchecked */
  CHECK_ST(mo_record_check(h, sizeof h, UINT64_MAX, 1, 0, &v), MO_OBJECT_EXTENT_INVALID);
  /* gather refuses views whose offset + extent wraps */
  mo_view bad = {0};
  bad.data_offset = 8;
  bad.extent = UINT64_MAX - 3;
  char dst[16];
  CHECK(mo_consumer_gather(&f.c, &bad, 1, dst, sizeof dst) == -(int64_t)MO_INVALID_ARGUMENT);
  /* timeouts and wait tuning near the limits neither wrap nor fail */
  mo_producer_set_wait(&f.p, UINT64_MAX, UINT64_MAX);
  CHECK(f.p.poll_ns <= (uint64_t)INT64_MAX);
  mo_producer_set_wait(&f.p, 0, 1000000);
  CHECK(mo_producer_write(&f.p, 1, 0, "12345678", 8, INT64_MAX) == 0);
  CHECK_ST(mo_consumer_read(&f.c, &v, INT64_MAX), MO_OK);
  CHECK(v.extent == 8);
  teardown(&f);
  /* an arena whose ring claims a max_extent no ring can hold is refused */
  mo_ring_config cfg = {64, 8, 4, 0};
  uint64_t size = mo_arena_size(&cfg, 1);
  uint8_t *base = aligned_alloc(MO_PAGE, size);
  CHECK_ST(mo_arena_init(base, size, &cfg, 1), MO_OK);
  ((struct mo_ring_ctrl *)(base + 4096))->max_extent = UINT64_MAX;
  const char *why = NULL;
  CHECK_ST(mo_arena_check(base, size, &why), MO_ARENA_INVALID);
  CHECK(strstr(why, "max_extent") != NULL);
  free(base);
}

/* --- segment names ------------------------------------------------------------------------ */
static void test_segment_names(void) {
  const char *why = NULL;
  CHECK_ST(mo_segment_name_check("/pyruntime-1-ab", 15, &why), MO_OK);
  CHECK_ST(mo_segment_name_check("pyruntime-1-ab", 14, NULL), MO_OK);
  CHECK_ST(mo_segment_name_check("x\0y", 3, &why), MO_ARENA_INVALID);
  CHECK(strstr(why, "NUL") != NULL);
  CHECK_ST(mo_segment_name_check("/a/b", 4, &why), MO_ARENA_INVALID);
  CHECK_ST(mo_segment_name_check("..", 2, &why), MO_ARENA_INVALID);
  CHECK_ST(mo_segment_name_check("/.", 2, &why), MO_ARENA_INVALID);
  CHECK_ST(mo_segment_name_check("/..x", 4, &why), MO_OK);
  CHECK_ST(mo_segment_name_check("", 0, &why), MO_ARENA_INVALID);
  CHECK_ST(mo_segment_name_check("/", 1, &why), MO_ARENA_INVALID);
  CHECK_ST(mo_segment_name_check(NULL, 5, &why), MO_ARENA_INVALID);
  CHECK_ST(mo_segment_name_check("a\nb", 3, &why), MO_ARENA_INVALID);
  char longname[300];
  memset(longname, 'x', sizeof longname);
  CHECK_ST(mo_segment_name_check(longname, MO_NAME_MAX, &why), MO_OK);
  CHECK_ST(mo_segment_name_check(longname, MO_NAME_MAX + 1, &why), MO_ARENA_INVALID);
  longname[0] = '/';
  CHECK_ST(mo_segment_name_check(longname, MO_NAME_MAX + 1, &why), MO_OK);
}

/* --- close, claims, takeover -------------------------------------------------------------- */
static void test_liveness(void) {
  fixture f;
  setup(&f, 1024, 64, 4);
  mo_producer p2;
  mo_consumer c2;
  CHECK_ST(mo_producer_attach(&p2, &f.ring), MO_BUSY); /* we are alive */
  CHECK_ST(mo_consumer_attach(&c2, &f.ring), MO_BUSY);
  CHECK(mo_producer_write(&f.p, 1, 0, "abcd", 4, 0) == 0);
  CHECK(mo_producer_write(&f.p, 2, 0, "efgh", 4, 0) == 1);
  mo_producer_close(&f.p);
  CHECK(mo_producer_write(&f.p, 3, 0, "ijkl", 4, 0) == -(int64_t)MO_CLOSED);
  mo_view v;
  CHECK_ST(mo_consumer_read(&f.c, &v, -1), MO_OK); /* drains first */
  CHECK_ST(mo_consumer_read(&f.c, &v, -1), MO_OK);
  CHECK_ST(mo_consumer_read(&f.c, &v, -1), MO_CLOSED); /* does not hang */
  CHECK_ST(mo_consumer_peek(&f.c, &v), MO_CLOSED);
  CHECK_ST(mo_producer_attach(&p2, &f.ring), MO_CLOSED);
  teardown(&f);

  setup(&f, 1024, 64, 4);
  mo_consumer_close(&f.c);
  CHECK(mo_producer_write(&f.p, 1, 0, "abcd", 4, -1) == -(int64_t)MO_CLOSED);
  teardown(&f);

  /* detach and resume: the new consumer continues at the last release and sequence */
  setup(&f, 1024, 64, 4);
  for (int i = 0; i < 3; i++) CHECK(mo_producer_write(&f.p, (uint64_t)i, 0, "abcd", 4, 0) == i);
  CHECK_ST(mo_consumer_read(&f.c, &v, 0), MO_OK);
  mo_consumer_release(&f.c);
  CHECK_ST(mo_consumer_read(&f.c, &v, 0), MO_OK); /* outstanding, not released */
  /* a consumer that dies holding it: the next owner gets it again */
  atomic_store(&f.ring.ctrl->consumer_owner, 4194303);
  CHECK_ST(mo_consumer_attach(&c2, &f.ring), MO_OK);
  CHECK_ST(mo_consumer_read(&c2, &v, 0), MO_OK);
  CHECK(v.sequence == 1 && v.object_id == 1);
  /* a consumer that detaches releases what it read */
  mo_consumer_detach(&c2);
  CHECK_ST(mo_consumer_attach(&f.c, &f.ring), MO_OK);
  CHECK_ST(mo_consumer_read(&f.c, &v, 0), MO_OK);
  CHECK(v.sequence == 2 && v.object_id == 2);
  mo_producer_detach(&f.p);
  CHECK_ST(mo_producer_attach(&p2, &f.ring), MO_OK);
  CHECK(mo_producer_write(&p2, 9, 0, "abcd", 4, 0) == 3);
  teardown(&f);

  /* a claim held by a dead process (pid far above pid_max) is taken over */
  setup(&f, 1024, 64, 4);
  mo_producer_detach(&f.p);
  atomic_store(&f.ring.ctrl->producer_owner, 4194303); /* a pid above any pid_max in use */
  mo_ring_state s;
  mo_ring_snapshot(&f.ring, &s);
  CHECK(s.producer_pid == 4194303);
  CHECK(mo_process_alive(4194303, 0) == 0);
  CHECK(mo_process_alive(getpid(), 0) == 1);
  CHECK(mo_process_alive(getpid(), mo_self_start_time()) == 1);
  CHECK(mo_process_alive(getpid(), mo_self_start_time() + 1) == 0); /* recycled pid */
  /* ...and a waiting consumer notices the dead producer */
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  mo_consumer_set_wait(&f.c, 0, 20000000);
  CHECK_ST(mo_consumer_read(&f.c, &v, -1), MO_PEER_DEAD);
  clock_gettime(CLOCK_MONOTONIC, &b);
  CHECK(b.tv_sec - a.tv_sec < 2);
  CHECK_ST(mo_producer_attach(&p2, &f.ring), MO_OK);
  teardown(&f);
}

static void test_status_names(void) {
  CHECK(strcmp(mo_status_name(MO_OK), "Ok") == 0);
  CHECK(strcmp(mo_status_name(MO_INVALID_OBJECT_MAGIC), "InvalidObjectMagic") == 0);
  CHECK(strcmp(mo_status_name(MO_SEQUENCE_VIOLATION), "SequenceViolation") == 0);
  CHECK(strcmp(mo_status_name(MO_OUTPUT_RING_CAPACITY_EXCEEDED), "OutputRingCapacityExceeded") == 0);
  CHECK(strcmp(mo_status_name((mo_status)999), "Unknown") == 0);
  for (int s = 0; s < 40; s++) CHECK(mo_status_message((mo_status)s) != NULL);
}

int main(void) {
  test_status_names();
  test_framing();
  test_wraparound();
  test_full_empty();
  test_batch();
  test_abort();
  test_producer_refusals();
  test_errors();
  test_record_check_fuzz();
  test_arena();
  test_huge_extents();
  test_segment_names();
  test_liveness();
  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("test_ring: all checks passed\n");
  return 0;
}
