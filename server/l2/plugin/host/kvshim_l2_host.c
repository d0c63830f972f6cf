/*
 * kvshim-l2-host: runs one kvshim L2 plugin (include/kvshim_l2.h) outside
 * kvshim's process. Usage (kvshim starts it; not meant for a person):
 *
 *     kvshim-l2-host PLUGIN.so    stdin: requests, stdout: replies,
 *                                 fd 3: the shared-memory window (memfd)
 *
 * Why a separate process: `kvshim serve` is a static Go binary (no cgo, so
 * no dlopen), and a plugin that crashes or scribbles must not take kvshim
 * or its L1 memory with it. The host maps only the window kvshim made for
 * it; every buffer of a call is a range of that window, checked against its
 * size before the plugin sees it.
 *
 * Protocol (little-endian; a frame is u32 body length, then the body):
 *   request  u64 id, u32 op, u32 n, then
 *              op OPEN (1): n bytes of the plugin's JSON config
 *              op LOOKUP/STORE/LOAD/REMOVE (2..5): n records of
 *                ns[16] rank u32 hash[32] off u64 len u64   (68 bytes)
 *   reply    u64 id, i32 rc, u32 n, n x (i32 status, u64 size), u32 m, m bytes message
 *              OPEN: rc is open()'s code, one entry (host ABI, plugin ABI), and
 *                    the message: the plugin's name on success, else why not
 *              batch: rc 0, an entry per key
 * EOF on stdin: wait for the batches in flight, call close(), exit 0.
 * Each batch runs on a thread of its own (kvshim bounds how many it sends).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvshim_l2.h"

enum { OP_OPEN = 1, OP_LOOKUP, OP_STORE, OP_LOAD, OP_REMOVE };
enum { RECORD = 68, MAX_FRAME = 64 << 20, MSG = 512 };

static const kvshim_l2_ops *plugin;
static void *state;
static uint8_t *window;
static uint64_t window_size;

static pthread_mutex_t out_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t run_cv = PTHREAD_COND_INITIALIZER;
static int running;

static void die(const char *what) {
  fprintf(stderr, "kvshim-l2-host: %s: %s\n", what, strerror(errno));
  exit(2);
}

static int read_full(int fd, void *p, size_t n) {
  uint8_t *b = p;
  while (n > 0) {
    ssize_t r = read(fd, b, n);
    if (r == 0) return 0;
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    b += r;
    n -= (size_t)r;
  }
  return 1;
}

static void write_full(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n > 0) {
    ssize_t w = write(fd, b, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      die("write reply"); /* kvshim is gone */
    }
    b += w;
    n -= (size_t)w;
  }
}

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); } /* x86-64 and arm64: little-endian */
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static void reply(uint64_t id, int32_t rc, uint32_t n, const int32_t *st, const uint64_t *sz, const char *msg) {
  uint32_t m = msg ? (uint32_t)strnlen(msg, MSG) : 0;
  size_t body = 8 + 4 + 4 + (size_t)n * 12 + 4 + m;
  uint8_t *b = malloc(4 + body);
  if (!b) die("malloc");
  uint8_t *p = b;
  put32(p, (uint32_t)body), p += 4;
  put64(p, id), p += 8;
  put32(p, (uint32_t)rc), p += 4;
  put32(p, n), p += 4;
  for (uint32_t i = 0; i < n; i++) {
    put32(p, (uint32_t)st[i]), p += 4;
    put64(p, sz ? sz[i] : 0), p += 8;
  }
  put32(p, m), p += 4;
  memcpy(p, msg, m);
  pthread_mutex_lock(&out_mu);
  write_full(1, b, 4 + body);
  pthread_mutex_unlock(&out_mu);
  free(b);
}

static void key_name(kvshim_l2_key *k) {
  static const char hex[] = "0123456789abcdef";
  char *s = k->name;
  memset(k->name, 0, sizeof k->name);
  for (int i = 0; i < 16; i++) *s++ = hex[k->ns[i] >> 4], *s++ = hex[k->ns[i] & 15];
  *s++ = '@';
  for (int i = 3; i >= 0; i--) {
    uint8_t b = (uint8_t)(k->rank >> (8 * i));
    *s++ = hex[b >> 4], *s++ = hex[b & 15];
  }
  *s++ = '@';
  for (int i = 0; i < 32; i++) *s++ = hex[k->hash[i] >> 4], *s++ = hex[k->hash[i] & 15];
}

