/*
 * mo_ring.h -- MO01 records over lock-free single-producer/single-consumer rings in shared memory.
 *
 * pyruntime's stage processes hand records to each other through rings that live in one POSIX
 * shared-memory object (an *arena*).  This header is the whole contract: the byte layout of the
 * arena, the record wire format (docs/wire-format.md), the memory-ordering protocol between the two
 * sides, and the C API.  The library never allocates: the caller maps the memory and owns every
 * handle struct.  C11, Linux (futex), little-endian hosts.
 *
 * This is the core (mo_ring.c).  What the library carries for its bindings and tests -- FFI
 * shortcuts (put, take*), raw publish and discard for fuzzing, the record codec as stand-alone
 * calls -- is declared in mo_ring_extra.h (mo_ring_extra.c), written on this API; so are the C
 * benchmark loops, mo_ring_bench.h (mo_ring_bench.c), which no shipped extension carries.
 *
 * ---------------------------------------------------------------------------------------------
 * 1. Arena layout (all offsets from the start of the mapping; all integers little-endian)
 *
 *      0  mo_superblock            magic "MOARENA\0", layout version, total size, ring count,
 *                                  creator pid + start time, ring_offset[ring_count]
 *      S  ring 0: mo_ring_ctrl     MO_CTRL_SIZE bytes (cursor lines, wait lines, config)
 *         ring 0: data             capacity bytes (a power of two)
 *         ring 1: ...
 *
 *    The superblock's fields are struct mo_superblock (below the API); bindings read the
 *    creator through mo_arena_creator() rather than restating offsets.
 *
 *    S and every ring offset are multiples of MO_PAGE.  The creator writes everything, then stores
 *    the superblock magic last (release), so an attacher that sees the magic sees an initialised
 *    arena.  mo_arena_check() refuses anything else (wrong magic, layout version, size, a ring
 *    that does not fit) with MO_ARENA_INVALID and a reason string.
 *
 * 2. Records (docs/wire-format.md, exact)
 *
 *    offset size field
 *         0    4 magic       "MO01"
 *         4    2 version     1
 *         6    2 header_len  40
 *         8    8 object_id   chosen by the producer
 *        16    8 sequence    per ring: 0, 1, 2, ... no gaps, no repeats
 *        24    8 extent      payload bytes that follow the header
 *        32    4 flags       the producer's; the ring passes them through untouched
 *        36    4 reserved    0
 *
 *    A record occupies mo_record_size(extent) = round_up(40 + extent, 8) bytes, so every header
 *    is 8-byte aligned (and every payload too: it starts 40 bytes after its header).  A record
 *    never wraps around the end of the data region: when it does not fit before the end, the
 *    producer writes a *padding record* -- the 4 bytes "MOPD" then 4 zero bytes -- which
 *    implicitly runs to the end of the data region, and starts the record at offset 0.  Padding
 *    is not an MO01 record and takes no sequence number; consumers skip it.  Every payload is one
 *    contiguous span.
 *
 *    In C the header is struct mo_record_header (below the API); it is encoded by
 *    mo_record_header_make() and judged by mo_record_header_check() -- the one encoder and the
 *    one validator, used by producer, consumer and tools alike.  Python's ring.encode_header and
 *    ring.record_size call them too (mo_record_encode, mo_record_size).
 *
 * 3. Cursors and memory ordering
 *
 *    Positions are free-running 64-bit byte counts (they never wrap in practice: 2^64 bytes);
 *    the byte at position p lives at data[p & (capacity - 1)].
 *
 *      head  (producer line)  end of the last *published* record.  The producer writes payload
 *                             and header with plain stores, then publishes any number of
 *                             records with ONE store-release of head.
 *      tail  (consumer line)  end of the last *released* record.  The consumer reads records in
 *                             place, then frees any number of them with ONE store-release of tail.
 *
 *    The consumer load-acquires head before reading records below it; the producer load-acquires
 *    tail before overwriting bytes below tail + capacity.  Each side keeps a private cached copy
 *    of the other side's cursor and reloads it only when the cached value says "full"/"empty",
 *    so in steady state neither side touches the other's cache line.  head, tail, the two wait
 *    lines and the config line are each on their own MO_LINE (128 bytes: two 64-byte lines,
 *    because adjacent-line prefetchers pull lines in pairs).
 *
 * 4. Waiting (spin, then futex)
 *
 *    A blocked side spins for spin_ns (tunable, default MO_DEFAULT_SPIN_NS) watching the other
 *    cursor, then parks on a 32-bit futex word in the shared region (FUTEX_WAIT/FUTEX_WAKE
 *    *without* FUTEX_PRIVATE_FLAG: the waker is another process).  The protocol is Dekker's:
 *
 *      waiter:  f = load(futex); store(sleeping, 1); fence(seq_cst); re-check cursor/closed;
 *               futex_wait(futex, f, slice)
 *      waker:   store-release(cursor); fence(seq_cst);
 *               if (load(sleeping) && exchange(sleeping, 0)) { futex += 1; futex_wake(futex) }
 *
 *    Either the waiter's re-check sees the new cursor, or the waker sees sleeping == 1; and a
 *    futex bump between the waiter's load and its FUTEX_WAIT makes the wait return at once.  So
 *    no wake-up is lost, and a waker makes no system call unless a waiter announced it sleeps.
 *    Closing bumps the futex words unconditionally.  A parked side wakes every poll_ns (default
 *    MO_DEFAULT_POLL_NS = 100 ms) to check that its peer process is alive; an idle waiter costs
 *    ten wake-ups a second.
 *
 * 5. Liveness
 *
 *    Claiming a side (mo_producer_attach / mo_consumer_attach) stores an *owner word*: the pid
 *    and the process start time (/proc/<pid>/stat field 22) packed as pid | start << 22, so a
 *    recycled pid is not mistaken for the peer.  A claimed side whose owner is alive cannot be
 *    claimed again (MO_BUSY); one whose owner died can be taken over, and the new owner resumes
 *    at the shared cursors and sequence numbers.  Either side can close (MO_CLOSED for the other
 *    side; a consumer first drains what was published).  A waiting side checks its peer on each
 *    park wake-up: kill(pid, 0) fails with ESRCH, or /proc says zombie/dead/another start time
 *    => MO_PEER_DEAD (again: a consumer first drains).  Pid checks assume both sides share a pid
 *    namespace.
 *
 * 6. Return conventions
 *
 *    Functions return mo_status (MO_OK == 0).  Functions that produce a sequence number return
 *    int64_t: the sequence (>= 0), or -(mo_status) on failure -- the liburing -errno style.
 *    Timeouts are int64_t nanoseconds: < 0 waits without limit (still ends on CLOSED, PEER_DEAD
 *    or INTERRUPTED), 0 never waits (MO_WOULD_BLOCK), > 0 waits at most that long
 *    (MO_TIMED_OUT); a timeout so long that the deadline would pass INT64_MAX ns saturates there
 *    (for ever, in practice).  A wait interrupted by a signal handler returns MO_INTERRUPTED and leaves
 *    the absolute CLOCK_MONOTONIC deadline in handle->deadline_ns, so the caller can run its
 *    handlers and retry for the remaining time.  A signal that lands while the waiter is not
 *    inside FUTEX_WAIT (spinning, or checking its peer) interrupts nothing; bindings that run
 *    their own handlers (Python) therefore set MO_WAIT_RETURN_ON_POLL in handle->wait_flags and
 *    get MO_INTERRUPTED at every poll wake-up too, so a pending handler waits at most poll_ns.
 *
 * 7. Two consequences of the design worth knowing
 *
 *    - Records a consumer has read but not released still occupy the ring.  A consumer that
 *      blocks waiting for more records while holding enough of them to fill the ring waits for
 *      ever (well: until its timeout or a peer's death).  Release before blocking.
 *    - A record that does not fit before the end of the data region needs the consumer to pass
 *      the padding record first, even when the ring is otherwise empty.  So a *try*-write
 *      (timeout 0) that wraps can return MO_WOULD_BLOCK on a drained ring; the padding is
 *      published at once, a consumer passes it on its next read attempt (hands the space back
 *      when it holds no records), and the write succeeds after that.  Blocking writes just wait
 *      for it.
 *
 * 8. Threads
 *
 *    One producer handle and one consumer handle per ring, each used by one thread at a time.
 *    The handles are plain structs: treat their fields as read-only outside this library.
 */
