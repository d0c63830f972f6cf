// fakecuda.c: the CUDA driver API calls kvshim uses, emulated in host memory,
// so the real DeviceEngine (dlopen table, locked driver thread, streams,
// events, batched and per-span copies, pinning) runs on machines without a
// GPU. Built by internal/fakecuda with -DFAKECUDA_BATCH=2|1|0 to look like a
// CUDA 13 driver (cuMemcpyBatchAsync_v2), CUDA 12.8 (cuMemcpyBatchAsync) or
// an older one (per-span copies only).
//
// What it models, because kvshim depends on it:
//   - one device, its primary context (refcounted) and a current context per
//     thread: stream, event, memory and copy calls need one (201 otherwise);
//   - streams are threads that run their queue in order, asynchronously:
//     a copy is not done when the call returns (a per-copy delay widens the
//     window); cuStreamWaitEvent waits for the event's latest record;
//   - events complete when their record is reached; an asynchronous copy
//     failure is sticky on its stream and reported by cuEventQuery;
//   - device memory is cuMemAlloc'd host memory (or memory a test adopts);
//     copies must stay inside an allocation.
// What it enforces beyond CUDA (kvshim rules; each breach is a "violation",
// counted and printed, and the Go tests fail on any):
//   - the host side of every copy is registered (cuMemHostRegister), so the
//     copy would be DMA from pinned memory;
//   - registered memory stays mapped, to the same file pages, until it is
//     unregistered (unmapping it first leaves the driver's pinned pages
//     behind; a new mapping at the same address would then receive DMA meant
//     for the old pages). Checked against /proc/self/maps (file-backed
//     mappings such as memfd L1 segments; anonymous ones only for presence);
//   - no handle is used after it is destroyed, and the legacy default stream
//     (0) is never used.
// It is not a performance model.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef FAKECUDA_BATCH
#define FAKECUDA_BATCH 2
#endif

typedef int CUresult;
typedef uint64_t CUdeviceptr;

enum {
	OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, INVALID_DEVICE = 101,
	INVALID_CONTEXT = 201, INVALID_HANDLE = 400, NOT_READY = 600, ILLEGAL_ADDRESS = 700,
	HOST_MEMORY_ALREADY_REGISTERED = 712, HOST_MEMORY_NOT_REGISTERED = 713, NOT_SUPPORTED = 801,
};

