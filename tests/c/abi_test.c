/* C ABI test: compiled against the handwritten kvshim.h and linked to
 * libkvshim.so. It exercises every function's success path and every error
 * path a C caller can reach: NULL arguments, bad JSON, unknown roles,
 * unknown and closed handles, truncated buffers, a recovered panic; and
 * each documented KVSHIM_E* code from a real failure that produces it.
 *
 * `make ctest` runs it twice (the Go runtime reads the environment once,
 * when the library loads, so each CUDA setting needs its own process):
 *   KVSHIM_LIBCUDA=<a path that does not exist>   everything, and a GPU
 *       cache without a driver (KVSHIM_ENOTSUP);
 *   KVSHIM_LIBCUDA=<internal/fakecuda's driver> FAKECUDA_COPY_DELAY_US=N
 *       the device tests only: a copy slower than its timeout
 *       (KVSHIM_ETIMEDOUT) on the real CUDA engine, against the emulated
 *       driver, so no GPU is needed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
  static __thread char buf[4096];
  int rc = kvshim_last_error(h, buf, sizeof buf);
  if (rc != KVSHIM_OK && rc != KVSHIM_ERANGE) snprintf(buf, sizeof buf, "<kvshim_last_error rc=%d>", rc);
  return buf;
}

/* A worker handle needs no server to open, register and copy: the socket
 * below does not exist. */
#define NAMESPACE "\"namespace\":{\"model\":\"t\",\"dtype\":\"bfloat16\",\"layout\":\"x\",\"world_size\":1,\"chunk_size\":8}"
#define WORKER_CFG                                                                                      \
  "{\"role\":\"worker\",\"server\":\"/nonexistent/kvshim-abi.sock\",\"rank\":0,\"timeout_ms\":1000," NAMESPACE "}"

/* The KV cache of the worker tests: L layers of NB blocks, each block BS
 * tokens of H heads of C bfloat16 values; a chunk (8 tokens) is 2 blocks. */
enum { L = 2, NB = 8, BS = 4, H = 2, C = 8, STRIDE = 4096 };

/* descs writes the JSON tensor descriptions of layers at kv[0..L) on
 * device; block_stride overrides the blocks' stride (0: the real one). */