#ifndef MO_RING_H
#define MO_RING_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* MO_CDEF_BEGIN -- everything between the markers is plain declarations; native/build_ring.py
 * hands this section verbatim to cffi as the Python-visible API. */

#define MO_HEADER_LEN 40              /* bytes of an MO01 header */
#define MO_RECORD_VERSION 1
#define MO_RECORD_MAGIC 0x31304F4D    /* "MO01" read as a little-endian u32 */
#define MO_PAD_MAGIC 0x44504F4D       /* "MOPD": padding to the end of the data region */
#define MO_LAYOUT_VERSION 1           /* arena layout version in the superblock */
#define MO_LINE 128                   /* separation of independently written shared fields */
#define MO_PAGE 4096                  /* alignment of the superblock end and of every ring */
#define MO_CTRL_SIZE 4096             /* bytes reserved for one ring's control block */
#define MO_SUPERBLOCK_FIXED 64        /* bytes of the superblock before ring_offset[] */
#define MO_MIN_CAPACITY 64            /* smallest data region */
#define MO_MAX_CAPACITY 0x10000000000 /* largest data region: 1 TiB */
#define MO_MAX_EXTENT 0xFFFFFFFFD8    /* MO_MAX_CAPACITY - MO_HEADER_LEN: no ring holds a larger payload */
#define MO_NAME_MAX 255               /* bytes of a segment name after its '/' (NAME_MAX of /dev/shm) */
#define MO_MAX_RINGS 4096
#define MO_DEFAULT_SPIN_NS 20000      /* spin this long before parking */
#define MO_DEFAULT_POLL_NS 100000000  /* a parked side wakes this often to check its peer */
#define MO_WAIT_RETURN_ON_POLL 1      /* wait_flags: also return MO_INTERRUPTED at each poll wake-up */

