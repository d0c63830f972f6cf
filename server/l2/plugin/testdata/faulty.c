/*
 * A kvshim L2 plugin for the fault tests (server/l2/plugin): it remembers
 * nothing (lookups and loads miss, stores succeed) except that a key whose
 * hash starts with 0xde crashes the host (SIGSEGV) and one starting with
 * 0xdf hangs it, in any operation. Before either, a load scribbles over
 * every buffer of its call (the window), to show that L1 never sees it.
 * Built with -DFAULTY_ABI=N it claims ABI N (the version-refusal test).
 */
#include <string.h>
#include <unistd.h>

#include "kvshim_l2.h"

#ifndef FAULTY_ABI
#define FAULTY_ABI KVSHIM_L2_ABI_VERSION
#endif

static void fault(const kvshim_l2_key *keys, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (keys[i].hash[0] == 0xde) *(volatile int *)0 = 1;
    if (keys[i].hash[0] == 0xdf) sleep(3600);
  }
}

static int32_t f_open(const char *c, size_t l, void **s, char *e, size_t el) {
  (void)l;
  if (strstr(c, "\"refuse\"")) {
    strncpy(e, "key \"refuse\": refused by the faulty plugin", el - 1);
    return KVSHIM_L2_EBADCONFIG;
  }
  *s = (void *)1;
  return KVSHIM_L2_OK;
}
static void f_lookup(void *s, const kvshim_l2_key *k, size_t n, int32_t *st, uint64_t *sz, char *e, size_t el) {
  (void)s, (void)sz, (void)e, (void)el;
  fault(k, n);
  for (size_t i = 0; i < n; i++) st[i] = KVSHIM_L2_MISS;
}
static void f_store(void *s, const kvshim_l2_key *k, const void *const *b, const uint64_t *l, size_t n, int32_t *st,
                    char *e, size_t el) {
  (void)s, (void)b, (void)l, (void)e, (void)el;
  fault(k, n);
  for (size_t i = 0; i < n; i++) st[i] = KVSHIM_L2_OK;
}
static void f_load(void *s, const kvshim_l2_key *k, void *const *b, const uint64_t *l, size_t n, int32_t *st, char *e,
                   size_t el) {
  (void)s, (void)e, (void)el;
  for (size_t i = 0; i < n; i++) memset(b[i], 0xee, l[i]);
  fault(k, n);
  for (size_t i = 0; i < n; i++) st[i] = KVSHIM_L2_MISS;
}
static void f_remove(void *s, const kvshim_l2_key *k, size_t n, int32_t *st, char *e, size_t el) {
  (void)s, (void)e, (void)el;
  fault(k, n);
  for (size_t i = 0; i < n; i++) st[i] = KVSHIM_L2_MISS;
}
static void f_close(void *s) { (void)s; }

static const kvshim_l2_ops table = {FAULTY_ABI, sizeof(kvshim_l2_ops), "faulty", f_open, f_lookup,
                                       f_store,    f_load,                   f_remove, f_close};

const kvshim_l2_ops *kvshim_l2_plugin(void) { return &table; }
