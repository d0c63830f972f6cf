/* C ABI test: compiled against the handwritten kvshim.h and linked to
 * libkvshim.so. It exercises every function's success path and every error
 * path a C caller can reach: NULL arguments, bad JSON, unknown roles,
 * unknown and closed handles, truncated buffers, a recovered panic. */
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvshim.h"

static int failures;

#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      failures++;                                                          \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);      \
      fprintf(stderr, __VA_ARGS__);                                        \
      fprintf(stderr, "\n");                                               \
    }                                                                      \
  } while (0)

static const char *last_error(kvshim_handle h) {
  static char buf[4096];
  int rc = kvshim_last_error(h, buf, sizeof buf);
  if (rc != KVSHIM_OK && rc != KVSHIM_ERANGE) snprintf(buf, sizeof buf, "<kvshim_last_error rc=%d>", rc);
  return buf;
}

static void test_version(void) {
  char buf[64];
  CHECK(kvshim_abi_version() == KVSHIM_ABI_VERSION, "abi %d", kvshim_abi_version());
  CHECK(kvshim_version(buf, sizeof buf) == KVSHIM_OK, "%s", last_error(0));
  CHECK(strlen(buf) > 0, "empty version");
  CHECK(kvshim_version(NULL, 10) == KVSHIM_EINVAL, "NULL buffer");
  CHECK(kvshim_version(buf, 0) == KVSHIM_EINVAL, "zero length");
  char tiny[3];
  CHECK(kvshim_version(tiny, sizeof tiny) == KVSHIM_ERANGE, "truncation");
  CHECK(tiny[2] == '\0' && strlen(tiny) == 2, "truncated output must stay NUL-terminated");
}

static void test_open_errors(void) {
  kvshim_handle h = 0;
  CHECK(kvshim_open(NULL, &h) == KVSHIM_EINVAL, "NULL config");
  CHECK(kvshim_open("{}", NULL) == KVSHIM_EINVAL, "NULL out");
  CHECK(kvshim_open("not json", &h) == KVSHIM_EINVAL, "bad JSON");
  CHECK(strstr(last_error(0), "not JSON") != NULL, "message: %s", last_error(0));
  CHECK(kvshim_open("{\"role\":\"nope\"}", &h) == KVSHIM_EINVAL, "unknown role");
  CHECK(strstr(last_error(0), "unknown role \"nope\"") != NULL, "message: %s", last_error(0));
  CHECK(strstr(last_error(0), "skeleton") != NULL, "the message lists valid roles: %s", last_error(0));
  CHECK(kvshim_open("{\"role\":\"skeleton\",\"block_bytes\":64,\"block_tokens\":4,\"chunk_tokens\":6}", &h) == KVSHIM_EINVAL,
        "chunk not a multiple of block");
  CHECK(kvshim_open("{\"role\":\"skeleton\",\"bogus\":1}", &h) == KVSHIM_EINVAL, "unknown key");
  CHECK(strstr(last_error(0), "bogus") != NULL, "message names the key: %s", last_error(0));
  CHECK(kvshim_open("{\"role\":\"tool\",\"server\":\"/nonexistent/kvshim.sock\"}", &h) == KVSHIM_EIO,
        "no server: %s", last_error(0));
  CHECK(h == 0, "out must not be written on failure");
}

static void test_bad_handles(void) {
  char buf[64];
  uint64_t n = 0;
  uint32_t tok[4] = {1, 2, 3, 4};
  CHECK(kvshim_close(0) == KVSHIM_EBADH, "handle 0");
  CHECK(kvshim_close(12345) == KVSHIM_EBADH, "unknown handle");
  CHECK(strstr(last_error(0), "12345") != NULL, "message names the handle: %s", last_error(0));
  CHECK(kvshim_last_error(12345, buf, sizeof buf) == KVSHIM_EBADH, "last_error of unknown handle");
  CHECK(kvshim_skeleton_lookup(-7, tok, 4, &n) == KVSHIM_EBADH, "skeleton call on unknown handle");
  int64_t ids[1] = {3};
  int delay = 7;
  CHECK(kvshim_sched_finished_tokens(-7, "req", tok, 4, 0, 3, ids, 1, &delay) == KVSHIM_EBADH,
        "request_finished with tokens on unknown handle");
}