static void descs(char *out, size_t cap, const char *device, uint16_t (*kv)[NB][BS][H][C], int block_stride) {
  int n = snprintf(out, cap, "[");
  for (int l = 0; l < L; l++) {
    n += snprintf(out + n, cap - n,
                  "%s{\"layer\":\"l%d\",\"group\":0,\"backend\":\"paged\",\"device\":\"%s\",\"data_ptr\":%llu,"
                  "\"dtype_size\":2,\"shape\":[%d,%d,%d,%d],\"stride_bytes\":[%d,%d,%d,2]}",
                  l ? "," : "", l, device, (unsigned long long)(uintptr_t)&kv[l][0][0][0][0], NB, H, BS, C,
                  block_stride ? block_stride : BS * H * C * 2, C * 2, H * C * 2);
  }
  snprintf(out + n, cap - n, "]");
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
  CHECK(strstr(last_error(0), "scheduler, tool, worker") != NULL, "the message lists valid roles: %s", last_error(0));
  CHECK(kvshim_open("{\"role\":\"skeleton\"}", &h) == KVSHIM_EINVAL, "the walking skeleton left the ABI");
  CHECK(kvshim_open("{\"role\":\"worker\",\"bogus\":1}", &h) == KVSHIM_EINVAL, "unknown key");
  CHECK(strstr(last_error(0), "bogus") != NULL, "message names the key: %s", last_error(0));
  CHECK(kvshim_open("{\"role\":\"worker\",\"server\":\"/nonexistent/kvshim.sock\",\"namespace\":{\"model\":\"t\","
                    "\"dtype\":\"bfloat16\",\"layout\":\"x\",\"world_size\":0,\"chunk_size\":8}}", &h) == KVSHIM_EINVAL,
        "world_size 0: %s", last_error(0));
  /* Out-of-range values are refused by the library itself, naming the field,
   * not replaced by defaults: another engine calling the ABI has no Python
   * connector validating for it. */
  CHECK(kvshim_open("{\"role\":\"scheduler\",\"engine_id\":\"abi\",\"l1_size_gb\":-1}", &h) == KVSHIM_EINVAL,
        "l1_size_gb -1: %s", last_error(0));
  CHECK(strstr(last_error(0), "l1_size_gb -1") != NULL, "message names the field: %s", last_error(0));
  CHECK(kvshim_open("{\"role\":\"scheduler\",\"engine_id\":\"abi\",\"hold_ttl_s\":-1}", &h) == KVSHIM_EINVAL,
        "hold_ttl_s -1: %s", last_error(0));
  CHECK(strstr(last_error(0), "hold_ttl_s -1") != NULL, "message names the field: %s", last_error(0));
  CHECK(kvshim_open("{\"role\":\"tool\",\"server\":\"/nonexistent/kvshim.sock\"}", &h) == KVSHIM_EIO,
        "no server: %s", last_error(0));
  CHECK(h == 0, "out must not be written on failure");

  /* kvshim_vllm_config: the connector's settings are checked here too. */
  char out[4096] = {0};
  size_t n = 0;
  CHECK(kvshim_vllm_config("{\"extra\":{\"kvshim.l1_size_gb\":-1}}", out, sizeof out, &n) == KVSHIM_EINVAL,
        "l1_size_gb -1: %s", last_error(0));
  CHECK(strstr(last_error(0), "kvshim.l1_size_gb: must be > 0") != NULL, "message names the key: %s", last_error(0));
  CHECK(kvshim_vllm_config("{\"extra\":{}}", out, 8, &n) == KVSHIM_ERANGE && n > 8, "small buffer: the size needed");
  CHECK(kvshim_vllm_config("{\"extra\":{}}", out, sizeof out, &n) == KVSHIM_OK, "%s", last_error(0));
  CHECK(strstr(out, "\"kvshim.chunk_size\":256") != NULL, "defaults: %.*s", (int)n, out);
}

static void test_bad_handles(void) {
  char buf[64];
  uint32_t tok[4] = {1, 2, 3, 4};
  CHECK(kvshim_close(0) == KVSHIM_EBADH, "handle 0");
  CHECK(kvshim_close(12345) == KVSHIM_EBADH, "unknown handle");
  CHECK(strstr(last_error(0), "12345") != NULL, "message names the handle: %s", last_error(0));
  CHECK(kvshim_last_error(12345, buf, sizeof buf) == KVSHIM_EBADH, "last_error of unknown handle");
  CHECK(kvshim_worker_start_loads(-7) == KVSHIM_EBADH, "worker call on unknown handle");
  CHECK(strstr(last_error(0), "-7") != NULL, "message names the handle: %s", last_error(0));
  int64_t ids[1] = {3};
  int delay = 7;
  CHECK(kvshim_sched_finished_tokens(-7, "req", tok, 4, 0, 3, ids, 1, 1, &delay) == KVSHIM_EBADH,
        "request_finished with tokens on unknown handle");
  size_t n = 0;
  CHECK(kvshim_take_output(-7, buf, sizeof buf, &n) == KVSHIM_EBADH, "take_output on unknown handle");
}

