/*
 * example_files: a kvshim L2 plugin (server/l2/plugin/include/kvshim_l2.h)
 * that keeps one file per object in a directory. It is the example of
 * docs/l2-plugins.md: a backend of its own, written against the header only,
 * that passes kvshim's L2 contract suite (server/l2/l2test).
 *
 * Build (make does this into out/libkvshim-l2-example_files.so):
 *     cc -O2 -shared -fPIC -Iserver/l2/plugin/include -o libkvshim-l2-example_files.so kvshim_l2_files.c
 * Use:
 *     kvshim serve --l2-adapter '{"type":"plugin","library":"out/libkvshim-l2-example_files.so","dir":"/var/cache/kv"}'
 *
 * Config (the adapter's pass-through JSON): "dir" (required; created if
 * missing, its parent must exist), "fsync" (true/false, default false).
 *
 * Layout: <dir>/<hash[0] hex>/<hash[1] hex>/<key name>, each file the
 * payload followed by a 72-byte trailer:
 *     u32 magic "KVP1", u32 crc32c of the payload, u64 payload length,
 *     ns[16], u32 rank, hash[32], u32 zero
 * so an object is bound to its key (a file renamed or copied under another
 * key's name is a miss) and its bytes are checked on every load. A store
 * writes a private temporary file and renames it over the name: readers
 * see no file or a whole one.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvshim_l2.h"

#define MAGIC 0x3150564bu /* "KVP1" little-endian */
#define TRAILER 72

struct files {
  char *dir;
  int fsync;
  atomic_uint_fast64_t tmp_seq;
};

/* ---- CRC-32C (Castagnoli), the checksum kvshim's own formats use ---- */

static uint32_t crc_table[256];

static void crc_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1)));
    crc_table[i] = c;
  }
}

static uint32_t crc_soft(uint32_t crc, const uint8_t *p, size_t n) {
  while (n--) crc = crc_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t v;
    memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8, n -= 8;
  }
  crc = (uint32_t)c;
  while (n--) crc = __builtin_ia32_crc32qi(crc, *p++);
  return crc;
}
#endif

static uint32_t crc32c(const void *buf, size_t n) {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("sse4.2")) return ~crc_hw(~0u, buf, n);
#endif
  return ~crc_soft(~0u, buf, n);
}

/* ---- config: a minimal reader of the two keys this plugin takes ---- */

/* json_string finds "key": "value" in a flat JSON object and returns a
 * malloc'd copy of value (\" and \\ unescaped), or NULL. */
static char *json_string(const char *js, const char *key) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\"", key);
  const char *p = strstr(js, pat);
  if (!p) return NULL;
  p += strlen(pat);
  while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
  if (*p++ != ':') return NULL;
  while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
  if (*p++ != '"') return NULL;
  char *out = malloc(strlen(p) + 1), *o = out;
  if (!out) return NULL;
  for (; *p && *p != '"'; p++) {
    if (*p == '\\' && (p[1] == '"' || p[1] == '\\' || p[1] == '/')) p++;
    *o++ = *p;
  }
  *o = 0;
  if (*p != '"') {
    free(out);
    return NULL;
  }
  return out;
}

static int json_true(const char *js, const char *key) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\"", key);
  const char *p = strstr(js, pat);
  if (!p) return 0;
  p += strlen(pat);
  while (*p == ' ' || *p == ':' || *p == '\t') p++;
  return strncmp(p, "true", 4) == 0;
}

/* ---- paths ---- */

static void obj_path(const struct files *f, const kvshim_l2_key *k, char *out, size_t len) {
  snprintf(out, len, "%s/%02x/%02x/%s", f->dir, k->hash[0], k->hash[1], k->name);
}

static int mkdir_shard(const struct files *f, const kvshim_l2_key *k) {
  char d[4096];
  snprintf(d, sizeof d, "%s/%02x", f->dir, k->hash[0]);
  if (mkdir(d, 0700) != 0 && errno != EEXIST) return -1;
  snprintf(d, sizeof d, "%s/%02x/%02x", f->dir, k->hash[0], k->hash[1]);
  if (mkdir(d, 0700) != 0 && errno != EEXIST) return -1;
  return 0;
}

