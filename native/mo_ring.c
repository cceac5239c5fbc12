/*
 * mo_ring.c -- implementation of mo_ring.h.  Read the header first: it defines the layout and
 * the ordering protocol this file follows, and holds the record codec (mo_record_header_make,
 * mo_record_header_check) that the producer and consumer below use.  The binding shortcuts and
 * test/fuzz entry points are in mo_ring_extra.c, the benchmark loops in mo_ring_bench.c.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "mo_ring.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mo_ring: the MO01 format is little-endian and this library stores it natively"
#endif

_Static_assert(sizeof(mo_record_header) == MO_HEADER_LEN, "MO01 header is 40 bytes");
_Static_assert(offsetof(mo_record_header, version) == 4, "MO01 header offset (docs/wire-format.md)");
_Static_assert(offsetof(mo_record_header, header_len) == 6, "MO01 header offset (docs/wire-format.md)");
_Static_assert(offsetof(mo_record_header, object_id) == 8, "MO01 header offset (docs/wire-format.md)");
_Static_assert(offsetof(mo_record_header, sequence) == 16, "MO01 header offset (docs/wire-format.md)");
_Static_assert(offsetof(mo_record_header, extent) == 24, "MO01 header offset (docs/wire-format.md)");
_Static_assert(offsetof(mo_record_header, flags) == 32, "MO01 header offset (docs/wire-format.md)");
_Static_assert(offsetof(mo_record_header, reserved) == 36, "MO01 header offset (docs/wire-format.md)");
_Static_assert(sizeof(mo_superblock) == MO_SUPERBLOCK_FIXED, "superblock fixed part");
_Static_assert(sizeof(struct mo_ring_ctrl) <= MO_CTRL_SIZE, "control block fits");
_Static_assert(offsetof(struct mo_ring_ctrl, tail) - offsetof(struct mo_ring_ctrl, head) >= MO_LINE,
               "cursors on separate lines");
_Static_assert(sizeof(_Atomic uint64_t) == 8 && sizeof(_Atomic uint32_t) == 4, "lock-free widths");
_Static_assert(MO_MAX_EXTENT == MO_MAX_CAPACITY - MO_HEADER_LEN, "the largest payload of the largest ring");

#define MO_LIKELY(x) __builtin_expect(!!(x), 1)
#define MO_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define RELAXED memory_order_relaxed
#define ACQUIRE memory_order_acquire
#define RELEASE memory_order_release
#define SEQ_CST memory_order_seq_cst

enum { ST_DETACHED = MO_STATE_DETACHED, ST_ATTACHED = MO_STATE_ATTACHED, ST_CLOSED = MO_STATE_CLOSED };
#define PID_MASK ((UINT64_C(1) << MO_OWNER_PID_BITS) - 1)

/* ------------------------------------------------------------------------------------------ */
/* status names                                                                                */

const char *mo_status_name(mo_status s) {
  switch (s) {
  case MO_OK: return "Ok";
  case MO_WOULD_BLOCK: return "WouldBlock";
  case MO_TIMED_OUT: return "RingTimeout";
  case MO_CLOSED: return "RingClosed";
  case MO_PEER_DEAD: return "PeerDead";
  case MO_BUSY: return "RingBusy";
  case MO_INTERRUPTED: return "Interrupted";
  case MO_EOF_BEFORE_FULL_HEADER: return "EofBeforeFullHeader";
  case MO_INVALID_OBJECT_MAGIC: return "InvalidObjectMagic";
  case MO_INVALID_OBJECT_HEADER: return "InvalidObjectHeader";
  case MO_OBJECT_EXTENT_INVALID: return "ObjectExtentInvalid";
  case MO_OBJECT_EXTENT_ALIGNMENT_VIOLATION: return "ObjectExtentAlignmentViolation";
  case MO_SEQUENCE_VIOLATION: return "SequenceViolation";
  case MO_OUTPUT_EXTENT_INVALID: return "OutputExtentInvalid";
  case MO_OUTPUT_EXTENT_ALIGNMENT_VIOLATION: return "OutputExtentAlignmentViolation";
  case MO_OUTPUT_RING_CAPACITY_EXCEEDED: return "OutputRingCapacityExceeded";
  case MO_ARENA_INVALID: return "ArenaInvalid";
  case MO_INVALID_ARGUMENT: return "InvalidArgument";
  case MO_INVALID_STATE: return "InvalidState";
  }
  return "Unknown";
}

const char *mo_status_message(mo_status s) {
  switch (s) {
  case MO_OK: return "success";
  case MO_WOULD_BLOCK: return "the ring is full (producer) or empty (consumer)";
  case MO_TIMED_OUT: return "the wait timed out";
  case MO_CLOSED: return "the ring was closed";
  case MO_PEER_DEAD: return "the process on the other side of the ring died";
  case MO_BUSY: return "this side of the ring is claimed by a live process";
  case MO_INTERRUPTED: return "the wait was interrupted by a signal";
  case MO_EOF_BEFORE_FULL_HEADER: return "fewer bytes are published than a full record header";
  case MO_INVALID_OBJECT_MAGIC: return "the record does not start with the magic MO01";
  case MO_INVALID_OBJECT_HEADER: return "the record header has a wrong version, header_len or reserved field";
  case MO_OBJECT_EXTENT_INVALID: return "the record extent exceeds max_extent or the published bytes";
  case MO_OBJECT_EXTENT_ALIGNMENT_VIOLATION: return "the record extent is not a multiple of the ring alignment";
  case MO_SEQUENCE_VIOLATION: return "the record sequence is not the expected one";
  case MO_OUTPUT_EXTENT_INVALID: return "the payload is larger than the ring's max_extent";
  case MO_OUTPUT_EXTENT_ALIGNMENT_VIOLATION: return "the payload length is not a multiple of the ring alignment";
  case MO_OUTPUT_RING_CAPACITY_EXCEEDED: return "the record can never fit in the ring";
  case MO_ARENA_INVALID: return "not a valid arena of this layout version";
  case MO_INVALID_ARGUMENT: return "invalid argument";
  case MO_INVALID_STATE: return "operation not valid in this state";
  }
  return "unknown status";
}