/* A handle's life: its own last error, a recovered panic, close. */
static void test_handle_life(void) {
  kvshim_handle h = 0;
  int before = kvshim_handle_count();
  CHECK(kvshim_open(WORKER_CFG, &h) == KVSHIM_OK, "%s", last_error(0));
  CHECK(h != 0, "handle");
  CHECK(kvshim_handle_count() == before + 1, "handle count");

  CHECK(kvshim_worker_start_loads(h) == KVSHIM_EINVAL, "start_loads before bind");
  CHECK(strstr(last_error(h), "no metadata bound") != NULL, "message: %s", last_error(h));
  char st[1024] = {0};
  size_t st_n = 0;
  CHECK(kvshim_take_step_stats(h, st, sizeof st, &st_n) == KVSHIM_OK, "%s", last_error(h));
  CHECK(strstr(st, "\"saved_chunks\":0") != NULL && strstr(st, "populate") == NULL, "step stats: %.*s", (int)st_n, st);
  CHECK(kvshim_worker_start_loads_wait(h, 5) == KVSHIM_EINVAL, "start_loads_wait before bind");
  CHECK(kvshim_worker_start_loads_wait(h, -1) == KVSHIM_EINVAL, "negative wait");
  CHECK(strstr(last_error(h), "wait_ms -1") != NULL, "message names the argument: %s", last_error(h));
  char small[8];
  CHECK(kvshim_last_error(h, small, sizeof small) == KVSHIM_ERANGE, "truncated error text");
  CHECK(strlen(small) == sizeof small - 1, "truncated text fills the buffer");
  CHECK(kvshim_sched_finished(h, "req", &(int){0}) == KVSHIM_EINVAL, "a scheduler call on a worker handle");
  CHECK(strstr(last_error(h), "worker handle, not a scheduler") != NULL, "message: %s", last_error(h));
  size_t n = 0;
  CHECK(kvshim_take_output(h, small, sizeof small, &n) == KVSHIM_EINVAL, "nothing pending");
  CHECK(strstr(last_error(h), "no pending output") != NULL, "message: %s", last_error(h));

  CHECK(kvshim_debug_panic(h) == KVSHIM_EPANIC, "panic becomes an error code");
  CHECK(strstr(last_error(h), "kvshim_debug_panic called") != NULL, "panic text: %s", last_error(h));
  CHECK(kvshim_debug_panic(0) == KVSHIM_EPANIC, "panic without a handle");
  CHECK(strstr(last_error(0), "kvshim_debug_panic called") != NULL, "panic text: %s", last_error(0));

  CHECK(kvshim_close(h) == KVSHIM_OK, "%s", last_error(0));
  CHECK(kvshim_close(h) == KVSHIM_EBADH, "double close");
  CHECK(kvshim_worker_start_loads(h) == KVSHIM_EBADH, "use after close");
  CHECK(kvshim_handle_count() == before, "handle released");
}

/* kvshim_worker_register: bad geometry and a second registration are
 * KVSHIM_EINVAL (both were KVSHIM_EINTERNAL in ABI 1). */
static void test_register_errors(void) {
  static uint16_t kv[L][NB][BS][H][C];
  static char js[2048];
  kvshim_handle h = 0;
  CHECK(kvshim_open(WORKER_CFG, &h) == KVSHIM_OK, "%s", last_error(0));
  descs(js, sizeof js, "cpu", kv, 7); /* blocks 7 bytes apart overlap */
  CHECK(kvshim_worker_register(h, js) == KVSHIM_EINVAL, "bad geometry: %s", last_error(h));
  CHECK(strstr(last_error(h), "layer \"l0\"") != NULL, "message names the layer: %s", last_error(h));
  CHECK(kvshim_worker_register(h, "[{\"layer\":\"l0\",\"bogus\":1}]") == KVSHIM_EINVAL, "unknown key");
  CHECK(strstr(last_error(h), "tensors_json: json: unknown field \"bogus\"") != NULL, "message: %s", last_error(h));
  CHECK(kvshim_worker_register(h, NULL) == KVSHIM_EINVAL, "NULL");
  descs(js, sizeof js, "cpu", kv, 0);
  CHECK(kvshim_worker_register(h, js) == KVSHIM_OK, "%s", last_error(h));
  CHECK(kvshim_worker_register(h, js) == KVSHIM_EINVAL, "registered twice: %s", last_error(h));
  CHECK(strstr(last_error(h), "registered twice") != NULL, "message: %s", last_error(h));
  CHECK(kvshim_close(h) == KVSHIM_OK, "%s", last_error(0));
}

/* kvshim_worker_engine_copy: a worker handle's copy engine alone, with no
 * server: the registered layout's plans move chunks between a paged cache
 * and caller-owned objects. */
