/* mo_graph.c -- the native launch loop of mo_graph.h (read that first). */
#define _GNU_SOURCE
#include "mo_graph.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

struct mo_pool {
  _Alignas(MO_GRAPH_ALIGN) _Atomic uint32_t seq;      /* launches published: helpers wait for it to move */
  _Atomic uint32_t sleepers;                          /* helpers asleep on seq */
  _Alignas(MO_GRAPH_ALIGN) _Atomic uint32_t pending;  /* helpers still running the current launch */
  _Atomic uint32_t caller_sleeps;                     /* the caller is asleep on pending */
  _Alignas(MO_GRAPH_ALIGN) const mo_kernel *launch;   /* written before seq's increment, read after it */
  _Atomic uint32_t stop;
  uint32_t helpers;
  uint64_t spin_ns;
  pthread_mutex_t lock;                               /* one mo_graph_run at a time */
  struct mo_helper { mo_pool *pool; uint32_t core; pthread_t thread; } helper[MO_GRAPH_MAX_HELPERS];
};

typedef void (*mo_entry)(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                         uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                         uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                         uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);
_Static_assert(MO_GRAPH_MAX_ARGS == 32, "mo_entry passes MO_GRAPH_MAX_ARGS words");

static void run_core(const mo_kernel *k, uint32_t core) {
  uint64_t a[MO_GRAPH_MAX_ARGS] = {0};
  memcpy(a, k->args, k->nargs * sizeof(uint64_t));
  if (k->core_arg >= 0) a[k->core_arg] = core;
  ((mo_entry)k->fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15],
                    a[16], a[17], a[18], a[19], a[20], a[21], a[22], a[23], a[24], a[25], a[26], a[27], a[28], a[29], a[30], a[31]);
}

/* the cores of launch k that worker w (0: the caller) runs: w, w + workers, ... */
static void run_share(const mo_kernel *k, uint32_t w, uint32_t workers) {
  for (uint32_t c = w; c < k->threads; c += workers) run_core(k, c);
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#else
  __asm__ __volatile__("yield");
#endif
}

static void futex_wait(_Atomic uint32_t *word, uint32_t seen) {
#ifdef __linux__
  syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
  (void)word; (void)seen;
  sched_yield();
#endif
}

static void futex_wake(_Atomic uint32_t *word) {
#ifdef __linux__
  syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
  (void)word;
#endif
}

/* Spin until *word != seen or spin_ns pass; yields the core every 512 checks (a few microseconds). */
static int spin_while(_Atomic uint32_t *word, uint32_t seen, uint64_t spin_ns) {
  uint64_t deadline = 0;
  for (uint32_t i = 1;; i++) {
    if (atomic_load_explicit(word, memory_order_acquire) != seen) return 1;
    cpu_relax();
    if ((i & 511) == 0) {
      uint64_t t = now_ns();
      if (!deadline) deadline = t + spin_ns;
      else if (t >= deadline) return 0;
      sched_yield();
    }
  }
}

static void *helper_main(void *arg) {
  struct mo_helper *h = arg;
  mo_pool *p = h->pool;
  uint32_t seen = 0;  /* seq's value at mo_pool_init, not now: a launch may be published before this thread runs */
  for (;;) {
    if (!spin_while(&p->seq, seen, p->spin_ns)) {
      atomic_fetch_add(&p->sleepers, 1);  /* seq_cst: then seq is loaded again (Dekker, mo_graph.h section 2) */
      if (atomic_load(&p->seq) == seen) futex_wait(&p->seq, seen);
      atomic_fetch_sub(&p->sleepers, 1);
      continue;
    }
    seen = atomic_load_explicit(&p->seq, memory_order_acquire);
    if (atomic_load_explicit(&p->stop, memory_order_relaxed)) return NULL;
    /* every helper answers every launch, with or without a share of it: the caller publishes the next one
       only after all have, so none can read `launch` of one seq and run it under another */
    run_share(p->launch, h->core, p->helpers + 1);
    if (atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->caller_sleeps)) futex_wake(&p->pending);
  }
}