/* Every outcome.  mo_status_name() gives the pyruntime error class name of each (errors.py). */
typedef enum mo_status {
  MO_OK = 0,
  /* flow and liveness */
  MO_WOULD_BLOCK = 1,                           /* "WouldBlock": a try-call found the ring full/empty */
  MO_TIMED_OUT = 2,                             /* "RingTimeout": the timeout expired */
  MO_CLOSED = 3,                                /* "RingClosed": this or the other side closed */
  MO_PEER_DEAD = 4,                             /* "PeerDead": the other side's process died */
  MO_BUSY = 5,                                  /* "RingBusy": the side is claimed by a live process */
  MO_INTERRUPTED = 6,                           /* "Interrupted": a signal handler interrupted a wait */
  /* consumer validation (docs/wire-format.md): the record is reported, the cursor does not move */
  MO_EOF_BEFORE_FULL_HEADER = 10,               /* "EofBeforeFullHeader" */
  MO_INVALID_OBJECT_MAGIC = 11,                 /* "InvalidObjectMagic" */
  MO_INVALID_OBJECT_HEADER = 12,                /* "InvalidObjectHeader": version, header_len, reserved */
  MO_OBJECT_EXTENT_INVALID = 13,                /* "ObjectExtentInvalid": > max_extent or past published bytes */
  MO_OBJECT_EXTENT_ALIGNMENT_VIOLATION = 14,    /* "ObjectExtentAlignmentViolation" */
  MO_SEQUENCE_VIOLATION = 15,                   /* "SequenceViolation": see mo_view.expected_sequence */
  /* producer refusals: nothing is published */
  MO_OUTPUT_EXTENT_INVALID = 20,                /* "OutputExtentInvalid": extent > max_extent */
  MO_OUTPUT_EXTENT_ALIGNMENT_VIOLATION = 21,    /* "OutputExtentAlignmentViolation" */
  MO_OUTPUT_RING_CAPACITY_EXCEEDED = 22,        /* "OutputRingCapacityExceeded": can never fit */
  /* arena and API misuse */
  MO_ARENA_INVALID = 30,                        /* "ArenaInvalid" */
  MO_INVALID_ARGUMENT = 31,                     /* "InvalidArgument" */
  MO_INVALID_STATE = 32                         /* "InvalidState": e.g. commit without reserve */
} mo_status;