static void test_worker_engine_copy(void) {
  static uint16_t kv[L][NB][BS][H][C], orig[L][NB][BS][H][C];
  static unsigned char objects[2 * STRIDE];
  static char js[2048];
  kvshim_handle h = 0, other = 0;
  uint64_t ns = 0;
  int64_t ids[4] = {3, 5, 6, 1}, moved[4] = {0, 2, 4, 7};
  CHECK(kvshim_open(WORKER_CFG, &h) == KVSHIM_OK, "%s", last_error(0));
  CHECK(kvshim_worker_engine_copy(h, 1, objects, STRIDE, ids, 4, 1000, &ns) == KVSHIM_EINVAL, "before register");
  CHECK(strstr(last_error(h), "register") != NULL, "message: %s", last_error(h));
  descs(js, sizeof js, "cpu", kv, 0);
  CHECK(kvshim_worker_register(h, js) == KVSHIM_OK, "%s", last_error(h));

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
  CHECK(kvshim_open("{\"role\":\"scheduler\",\"server\":\"/nonexistent/kvshim-abi.sock\",\"block_size\":4," NAMESPACE "}",
                    &other) == KVSHIM_OK, "%s", last_error(0));
  CHECK(kvshim_worker_engine_copy(other, 2, objects, STRIDE, ids, 4, 1000, &ns) == KVSHIM_EINVAL, "not a worker handle");
  CHECK(strstr(last_error(other), "scheduler handle, not a worker") != NULL, "message: %s", last_error(other));
  CHECK(kvshim_close(other) == KVSHIM_OK, "%s", last_error(0));
  CHECK(kvshim_close(h) == KVSHIM_OK, "%s", last_error(0));
  CHECK(kvshim_worker_engine_copy(h, 2, objects, STRIDE, ids, 4, 1000, &ns) == KVSHIM_EBADH, "closed handle");
}

/* Pending output belongs to the thread that got KVSHIM_ERANGE: two threads
 * pinging one tool handle with bodies too large for their buffers each
 * take back their own answer, in the order that would have swapped them
 * when the output was one slot per handle. */
enum { BODY = 3000 };
static kvshim_handle tool;
static pthread_barrier_t step;

static void *pinger(void *arg) {
  char who = *(const char *)arg, body[BODY], small[16];
  static __thread char got[BODY];
  memset(body, who, sizeof body);
  size_t n = 0;
  if (who == 'B') pthread_barrier_wait(&step); /* 1: A's output is pending */
  CHECK(kvshim_ping(tool, body, sizeof body, small, sizeof small, &n) == KVSHIM_ERANGE, "%c: %s", who, last_error(tool));
  CHECK(n == BODY, "%c: out_len %zu", who, n);
  if (who == 'A') {
    pthread_barrier_wait(&step); /* 1 */
    pthread_barrier_wait(&step); /* 2: B's output is pending too */
  } else {
    pthread_barrier_wait(&step); /* 2 */
  }
  if (who == 'B') pthread_barrier_wait(&step); /* 3: A took its own first */
  memset(got, 0, sizeof got);
  CHECK(kvshim_take_output(tool, got, sizeof got, &n) == KVSHIM_OK, "%c: %s", who, last_error(tool));
  CHECK(n == BODY && memcmp(got, body, BODY) == 0, "%c took another thread's output (%zu bytes of '%c')", who, n, got[0]);
  CHECK(kvshim_take_output(tool, got, sizeof got, &n) == KVSHIM_EINVAL, "%c: taken once", who);
  if (who == 'A') pthread_barrier_wait(&step); /* 3 */
  return NULL;
}

static void test_take_output_per_thread(void) {
  char cfg[512], id[64];
  kvshim_handle sched = 0;
  snprintf(id, sizeof id, "abi-test-%d", (int)getpid());
  /* The scheduler role starts the embedded server; a tool handle dials it. */
  snprintf(cfg, sizeof cfg,
           "{\"role\":\"scheduler\",\"server\":\"embedded\",\"engine_id\":\"%s\",\"block_size\":4,"
           "\"l1_size_gb\":0.0625,\"l1_prefault_gb\":0," NAMESPACE "}", id);
  CHECK(kvshim_open(cfg, &sched) == KVSHIM_OK, "embedded server: %s", last_error(0));
  snprintf(cfg, sizeof cfg, "{\"role\":\"tool\",\"server\":\"embedded\",\"engine_id\":\"%s\"}", id);
  CHECK(kvshim_open(cfg, &tool) == KVSHIM_OK, "tool: %s", last_error(0));
  pthread_barrier_init(&step, NULL, 2);
  pthread_t a, b;
  pthread_create(&a, NULL, pinger, "A");
  pthread_create(&b, NULL, pinger, "B");
  pthread_join(a, NULL);
  pthread_join(b, NULL);
  pthread_barrier_destroy(&step);
  CHECK(kvshim_close(tool) == KVSHIM_OK, "%s", last_error(0));
  CHECK(kvshim_close(sched) == KVSHIM_OK, "%s", last_error(0));
}