size_t mo_pool_size(void) { return sizeof(mo_pool); }

uint32_t mo_pool_helpers(const mo_pool *pool) { return pool->helpers; }

int mo_pool_init(mo_pool *pool, uint32_t helpers, uint64_t spin_ns) {
  if ((uintptr_t)pool % MO_GRAPH_ALIGN) return MO_GRAPH_EALIGN;
  if (helpers > MO_GRAPH_MAX_HELPERS) return MO_GRAPH_EHELPERS;
  memset(pool, 0, sizeof *pool);
  pool->spin_ns = spin_ns;
  pthread_mutex_init(&pool->lock, NULL);
  for (uint32_t i = 0; i < helpers; i++) {
    pool->helper[i] = (struct mo_helper){.pool = pool, .core = i + 1};
    if (pthread_create(&pool->helper[i].thread, NULL, helper_main, &pool->helper[i]) != 0) {
      mo_pool_fini(pool);  /* stops the i started so far */
      return MO_GRAPH_ESPAWN;
    }
    pool->helpers = i + 1;
  }
  return MO_GRAPH_OK;
}

void mo_pool_fini(mo_pool *pool) {
  atomic_store(&pool->stop, 1);
  atomic_fetch_add(&pool->seq, 1);
  futex_wake(&pool->seq);
  for (uint32_t i = 0; i < pool->helpers; i++) pthread_join(pool->helper[i].thread, NULL);
  pool->helpers = 0;
  pthread_mutex_destroy(&pool->lock);
}

static void run_split(mo_pool *p, const mo_kernel *k) {
  p->launch = k;
  atomic_store_explicit(&p->pending, p->helpers, memory_order_relaxed);
  atomic_fetch_add(&p->seq, 1);  /* seq_cst: publishes launch and pending, then sleepers is loaded */
  if (atomic_load(&p->sleepers)) futex_wake(&p->seq);
  run_share(k, 0, p->helpers + 1);
  uint32_t left;
  while ((left = atomic_load_explicit(&p->pending, memory_order_acquire)) != 0) {
    if (spin_while(&p->pending, left, p->spin_ns)) continue;
    atomic_store(&p->caller_sleeps, 1);
    if ((left = atomic_load(&p->pending)) != 0) futex_wait(&p->pending, left);
    atomic_store(&p->caller_sleeps, 0);
  }
}

int mo_graph_run(mo_pool *pool, const mo_kernel *launches, uint32_t count) {
  for (uint32_t i = 0; i < count; i++) {
    const mo_kernel *k = &launches[i];
    if (k->nargs > MO_GRAPH_MAX_ARGS || k->core_arg >= (int32_t)MO_GRAPH_MAX_ARGS || k->fn == NULL) return MO_GRAPH_EARGS;
  }
  pthread_mutex_lock(&pool->lock);
  for (uint32_t i = 0; i < count; i++) {
    const mo_kernel *k = &launches[i];
    if (k->threads <= 1) run_core(k, 0);
    else if (pool->helpers == 0) run_share(k, 0, 1);
    else run_split(pool, k);
  }
  pthread_mutex_unlock(&pool->lock);
  return MO_GRAPH_OK;
}

const char *mo_graph_strerror(int code) {
  switch (code) {
    case MO_GRAPH_OK: return "ok";
    case MO_GRAPH_EARGS: return "a launch has more words than MO_GRAPH_MAX_ARGS, a core index outside them, or no entry point";
    case MO_GRAPH_ESPAWN: return "a helper thread could not be started";
    case MO_GRAPH_EALIGN: return "the pool's memory is not aligned to MO_GRAPH_ALIGN";
    case MO_GRAPH_EHELPERS: return "more helpers than MO_GRAPH_MAX_HELPERS";
    default: return "unknown mo_graph error";
  }
}