/* Configuration of one ring, as asked for by the creator. */
typedef struct mo_ring_config {
  uint64_t capacity;    /* data bytes; rounded up to a power of two >= MO_MIN_CAPACITY */
  uint64_t max_extent;  /* largest payload accepted, in bytes; stored capped at MO_MAX_EXTENT */
  uint32_t alignment;   /* every extent is a multiple of this (>= 1) */
  uint32_t reserved;    /* 0 */
} mo_ring_config;

/* The shared control block of a ring; its layout is defined below the cdef section. */
typedef struct mo_ring_ctrl mo_ring_ctrl;

/* A process-local view of one ring inside a mapped arena. */
typedef struct mo_ring {
  mo_ring_ctrl *ctrl;   /* shared control block */
  uint8_t *data;        /* shared data region, capacity bytes */
  uint64_t capacity;    /* power of two */
  uint64_t mask;        /* capacity - 1 */
  uint64_t max_extent;
  uint64_t data_offset; /* offset of data from the arena base */
  uint32_t alignment;
  uint32_t index;       /* ring index within the arena */
} mo_ring;

/* One record found by the consumer, in place.  On a validation error the fields hold what was
 * read (for the message); expected_sequence is always the sequence the consumer expected. */
typedef struct mo_view {
  uint64_t object_id;
  uint64_t sequence;
  uint64_t extent;
  uint32_t flags;
  uint32_t reserved;          /* the header's reserved field as read */
  uint64_t position;          /* free-running position of the header */
  uint64_t data_offset;       /* payload offset within the data region */
  uint64_t expected_sequence;
  uint32_t magic;             /* as read */
  uint16_t version;           /* as read */
  uint16_t header_len;        /* as read */
  const uint8_t *payload;     /* extent bytes, valid until released */
} mo_view;

/* Producer handle (process-local; the caller owns the memory). */
typedef struct mo_producer {
  mo_ring r;
  uint64_t wpos;          /* end of the last committed record (published or not) */
  uint64_t published;     /* last value stored to head */
  uint64_t cached_tail;   /* the consumer's cursor as last loaded */
  uint64_t next_seq;      /* sequence the next commit gets */
  uint64_t res_pos;       /* header position of the open reservation */
  uint64_t res_extent;    /* extent of the open reservation */
  uint64_t spin_ns;       /* wait tuning (mo_producer_set_wait) */
  uint64_t poll_ns;
  int64_t deadline_ns;    /* absolute deadline of the last timed wait (see MO_INTERRUPTED) */
  uint64_t owner;         /* our owner word */
  uint64_t parks;         /* statistics: futex waits, futex wakes issued, records committed */
  uint64_t wakes;
  uint64_t records;
  uint32_t state;         /* 0 detached, 1 attached, 2 closed */
  uint32_t res_open;      /* 1 while a reservation is open */
  uint32_t wait_flags;    /* MO_WAIT_RETURN_ON_POLL or 0 */
  uint32_t reserved;
} mo_producer;

/* Consumer handle (process-local; the caller owns the memory). */
typedef struct mo_consumer {
  mo_ring r;
  uint64_t rpos;          /* position of the next record to examine */
  uint64_t released;      /* last value stored to tail */
  uint64_t cached_head;   /* the producer's cursor as last loaded */
  uint64_t next_seq;      /* sequence expected at rpos */
  uint64_t outstanding;   /* records read but not released */
  uint64_t spin_ns;
  uint64_t poll_ns;
  int64_t deadline_ns;
  uint64_t owner;
  uint64_t parks;
  uint64_t wakes;
  uint64_t records;
  uint32_t state;         /* 0 detached, 1 attached, 2 closed */
  uint32_t slot;          /* next slot of views[] for mo_consumer_take*() (mo_ring_extra.h); release resets it */
  mo_view *views;         /* caller-owned slots for mo_consumer_take*() (bindings) */
  uint32_t nviews;
  uint32_t wait_flags;    /* MO_WAIT_RETURN_ON_POLL or 0 */
} mo_consumer;