static void trailer(uint8_t t[TRAILER], const kvshim_l2_key *k, uint32_t crc, uint64_t len) {
  uint32_t m = MAGIC, zero = 0;
  memcpy(t, &m, 4);
  memcpy(t + 4, &crc, 4);
  memcpy(t + 8, &len, 8);
  memcpy(t + 16, k->ns, 16);
  memcpy(t + 32, &k->rank, 4);
  memcpy(t + 36, k->hash, 32);
  memcpy(t + 68, &zero, 4);
}

/* open_obj opens k's object and checks its trailer against k and the file
 * size: 1 with *fd, *len, *crc set; 0 when there is no valid object (a
 * damaged one is unlinked); -1 on an I/O error. */
static int open_obj(const struct files *f, const kvshim_l2_key *k, int *fd, uint64_t *len, uint32_t *crc) {
  char path[4096];
  obj_path(f, k, path, sizeof path);
  int d = open(path, O_RDONLY | O_CLOEXEC);
  if (d < 0) return errno == ENOENT || errno == ENOTDIR ? 0 : -1;
  struct stat st;
  uint8_t t[TRAILER], want[TRAILER];
  if (fstat(d, &st) != 0) {
    close(d);
    return -1;
  }
  if (!S_ISREG(st.st_mode) || st.st_size < TRAILER || pread(d, t, TRAILER, st.st_size - TRAILER) != TRAILER) {
    close(d);
    unlink(path);
    return 0;
  }
  uint64_t n;
  uint32_t c;
  memcpy(&n, t + 8, 8);
  memcpy(&c, t + 4, 4);
  trailer(want, k, c, n);
  if (memcmp(t, want, TRAILER) != 0 || n != (uint64_t)st.st_size - TRAILER) {
    close(d); /* damaged, or another key's bytes under this name */
    unlink(path);
    return 0;
  }
  *fd = d, *len = n, *crc = c;
  return 1;
}

static void say(char *err, size_t len, const char *op, const kvshim_l2_key *k, const char *why) {
  if (err && len && !err[0]) snprintf(err, len, "example_files: %s %s: %s", op, k->name, why);
}

/* ---- the ABI ---- */

static int32_t files_open(const char *config, size_t config_len, void **state, char *err, size_t err_len) {
  (void)config_len;
  crc_init();
  struct files *f = calloc(1, sizeof *f);
  if (!f) return KVSHIM_L2_EIO;
  f->dir = json_string(config, "dir");
  f->fsync = json_true(config, "fsync");
  if (!f->dir || !f->dir[0]) {
    snprintf(err, err_len, "key \"dir\": missing (the directory that holds the objects)");
    free(f->dir), free(f);
    return KVSHIM_L2_EBADCONFIG;
  }
  if (mkdir(f->dir, 0700) != 0 && errno != EEXIST) {
    snprintf(err, err_len, "key \"dir\": mkdir %s: %s", f->dir, strerror(errno));
    free(f->dir), free(f);
    return KVSHIM_L2_EBADCONFIG;
  }
  *state = f;
  return KVSHIM_L2_OK;
}

static void files_lookup(void *state, const kvshim_l2_key *keys, size_t n, int32_t *status, uint64_t *sizes,
                         char *err, size_t err_len) {
  struct files *f = state;
  for (size_t i = 0; i < n; i++) {
    int fd;
    uint64_t len;
    uint32_t crc;
    int r = open_obj(f, &keys[i], &fd, &len, &crc);
    if (r < 0) {
      status[i] = KVSHIM_L2_EIO;
      say(err, err_len, "lookup", &keys[i], strerror(errno));
      continue;
    }
    status[i] = r ? KVSHIM_L2_OK : KVSHIM_L2_MISS;
    sizes[i] = r ? len : 0;
    if (r) close(fd);
  }
}