static void test_skeleton_round_trip(void) {
  enum { BLOCKS = 32, BLOCK_BYTES = 256, BLOCK_TOKENS = 4, CHUNK_TOKENS = 8, TOKENS = 26 };
  kvshim_handle h = 0;
  char cfg[160];
  snprintf(cfg, sizeof cfg, "{\"role\":\"skeleton\",\"block_bytes\":%d,\"block_tokens\":%d,\"chunk_tokens\":%d}",
           BLOCK_BYTES, BLOCK_TOKENS, CHUNK_TOKENS);
  CHECK(kvshim_open(cfg, &h) == KVSHIM_OK, "%s", last_error(0));
  CHECK(h != 0, "handle");
  int before = kvshim_handle_count();

  static unsigned char cache[BLOCKS * BLOCK_BYTES];
  for (size_t i = 0; i < sizeof cache; i++) cache[i] = (unsigned char)(i * 7 + 3);
  uint32_t tokens[TOKENS];
  for (int i = 0; i < TOKENS; i++) tokens[i] = 1000 + i;
  int64_t src[7] = {3, 4, 5, 6, 7, 8, 9}; /* 26 tokens: 3 full chunks = 6 blocks */
  int64_t dst[7] = {20, 21, 22, 23, 24, 25, 26};
  uint64_t saved = 0, chunks = 0;

  CHECK(kvshim_skeleton_save(h, cache, sizeof cache, src, 7, tokens, TOKENS, &saved) == KVSHIM_OK, "%s", last_error(h));
  CHECK(saved == 3, "saved %llu chunks, want 3", (unsigned long long)saved);
  CHECK(kvshim_skeleton_save(h, cache, sizeof cache, src, 7, tokens, TOKENS, &saved) == KVSHIM_OK, "%s", last_error(h));
  CHECK(saved == 0, "second save writes nothing, wrote %llu", (unsigned long long)saved);
  CHECK(kvshim_skeleton_lookup(h, tokens, TOKENS, &chunks) == KVSHIM_OK, "%s", last_error(h));
  CHECK(chunks == 3, "lookup %llu, want 3", (unsigned long long)chunks);

  tokens[9] = 1; /* chunk 1 changes, so chunks 1 and 2 no longer match */
  CHECK(kvshim_skeleton_lookup(h, tokens, TOKENS, &chunks) == KVSHIM_OK && chunks == 1, "prefix lookup %llu", (unsigned long long)chunks);
  tokens[9] = 1009;

  CHECK(kvshim_skeleton_load(h, cache, sizeof cache, dst, 7, tokens, TOKENS, 3) == KVSHIM_OK, "%s", last_error(h));
  for (int b = 0; b < 6; b++)
    CHECK(memcmp(cache + dst[b] * BLOCK_BYTES, cache + src[b] * BLOCK_BYTES, BLOCK_BYTES) == 0, "block %d differs", b);

  int64_t bad[6] = {20, 21, 22, 23, 24, BLOCKS};
  CHECK(kvshim_skeleton_load(h, cache, sizeof cache, bad, 6, tokens, TOKENS, 3) == KVSHIM_EINVAL, "block id out of range");
  CHECK(strstr(last_error(h), "outside") != NULL, "message: %s", last_error(h));
  CHECK(kvshim_skeleton_load(h, cache, sizeof cache, dst, 7, tokens, TOKENS, 4) == KVSHIM_EINVAL, "more chunks than stored");
  CHECK(kvshim_skeleton_save(h, NULL, 100, src, 7, tokens, TOKENS, &saved) == KVSHIM_EINVAL, "NULL cache");
  CHECK(kvshim_skeleton_lookup(h, tokens, TOKENS, NULL) == KVSHIM_EINVAL, "NULL out");

  char small[8];
  CHECK(kvshim_last_error(h, small, sizeof small) == KVSHIM_ERANGE, "truncated error text");
  CHECK(strlen(small) == sizeof small - 1, "truncated text fills the buffer");

  CHECK(kvshim_debug_panic(h) == KVSHIM_EPANIC, "panic becomes an error code");
  CHECK(strstr(last_error(h), "panic") != NULL, "panic text: %s", last_error(h));
  CHECK(kvshim_debug_panic(0) == KVSHIM_EPANIC, "panic without a handle");

  CHECK(kvshim_handle_count() == before, "handle count");
  CHECK(kvshim_close(h) == KVSHIM_OK, "%s", last_error(0));
  CHECK(kvshim_close(h) == KVSHIM_EBADH, "double close");
  CHECK(kvshim_skeleton_lookup(h, tokens, TOKENS, &chunks) == KVSHIM_EBADH, "use after close");
  CHECK(kvshim_handle_count() == before - 1, "handle released");
}