struct batch {
  uint64_t id;
  uint32_t op, n;
  uint8_t *body; /* the records */
};

static void *run_batch(void *arg) {
  struct batch *bt = arg;
  uint32_t n = bt->n;
  kvshim_l2_key *keys = calloc(n ? n : 1, sizeof *keys);
  void **bufs = calloc(n ? n : 1, sizeof *bufs);
  uint64_t *lens = calloc(n ? n : 1, sizeof *lens);
  int32_t *st = calloc(n ? n : 1, sizeof *st);
  uint64_t *sz = calloc(n ? n : 1, sizeof *sz);
  char err[MSG] = "";
  if (!keys || !bufs || !lens || !st || !sz) die("calloc");
  /* The plugin sees only the keys whose range lies inside the window; the
   * others are refused here. */
  size_t *idx = calloc(n ? n : 1, sizeof *idx);
  if (!idx) die("calloc");
  size_t m = 0;
  for (uint32_t i = 0; i < n; i++) {
    const uint8_t *r = bt->body + (size_t)i * RECORD;
    uint64_t off = get64(r + 52), len = get64(r + 60);
    st[i] = KVSHIM_L2_EIO;
    if ((bt->op == OP_STORE || bt->op == OP_LOAD) && (off > window_size || len > window_size - off)) {
      st[i] = KVSHIM_L2_EINVAL;
      continue;
    }
    kvshim_l2_key *k = &keys[m];
    memcpy(k->ns, r, 16);
    k->rank = get32(r + 16);
    memcpy(k->hash, r + 20, 32);
    key_name(k);
    bufs[m] = window + off;
    lens[m] = len;
    idx[m] = i;
    m++;
  }
  int32_t *pst = calloc(m ? m : 1, sizeof *pst);
  uint64_t *psz = calloc(m ? m : 1, sizeof *psz);
  if (!pst || !psz) die("calloc");
  for (size_t j = 0; j < m; j++) pst[j] = KVSHIM_L2_EIO;
  if (m > 0) {
    switch (bt->op) {
    case OP_LOOKUP: plugin->lookup(state, keys, m, pst, psz, err, sizeof err); break;
    case OP_STORE: plugin->store(state, keys, (const void *const *)bufs, lens, m, pst, err, sizeof err); break;
    case OP_LOAD: plugin->load(state, keys, bufs, lens, m, pst, err, sizeof err); break;
    case OP_REMOVE: plugin->remove(state, keys, m, pst, err, sizeof err); break;
    }
  }
  err[sizeof err - 1] = 0;
  for (size_t j = 0; j < m; j++) {
    st[idx[j]] = pst[j];
    sz[idx[j]] = psz[j];
  }
  reply(bt->id, 0, n, st, sz, err);
  free(pst), free(psz), free(idx), free(keys), free(bufs), free(lens), free(st), free(sz);
  free(bt->body), free(bt);
  pthread_mutex_lock(&run_mu);
  running--;
  pthread_cond_broadcast(&run_cv);
  pthread_mutex_unlock(&run_mu);
  return NULL;
}