static const struct { CUresult code; const char *name; } names[] = {
	{OK, "CUDA_SUCCESS"}, {INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
	{OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"}, {NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
	{INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"}, {INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
	{INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"}, {NOT_READY, "CUDA_ERROR_NOT_READY"},
	{ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"},
	{HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
	{HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"},
	{NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"},
};

// Everything below is guarded by mu; stream threads wait on cv.
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int initialized;
static int primary_refs;           // the one device's primary context
static int primary_ctx;            // its handle is &primary_ctx
static __thread int *current_ctx;  // cuCtxSetCurrent, per thread

struct range {
	uint64_t base, len;
	int file_backed;              // registrations: identity below is checked
	unsigned long dev, ino;
	uint64_t foff;                // file offset of base
	struct range *next;
};
static struct range *allocs, *adopted, *regs;

struct event {
	uint64_t recorded, completed; // record sequence numbers
	CUresult err;                 // of the stream at the latest completed record
	int destroyed, refs;          // refs: queued ops naming it
	struct event *next;
};
static struct event *events;

enum { OP_COPY, OP_RECORD, OP_WAIT };
struct op {
	int kind;
	uint64_t dst, src, len;
	CUresult fail;                // injected asynchronous failure
	unsigned delay_us;            // extra wait before this copy
	struct event *ev;
	uint64_t seq;
	struct op *next;
};
struct stream {
	struct op *head, *tail;
	int busy, destroyed;
	CUresult err;                 // sticky asynchronous error
	struct stream *next;
};
static struct stream *streams;

static struct {
	uint64_t copies, bytes, batch_calls, span_calls, violations;
} cnt;
static char last_violation[512];
static unsigned copy_delay_us;

struct rule { char fn[64]; int nth, async; CUresult code; struct rule *next; };
static struct rule *rules;

static void violation(const char *fmt, ...) {
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(last_violation, sizeof(last_violation), fmt, ap);
	va_end(ap);
	cnt.violations++;
	fprintf(stderr, "fakecuda: violation: %s\n", last_violation);
}

// injected returns the code a fault rule makes fn return now (0: none).
// With async set the rule is for a copy's execution instead.
static CUresult injected(const char *fn, int async) {
	for (struct rule **p = &rules; *p; p = &(*p)->next) {
		struct rule *r = *p;
		if (r->async != async || strcmp(r->fn, fn) != 0) continue;
		if (--r->nth > 0) return OK;
		CUresult c = r->code;
		*p = r->next;
		free(r);
		return c;
	}
	return OK;
}

#define ENTER(fn)                                                   \
	pthread_mutex_lock(&mu);                                        \
	CUresult _inj = injected(fn, 0);                                \
	if (_inj != OK) { pthread_mutex_unlock(&mu); return _inj; }
#define RETURN(r) do { CUresult _r = (r); pthread_mutex_unlock(&mu); return _r; } while (0)

static CUresult need_ctx(void) {
	if (!initialized) return NOT_INITIALIZED;
	if (current_ctx == NULL || primary_refs == 0) return INVALID_CONTEXT;
	return OK;
}

static struct range *find(struct range *l, uint64_t p, uint64_t n) {
	for (; l; l = l->next)
		if (p >= l->base && n <= l->len && p - l->base <= l->len - n) return l;
	return NULL;
}

static int overlaps(struct range *l, uint64_t p, uint64_t n) {
	for (; l; l = l->next)
		if (p < l->base + l->len && l->base < p + n) return 1;
	return 0;
}

// mapping reads /proc/self/maps for the mapping holding addr: 0 if none.
static int mapping(uint64_t addr, unsigned long *dev, unsigned long *ino, uint64_t *foff) {
	FILE *f = fopen("/proc/self/maps", "r");
	if (f == NULL) return -1;
	char line[512];
	int found = 0;
	while (fgets(line, sizeof(line), f)) {
		unsigned long lo, hi, off, maj, min, inode;
		if (sscanf(line, "%lx-%lx %*4s %lx %lx:%lx %lu", &lo, &hi, &off, &maj, &min, &inode) != 6) continue;
		if (addr >= lo && addr < hi) {
			*dev = maj << 20 | min;
			*ino = inode;
			*foff = off + (addr - lo);
			found = 1;
			break;
		}
	}
	fclose(f);
	return found;
}

// reg_intact checks a registration is still mapped to the same pages.
static int reg_intact(struct range *r) {
	unsigned long dev, ino;
	uint64_t foff;
	int m1 = mapping(r->base, &dev, &ino, &foff);
	if (m1 < 0) return 1; // no /proc: cannot tell
	if (m1 == 0) return 0;
	if (r->file_backed && (dev != r->dev || ino != r->ino || foff != r->foff)) return 0;
	unsigned long d2, i2;
	uint64_t o2;
	return mapping(r->base + r->len - 1, &d2, &i2, &o2) == 1;
}

static int is_device(uint64_t p, uint64_t n) { return find(allocs, p, n) || find(adopted, p, n); }

// check_host: the host side of a copy must be registered and intact.
static CUresult check_host(const char *fn, uint64_t p, uint64_t n) {
	struct range *r = find(regs, p, n);
	if (r == NULL) {
		violation("%s: host range [%#lx, +%lu) is not registered (cuMemHostRegister)", fn,
		          (unsigned long)p, (unsigned long)n);
		return INVALID_VALUE;
	}
	if (!reg_intact(r)) {
		violation("%s: registered host range [%#lx, +%lu) was unmapped or replaced before cuMemHostUnregister",
		          fn, (unsigned long)r->base, (unsigned long)r->len);
		return INVALID_VALUE;
	}
	return OK;
}

static CUresult check_device(const char *fn, uint64_t p, uint64_t n) {
	if (is_device(p, n)) return OK;
	violation("%s: device range [%#lx, +%lu) is outside every allocation", fn, (unsigned long)p,
	          (unsigned long)n);
	return INVALID_VALUE;
}

static struct stream *find_stream(const char *fn, void *h) {
	if (h == NULL) {
		violation("%s: legacy default stream (0)", fn);
		return NULL;
	}
	for (struct stream *s = streams; s; s = s->next)
		if (s == h) return s;
	violation("%s: unknown or destroyed stream %p", fn, h);
	return NULL;
}

static struct event *find_event(const char *fn, void *h) {
	for (struct event *e = events; e; e = e->next)
		if (e == h) return e;
	violation("%s: unknown or destroyed event %p", fn, h);
	return NULL;
}

static void event_unref(struct event *e) {
	if (e != NULL && --e->refs == 0 && e->destroyed) free(e);
}

static void push(struct stream *s, struct op *o) {
	if (o->ev) o->ev->refs++;
	if (s->tail) s->tail->next = o;
	else s->head = o;
	s->tail = o;
	pthread_cond_broadcast(&cv);
}

static void *stream_main(void *arg) {
	struct stream *s = arg;
	pthread_mutex_lock(&mu);
	for (;;) {
		while (s->head == NULL && !s->destroyed) pthread_cond_wait(&cv, &mu);
		struct op *o = s->head;
		if (o == NULL) break; // destroyed and drained
		s->busy = 1;
		if (o->kind == OP_WAIT) {
			while (o->ev->completed < o->seq) pthread_cond_wait(&cv, &mu);
		} else if (o->kind == OP_COPY) {
			pthread_mutex_unlock(&mu);
			if (copy_delay_us + o->delay_us) usleep(copy_delay_us + o->delay_us);
			if (o->fail == OK) memcpy((void *)(uintptr_t)o->dst, (const void *)(uintptr_t)o->src, o->len);
			pthread_mutex_lock(&mu);
			if (o->fail != OK && s->err == OK) s->err = o->fail;
			cnt.copies++;
			cnt.bytes += o->len;
		} else { // OP_RECORD
			if (o->seq > o->ev->completed) {
				o->ev->completed = o->seq;
				o->ev->err = s->err;
			}
		}
		s->busy = 0;
		s->head = o->next;
		if (s->head == NULL) s->tail = NULL;
		event_unref(o->ev);
		free(o);
		pthread_cond_broadcast(&cv);
	}
	pthread_mutex_unlock(&mu);
	free(s);
	return NULL;
}

// enqueue_copy validates one copy (either direction) and queues it.
static CUresult enqueue_copy(const char *fn, struct stream *s, uint64_t dst, uint64_t src, uint64_t n) {
	if (n == 0 || dst == 0 || src == 0) return INVALID_VALUE;
	int dd = is_device(dst, n), sd = is_device(src, n);
	CUresult r = dd ? OK : check_host(fn, dst, n);
	if (r == OK) r = sd ? OK : check_host(fn, src, n);
	if (r != OK) return r;
	struct op *o = calloc(1, sizeof(*o));
	if (o == NULL) return OUT_OF_MEMORY;
	*o = (struct op){.kind = OP_COPY, .dst = dst, .src = src, .len = n, .fail = injected(fn, 1)};
	push(s, o);
	return OK;
}

CUresult cuInit(unsigned int flags) {
	ENTER("cuInit");
	if (flags != 0) RETURN(INVALID_VALUE);
	unsigned long us = 0;
	const char *d = getenv("FAKECUDA_COPY_DELAY_US");
	if (d != NULL) us = strtoul(d, NULL, 10);
	if (!initialized) copy_delay_us = (unsigned)us;
	initialized = 1;
	RETURN(OK);
}

CUresult cuDriverGetVersion(int *v) {
	ENTER("cuDriverGetVersion");
	*v = FAKECUDA_BATCH == 2 ? 13000 : FAKECUDA_BATCH == 1 ? 12080 : 12040;
	RETURN(OK);
}

CUresult cuGetErrorName(CUresult code, const char **name) {
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (names[i].code == code) {
			*name = names[i].name;
			return OK;
		}
	*name = NULL;
	return INVALID_VALUE;
}

CUresult cuDeviceGetCount(int *n) {
	ENTER("cuDeviceGetCount");
	if (!initialized) RETURN(NOT_INITIALIZED);
	*n = 1;
	RETURN(OK);
}

CUresult cuDeviceGet(int *dev, int ordinal) {
	ENTER("cuDeviceGet");
	if (!initialized) RETURN(NOT_INITIALIZED);
	if (ordinal != 0) RETURN(INVALID_DEVICE);
	*dev = 0;
	RETURN(OK);
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
	ENTER("cuDevicePrimaryCtxRetain");
	if (!initialized) RETURN(NOT_INITIALIZED);
	if (dev != 0) RETURN(INVALID_DEVICE);
	primary_refs++;
	*ctx = &primary_ctx;
	RETURN(OK);
}

CUresult cuDevicePrimaryCtxRelease_v2(int dev) {
	ENTER("cuDevicePrimaryCtxRelease_v2");
	if (dev != 0) RETURN(INVALID_DEVICE);
	if (primary_refs == 0) RETURN(INVALID_CONTEXT);
	primary_refs--;
	RETURN(OK);
}

CUresult cuCtxSetCurrent(void *ctx) {
	ENTER("cuCtxSetCurrent");
	if (ctx != NULL && ctx != &primary_ctx) RETURN(INVALID_CONTEXT);
	current_ctx = ctx;
	RETURN(OK);
}

// new_stream starts a stream's thread (mu held).
static struct stream *new_stream(void) {
	struct stream *s = calloc(1, sizeof(*s));
	if (s == NULL) return NULL;
	pthread_t th;
	if (pthread_create(&th, NULL, stream_main, s) != 0) {
		free(s);
		return NULL;
	}
	pthread_detach(th);
	return s;
}

CUresult cuStreamCreate(void **out, unsigned int flags) {
	ENTER("cuStreamCreate");
	(void)flags;
	CUresult r = need_ctx();
	if (r != OK) RETURN(r);
	struct stream *s = new_stream();
	if (s == NULL) RETURN(OUT_OF_MEMORY);
	s->next = streams;
	streams = s;
	*out = s;
	RETURN(OK);
}

// cuStreamDestroy_v2 returns at once; the stream's thread finishes the
// queued work and frees it (CUDA releases a busy stream the same way).
CUresult cuStreamDestroy_v2(void *h) {
	ENTER("cuStreamDestroy_v2");
	struct stream *s = find_stream("cuStreamDestroy_v2", h);
	if (s == NULL) RETURN(INVALID_HANDLE);
	for (struct stream **p = &streams; *p; p = &(*p)->next)
		if (*p == s) {
			*p = s->next;
			break;
		}
	s->destroyed = 1;
	pthread_cond_broadcast(&cv);
	RETURN(OK);
}

CUresult cuStreamQuery(void *h) {
	ENTER("cuStreamQuery");
	struct stream *s = find_stream("cuStreamQuery", h);
	if (s == NULL) RETURN(INVALID_HANDLE);
	if (s->head != NULL) RETURN(NOT_READY);
	RETURN(s->err);
}

CUresult cuStreamWaitEvent(void *h, void *ev, unsigned int flags) {
	ENTER("cuStreamWaitEvent");
	struct stream *s = find_stream("cuStreamWaitEvent", h);
	struct event *e = find_event("cuStreamWaitEvent", ev);
	if (s == NULL || e == NULL) RETURN(INVALID_HANDLE);
	if (flags != 0) RETURN(INVALID_VALUE);
	if (e->recorded == 0) RETURN(OK); // never recorded: nothing to wait for
	struct op *o = calloc(1, sizeof(*o));
	if (o == NULL) RETURN(OUT_OF_MEMORY);
	*o = (struct op){.kind = OP_WAIT, .ev = e, .seq = e->recorded};
	push(s, o);
	RETURN(OK);
}

// new_event creates a live event (mu held).
static struct event *new_event(void) {
	struct event *e = calloc(1, sizeof(*e));
	if (e == NULL) return NULL;
	e->next = events;
	events = e;
	return e;
}

CUresult cuEventCreate(void **out, unsigned int flags) {
	ENTER("cuEventCreate");
	(void)flags;
	CUresult r = need_ctx();
	if (r != OK) RETURN(r);
	struct event *e = new_event();
	if (e == NULL) RETURN(OUT_OF_MEMORY);
	*out = e;
	RETURN(OK);
}

CUresult cuEventDestroy_v2(void *h) {
	ENTER("cuEventDestroy_v2");
	struct event *e = find_event("cuEventDestroy_v2", h);
	if (e == NULL) RETURN(INVALID_HANDLE);
	for (struct event **p = &events; *p; p = &(*p)->next)
		if (*p == e) {
			*p = e->next;
			break;
		}
	e->destroyed = 1;
	if (e->refs == 0) free(e);
	RETURN(OK);
}

CUresult cuEventRecord(void *ev, void *h) {
	ENTER("cuEventRecord");
	struct event *e = find_event("cuEventRecord", ev);
	struct stream *s = find_stream("cuEventRecord", h);
	if (s == NULL || e == NULL) RETURN(INVALID_HANDLE);
	struct op *o = calloc(1, sizeof(*o));
	if (o == NULL) RETURN(OUT_OF_MEMORY);
	*o = (struct op){.kind = OP_RECORD, .ev = e, .seq = ++e->recorded};
	push(s, o);
	RETURN(OK);
}

CUresult cuEventQuery(void *ev) {
	ENTER("cuEventQuery");
	struct event *e = find_event("cuEventQuery", ev);
	if (e == NULL) RETURN(INVALID_HANDLE);
	if (e->completed < e->recorded) RETURN(NOT_READY);
	RETURN(e->err);
}

CUresult cuEventSynchronize(void *ev) {
	ENTER("cuEventSynchronize");
	struct event *e = find_event("cuEventSynchronize", ev);
	if (e == NULL) RETURN(INVALID_HANDLE);
	while (e->completed < e->recorded) pthread_cond_wait(&cv, &mu);
	RETURN(e->err);
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
	ENTER("cuMemAlloc_v2");
	CUresult r = need_ctx();
	if (r != OK) RETURN(r);
	if (n == 0) RETURN(INVALID_VALUE);
	void *m = NULL;
	struct range *a = calloc(1, sizeof(*a));
	if (a == NULL || posix_memalign(&m, 256, n) != 0) {
		free(a);
		RETURN(OUT_OF_MEMORY);
	}
	*a = (struct range){.base = (uint64_t)(uintptr_t)m, .len = n, .next = allocs};
	allocs = a;
	*p = a->base;
	RETURN(OK);
}

CUresult cuMemFree_v2(CUdeviceptr p) {
	ENTER("cuMemFree_v2");
	CUresult r = need_ctx();
	if (r != OK) RETURN(r);
	for (struct range **l = &allocs; *l; l = &(*l)->next)
		if ((*l)->base == p) {
			struct range *a = *l;
			*l = a->next;
			free((void *)(uintptr_t)a->base);
			free(a);
			RETURN(OK);
		}
	RETURN(INVALID_VALUE);
}

CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int flags) {
	ENTER("cuMemHostRegister_v2");
	CUresult r = need_ctx();
	if (r != OK) RETURN(r);
	uint64_t base = (uint64_t)(uintptr_t)p;
	if (p == NULL || n == 0 || (flags & ~0xfu) != 0) RETURN(INVALID_VALUE);
	if (overlaps(regs, base, n)) RETURN(HOST_MEMORY_ALREADY_REGISTERED);
	struct range *g = calloc(1, sizeof(*g));
	if (g == NULL) RETURN(OUT_OF_MEMORY);
	*g = (struct range){.base = base, .len = n};
	int m = mapping(base, &g->dev, &g->ino, &g->foff);
	if (m == 0) {
		free(g);
		RETURN(INVALID_VALUE); // not mapped
	}
	g->file_backed = m == 1 && g->ino != 0;
	g->next = regs;
	regs = g;
	RETURN(OK);
}

CUresult cuMemHostUnregister(void *p) {
	ENTER("cuMemHostUnregister");
	CUresult r = need_ctx();
	if (r != OK) RETURN(r);
	for (struct range **l = &regs; *l; l = &(*l)->next)
		if ((*l)->base == (uint64_t)(uintptr_t)p) {
			struct range *g = *l;
			if (!reg_intact(g))
				violation("cuMemHostUnregister: [%#lx, +%lu) was unmapped or replaced while registered",
				          (unsigned long)g->base, (unsigned long)g->len);
			*l = g->next;
			free(g);
			RETURN(OK);
		}
	RETURN(HOST_MEMORY_NOT_REGISTERED);
}

static CUresult copy1(const char *fn, CUdeviceptr dst, CUdeviceptr src, size_t n, void *h, int h2d) {
	ENTER(fn);
	CUresult r = need_ctx();
	if (r != OK) RETURN(r);
	struct stream *s = find_stream(fn, h);
	if (s == NULL) RETURN(INVALID_HANDLE);
	r = check_device(fn, h2d ? dst : src, n);
	if (r == OK) r = enqueue_copy(fn, s, dst, src, n);
	if (r == OK) cnt.span_calls++;
	RETURN(r);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *h) {
	return copy1("cuMemcpyHtoDAsync_v2", dst, (CUdeviceptr)(uintptr_t)src, n, h, 1);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *h) {
	return copy1("cuMemcpyDtoHAsync_v2", (CUdeviceptr)(uintptr_t)dst, src, n, h, 0);
}

#if FAKECUDA_BATCH > 0
typedef struct {
	int srcAccessOrder;
	struct { int type, id; } srcLocHint, dstLocHint;
	unsigned int flags;
} CUmemcpyAttributes;

static CUresult batch(const char *fn, CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                      CUmemcpyAttributes *attrs, size_t *attrIdxs, size_t numAttrs, size_t *failIdx, void *h) {
	ENTER(fn);
	if (failIdx) *failIdx = (size_t)-1;
	CUresult r = need_ctx();
	if (r != OK) RETURN(r);
	struct stream *s = find_stream(fn, h);
	if (s == NULL) RETURN(INVALID_HANDLE);
	if (count == 0 || numAttrs == 0 || numAttrs > count || attrIdxs[0] != 0) RETURN(INVALID_VALUE);
	for (size_t i = 0; i < numAttrs; i++) {
		int o = attrs[i].srcAccessOrder;
		if (o < 1 || o > 3 || (i > 0 && attrIdxs[i] <= attrIdxs[i - 1]) || attrIdxs[i] >= count)
			RETURN(INVALID_VALUE);
	}
	for (size_t i = 0; i < count; i++) {
		r = enqueue_copy(fn, s, dsts[i], srcs[i], sizes[i]);
		if (r != OK) {
			if (failIdx) *failIdx = i;
			RETURN(r);
		}
	}
	cnt.batch_calls++;
	RETURN(OK);
}

CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                            CUmemcpyAttributes *attrs, size_t *attrIdxs, size_t numAttrs, size_t *failIdx,
                            void *h) {
	return batch("cuMemcpyBatchAsync", dsts, srcs, sizes, count, attrs, attrIdxs, numAttrs, failIdx, h);
}
#endif

#if FAKECUDA_BATCH > 1
CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                               CUmemcpyAttributes *attrs, size_t *attrIdxs, size_t numAttrs, void *h) {
	return batch("cuMemcpyBatchAsync_v2", dsts, srcs, sizes, count, attrs, attrIdxs, numAttrs, NULL, h);
}
#endif

// ---- test controls (not CUDA) ----

// fakecuda_inject makes the nth call from now of fn return code; with
// async set, the nth copy queued by fn fails when it executes instead
// (sticky on its stream, reported by the next event record's query).
int fakecuda_inject(const char *fn, int nth, int code, int async) {
	struct rule *r = calloc(1, sizeof(*r));
	if (r == NULL || nth < 1 || strlen(fn) >= sizeof(r->fn)) {
		free(r);
		return -1;
	}
	snprintf(r->fn, sizeof(r->fn), "%s", fn);
	r->nth = nth;
	r->code = code;
	r->async = async;
	pthread_mutex_lock(&mu);
	r->next = rules;
	rules = r;
	pthread_mutex_unlock(&mu);
	return 0;
}

// fakecuda_vllm_write plays vLLM's forward pass: on a stream of its own it
// copies n bytes src -> dst, delay_us after it reaches the copy, and
// records a new event after the copy, returned in *ev. The caller owns the
// event and may destroy it (cuEventDestroy_v2) at once, as torch may.
int fakecuda_vllm_write(uint64_t dst, uint64_t src, uint64_t n, unsigned delay_us, uint64_t *ev) {
	static struct stream *vllm; // never destroyed, not counted as live
	pthread_mutex_lock(&mu);
	struct op *c = calloc(1, sizeof(*c)), *rec = calloc(1, sizeof(*rec));
	struct event *e = NULL;
	if (vllm == NULL) vllm = new_stream();
	if (vllm != NULL && c != NULL && rec != NULL) e = new_event();
	if (e == NULL) {
		free(c);
		free(rec);
		pthread_mutex_unlock(&mu);
		return -1;
	}
	*c = (struct op){.kind = OP_COPY, .dst = dst, .src = src, .len = n, .delay_us = delay_us};
	*rec = (struct op){.kind = OP_RECORD, .ev = e, .seq = ++e->recorded};
	push(vllm, c);
	push(vllm, rec);
	*ev = (uint64_t)(uintptr_t)e;
	pthread_mutex_unlock(&mu);
	return 0;
}

// fakecuda_reset drops fault rules and sets the per-copy delay.
void fakecuda_reset(unsigned delay_us) {
	pthread_mutex_lock(&mu);
	while (rules) {
		struct rule *r = rules;
		rules = r->next;
		free(r);
	}
	copy_delay_us = delay_us;
	pthread_mutex_unlock(&mu);
}

// fakecuda_adopt declares [p, p+n) device memory (a test's stand-in for a
// tensor on cuda:0); fakecuda_unadopt undoes it.
int fakecuda_adopt(uint64_t p, uint64_t n) {
	struct range *a = calloc(1, sizeof(*a));
	if (a == NULL) return -1;
	pthread_mutex_lock(&mu);
	*a = (struct range){.base = p, .len = n, .next = adopted};
	adopted = a;
	pthread_mutex_unlock(&mu);
	return 0;
}

void fakecuda_unadopt(uint64_t p) {
	pthread_mutex_lock(&mu);
	for (struct range **l = &adopted; *l; l = &(*l)->next)
		if ((*l)->base == p) {
			struct range *a = *l;
			*l = a->next;
			free(a);
			break;
		}
	pthread_mutex_unlock(&mu);
}

static uint64_t count_ranges(struct range *l) {
	uint64_t n = 0;
	for (; l; l = l->next) n++;
	return n;
}

// fakecuda_stats fills out[0..9]: copies executed, bytes copied, batch
// calls, per-span calls, violations, primary-context references, live
// streams, live events, host registrations, device allocations; and the
// last violation's text into msg.
void fakecuda_stats(uint64_t *out, char *msg, size_t msglen) {
	pthread_mutex_lock(&mu);
	uint64_t ns = 0, ne = 0;
	for (struct stream *s = streams; s; s = s->next) ns++;
	for (struct event *e = events; e; e = e->next) ne++;
	uint64_t v[10] = {cnt.copies, cnt.bytes, cnt.batch_calls, cnt.span_calls, cnt.violations,
	                  (uint64_t)primary_refs, ns, ne, count_ranges(regs), count_ranges(allocs)};
	memcpy(out, v, sizeof(v));
	snprintf(msg, msglen, "%s", last_violation);
	pthread_mutex_unlock(&mu);
}