static int store1(struct files *f, const kvshim_l2_key *k, const void *buf, uint64_t len, char *err, size_t err_len) {
  int fd;
  uint64_t have;
  uint32_t crc;
  if (open_obj(f, k, &fd, &have, &crc) == 1) {
    close(fd);
    if (have == len) return KVSHIM_L2_OK; /* immutable: the same object */
  }
  if (mkdir_shard(f, k) != 0) {
    say(err, err_len, "store", k, strerror(errno));
    return KVSHIM_L2_EIO;
  }
  char path[4096], tmp[4200];
  obj_path(f, k, path, sizeof path);
  snprintf(tmp, sizeof tmp, "%s.tmp.%d.%llu", path, (int)getpid(),
           (unsigned long long)atomic_fetch_add(&f->tmp_seq, 1));
  fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    say(err, err_len, "store", k, strerror(errno));
    return errno == ENOSPC ? KVSHIM_L2_ENOSPC : KVSHIM_L2_EIO;
  }
  uint8_t t[TRAILER];
  trailer(t, k, crc32c(buf, len), len);
  const uint8_t *p = buf;
  uint64_t done = 0;
  int rc = KVSHIM_L2_OK;
  while (done < len) {
    ssize_t w = pwrite(fd, p + done, len - done, (off_t)done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      rc = errno == ENOSPC ? KVSHIM_L2_ENOSPC : KVSHIM_L2_EIO;
      break;
    }
    done += (uint64_t)w;
  }
  if (rc == KVSHIM_L2_OK && pwrite(fd, t, TRAILER, (off_t)len) != TRAILER) rc = KVSHIM_L2_EIO;
  if (rc == KVSHIM_L2_OK && f->fsync && fsync(fd) != 0) rc = KVSHIM_L2_EIO;
  if (close(fd) != 0 && rc == KVSHIM_L2_OK) rc = KVSHIM_L2_EIO;
  if (rc == KVSHIM_L2_OK && rename(tmp, path) != 0) rc = KVSHIM_L2_EIO;
  if (rc != KVSHIM_L2_OK) {
    say(err, err_len, "store", k, strerror(errno));
    unlink(tmp);
  }
  return rc;
}

static void files_store(void *state, const kvshim_l2_key *keys, const void *const *bufs, const uint64_t *lens,
                        size_t n, int32_t *status, char *err, size_t err_len) {
  for (size_t i = 0; i < n; i++) status[i] = store1(state, &keys[i], bufs[i], lens[i], err, err_len);
}

static void files_load(void *state, const kvshim_l2_key *keys, void *const *bufs, const uint64_t *lens, size_t n,
                       int32_t *status, char *err, size_t err_len) {
  struct files *f = state;
  for (size_t i = 0; i < n; i++) {
    int fd;
    uint64_t len;
    uint32_t crc;
    int r = open_obj(f, &keys[i], &fd, &len, &crc);
    if (r <= 0) {
      status[i] = r == 0 ? KVSHIM_L2_MISS : KVSHIM_L2_EIO;
      if (r < 0) say(err, err_len, "load", &keys[i], strerror(errno));
      continue;
    }
    if (len != lens[i]) {
      close(fd);
      status[i] = KVSHIM_L2_ESIZE;
      say(err, err_len, "load", &keys[i], "the object's size differs from the buffer's");
      continue;
    }
    uint8_t *p = bufs[i];
    uint64_t done = 0;
    int ok = 1;
    while (done < len) {
      ssize_t got = pread(fd, p + done, len - done, (off_t)done);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        ok = 0;
        break;
      }
      done += (uint64_t)got;
    }
    close(fd);
    if (!ok) {
      status[i] = KVSHIM_L2_EIO;
      say(err, err_len, "load", &keys[i], "short read");
    } else if (crc32c(p, len) != crc) {
      char path[4096];
      obj_path(f, &keys[i], path, sizeof path);
      unlink(path); /* corrupt: a miss, never served again */
      status[i] = KVSHIM_L2_MISS;
    } else {
      status[i] = KVSHIM_L2_OK;
    }
  }
}

static void files_remove(void *state, const kvshim_l2_key *keys, size_t n, int32_t *status, char *err,
                         size_t err_len) {
  struct files *f = state;
  for (size_t i = 0; i < n; i++) {
    char path[4096];
    obj_path(f, &keys[i], path, sizeof path);
    if (unlink(path) == 0) {
      status[i] = KVSHIM_L2_OK;
    } else if (errno == ENOENT || errno == ENOTDIR) {
      status[i] = KVSHIM_L2_MISS;
    } else {
      status[i] = KVSHIM_L2_EIO;
      say(err, err_len, "remove", &keys[i], strerror(errno));
    }
  }
}

static void files_close(void *state) {
  struct files *f = state;
  free(f->dir);
  free(f);
}

static const kvshim_l2_ops table = {
    .abi_version = KVSHIM_L2_ABI_VERSION,
    .struct_size = sizeof(kvshim_l2_ops),
    .name = "example_files",
    .open = files_open,
    .lookup = files_lookup,
    .store = files_store,
    .load = files_load,
    .remove = files_remove,
    .close = files_close,
};

const kvshim_l2_ops *kvshim_l2_plugin(void) { return &table; }