/* A consistent-enough snapshot of a ring's shared state (for metrics and tests). */
typedef struct mo_ring_state {
  uint64_t head;
  uint64_t tail;
  uint64_t head_seq;          /* sequence of the next record the producer will publish */
  uint64_t tail_seq;          /* sequence the consumer expects after its last release */
  uint64_t producer_start;    /* owner start times (see mo_self_start_time), 0 when unclaimed */
  uint64_t consumer_start;
  int32_t producer_pid;       /* 0 when unclaimed */
  int32_t consumer_pid;
  uint32_t producer_closed;
  uint32_t consumer_closed;
  uint32_t reader_sleeping;
  uint32_t writer_sleeping;
} mo_ring_state;

/* --- status ------------------------------------------------------------------------------- */
const char *mo_status_name(mo_status status);     /* "InvalidObjectMagic", ...; "Unknown" */
const char *mo_status_message(mo_status status);  /* one human sentence */

/* --- segment names ------------------------------------------------------------------------ */
/* MO_OK if name[0..len) can name an arena's shared-memory segment: an optional leading '/', then
 * 1..MO_NAME_MAX bytes with no '/', NUL or control character (0x01-0x1f, 0x7f), and not "." or
 * "..".  Else MO_ARENA_INVALID and, when reason is not NULL, a static string saying why.  The
 * length is explicit so that an embedded NUL is refused instead of silently cutting the name. */
mo_status mo_segment_name_check(const char *name, uint64_t len, const char **reason);

/* --- records ------------------------------------------------------------------------------ */
/* Bytes a record with this payload extent occupies in a ring: round_up(40 + extent, 8); 0 when
 * that does not fit in 64 bits (no ring holds such a record: see MO_MAX_EXTENT). */
uint64_t mo_record_size(uint64_t extent);

/* --- arena -------------------------------------------------------------------------------- */
/* Bytes an arena with these rings needs; 0 if a config is invalid (capacity 0 or above
 * MO_MAX_CAPACITY, alignment 0, n == 0 or above MO_MAX_RINGS).  A max_extent above MO_MAX_EXTENT
 * is valid and stored as MO_MAX_EXTENT: nothing larger fits in any ring, and the cap keeps
 * every size computed from an accepted extent far from 2^64. */
uint64_t mo_arena_size(const mo_ring_config *rings, uint32_t n);
/* Lay out an arena in memory of exactly mo_arena_size() bytes, aligned to MO_LINE (data regions
 * need not be zeroed); records the caller's pid as the creator.  Stores the magic last. */
mo_status mo_arena_init(void *base, uint64_t size, const mo_ring_config *rings, uint32_t n);
/* MO_OK if base[0..size) is an arena of this layout version (every ring in bounds, max_extent
 * <= MO_MAX_EXTENT); else MO_ARENA_INVALID and, when reason is not NULL, a static string saying
 * why. */
mo_status mo_arena_check(const void *base, uint64_t size, const char **reason);
uint32_t mo_arena_ring_count(const void *base);
/* The creator recorded in the superblock whose first len bytes are at head (the start of a
 * mapped arena, or just MO_SUPERBLOCK_FIXED bytes read from a segment file: a cleaner judges
 * segments it does not map; any alignment).  MO_OK and *pid, *start (either may be NULL), or MO_ARENA_INVALID
 * when len < MO_SUPERBLOCK_FIXED or the arena magic is not there (yet). */
mo_status mo_arena_creator(const void *head, uint64_t len, int32_t *pid, uint64_t *start);
/* Fill *out with a view of ring index of a checked arena. */
mo_status mo_arena_ring(void *base, uint64_t size, uint32_t index, mo_ring *out);