/* KVSHIM_ENOSPC is not provoked here: it surfaces when the kernel refuses
 * the memory or disk behind the cache (syscall ENOSPC creating L1, a full
 * L2 file system or Redis), and provoking that from a test means filling
 * the host's memory or a disk. export/errors_test.go maps a real ENOSPC
 * (a write to /dev/full) and every ENOSPC sentinel through the same table. */

/* KVSHIM_ECLOSED is not provoked either: it answers a call that races the
 * handle's own kvshim_close (or a connection this side closed), a window a
 * test cannot hit on purpose; the Go test maps its sentinels. */

/* No CUDA driver (KVSHIM_LIBCUDA names no file): a GPU cache is
 * KVSHIM_ENOTSUP, the host engine still works. */
static void test_no_driver(void) {
  static uint16_t kv[L][NB][BS][H][C];
  static char js[2048];
  kvshim_handle h = 0;
  CHECK(kvshim_open(WORKER_CFG, &h) == KVSHIM_OK, "%s", last_error(0));
  descs(js, sizeof js, "cuda:0", kv, 0);
  CHECK(kvshim_worker_register(h, js) == KVSHIM_ENOTSUP, "GPU cache without a driver: %s", last_error(h));
  CHECK(strstr(last_error(h), "cuda") != NULL, "message: %s", last_error(h));
  descs(js, sizeof js, "cpu", kv, 0);
  CHECK(kvshim_worker_register(h, js) == KVSHIM_OK, "a CPU cache needs no driver: %s", last_error(h));
  CHECK(kvshim_close(h) == KVSHIM_OK, "%s", last_error(0));
}

/* The emulated driver (internal/fakecuda) with FAKECUDA_COPY_DELAY_US: a
 * copy on the real CUDA engine slower than timeout_ms is KVSHIM_ETIMEDOUT
 * (it was KVSHIM_EINTERNAL in ABI 1). The fake's device memory is
 * host memory the test adopts; the objects are pinned, as the header asks. */
static void test_preempt_wait_timeout(uint16_t (*kv)[NB][BS][H][C]);