/* ------------------------------------------------------------------------------------------ */
/* small helpers                                                                               */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield" ::: "memory");
#else
  atomic_signal_fence(SEQ_CST);
#endif
}

static inline int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline uint64_t round8(uint64_t x) { return (x + 7) & ~UINT64_C(7); }

/* a + b, saturating at INT64_MAX: deadlines from caller-given nanoseconds never wrap. */
static inline int64_t add_sat(int64_t a, uint64_t b) {
  return b > (uint64_t)(INT64_MAX - a) ? INT64_MAX : a + (int64_t)b; /* a >= 0: a monotonic clock */
}

uint64_t mo_record_size(uint64_t extent) {
  return MO_LIKELY(extent <= MO_RECORD_EXTENT_LIMIT) ? round8(MO_HEADER_LEN + extent) : 0;
}

/* FUTEX_WAIT (shared, not private: the waker is another process).  Returns 0 when woken (or the
 * value already differed), else the errno: ETIMEDOUT or EINTR. */
static int futex_wait(_Atomic uint32_t *addr, uint32_t expected, int64_t timeout_ns) {
  struct timespec ts, *tsp = NULL;
  if (timeout_ns >= 0) {
    ts.tv_sec = (time_t)(timeout_ns / 1000000000);
    ts.tv_nsec = (long)(timeout_ns % 1000000000);
    tsp = &ts;
  }
  long r = syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, expected, tsp, NULL, 0);
  if (r == 0) return 0;
  if (errno == EAGAIN) return 0;
  return errno;
}