/* --- ring state and liveness --------------------------------------------------------------- */
void mo_ring_snapshot(const mo_ring *r, mo_ring_state *out);
double mo_ring_occupancy(const mo_ring *r);        /* (head - tail) / capacity */
/* 1 if process pid is alive (start == 0 skips the start-time check), 0 if it is gone. */
int mo_process_alive(int32_t pid, uint64_t start);
/* Start time of this process (/proc/self/stat field 22, clock ticks since boot); 0 if unknown. */
uint64_t mo_self_start_time(void);

/* --- producer ----------------------------------------------------------------------------- */
/* Claim the producer side: MO_BUSY if a live process holds it, MO_CLOSED if it was closed. */
mo_status mo_producer_attach(mo_producer *p, const mo_ring *r);
/* Wait tuning: spin this long before parking; parked, wake this often for liveness checks. */
void mo_producer_set_wait(mo_producer *p, uint64_t spin_ns, uint64_t poll_ns);
/* Open a reservation of extent payload bytes; *payload points at a contiguous writable span.
 * Refuses (nothing published): MO_OUTPUT_EXTENT_INVALID (extent > max_extent),
 * MO_OUTPUT_EXTENT_ALIGNMENT_VIOLATION, MO_OUTPUT_RING_CAPACITY_EXCEEDED (extent > capacity -
 * MO_HEADER_LEN).  Waits for space per timeout_ns. */
mo_status mo_producer_reserve(mo_producer *p, uint64_t extent, int64_t timeout_ns, void **payload);
/* Close the reservation with its header and publish it (one store-release); returns its
 * sequence or -(status). */
int64_t mo_producer_commit(mo_producer *p, uint64_t object_id, uint32_t flags);
/* Close the reservation with its header but do not publish yet: a batch of these becomes visible
 * with the next mo_producer_publish() or commit (one store-release for the whole batch).  A
 * producer that must wait for space publishes its committed records first. */
int64_t mo_producer_commit_deferred(mo_producer *p, uint64_t object_id, uint32_t flags);
/* Publish every committed record: one store-release of head, a futex wake only if the consumer
 * sleeps.  Returns the number of records that became visible. */
uint64_t mo_producer_publish(mo_producer *p);
/* Drop the open reservation; nothing was written to the ring. */
void mo_producer_abort(mo_producer *p);
/* reserve + copy + commit in one call; returns the sequence or -(status). */
int64_t mo_producer_write(mo_producer *p, uint64_t object_id, uint32_t flags, const char *data,
                          uint64_t len, int64_t timeout_ns);
/* Write n records, published with one store-release (more only if the ring fills meanwhile).
 * Payload i is the next len_i bytes of data, len_i = lengths ? lengths[i] : fixed_len; object
 * ids and flags come from the arrays (NULL means all 0).  *written (may be NULL) counts the
 * records committed, all published, also when an error stops the batch early; their sequences
 * are consecutive. */
mo_status mo_producer_write_many(mo_producer *p, const uint64_t *object_ids, const uint32_t *flags,
                                 const char *data, const uint64_t *lengths, uint64_t fixed_len,
                                 uint32_t n, int64_t timeout_ns, uint32_t *written);
/* Publish, mark the producer side closed and wake the consumer.  Idempotent. */
void mo_producer_close(mo_producer *p);
/* Publish and give up the claim without closing (another process may attach). */
void mo_producer_detach(mo_producer *p);

/* --- consumer ----------------------------------------------------------------------------- */
mo_status mo_consumer_attach(mo_consumer *c, const mo_ring *r);
void mo_consumer_set_wait(mo_consumer *c, uint64_t spin_ns, uint64_t poll_ns);
/* The next record, validated, in place, without waiting: MO_OK and *out, or MO_WOULD_BLOCK,
 * MO_CLOSED (producer closed and everything drained), or a validation error (cursor unmoved).
 * The record becomes *outstanding*: it stays valid until mo_consumer_release(). */