static void test_copy_timeout(const char *fake) {
  static uint16_t kv[L][NB][BS][H][C];
  static unsigned char objects[2 * STRIDE];
  static char js[2048];
  void *lib = dlopen(fake, RTLD_NOW);
  CHECK(lib != NULL, "dlopen %s: %s", fake, dlerror());
  if (lib == NULL) return;
  int (*adopt)(uint64_t, uint64_t) = (int (*)(uint64_t, uint64_t))dlsym(lib, "fakecuda_adopt");
  int (*init)(unsigned) = (int (*)(unsigned))dlsym(lib, "cuInit");
  int (*retain)(void **, int) = (int (*)(void **, int))dlsym(lib, "cuDevicePrimaryCtxRetain");
  int (*release)(int) = (int (*)(int))dlsym(lib, "cuDevicePrimaryCtxRelease_v2");
  int (*set_current)(void *) = (int (*)(void *))dlsym(lib, "cuCtxSetCurrent");
  int (*pin)(void *, size_t, unsigned) = (int (*)(void *, size_t, unsigned))dlsym(lib, "cuMemHostRegister_v2");
  int (*unpin)(void *) = (int (*)(void *))dlsym(lib, "cuMemHostUnregister");
  void *ctx = NULL;
  CHECK(adopt && init && retain && release && set_current && pin && unpin, "the fake lacks a symbol");
  CHECK(adopt(((uint64_t)(uintptr_t)kv), sizeof kv) == 0, "adopt");
  CHECK(init(0) == 0 && retain(&ctx, 0) == 0 && set_current(ctx) == 0, "context");
  CHECK(pin(objects, sizeof objects, 0) == 0, "pin the objects");

  kvshim_handle h = 0;
  int64_t ids[4] = {3, 5, 6, 1};
  uint64_t ns = 0;
  CHECK(kvshim_open(WORKER_CFG, &h) == KVSHIM_OK, "%s", last_error(0));
  descs(js, sizeof js, "cuda:0", kv, 0);
  CHECK(kvshim_worker_register(h, js) == KVSHIM_OK, "register on the fake: %s", last_error(h));
  CHECK(kvshim_worker_engine_copy(h, 1, objects, STRIDE, ids, 4, 1, &ns) == KVSHIM_ETIMEDOUT,
        "a copy slower than 1 ms: %s", last_error(h));
  CHECK(strstr(last_error(h), "slower than timeout_ms") != NULL, "message: %s", last_error(h));
  CHECK(kvshim_worker_engine_copy(h, 1, objects, STRIDE, ids, 4, 60000, &ns) == KVSHIM_OK, "with time: %s",
        last_error(h));
  CHECK(kvshim_close(h) == KVSHIM_OK, "%s", last_error(0));
  test_preempt_wait_timeout(kv);
  CHECK(unpin(objects) == 0 && release(0) == 0, "unpin");
  void (*stats)(uint64_t *, char *, size_t) = (void (*)(uint64_t *, char *, size_t))dlsym(lib, "fakecuda_stats");
  uint64_t st[10] = {0};
  char msg[512] = "";
  if (stats) stats(st, msg, sizeof msg);
  CHECK(stats && st[0] > 0, "the fake executed no copy");
  CHECK(st[4] == 0, "%llu violations of the driver's rules, the last: %s", (unsigned long long)st[4], msg);
  CHECK(st[5] == 0 && st[6] == 0 && st[8] == 0, "left behind: %llu context refs, %llu streams, %llu registrations",
        (unsigned long long)st[5], (unsigned long long)st[6], (unsigned long long)st[8]);
  dlclose(lib);
}

/* Worker.WaitFor (kvshim_worker_bind with a preempted request whose saves
 * are still copying) past its timeout is KVSHIM_ETIMEDOUT too (it was
 * KVSHIM_EINTERNAL). A real scheduler, embedded server and worker on the
 * emulated driver, whose slow copies keep the save in flight. Runs after
 * test_copy_timeout, which set up the fake's context and adopted kv. */
