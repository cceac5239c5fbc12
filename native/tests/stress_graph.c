/* stress_graph.c -- mo_graph_run under contention (tests/integration/test_native_sanitizers.py runs it under TSan).
 *
 * Each launch computes dst[i] = src[i] + src[(i + 1) % N] + launch number, split over `cores` cores (each core its
 * own slice of dst), reading what every core wrote in the launch before: a launch that started before the previous
 * one ended on every core, or a helper's stores not visible to the next launch's readers, gives a wrong sum.  Unsplit
 * launches in between run on the caller alone.  The result is checked against the same launches run serially.
 *
 *   stress_graph ROUNDS HELPERS SPIN_NS
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mo_graph.h"

#define N 4096
#define LAUNCHES 64

static void step(uint64_t dst_, uint64_t src_, uint64_t k, uint64_t cores, uint64_t core) {
  uint64_t *dst = (uint64_t *)(uintptr_t)dst_;
  const uint64_t *src = (const uint64_t *)(uintptr_t)src_;
  uint64_t lo = N * core / cores, hi = N * (core + 1) / cores;
  for (uint64_t i = lo; i < hi; i++) dst[i] = src[i] + src[(i + 1) % N] + k;
}

static uint64_t buf[2][N], want[2][N];

int main(int argc, char **argv) {
  uint32_t rounds = argc > 1 ? (uint32_t)atoi(argv[1]) : 200, helpers = argc > 2 ? (uint32_t)atoi(argv[2]) : 3;
  uint64_t spin = argc > 3 ? strtoull(argv[3], NULL, 10) : 0;
  static _Alignas(MO_GRAPH_ALIGN) unsigned char mem[1 << 16];
  if (mo_pool_size() > sizeof mem) { fprintf(stderr, "pool too large\n"); return 2; }
  mo_pool *pool = (mo_pool *)mem;
  int rc = mo_pool_init(pool, helpers, spin);
  if (rc != MO_GRAPH_OK) { fprintf(stderr, "mo_pool_init: %s\n", mo_graph_strerror(rc)); return 2; }
  static mo_kernel ks[LAUNCHES];
  for (uint32_t j = 0; j < LAUNCHES; j++) {
    uint32_t cores = j % 4 == 3 ? 1 : 1 + (j % 7);  /* 1..7 cores: fewer, as many as and more than the pool's */
    ks[j] = (mo_kernel){.fn = (void *)step, .nargs = 5, .threads = cores, .core_arg = 4,
                        .args = {(uint64_t)(uintptr_t)buf[(j + 1) % 2], (uint64_t)(uintptr_t)buf[j % 2], j, cores, 0}};
  }
  for (uint32_t i = 0; i < N; i++) buf[0][i] = want[0][i] = i * 2654435761u;
  for (uint32_t r = 0; r < rounds; r++) {
    if ((rc = mo_graph_run(pool, ks, LAUNCHES)) != MO_GRAPH_OK) { fprintf(stderr, "mo_graph_run: %s\n", mo_graph_strerror(rc)); return 1; }
    for (uint32_t j = 0; j < LAUNCHES; j++) step((uint64_t)(uintptr_t)want[(j + 1) % 2], (uint64_t)(uintptr_t)want[j % 2], j, 1, 0);
    if (memcmp(buf[0], want[0], sizeof want[0]) != 0) { fprintf(stderr, "round %u: wrong sums\n", r); return 1; }
  }
  mo_pool_fini(pool);
  printf("%u rounds of %d launches over %u helpers: every sum right\n", rounds, LAUNCHES, helpers);
  return 0;
}