mo_status mo_consumer_peek(mo_consumer *c, mo_view *out);
/* As mo_consumer_peek, waiting per timeout_ns. */
mo_status mo_consumer_read(mo_consumer *c, mo_view *out, int64_t timeout_ns);
/* Wait per timeout_ns for one record, then take up to max records already published without
 * waiting further.  *n counts records filled in out[]; a bad record after good ones ends the
 * batch with MO_OK and is reported by the next call. */
mo_status mo_consumer_read_many(mo_consumer *c, mo_view *out, uint32_t max, int64_t timeout_ns,
                                uint32_t *n);
/* Release every outstanding record: one store-release of tail, a futex wake only if the
 * producer sleeps.  Returns the number released. */
uint64_t mo_consumer_release(mo_consumer *c);
/* Copy the payloads of views[0..n) back to back into dst (dst_len bytes); returns the bytes
 * copied or -(status). */
int64_t mo_consumer_gather(const mo_consumer *c, const mo_view *views, uint32_t n, char *dst,
                           uint64_t dst_len);
/* Release outstanding records, mark the consumer side closed and wake the producer. */
void mo_consumer_close(mo_consumer *c);
void mo_consumer_detach(mo_consumer *c);

/* MO_CDEF_END */

/* ---------------------------------------------------------------------------------------------
 * Shared-memory structures (not visible to Python).  Only this library touches them.
 */
#ifndef __cplusplus
#include <stdatomic.h>

/* The header of an MO01 record as it lies in the ring (natural alignment gives exactly the
 * docs/wire-format.md offsets on every ABI we build for; checked with static asserts in mo_ring.c). */
typedef struct mo_record_header {
  uint32_t magic;
  uint16_t version;
  uint16_t header_len;
  uint64_t object_id;
  uint64_t sequence;
  uint64_t extent;
  uint32_t flags;
  uint32_t reserved;
} mo_record_header;

/* The record codec: the one place in C that encodes an MO01 header (docs/wire-format.md) and
 * the one place that judges it.  The producer, the consumer and the tool entry points of
 * mo_ring_extra.h all go through these. */

/* The header of a record: the wire format's fixed fields, then the caller's. */
static inline mo_record_header mo_record_header_make(uint64_t object_id, uint64_t sequence, uint64_t extent,
                                                     uint32_t flags) {
  mo_record_header h = {.magic = MO_RECORD_MAGIC, .version = MO_RECORD_VERSION, .header_len = MO_HEADER_LEN,
                        .object_id = object_id, .sequence = sequence, .extent = extent, .flags = flags,
                        .reserved = 0};
  return h;
}

/* The largest extent whose record size round_up(40 + extent, 8) fits in 64 bits. */
#define MO_RECORD_EXTENT_LIMIT (UINT64_MAX - 7 - MO_HEADER_LEN)

/* 1 if a record with this extent fits in room bytes.  Compares the extent against what is left
 * after the header instead of adding to it, so a hostile extent near 2^64 cannot wrap around. */
static inline int mo_record_fits(uint64_t extent, uint64_t room) {
  return room >= MO_HEADER_LEN && extent <= room - MO_HEADER_LEN && extent <= MO_RECORD_EXTENT_LIMIT &&
         ((MO_HEADER_LEN + extent + 7) & ~(uint64_t)7) <= room;
}

static inline int mo_extent_misaligned(uint64_t extent, uint32_t alignment) {
  if ((alignment & (alignment - 1)) == 0) return (extent & (alignment - 1)) != 0;
  return extent % alignment != 0;
}

/* The consumer's validation of one header, of which the record has room bytes readable (on a
 * private copy, so a misbehaving producer cannot change it between the check and the use). */
