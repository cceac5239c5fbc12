/*
 * mo_graph.h -- a captured step's CPU kernels, run from one native loop.
 *
 * A stage on the CPU replays the same few hundred compiled kernels every decode step.  tinygrad 0.13
 * launches each one from Python (a queue to a worker thread, then a ctypes call; a kernel split over
 * n cores is handed to n-1 more Python threads and joined): ~30 us of interpreter per kernel, more
 * than the kernels themselves take.  Here the step is a plain array of launches, and one call runs
 * them all in order, on the caller's thread and a pool of helper threads that live as long as the
 * pool.  Python fills the array once per captured graph and rewrites only what changes between
 * replays (input buffers, symbolic values: pyruntime/stage/cpu_graph.py).
 *
 * 1. A launch (mo_kernel)
 *
 *    fn is a compiled kernel's entry point, `void fn(a0, a1, ...)`, whose parameters are buffer
 *    pointers then ints.  Every argument is passed as a 64-bit word in the order of args[]: under
 *    the x86-64 System V and AArch64 procedure-call standards a pointer or an int takes one integer
 *    register or one 8-byte stack slot, and an int parameter reads the low 32 bits of its word, so
 *    one call shape fits every kernel.  Words past nargs are passed as zeros and never read (the
 *    caller pops them).  This file refuses to build for any other ABI.
 *
 *    threads = 1: the caller runs fn.  threads = n > 1: cores 0..n-1 each run fn once, with their
 *    core number in args[core_arg], and the launch ends when all n have returned (a kernel split
 *    over cores by tinygrad's THREAD opt: each core writes its own outputs).  Launches run in array
 *    order, each after the previous one has ended on every core.
 *
 * 2. The pool (mo_pool)
 *
 *    helpers threads, started by mo_pool_init and joined by mo_pool_fini.  The caller of
 *    mo_graph_run runs core 0 and helper i core i; a launch split over more cores than the pool has
    (helpers + 1) gives each of them every (helpers + 1)-th core, in turn.  For a split launch the caller publishes it with
 *    one increment of `seq`, runs its own share, then waits for `pending` (the helpers yet to
 *    answer it: every helper answers every launch, with its share or none) to reach zero.  Either side waits the same way: it spins for spin_ns (yielding
 *    the core every few microseconds: two stages, a launcher and their helpers may share two
 *    cores), then sleeps on the word with FUTEX_WAIT.  A waker calls FUTEX_WAKE only when the other
 *    side has said it sleeps (`sleepers`, `caller_sleeps`), the Dekker pattern of mo_ring.h's
 *    waits: each side stores its flag and then loads the other's word, both sequentially
 *    consistent, so one of them always sees the other.
 *
 *    The library allocates nothing: the caller owns the pool's memory (mo_pool_size() bytes,
 *    aligned to MO_GRAPH_ALIGN) and the launch array.  mo_graph_run holds the pool's lock for
 *    the whole run, so two threads sharing one pool run their graphs one after the other.
 *
 * 3. Errors: the MO_GRAPH_* codes below, returned; nothing is printed.
 */
#ifndef MO_GRAPH_H
#define MO_GRAPH_H

#include <stddef.h>
#include <stdint.h>

#if !(defined(__x86_64__) || defined(__aarch64__))
#error "mo_graph: every argument as a 64-bit word needs the x86-64 SysV or AArch64 calling convention"
#endif

/* MO_CDEF_BEGIN -- plain declarations, handed to cffi verbatim (native/build_graph.py) */
#define MO_GRAPH_MAX_ARGS 32    /* words per launch: buffers + ints of the widest kernel */
#define MO_GRAPH_MAX_HELPERS 255
#define MO_GRAPH_ALIGN 64       /* the pool's memory: its words sit on cache lines of their own */

#define MO_GRAPH_OK 0
#define MO_GRAPH_EARGS -1       /* a launch with nargs > MO_GRAPH_MAX_ARGS or core_arg outside args */
#define MO_GRAPH_ESPAWN -2      /* a helper thread could not be started (mo_pool_init) */
#define MO_GRAPH_EALIGN -3      /* the pool's memory is not MO_GRAPH_ALIGN-aligned */
#define MO_GRAPH_EHELPERS -4    /* more helpers than MO_GRAPH_MAX_HELPERS */

typedef struct mo_kernel {
  void *fn;                        /* the kernel's entry point */
  uint32_t nargs;                  /* words of args[] the kernel reads */
  uint32_t threads;                /* cores that each run fn (1: the caller alone) */
  int32_t core_arg;                /* index in args[] of the core number, -1: none */
  uint32_t reserved;               /* 0 */
  uint64_t args[MO_GRAPH_MAX_ARGS];
} mo_kernel;

typedef struct mo_pool mo_pool;

size_t mo_pool_size(void);
/* Start `helpers` threads (0: the caller runs every core's share itself, one after another). */
int mo_pool_init(mo_pool *pool, uint32_t helpers, uint64_t spin_ns);
/* Stop and join the helpers. The pool's memory may then be freed. */
void mo_pool_fini(mo_pool *pool);
uint32_t mo_pool_helpers(const mo_pool *pool);
/* Run launches[0..count) in order (section 1). Checks every launch before running any. */
int mo_graph_run(mo_pool *pool, const mo_kernel *launches, uint32_t count);
const char *mo_graph_strerror(int code);
/* MO_CDEF_END */

#endif /* MO_GRAPH_H */