static void test_preempt_wait_timeout(uint16_t (*kv)[NB][BS][H][C]) {
  static char cfg[512], js[2048], meta[1 << 16];
  char id[64];
  kvshim_handle sched = 0, w = 0;
  snprintf(id, sizeof id, "abi-fake-%d", (int)getpid());
  snprintf(cfg, sizeof cfg,
           "{\"role\":\"scheduler\",\"server\":\"embedded\",\"engine_id\":\"%s\",\"block_size\":%d,"
           "\"l1_size_gb\":0.0625,\"l1_prefault_gb\":0," NAMESPACE "}", id, BS);
  CHECK(kvshim_open(cfg, &sched) == KVSHIM_OK, "scheduler: %s", last_error(0));
  snprintf(cfg, sizeof cfg, "{\"role\":\"worker\",\"server\":\"embedded\",\"engine_id\":\"%s\",\"rank\":0," NAMESPACE "}", id);
  CHECK(kvshim_open(cfg, &w) == KVSHIM_OK, "worker: %s", last_error(0));
  descs(js, sizeof js, "cuda:0", kv, 0);
  CHECK(kvshim_worker_register(w, js) == KVSHIM_OK, "register on the fake: %s", last_error(w));

  uint32_t tokens[16];
  for (int i = 0; i < 16; i++) tokens[i] = 500 + i;
  int64_t hit = -1, blocks[4] = {0, 1, 2, 3};
  /* The Python-list entry points need the Python C API: not in this process. */
  CHECK(kvshim_sched_match_list(sched, "r", NULL, NULL, 0, &hit) == KVSHIM_EINVAL, "match_list NULL list");
  CHECK(kvshim_sched_match_list(sched, "r", tokens, NULL, 0, &hit) == KVSHIM_ENOTSUP && hit == -1,
        "match_list without Python: %s", last_error(sched));
  size_t listed = 0;
  CHECK(kvshim_tokens_from_list(tokens, tokens, 16, &listed) == KVSHIM_ENOTSUP, "tokens_from_list without Python");
  for (int i = 0; i < 2000 && hit < 0; i++) {
    CHECK(kvshim_sched_match(sched, "r", tokens, 16, NULL, 0, &hit) == KVSHIM_OK, "match: %s", last_error(sched));
    if (hit < 0) usleep(2000);
  }
  CHECK(hit == 0, "a new prompt misses: %lld", (long long)hit);
  CHECK(kvshim_sched_after_alloc(sched, "r", blocks, 4, 2, -1, 0) == KVSHIM_EINVAL, "two groups on a one-group namespace");
  CHECK(strstr(last_error(sched), "block ids of 2 KV-cache groups, the namespace has 1") != NULL, "message: %s",
        last_error(sched));
  CHECK(kvshim_sched_after_alloc(sched, "r", blocks, 4, 1, -1, 0) == KVSHIM_OK, "%s", last_error(sched));
  size_t n = 0;
  CHECK(kvshim_sched_build_meta(sched, "{\"requests\":[{\"req\":\"r\",\"blocks\":[0,1,2,3],\"computed\":0,\"scheduled\":16}]}",
                                meta, sizeof meta, &n) == KVSHIM_OK, "%s", last_error(sched));
  CHECK(kvshim_worker_bind(w, meta, n, 1000) == KVSHIM_OK, "%s", last_error(w));
  CHECK(kvshim_worker_start_saves(w, 0) == KVSHIM_OK, "%s", last_error(w));
  /* r is preempted while its two chunks are still being copied out. */
  CHECK(kvshim_sched_build_meta(sched, "{\"requests\":[],\"preempted\":[\"r\"]}", meta, sizeof meta, &n) == KVSHIM_OK,
        "%s", last_error(sched));
  CHECK(kvshim_worker_bind(w, meta, n, 1) == KVSHIM_ETIMEDOUT, "preempted with its saves in flight: %s", last_error(w));
  CHECK(strstr(last_error(w), "still running") != NULL, "message: %s", last_error(w));
  CHECK(kvshim_worker_bind(w, meta, n, 60000) == KVSHIM_OK, "with time the copies end: %s", last_error(w));
  CHECK(kvshim_close(w) == KVSHIM_OK, "%s", last_error(0));
  CHECK(kvshim_close(sched) == KVSHIM_OK, "%s", last_error(0));
}

static void test_main(void) {
  char *help[] = {"kvshim", "--help", NULL};
  CHECK(kvshim_main(2, help) == 0, "help");
  char *bad[] = {"kvshim", "no-such-command", NULL};
  CHECK(kvshim_main(2, bad) == 2, "unknown command is a usage error");
}

int main(void) {
  const char *cuda = getenv("KVSHIM_LIBCUDA");
  if (cuda != NULL && getenv("FAKECUDA_COPY_DELAY_US") != NULL) {
    test_copy_timeout(cuda);
  } else {
    test_version();
    test_open_errors();
    test_bad_handles();
    test_handle_life();
    test_register_errors();
    test_worker_engine_copy();
    test_take_output_per_thread();
    if (cuda != NULL && access(cuda, F_OK) != 0)
      test_no_driver();
    else
      printf("C ABI test: KVSHIM_ENOTSUP not checked (KVSHIM_LIBCUDA does not name a missing file)\n");
    test_main();
  }
  if (failures) {
    printf("%d failed\n", failures);
    return 1;
  }
  printf("C ABI test: all checks passed%s\n", cuda && getenv("FAKECUDA_COPY_DELAY_US") ? " (emulated CUDA driver)" : "");
  return 0;
}