static inline mo_status mo_record_header_check(const mo_record_header *h, uint64_t room, uint64_t max_extent,
                                               uint32_t alignment, uint64_t expected_sequence) {
  if (__builtin_expect(h->magic != MO_RECORD_MAGIC, 0)) return MO_INVALID_OBJECT_MAGIC;
  if (__builtin_expect(h->version != MO_RECORD_VERSION || h->header_len != MO_HEADER_LEN, 0))
    return MO_INVALID_OBJECT_HEADER;
  if (__builtin_expect(h->reserved != 0, 0)) return MO_INVALID_OBJECT_HEADER;
  if (__builtin_expect(h->extent > max_extent, 0)) return MO_OBJECT_EXTENT_INVALID;
  if (__builtin_expect(mo_extent_misaligned(h->extent, alignment), 0))
    return MO_OBJECT_EXTENT_ALIGNMENT_VIOLATION;
  if (__builtin_expect(!mo_record_fits(h->extent, room), 0)) return MO_OBJECT_EXTENT_INVALID;
  if (__builtin_expect(h->sequence != expected_sequence, 0)) return MO_SEQUENCE_VIOLATION;
  return MO_OK;
}

/* A view's header fields as read (also on a validation error: they go into the message). */
static inline void mo_view_fill(mo_view *out, const mo_record_header *h, uint64_t expected_sequence) {
  out->magic = h->magic;
  out->version = h->version;
  out->header_len = h->header_len;
  out->object_id = h->object_id;
  out->sequence = h->sequence;
  out->extent = h->extent;
  out->flags = h->flags;
  out->reserved = h->reserved;
  out->expected_sequence = expected_sequence;
}

/* The arena's first bytes. */
typedef struct mo_superblock {
  _Atomic uint64_t magic;      /* MO_ARENA_MAGIC ("MOARENA\0"), stored last by the creator */
  uint32_t layout_version;     /* MO_LAYOUT_VERSION */
  uint32_t ring_count;
  uint64_t total_size;         /* bytes of the whole mapping */
  int32_t creator_pid;
  uint32_t superblock_size;    /* bytes before the first ring (multiple of MO_PAGE) */
  uint64_t creator_start;      /* creator's start time (see mo_self_start_time) */
  uint64_t reserved[3];
  uint64_t ring_offset[];      /* ring_count offsets of mo_ring_ctrl blocks */
} mo_superblock;

#define MO_ARENA_MAGIC 0x00414E4552414F4DULL /* "MOARENA\0" as a little-endian u64 */
#define MO_RING_CTRL_MAGIC 0x47524F4DU       /* "MORG" */

/* One ring's control block: MO_CTRL_SIZE bytes at ring_offset[i]; its data region follows. */
struct mo_ring_ctrl {
  /* Producer line: written only by the producer. */
  _Alignas(MO_LINE) _Atomic uint64_t head;     /* end of the last published record */
  _Atomic uint64_t head_seq;                   /* sequence of the next record to be published */
  /* Consumer line: written only by the consumer. */
  _Alignas(MO_LINE) _Atomic uint64_t tail;     /* end of the last released record */
  _Atomic uint64_t tail_seq;                   /* sequence expected at tail */
  /* Reader wait line: the consumer parks on data_futex when the ring is empty. */
  _Alignas(MO_LINE) _Atomic uint32_t data_futex;
  _Atomic uint32_t reader_sleeping;
  /* Writer wait line: the producer parks on space_futex when the ring is full. */
  _Alignas(MO_LINE) _Atomic uint32_t space_futex;
  _Atomic uint32_t writer_sleeping;
  /* Config (immutable after init) and liveness (written on claim and close only). */
  _Alignas(MO_LINE) uint32_t magic;            /* MO_RING_CTRL_MAGIC */
  uint32_t index;
  uint64_t capacity;
  uint64_t max_extent;
  uint64_t data_offset;                        /* from the arena base */
  uint32_t alignment;
  uint32_t reserved;
  _Atomic uint64_t producer_owner;             /* pid | start << 22, 0 when unclaimed */
  _Atomic uint64_t consumer_owner;
  _Atomic uint32_t producer_closed;
  _Atomic uint32_t consumer_closed;
};

#define MO_OWNER_PID_BITS 22 /* PID_MAX_LIMIT is 2^22 */

/* mo_producer.state and mo_consumer.state. */
enum { MO_STATE_DETACHED = 0, MO_STATE_ATTACHED = 1, MO_STATE_CLOSED = 2 };
#endif /* !__cplusplus */

#ifdef __cplusplus
}
#endif
#endif /* MO_RING_H */