static void futex_wake_all(_Atomic uint32_t *addr) {
  syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* ------------------------------------------------------------------------------------------ */
/* process liveness                                                                            */

/* Parse /proc/<pid>/stat: state char and start time.  Returns 0 on success, else errno. */
static int read_proc_stat(int32_t pid, char *state, uint64_t *start) {
  char path[64], buf[1024];
  if (pid > 0) snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  else snprintf(path, sizeof path, "/proc/self/stat");
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno ? errno : EIO;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  int err = errno;
  close(fd);
  if (n <= 0) return n < 0 ? err : EIO;
  buf[n] = 0;
  char *p = strrchr(buf, ')'); /* the command name may contain spaces and parentheses */
  if (!p || p[1] != ' ') return EIO;
  p += 2;
  *state = *p;
  /* fields after the name: 3 state, 4 ppid, ... 22 starttime -> skip 19 separators */
  for (int field = 3; field < 22; field++) {
    p = strchr(p, ' ');
    if (!p) return EIO;
    p++;
  }
  uint64_t v = 0;
  while (*p >= '0' && *p <= '9') v = v * 10 + (uint64_t)(*p++ - '0');
  *start = v;
  return 0;
}

uint64_t mo_self_start_time(void) {
  static int32_t cached_pid;
  static uint64_t cached_start;
  int32_t pid = (int32_t)getpid();
  if (cached_pid != pid) { /* fork-safe cache */
    char st;
    uint64_t start = 0;
    if (read_proc_stat(pid, &st, &start) != 0) start = 0;
    cached_start = start;
    cached_pid = pid;
  }
  return cached_start;
}

int mo_process_alive(int32_t pid, uint64_t start) {
  if (pid <= 0) return 1; /* unknown: never declare death without evidence */
  if (kill(pid, 0) == -1 && errno == ESRCH) return 0;
  char st = 0;
  uint64_t now_start = 0;
  int err = read_proc_stat(pid, &st, &now_start);
  if (err == ENOENT || err == ESRCH) return 0;
  if (err != 0) return 1;
  if (st == 'Z' || st == 'X' || st == 'x') return 0; /* zombie: dead, just not reaped */
  if (start != 0 && now_start != 0 && now_start != start) return 0; /* pid was recycled */
  return 1;
}

static uint64_t self_owner(void) {
  return ((uint64_t)getpid() & PID_MASK) | (mo_self_start_time() << MO_OWNER_PID_BITS);
}

static int owner_alive(uint64_t owner) {
  if (owner == 0) return 1;
  return mo_process_alive((int32_t)(owner & PID_MASK), owner >> MO_OWNER_PID_BITS);
}

/* Claim *slot for us: MO_OK, or MO_BUSY while a live owner holds it (dead owners are replaced). */
static mo_status claim(_Atomic uint64_t *slot, uint64_t me) {
  uint64_t cur = atomic_load_explicit(slot, ACQUIRE);
  for (;;) {
    if (cur != 0 && owner_alive(cur)) return MO_BUSY;
    if (atomic_compare_exchange_weak_explicit(slot, &cur, me, memory_order_acq_rel, ACQUIRE)) return MO_OK;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* segment names                                                                               */

mo_status mo_segment_name_check(const char *name, uint64_t len, const char **reason) {
  const char *why = NULL;
  if (name && len > 0 && name[0] == '/') {
    name++;
    len--;
  }
  if (!name || len == 0) why = "the name is empty";
  else if (len > MO_NAME_MAX) why = "the name is longer than 255 bytes";
  else if ((len == 1 && name[0] == '.') || (len == 2 && name[0] == '.' && name[1] == '.'))
    why = "the name is '.' or '..'";
  else
    for (uint64_t i = 0; i < len && !why; i++) {
      unsigned char ch = (unsigned char)name[i];
      if (ch == '/') why = "the name contains '/' after its first byte";
      else if (ch == 0) why = "the name contains a NUL byte";
      else if (ch < 0x20 || ch == 0x7f) why = "the name contains a control character";
    }
  if (reason) *reason = why ? why : "ok";
  return why ? MO_ARENA_INVALID : MO_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* arena                                                                                       */

static uint64_t round_pow2(uint64_t x) {
  if (x <= MO_MIN_CAPACITY) return MO_MIN_CAPACITY;
  return UINT64_C(1) << (64 - __builtin_clzll(x - 1));
}

static uint64_t round_page(uint64_t x) { return (x + MO_PAGE - 1) & ~(uint64_t)(MO_PAGE - 1); }

static int config_ok(const mo_ring_config *c) {
  return c->capacity > 0 && c->capacity <= MO_MAX_CAPACITY && c->alignment > 0;
}

static uint64_t superblock_size(uint32_t n) { return round_page(MO_SUPERBLOCK_FIXED + 8 * (uint64_t)n); }

uint64_t mo_arena_size(const mo_ring_config *rings, uint32_t n) {
  if (!rings || n == 0 || n > MO_MAX_RINGS) return 0;
  uint64_t size = superblock_size(n);
  for (uint32_t i = 0; i < n; i++) {
    if (!config_ok(&rings[i])) return 0;
    size += MO_CTRL_SIZE + round_page(round_pow2(rings[i].capacity));
  }
  return size;
}

mo_status mo_arena_init(void *base, uint64_t size, const mo_ring_config *rings, uint32_t n) {
  uint64_t need = mo_arena_size(rings, n);
  if (!base || need == 0 || size != need || ((uintptr_t)base & (MO_LINE - 1))) return MO_INVALID_ARGUMENT;
  mo_superblock *sb = (mo_superblock *)base;
  memset(base, 0, superblock_size(n)); /* magic stays 0 until the very end */
  sb->layout_version = MO_LAYOUT_VERSION;
  sb->ring_count = n;
  sb->total_size = size;
  sb->creator_pid = (int32_t)getpid();
  sb->creator_start = mo_self_start_time();
  sb->superblock_size = (uint32_t)superblock_size(n);
  uint64_t off = sb->superblock_size;
  for (uint32_t i = 0; i < n; i++) {
    struct mo_ring_ctrl *c = (struct mo_ring_ctrl *)((uint8_t *)base + off);
    memset(c, 0, MO_CTRL_SIZE);
    uint64_t cap = round_pow2(rings[i].capacity);
    c->magic = MO_RING_CTRL_MAGIC;
    c->index = i;
    c->capacity = cap;
    c->max_extent = rings[i].max_extent < MO_MAX_EXTENT ? rings[i].max_extent : MO_MAX_EXTENT;
    c->alignment = rings[i].alignment;
    c->data_offset = off + MO_CTRL_SIZE;
    atomic_init(&c->head, 0);
    atomic_init(&c->tail, 0);
    atomic_init(&c->head_seq, 0);
    atomic_init(&c->tail_seq, 0);
    atomic_init(&c->producer_owner, 0);
    atomic_init(&c->consumer_owner, 0);
    sb->ring_offset[i] = off;
    off += MO_CTRL_SIZE + round_page(cap);
  }
  atomic_store_explicit(&sb->magic, MO_ARENA_MAGIC, RELEASE);
  return MO_OK;
}

mo_status mo_arena_check(const void *base, uint64_t size, const char **reason) {
  const char *why = NULL;
  const mo_superblock *sb = (const mo_superblock *)base;
  if (!base || size < MO_SUPERBLOCK_FIXED) why = "the segment is smaller than an arena superblock";
  else if (atomic_load_explicit(&((mo_superblock *)sb)->magic, ACQUIRE) != MO_ARENA_MAGIC)
    why = "wrong magic: not a pyruntime arena (or not initialised yet)";
  else if (sb->layout_version != MO_LAYOUT_VERSION) why = "unsupported arena layout version";
  else if (sb->total_size != size) why = "the segment size differs from the size in the superblock";
  else if (sb->ring_count == 0 || sb->ring_count > MO_MAX_RINGS) why = "invalid ring count";
  else if (sb->superblock_size != superblock_size(sb->ring_count) || sb->superblock_size > size)
    why = "invalid superblock size";
  else {
    uint64_t prev_end = sb->superblock_size;
    for (uint32_t i = 0; i < sb->ring_count && !why; i++) {
      uint64_t off = sb->ring_offset[i];
      if (off < prev_end || off % MO_PAGE || off > size || size - off < MO_CTRL_SIZE) {
        why = "a ring offset is out of bounds";
        break;
      }
      const struct mo_ring_ctrl *c = (const struct mo_ring_ctrl *)((const uint8_t *)base + off);
      uint64_t cap = c->capacity;
      if (c->magic != MO_RING_CTRL_MAGIC || c->index != i) why = "a ring control block is corrupt";
      else if (cap < MO_MIN_CAPACITY || cap > MO_MAX_CAPACITY || (cap & (cap - 1)))
        why = "a ring capacity is not a power of two in range";
      else if (c->alignment == 0) why = "a ring alignment is zero";
      else if (c->max_extent > MO_MAX_EXTENT) why = "a ring max_extent is larger than any ring can hold";
      else if (c->data_offset != off + MO_CTRL_SIZE || size - off - MO_CTRL_SIZE < cap)
        why = "a ring data region is out of bounds";
      else prev_end = off + MO_CTRL_SIZE + cap;
    }
  }
  if (reason) *reason = why ? why : "ok";
  return why ? MO_ARENA_INVALID : MO_OK;
}

uint32_t mo_arena_ring_count(const void *base) { return ((const mo_superblock *)base)->ring_count; }

mo_status mo_arena_creator(const void *head, uint64_t len, int32_t *pid, uint64_t *start) {
  if (!head || len < MO_SUPERBLOCK_FIXED) return MO_ARENA_INVALID;
  const uint8_t *b = (const uint8_t *)head; /* maybe a copy read from a file: any alignment */
  uint64_t magic;
  memcpy(&magic, b + offsetof(mo_superblock, magic), sizeof magic);
  atomic_thread_fence(ACQUIRE); /* a live arena: the creator stored the magic last (release) */
  if (magic != MO_ARENA_MAGIC) return MO_ARENA_INVALID;
  if (pid) memcpy(pid, b + offsetof(mo_superblock, creator_pid), sizeof *pid);
  if (start) memcpy(start, b + offsetof(mo_superblock, creator_start), sizeof *start);
  return MO_OK;
}

mo_status mo_arena_ring(void *base, uint64_t size, uint32_t index, mo_ring *out) {
  if (!out) return MO_INVALID_ARGUMENT;
  memset(out, 0, sizeof *out);
  mo_status st = mo_arena_check(base, size, NULL);
  if (st != MO_OK) return st;
  mo_superblock *sb = (mo_superblock *)base;
  if (index >= sb->ring_count) return MO_INVALID_ARGUMENT;
  struct mo_ring_ctrl *c = (struct mo_ring_ctrl *)((uint8_t *)base + sb->ring_offset[index]);
  out->ctrl = c;
  out->data = (uint8_t *)base + c->data_offset;
  out->capacity = c->capacity;
  out->mask = c->capacity - 1;
  out->max_extent = c->max_extent;
  out->data_offset = c->data_offset;
  out->alignment = c->alignment;
  out->index = index;
  return MO_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* ring state                                                                                  */

void mo_ring_snapshot(const mo_ring *r, mo_ring_state *out) {
  memset(out, 0, sizeof *out);
  if (!r || !r->ctrl) return;
  struct mo_ring_ctrl *c = r->ctrl;
  out->head = atomic_load_explicit(&c->head, ACQUIRE);
  out->tail = atomic_load_explicit(&c->tail, ACQUIRE);
  out->head_seq = atomic_load_explicit(&c->head_seq, RELAXED);
  out->tail_seq = atomic_load_explicit(&c->tail_seq, RELAXED);
  uint64_t po = atomic_load_explicit(&c->producer_owner, RELAXED);
  uint64_t co = atomic_load_explicit(&c->consumer_owner, RELAXED);
  out->producer_pid = (int32_t)(po & PID_MASK);
  out->consumer_pid = (int32_t)(co & PID_MASK);
  out->producer_start = po >> MO_OWNER_PID_BITS;
  out->consumer_start = co >> MO_OWNER_PID_BITS;
  out->producer_closed = atomic_load_explicit(&c->producer_closed, RELAXED);
  out->consumer_closed = atomic_load_explicit(&c->consumer_closed, RELAXED);
  out->reader_sleeping = atomic_load_explicit(&c->reader_sleeping, RELAXED);
  out->writer_sleeping = atomic_load_explicit(&c->writer_sleeping, RELAXED);
}

double mo_ring_occupancy(const mo_ring *r) {
  if (!r || !r->ctrl) return 0.0;
  uint64_t tail = atomic_load_explicit(&r->ctrl->tail, ACQUIRE);
  uint64_t head = atomic_load_explicit(&r->ctrl->head, ACQUIRE);
  uint64_t used = head - tail;
  if (used > r->capacity) used = r->capacity; /* torn snapshot */
  return (double)used / (double)r->capacity;
}

/* ------------------------------------------------------------------------------------------ */
/* waiting                                                                                     */

/* What a waiter watches.  `ready` says whether the awaited condition already holds. */
typedef struct waitspec {
  struct mo_ring_ctrl *c;
  _Atomic uint32_t *futex;
  _Atomic uint32_t *sleeping;
  _Atomic uint32_t *peer_closed;
  _Atomic uint32_t *self_closed;
  _Atomic uint64_t *peer_owner;
  _Atomic uint64_t *cursor;      /* the peer's cursor we wait to move */
  uint64_t stuck;                /* ... away from this value */
  uint64_t spin_ns, poll_ns;
  int64_t *deadline;             /* handle->deadline_ns */
  uint64_t *parks;
  uint32_t flags;                /* handle->wait_flags */
} waitspec;

/* Wait until *cursor != stuck.  MO_OK when it moved (the caller re-checks with acquire), else
 * MO_TIMED_OUT, MO_CLOSED, MO_PEER_DEAD or MO_INTERRUPTED.  timeout_ns != 0. */
static mo_status wait_cursor(const waitspec *w, int64_t timeout_ns) {
  int64_t start = now_ns();
  int64_t deadline = timeout_ns > 0 ? add_sat(start, (uint64_t)timeout_ns) : INT64_MAX;
  *w->deadline = timeout_ns > 0 ? deadline : -1;

  /* 1. spin */
  if (w->spin_ns > 0) {
    int64_t spin_end = add_sat(start, w->spin_ns);
    if (spin_end > deadline) spin_end = deadline;
    for (uint32_t i = 1;; i++) {
      if (atomic_load_explicit(w->cursor, RELAXED) != w->stuck) return MO_OK;
      cpu_relax();
      if ((i & 63) == 0 && now_ns() >= spin_end) break;
    }
  }

  /* 2. park */
  for (;;) {
    uint32_t f = atomic_load_explicit(w->futex, ACQUIRE);
    atomic_store_explicit(w->sleeping, 1, RELAXED);
    atomic_thread_fence(SEQ_CST); /* Dekker: our flag before our re-check of the cursor */
    if (atomic_load_explicit(w->cursor, RELAXED) != w->stuck) {
      atomic_store_explicit(w->sleeping, 0, RELAXED);
      return MO_OK;
    }
    if (atomic_load_explicit(w->peer_closed, ACQUIRE) || atomic_load_explicit(w->self_closed, ACQUIRE)) {
      atomic_store_explicit(w->sleeping, 0, RELAXED);
      return atomic_load_explicit(w->cursor, ACQUIRE) != w->stuck ? MO_OK : MO_CLOSED;
    }
    int64_t slice = (int64_t)w->poll_ns;
    if (timeout_ns > 0) {
      int64_t left = deadline - now_ns();
      if (left <= 0) {
        atomic_store_explicit(w->sleeping, 0, RELAXED);
        return MO_TIMED_OUT;
      }
      if (left < slice) slice = left;
    }
    (*w->parks)++;
    int r = futex_wait(w->futex, f, slice);
    atomic_store_explicit(w->sleeping, 0, RELAXED);
    if (atomic_load_explicit(w->cursor, RELAXED) != w->stuck) return MO_OK;
    if (r == EINTR) return MO_INTERRUPTED;
    if (r != 0 && !owner_alive(atomic_load_explicit(w->peer_owner, ACQUIRE)))
      return atomic_load_explicit(w->cursor, ACQUIRE) != w->stuck ? MO_OK : MO_PEER_DEAD;
    if (r == ETIMEDOUT && (w->flags & MO_WAIT_RETURN_ON_POLL)) return MO_INTERRUPTED;
  }
}

/* After a cursor store: wake the other side if (and only if) it announced it sleeps. */
static inline void wake_if_sleeping(_Atomic uint32_t *sleeping, _Atomic uint32_t *futex, uint64_t *wakes) {
  atomic_thread_fence(SEQ_CST); /* Dekker: our cursor store before our look at the flag */
  if (MO_UNLIKELY(atomic_load_explicit(sleeping, RELAXED)) && atomic_exchange_explicit(sleeping, 0, RELAXED)) {
    atomic_fetch_add_explicit(futex, 1, RELEASE);
    futex_wake_all(futex);
    (*wakes)++;
  }
}

static void wake_always(_Atomic uint32_t *futex) {
  atomic_fetch_add_explicit(futex, 1, SEQ_CST);
  futex_wake_all(futex);
}

/* ------------------------------------------------------------------------------------------ */
/* producer                                                                                    */

mo_status mo_producer_attach(mo_producer *p, const mo_ring *r) {
  if (!p || !r || !r->ctrl) return MO_INVALID_ARGUMENT;
  memset(p, 0, sizeof *p);
  struct mo_ring_ctrl *c = r->ctrl;
  if (atomic_load_explicit(&c->producer_closed, ACQUIRE)) return MO_CLOSED;
  uint64_t me = self_owner();
  mo_status st = claim(&c->producer_owner, me);
  if (st != MO_OK) return st;
  p->r = *r;
  p->owner = me;
  /* resume where the previous owner (if any) left off */
  p->wpos = p->published = atomic_load_explicit(&c->head, ACQUIRE);
  p->next_seq = atomic_load_explicit(&c->head_seq, RELAXED);
  p->cached_tail = atomic_load_explicit(&c->tail, ACQUIRE);
  p->spin_ns = MO_DEFAULT_SPIN_NS;
  p->poll_ns = MO_DEFAULT_POLL_NS;
  p->state = ST_ATTACHED;
  return MO_OK;
}

/* A poll slice becomes a futex timeout (int64 nanoseconds): keep it positive and in range. */
static uint64_t poll_slice(uint64_t poll_ns) {
  if (poll_ns == 0) return MO_DEFAULT_POLL_NS;
  return poll_ns < (uint64_t)INT64_MAX ? poll_ns : (uint64_t)INT64_MAX;
}

void mo_producer_set_wait(mo_producer *p, uint64_t spin_ns, uint64_t poll_ns) {
  p->spin_ns = spin_ns;
  p->poll_ns = poll_slice(poll_ns);
}

uint64_t mo_producer_publish(mo_producer *p) {
  if (MO_UNLIKELY(p->state == ST_DETACHED)) return 0;
  if (p->wpos == p->published) return 0;
  struct mo_ring_ctrl *c = p->r.ctrl;
  uint64_t before = atomic_load_explicit(&c->head_seq, RELAXED);
  atomic_store_explicit(&c->head_seq, p->next_seq, RELAXED);
  atomic_store_explicit(&c->head, p->wpos, RELEASE); /* the one publishing store */
  p->published = p->wpos;
  wake_if_sleeping(&c->reader_sleeping, &c->data_futex, &p->wakes);
  return p->next_seq - before;
}

static waitspec producer_waitspec(mo_producer *p) {
  struct mo_ring_ctrl *c = p->r.ctrl;
  waitspec w = {c, &c->space_futex, &c->writer_sleeping, &c->consumer_closed, &c->producer_closed,
                &c->consumer_owner, &c->tail, p->cached_tail, p->spin_ns, p->poll_ns, &p->deadline_ns, &p->parks,
                p->wait_flags};
  return w;
}

/* Make room for `need` bytes at wpos.  Publishes committed records before it waits or fails, so
 * a consumer is never left waiting for records this producer sits on. */
static mo_status make_room(mo_producer *p, uint64_t need, int64_t timeout_ns) {
  uint64_t cap = p->r.capacity;
  if (MO_LIKELY(p->wpos + need - p->cached_tail <= cap)) return MO_OK;
  struct mo_ring_ctrl *c = p->r.ctrl;
  p->cached_tail = atomic_load_explicit(&c->tail, ACQUIRE);
  if (p->wpos + need - p->cached_tail <= cap) return MO_OK;
  mo_producer_publish(p);
  for (;;) {
    if (atomic_load_explicit(&c->consumer_closed, ACQUIRE)) return MO_CLOSED;
    if (timeout_ns == 0) return MO_WOULD_BLOCK;
    waitspec w = producer_waitspec(p);
    mo_status st = wait_cursor(&w, timeout_ns);
    p->cached_tail = atomic_load_explicit(&c->tail, ACQUIRE);
    if (p->wpos + need - p->cached_tail <= cap) return MO_OK;
    if (st != MO_OK) return st;
    /* the consumer released something, not yet enough: keep waiting for the remaining time */
    if (timeout_ns > 0) {
      timeout_ns = p->deadline_ns - now_ns();
      if (timeout_ns <= 0) return MO_TIMED_OUT;
    }
  }
}

static inline mo_status producer_usable(const mo_producer *p) {
  if (MO_UNLIKELY(p->state != ST_ATTACHED)) return p->state == ST_CLOSED ? MO_CLOSED : MO_INVALID_STATE;
  if (MO_UNLIKELY(p->res_open)) return MO_INVALID_STATE;
  return MO_OK;
}

/* Validate extent and find room for one record at wpos (writing a padding record first when it
 * would not fit before the end of the data region).  On MO_OK the record goes at p->wpos. */
static inline mo_status place(mo_producer *p, uint64_t extent, int64_t timeout_ns) {
  if (MO_UNLIKELY(extent > p->r.max_extent)) return MO_OUTPUT_EXTENT_INVALID;
  if (MO_UNLIKELY(mo_extent_misaligned(extent, p->r.alignment))) return MO_OUTPUT_EXTENT_ALIGNMENT_VIOLATION;
  uint64_t cap = p->r.capacity;
  if (MO_UNLIKELY(!mo_record_fits(extent, cap))) return MO_OUTPUT_RING_CAPACITY_EXCEEDED;
  uint64_t size = round8(MO_HEADER_LEN + extent); /* no overflow: extent <= cap - 40 */
  if (MO_UNLIKELY(atomic_load_explicit(&p->r.ctrl->consumer_closed, RELAXED))) return MO_CLOSED;
  uint64_t off = p->wpos & p->r.mask;
  if (MO_UNLIKELY(cap - off < size)) {
    uint64_t pad = cap - off;
    mo_status st = make_room(p, pad, timeout_ns);
    if (st != MO_OK) return st;
    uint32_t marker[2] = {MO_PAD_MAGIC, 0};
    memcpy(p->r.data + off, marker, sizeof marker);
    p->wpos += pad; /* committed; published with the next publish (at the latest before a wait) */
  }
  return make_room(p, size, timeout_ns);
}

mo_status mo_producer_reserve(mo_producer *p, uint64_t extent, int64_t timeout_ns, void **payload) {
  mo_status st = producer_usable(p);
  if (st != MO_OK) return st;
  st = place(p, extent, timeout_ns);
  if (st != MO_OK) return st;
  p->res_pos = p->wpos;
  p->res_extent = extent;
  p->res_open = 1;
  if (payload) *payload = p->r.data + (p->wpos & p->r.mask) + MO_HEADER_LEN;
  return MO_OK;
}

static inline uint64_t finish_record(mo_producer *p, uint64_t pos, uint64_t extent, uint64_t object_id,
                                     uint32_t flags) {
  uint64_t seq = p->next_seq++;
  mo_record_header h = mo_record_header_make(object_id, seq, extent, flags);
  memcpy(p->r.data + (pos & p->r.mask), &h, sizeof h);
  p->wpos = pos + mo_record_size(extent);
  p->records++;
  return seq;
}

int64_t mo_producer_commit_deferred(mo_producer *p, uint64_t object_id, uint32_t flags) {
  if (MO_UNLIKELY(p->state != ST_ATTACHED)) return -(int64_t)(p->state == ST_CLOSED ? MO_CLOSED : MO_INVALID_STATE);
  if (MO_UNLIKELY(!p->res_open)) return -(int64_t)MO_INVALID_STATE;
  p->res_open = 0;
  return (int64_t)finish_record(p, p->res_pos, p->res_extent, object_id, flags);
}

int64_t mo_producer_commit(mo_producer *p, uint64_t object_id, uint32_t flags) {
  int64_t seq = mo_producer_commit_deferred(p, object_id, flags);
  if (seq >= 0) mo_producer_publish(p);
  return seq;
}

void mo_producer_abort(mo_producer *p) { p->res_open = 0; }

int64_t mo_producer_write(mo_producer *p, uint64_t object_id, uint32_t flags, const char *data, uint64_t len,
                          int64_t timeout_ns) {
  mo_status st = producer_usable(p);
  if (MO_UNLIKELY(st != MO_OK)) return -(int64_t)st;
  st = place(p, len, timeout_ns);
  if (MO_UNLIKELY(st != MO_OK)) return -(int64_t)st;
  uint64_t pos = p->wpos;
  if (len) memcpy(p->r.data + (pos & p->r.mask) + MO_HEADER_LEN, data, len);
  uint64_t seq = finish_record(p, pos, len, object_id, flags);
  mo_producer_publish(p);
  return (int64_t)seq;
}

mo_status mo_producer_write_many(mo_producer *p, const uint64_t *object_ids, const uint32_t *flags,
                                 const char *data, const uint64_t *lengths, uint64_t fixed_len, uint32_t n,
                                 int64_t timeout_ns, uint32_t *written) {
  uint32_t i = 0;
  mo_status st = producer_usable(p);
  if (st == MO_OK) {
    const char *src = data;
    for (; i < n; i++) {
      uint64_t len = lengths ? lengths[i] : fixed_len;
      if (MO_UNLIKELY(len && !data)) {
        st = MO_INVALID_ARGUMENT;
        break;
      }
      st = place(p, len, timeout_ns);
      if (MO_UNLIKELY(st != MO_OK)) break;
      uint64_t pos = p->wpos;
      if (len) memcpy(p->r.data + (pos & p->r.mask) + MO_HEADER_LEN, src, len);
      src += len;
      finish_record(p, pos, len, object_ids ? object_ids[i] : 0, flags ? flags[i] : 0);
    }
    mo_producer_publish(p);
  }
  if (written) *written = i;
  return st;
}

void mo_producer_close(mo_producer *p) {
  if (!p || p->state != ST_ATTACHED) return;
  p->res_open = 0;
  mo_producer_publish(p);
  struct mo_ring_ctrl *c = p->r.ctrl;
  atomic_store_explicit(&c->producer_closed, 1, SEQ_CST);
  wake_always(&c->data_futex);
  wake_always(&c->space_futex);
  p->state = ST_CLOSED;
}

void mo_producer_detach(mo_producer *p) {
  if (!p || p->state == ST_DETACHED || !p->r.ctrl) return;
  p->res_open = 0;
  if (p->state == ST_ATTACHED) mo_producer_publish(p);
  uint64_t me = p->owner;
  atomic_compare_exchange_strong(&p->r.ctrl->producer_owner, &me, 0);
  p->state = ST_DETACHED;
}

/* ------------------------------------------------------------------------------------------ */
/* consumer                                                                                    */

mo_status mo_consumer_attach(mo_consumer *c, const mo_ring *r) {
  if (!c || !r || !r->ctrl) return MO_INVALID_ARGUMENT;
  memset(c, 0, sizeof *c);
  struct mo_ring_ctrl *k = r->ctrl;
  if (atomic_load_explicit(&k->consumer_closed, ACQUIRE)) return MO_CLOSED;
  uint64_t me = self_owner();
  mo_status st = claim(&k->consumer_owner, me);
  if (st != MO_OK) return st;
  c->r = *r;
  c->owner = me;
  c->rpos = c->released = atomic_load_explicit(&k->tail, ACQUIRE);
  c->next_seq = atomic_load_explicit(&k->tail_seq, RELAXED);
  c->cached_head = atomic_load_explicit(&k->head, ACQUIRE);
  c->spin_ns = MO_DEFAULT_SPIN_NS;
  c->poll_ns = MO_DEFAULT_POLL_NS;
  c->state = ST_ATTACHED;
  return MO_OK;
}

void mo_consumer_set_wait(mo_consumer *c, uint64_t spin_ns, uint64_t poll_ns) {
  c->spin_ns = spin_ns;
  c->poll_ns = poll_slice(poll_ns);
}

static inline void store_tail(mo_consumer *c) {
  struct mo_ring_ctrl *k = c->r.ctrl;
  atomic_store_explicit(&k->tail_seq, c->next_seq, RELAXED);
  atomic_store_explicit(&k->tail, c->rpos, RELEASE); /* the one releasing store */
  c->released = c->rpos;
  wake_if_sleeping(&k->writer_sleeping, &k->space_futex, &c->wakes);
}

uint64_t mo_consumer_release(mo_consumer *c) {
  if (MO_UNLIKELY(c->state != ST_ATTACHED)) return 0;
  uint64_t n = c->outstanding;
  c->outstanding = 0;
  c->slot = 0;
  if (c->rpos != c->released) store_tail(c);
  return n;
}

/* One record at rpos without waiting: MO_OK, MO_WOULD_BLOCK (nothing published past rpos) or a
 * validation error.  Skips padding. */
static inline mo_status take(mo_consumer *c, mo_view *out) {
  const uint64_t cap = c->r.capacity;
  for (;;) {
    uint64_t avail = c->cached_head - c->rpos;
    if (avail == 0) {
      c->cached_head = atomic_load_explicit(&c->r.ctrl->head, ACQUIRE);
      avail = c->cached_head - c->rpos;
      if (avail == 0) return MO_WOULD_BLOCK;
    }
    uint64_t off = c->rpos & c->r.mask;
    uint64_t room = cap - off; /* >= 8: rpos stays 8-aligned */
    const uint8_t *rec = c->r.data + off;
    if (avail > cap) avail = cap; /* a garbage head: never look further than one lap */
    if (MO_UNLIKELY(avail < 8)) {
      memset(out, 0, sizeof *out);
      out->position = c->rpos;
      out->expected_sequence = c->next_seq;
      return MO_EOF_BEFORE_FULL_HEADER;
    }
    uint32_t w[2];
    memcpy(w, rec, sizeof w);
    if (w[0] == MO_PAD_MAGIC) {
      if (MO_UNLIKELY(avail < room || w[1] != 0)) {
        memset(out, 0, sizeof *out);
        out->magic = w[0];
        out->position = c->rpos;
        out->expected_sequence = c->next_seq;
        return avail < room ? MO_EOF_BEFORE_FULL_HEADER : MO_INVALID_OBJECT_HEADER;
      }
      c->rpos += room;
      if (c->outstanding == 0) store_tail(c); /* nothing held: hand the space back now */
      continue;
    }
    out->position = c->rpos;
    out->data_offset = off + MO_HEADER_LEN;
    if (MO_UNLIKELY(avail < MO_HEADER_LEN || room < MO_HEADER_LEN)) {
      memset(out, 0, sizeof *out);
      out->magic = w[0];
      out->position = c->rpos;
      out->expected_sequence = c->next_seq;
      if (avail < MO_HEADER_LEN) return MO_EOF_BEFORE_FULL_HEADER;
      /* no header fits before the end of the region: only padding may start here */
      return w[0] == MO_RECORD_MAGIC ? MO_INVALID_OBJECT_HEADER : MO_INVALID_OBJECT_MAGIC;
    }
    mo_record_header h;
    memcpy(&h, rec, sizeof h);
    mo_view_fill(out, &h, c->next_seq);
    mo_status st = mo_record_header_check(&h, avail < room ? avail : room, c->r.max_extent, c->r.alignment, c->next_seq);
    if (MO_UNLIKELY(st != MO_OK)) {
      out->payload = NULL;
      return st;
    }
    out->payload = rec + MO_HEADER_LEN;
    c->rpos += mo_record_size(h.extent);
    c->next_seq++;
    c->outstanding++;
    c->records++;
    return MO_OK;
  }
}

static inline mo_status consumer_usable(const mo_consumer *c) {
  if (MO_UNLIKELY(c->state != ST_ATTACHED)) return c->state == ST_CLOSED ? MO_CLOSED : MO_INVALID_STATE;
  return MO_OK;
}

/* Empty ring: CLOSED if the producer closed (after a final look at head), else WOULD_BLOCK. */
static mo_status empty_status(mo_consumer *c, mo_view *out) {
  if (atomic_load_explicit(&c->r.ctrl->producer_closed, ACQUIRE)) {
    mo_status st = take(c, out); /* the producer publishes before it closes */
    return st == MO_WOULD_BLOCK ? MO_CLOSED : st;
  }
  return MO_WOULD_BLOCK;
}

mo_status mo_consumer_peek(mo_consumer *c, mo_view *out) {
  mo_status st = consumer_usable(c);
  if (MO_UNLIKELY(st != MO_OK)) return st;
  st = take(c, out);
  return MO_LIKELY(st != MO_WOULD_BLOCK) ? st : empty_status(c, out);
}

static waitspec consumer_waitspec(mo_consumer *c) {
  struct mo_ring_ctrl *k = c->r.ctrl;
  waitspec w = {k, &k->data_futex, &k->reader_sleeping, &k->producer_closed, &k->consumer_closed,
                &k->producer_owner, &k->head, c->rpos, c->spin_ns, c->poll_ns, &c->deadline_ns, &c->parks,
                c->wait_flags};
  return w;
}

mo_status mo_consumer_read(mo_consumer *c, mo_view *out, int64_t timeout_ns) {
  mo_status st = consumer_usable(c);
  if (MO_UNLIKELY(st != MO_OK)) return st;
  st = take(c, out);
  if (MO_LIKELY(st != MO_WOULD_BLOCK)) return st;
  for (;;) {
    st = empty_status(c, out);
    if (st != MO_WOULD_BLOCK || timeout_ns == 0) return st;
    waitspec w = consumer_waitspec(c);
    mo_status ws = wait_cursor(&w, timeout_ns);
    st = take(c, out);
    if (st != MO_WOULD_BLOCK) return st;
    if (ws == MO_CLOSED) {
      st = empty_status(c, out);
      return st == MO_WOULD_BLOCK ? MO_CLOSED : st; /* our own side was closed */
    }
    if (ws != MO_OK) return ws;
    /* head moved but only past padding: wait again for the remaining time */
    if (timeout_ns > 0) {
      timeout_ns = c->deadline_ns - now_ns();
      if (timeout_ns <= 0) return MO_TIMED_OUT;
    }
  }
}

mo_status mo_consumer_read_many(mo_consumer *c, mo_view *out, uint32_t max, int64_t timeout_ns, uint32_t *n) {
  uint32_t got = 0;
  mo_status st = MO_INVALID_ARGUMENT;
  if (max > 0 && out) {
    st = mo_consumer_read(c, &out[0], timeout_ns);
    if (st == MO_OK) {
      got = 1;
      while (got < max && take(c, &out[got]) == MO_OK) got++;
    }
  }
  if (n) *n = got;
  return st;
}

int64_t mo_consumer_gather(const mo_consumer *c, const mo_view *views, uint32_t n, char *dst, uint64_t dst_len) {
  if (c->state == ST_DETACHED) return -(int64_t)MO_INVALID_STATE;
  uint64_t total = 0;
  for (uint32_t i = 0; i < n; i++) {
    uint64_t e = views[i].extent;
    uint64_t o = views[i].data_offset;
    if (o > c->r.capacity || e > c->r.capacity - o) return -(int64_t)MO_INVALID_ARGUMENT;
    if (e > dst_len - total) return -(int64_t)MO_INVALID_ARGUMENT;
    memcpy(dst + total, c->r.data + o, e);
    total += e;
  }
  return (int64_t)total;
}

void mo_consumer_close(mo_consumer *c) {
  if (!c || c->state != ST_ATTACHED) return;
  mo_consumer_release(c);
  struct mo_ring_ctrl *k = c->r.ctrl;
  atomic_store_explicit(&k->consumer_closed, 1, SEQ_CST);
  wake_always(&k->space_futex);
  wake_always(&k->data_futex);
  c->state = ST_CLOSED;
}

void mo_consumer_detach(mo_consumer *c) {
  if (!c || c->state == ST_DETACHED || !c->r.ctrl) return;
  if (c->state == ST_ATTACHED) mo_consumer_release(c);
  uint64_t me = c->owner;
  atomic_compare_exchange_strong(&c->r.ctrl->consumer_owner, &me, 0);
  c->state = ST_DETACHED;
}