/* open_plugin loads lib and checks its ABI; on failure msg says why. */
static int open_plugin(const char *lib, char *msg, size_t len) {
  void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(msg, len, "dlopen %s: %s", lib, dlerror());
    return -1;
  }
  const kvshim_l2_ops *(*entry)(void) = (const kvshim_l2_ops *(*)(void))dlsym(h, "kvshim_l2_plugin");
  if (!entry) {
    snprintf(msg, len, "%s exports no kvshim_l2_plugin(): not a kvshim L2 plugin", lib);
    return -1;
  }
  const kvshim_l2_ops *p = entry();
  if (!p) {
    snprintf(msg, len, "%s: kvshim_l2_plugin() returned NULL", lib);
    return -1;
  }
  if (p->abi_version != KVSHIM_L2_ABI_VERSION) {
    snprintf(msg, len, "%s was built for kvshim L2 plugin ABI %u; this kvshim speaks ABI %u (rebuild it against this kvshim's kvshim_l2.h)",
             lib, p->abi_version, KVSHIM_L2_ABI_VERSION);
    return -1;
  }
  if (p->struct_size < sizeof *p || !p->open || !p->lookup || !p->store || !p->load || !p->remove || !p->close) {
    snprintf(msg, len, "%s: its function table is incomplete (struct_size %u, want %zu, every function set)", lib,
             p->struct_size, sizeof *p);
    return -1;
  }
  plugin = p;
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: kvshim-l2-host PLUGIN.so (started by kvshim; see docs/l2-plugins.md)\n");
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  struct stat sb;
  if (fstat(3, &sb) != 0) die("fd 3 (the window)");
  window_size = (uint64_t)sb.st_size;
  if (window_size > 0) {
    window = mmap(NULL, window_size, PROT_READ | PROT_WRITE, MAP_SHARED, 3, 0);
    if (window == MAP_FAILED) die("mmap window");
  }
  close(3);
  char loadmsg[MSG] = "";
  int loaded = open_plugin(argv[1], loadmsg, sizeof loadmsg);
  int opened = 0;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  for (;;) {
    uint8_t hdr[4];
    int r = read_full(0, hdr, 4);
    if (r <= 0) break;
    uint32_t len = get32(hdr);
    if (len < 16 || len > MAX_FRAME) {
      fprintf(stderr, "kvshim-l2-host: frame of %u bytes\n", len);
      return 2;
    }
    uint8_t *body = malloc(len);
    if (!body) die("malloc");
    if (read_full(0, body, len) <= 0) break;
    uint64_t id = get64(body);
    uint32_t op = get32(body + 8), n = get32(body + 12);
    if (op == OP_OPEN) {
      int32_t abi[1] = {KVSHIM_L2_ABI_VERSION};
      uint64_t pabi[1] = {plugin ? plugin->abi_version : 0};
      if (loaded != 0) {
        reply(id, KVSHIM_L2_EBADCONFIG, 1, abi, pabi, loadmsg);
      } else if (opened) {
        reply(id, KVSHIM_L2_EINVAL, 1, abi, pabi, "opened twice");
      } else if (n != len - 16) {
        reply(id, KVSHIM_L2_EINVAL, 1, abi, pabi, "open: bad config length");
      } else {
        char *cfg = malloc((size_t)n + 1);
        if (!cfg) die("malloc");
        memcpy(cfg, body + 16, n);
        cfg[n] = 0;
        char err[MSG] = "";
        int32_t rc = plugin->open(cfg, n, &state, err, sizeof err);
        err[sizeof err - 1] = 0;
        free(cfg);
        opened = rc == KVSHIM_L2_OK;
        /* On success the message is the plugin's name (for kvshim's logs). */
        reply(id, rc, 1, abi, pabi, opened ? (plugin->name ? plugin->name : "") : err);
      }
      free(body);
      continue;
    }
    if (op < OP_LOOKUP || op > OP_REMOVE || (uint64_t)n * RECORD != (uint64_t)len - 16 || !opened) {
      fprintf(stderr, "kvshim-l2-host: bad request (op %u, %u keys, %u bytes, opened %d)\n", op, n, len, opened);
      return 2;
    }
    struct batch *bt = malloc(sizeof *bt);
    if (!bt) die("malloc");
    bt->id = id, bt->op = op, bt->n = n;
    bt->body = malloc((size_t)n * RECORD + 1);
    if (!bt->body) die("malloc");
    memcpy(bt->body, body + 16, (size_t)n * RECORD);
    free(body);
    pthread_mutex_lock(&run_mu);
    running++;
    pthread_mutex_unlock(&run_mu);
    pthread_t th;
    if (pthread_create(&th, &attr, run_batch, bt) != 0) die("pthread_create");
  }
  pthread_mutex_lock(&run_mu);
  while (running > 0) pthread_cond_wait(&run_cv, &run_mu);
  pthread_mutex_unlock(&run_mu);
  if (opened) plugin->close(state);
  return 0;
}