/* kvshim_worker_engine_copy: a worker handle's copy engine alone, with no
 * server (the socket does not exist): the registered layout's plans move
 * chunks between a paged LBNHC cache and caller-owned objects. */
static void test_worker_engine_copy(void) {
  enum { L = 2, NB = 8, BS = 4, H = 2, C = 8, CHUNK = 8, STRIDE = 4096 };
  static uint16_t kv[L][NB][BS][H][C], orig[L][NB][BS][H][C];
  static unsigned char objects[2 * STRIDE];
  kvshim_handle h = 0, sk = 0;
  uint64_t ns = 0;
  int64_t ids[4] = {3, 5, 6, 1}, moved[4] = {0, 2, 4, 7};
  CHECK(kvshim_open("{\"role\":\"worker\",\"server\":\"/nonexistent/kvshim-engine.sock\",\"rank\":0,\"timeout_ms\":1000,"
                    "\"namespace\":{\"model\":\"t\",\"dtype\":\"bfloat16\",\"layout\":\"x\",\"world_size\":1,\"chunk_size\":8}}",
                    &h) == KVSHIM_OK, "%s", last_error(0));
  CHECK(kvshim_worker_engine_copy(h, 1, objects, STRIDE, ids, 4, 1000, &ns) == KVSHIM_EINVAL, "before register");
  CHECK(strstr(last_error(h), "register") != NULL, "message: %s", last_error(h));

  char descs[2048];
  int n = snprintf(descs, sizeof descs, "[");
  for (int l = 0; l < L; l++) {
    n += snprintf(descs + n, sizeof descs - n,
                  "%s{\"layer\":\"l%d\",\"group\":0,\"backend\":\"paged\",\"device\":\"cpu\",\"data_ptr\":%llu,"
                  "\"dtype_size\":2,\"shape\":[%d,%d,%d,%d],\"stride_bytes\":[%d,%d,%d,2]}",
                  l ? "," : "", l, (unsigned long long)(uintptr_t)&kv[l][0][0][0][0], NB, H, BS, C,
                  BS * H * C * 2, C * 2, H * C * 2);
  }
  snprintf(descs + n, sizeof descs - n, "]");
  CHECK(kvshim_worker_register(h, descs) == KVSHIM_OK, "%s", last_error(h));

  uint16_t *flat = &kv[0][0][0][0][0];
  for (size_t i = 0; i < sizeof kv / sizeof kv[0][0][0][0][0]; i++) flat[i] = (uint16_t)(i * 2654435761u >> 7);
  memcpy(orig, kv, sizeof kv);
  CHECK(kvshim_worker_engine_copy(h, 1, objects, STRIDE, ids, 4, 1000, &ns) == KVSHIM_OK, "save: %s", last_error(h));
  CHECK(ns > 0, "elapsed %llu ns", (unsigned long long)ns);
  for (int l = 0; l < L; l++)
    for (int i = 0; i < 4; i++) memset(kv[l][ids[i]], 0, sizeof kv[l][ids[i]]);
  CHECK(kvshim_worker_engine_copy(h, 2, objects, STRIDE, ids, 4, 1000, &ns) == KVSHIM_OK, "load: %s", last_error(h));
  CHECK(memcmp(kv, orig, sizeof kv) == 0, "a save then a load into the same blocks restores them");
  CHECK(kvshim_worker_engine_copy(h, 2, objects, STRIDE, moved, 4, 1000, &ns) == KVSHIM_OK, "load: %s", last_error(h));
  for (int l = 0; l < L; l++)
    for (int i = 0; i < 4; i++)
      CHECK(memcmp(kv[l][moved[i]], orig[l][ids[i]], sizeof kv[l][0]) == 0, "layer %d: block %d holds block %d", l,
            (int)moved[i], (int)ids[i]);

  int64_t bad[4] = {3, 5, 6, 99}, odd[3] = {3, 5, 6};
  CHECK(kvshim_worker_engine_copy(h, 3, objects, STRIDE, ids, 4, 1000, &ns) == KVSHIM_EINVAL, "direction 3");
  CHECK(strstr(last_error(h), "direction 3") != NULL, "message: %s", last_error(h));
  CHECK(kvshim_worker_engine_copy(h, 2, objects, 100, ids, 4, 1000, &ns) == KVSHIM_EINVAL, "stride below an object");
  CHECK(strstr(last_error(h), "object_stride 100") != NULL, "message: %s", last_error(h));
  CHECK(kvshim_worker_engine_copy(h, 2, objects, STRIDE, odd, 3, 1000, &ns) == KVSHIM_EINVAL, "not whole chunks");
  CHECK(kvshim_worker_engine_copy(h, 2, objects, STRIDE, bad, 4, 1000, &ns) == KVSHIM_EINVAL, "block id out of range");
  CHECK(kvshim_worker_engine_copy(h, 2, NULL, STRIDE, ids, 4, 1000, &ns) == KVSHIM_EINVAL, "NULL objects");
  CHECK(kvshim_worker_engine_copy(h, 2, objects, STRIDE, ids, 4, 1000, NULL) == KVSHIM_EINVAL, "NULL elapsed_ns");
  CHECK(kvshim_worker_engine_copy(h, 2, objects, STRIDE, ids, 4, 0, &ns) == KVSHIM_EINVAL, "zero timeout");
  CHECK(kvshim_open("{\"role\":\"skeleton\",\"block_bytes\":64,\"block_tokens\":4,\"chunk_tokens\":8}", &sk) == KVSHIM_OK,
        "%s", last_error(0));
  CHECK(kvshim_worker_engine_copy(sk, 2, objects, STRIDE, ids, 4, 1000, &ns) == KVSHIM_EINVAL, "not a worker handle");
  CHECK(kvshim_close(sk) == KVSHIM_OK, "%s", last_error(0));
  CHECK(kvshim_close(h) == KVSHIM_OK, "%s", last_error(0));
  CHECK(kvshim_worker_engine_copy(h, 2, objects, STRIDE, ids, 4, 1000, &ns) == KVSHIM_EBADH, "closed handle");
}

static void test_main(void) {
  char *help[] = {"kvshim", "--help", NULL};
  CHECK(kvshim_main(2, help) == 0, "help");
  char *bad[] = {"kvshim", "no-such-command", NULL};
  CHECK(kvshim_main(2, bad) == 2, "unknown command is a usage error");
}

int main(void) {
  test_version();
  test_open_errors();
  test_bad_handles();
  test_skeleton_round_trip();
  test_worker_engine_copy();
  test_main();
  if (failures) {
    printf("%d failed\n", failures);
    return 1;
  }
  printf("C ABI test: all checks passed\n");
  return 0;
}
