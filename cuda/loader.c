#include "loader.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(sizeof(kvs_CUmemcpyAttributes) == 24, "CUmemcpyAttributes is 24 bytes");

kvs_driver *kvs_open(const char *path, char *err, size_t errlen) {
	kvs_driver *d = calloc(1, sizeof(*d));
	if (d == NULL) {
		snprintf(err, errlen, "out of memory");
		return NULL;
	}
	dlerror();
	d->handle = dlopen(path, RTLD_LAZY | RTLD_LOCAL);
	if (d->handle == NULL) {
		const char *e = dlerror();
		snprintf(err, errlen, "%s", e ? e : "dlopen failed");
		free(d);
		return NULL;
	}
	struct {
		const char *name;
		void **ptr;
		int required;
	} l[] = {
		{"cuInit", (void **)&d->cuInit, 1},
		{"cuDriverGetVersion", (void **)&d->cuDriverGetVersion, 1},
		{"cuGetErrorName", (void **)&d->cuGetErrorName, 1},
		{"cuDeviceGetCount", (void **)&d->cuDeviceGetCount, 1},
		{"cuDeviceGet", (void **)&d->cuDeviceGet, 1},
		{"cuDevicePrimaryCtxRetain", (void **)&d->cuDevicePrimaryCtxRetain, 1},
		{"cuDevicePrimaryCtxRelease_v2", (void **)&d->cuDevicePrimaryCtxRelease, 1},
		{"cuCtxSetCurrent", (void **)&d->cuCtxSetCurrent, 1},
		{"cuStreamCreate", (void **)&d->cuStreamCreate, 1},
		{"cuStreamDestroy_v2", (void **)&d->cuStreamDestroy, 1},
		{"cuStreamWaitEvent", (void **)&d->cuStreamWaitEvent, 1},
		{"cuStreamQuery", (void **)&d->cuStreamQuery, 1},
		{"cuEventCreate", (void **)&d->cuEventCreate, 1},
		{"cuEventDestroy_v2", (void **)&d->cuEventDestroy, 1},
		{"cuEventRecord", (void **)&d->cuEventRecord, 1},
		{"cuEventQuery", (void **)&d->cuEventQuery, 1},
		{"cuEventSynchronize", (void **)&d->cuEventSynchronize, 1},
		{"cuMemHostRegister_v2", (void **)&d->cuMemHostRegister, 1},
		{"cuMemHostUnregister", (void **)&d->cuMemHostUnregister, 1},
		{"cuMemcpyHtoDAsync_v2", (void **)&d->cuMemcpyHtoDAsync, 1},
		{"cuMemcpyDtoHAsync_v2", (void **)&d->cuMemcpyDtoHAsync, 1},
		{"cuMemAlloc_v2", (void **)&d->cuMemAlloc, 1},
		{"cuMemFree_v2", (void **)&d->cuMemFree, 1},
		{"cuMemcpyBatchAsync_v2", (void **)&d->cuMemcpyBatchAsync_v2, 0},
		{"cuMemcpyBatchAsync", (void **)&d->cuMemcpyBatchAsync, 0},
		{"cuEventElapsedTime_v2", (void **)&d->cuEventElapsedTime, 0},
		{NULL, NULL, 0},
	};
	for (int i = 0; l[i].name != NULL; i++) {
		*l[i].ptr = dlsym(d->handle, l[i].name);
		if (*l[i].ptr == NULL && l[i].required) {
			snprintf(err, errlen, "%s: missing required symbol %s", path, l[i].name);
			dlclose(d->handle);
			free(d);
			return NULL;
		}
	}
	if (d->cuEventElapsedTime == NULL) {
		d->cuEventElapsedTime = dlsym(d->handle, "cuEventElapsedTime");
	}
	return d;
}

void kvs_close(kvs_driver *d) {
	if (d != NULL) {
		dlclose(d->handle);
		free(d);
	}
}

int kvs_batch_kind(kvs_driver *d) {
	if (d->cuMemcpyBatchAsync_v2 != NULL) return 2;
	if (d->cuMemcpyBatchAsync != NULL) return 1;
	return 0;
}

const char *kvs_error_name(kvs_driver *d, CUresult r) {
	const char *s = NULL;
	if (d->cuGetErrorName(r, &s) != KVS_CUDA_SUCCESS || s == NULL) return "CUDA_ERROR_UNKNOWN_CODE";
	return s;
}

#define P(x) ((void *)(uintptr_t)(x))
#define H(x) ((uint64_t)(uintptr_t)(x))

CUresult kvs_init(kvs_driver *d) { return d->cuInit(0); }
CUresult kvs_driver_version(kvs_driver *d, int *v) { return d->cuDriverGetVersion(v); }
CUresult kvs_device_count(kvs_driver *d, int *n) { return d->cuDeviceGetCount(n); }

CUresult kvs_primary_ctx_retain(kvs_driver *d, int ordinal, uint64_t *ctx, int *dev) {
	CUdevice dv;
	CUresult r = d->cuDeviceGet(&dv, ordinal);
	if (r != KVS_CUDA_SUCCESS) return r;
	CUcontext c = NULL;
	r = d->cuDevicePrimaryCtxRetain(&c, dv);
	*ctx = H(c);
	*dev = dv;
	return r;
}

CUresult kvs_primary_ctx_release(kvs_driver *d, int dev) { return d->cuDevicePrimaryCtxRelease(dev); }
CUresult kvs_ctx_set_current(kvs_driver *d, uint64_t ctx) { return d->cuCtxSetCurrent(P(ctx)); }

CUresult kvs_stream_create(kvs_driver *d, uint64_t *s) {
	CUstream st = NULL;
	CUresult r = d->cuStreamCreate(&st, KVS_CU_STREAM_NON_BLOCKING);
	*s = H(st);
	return r;
}

CUresult kvs_stream_destroy(kvs_driver *d, uint64_t s) { return d->cuStreamDestroy(P(s)); }
CUresult kvs_stream_wait_event(kvs_driver *d, uint64_t s, uint64_t ev) { return d->cuStreamWaitEvent(P(s), P(ev), 0); }
CUresult kvs_stream_query(kvs_driver *d, uint64_t s) { return d->cuStreamQuery(P(s)); }

CUresult kvs_event_create(kvs_driver *d, uint64_t *ev, unsigned int flags) {
	CUevent e = NULL;
	CUresult r = d->cuEventCreate(&e, flags);
	*ev = H(e);
	return r;
}

CUresult kvs_event_destroy(kvs_driver *d, uint64_t ev) { return d->cuEventDestroy(P(ev)); }
CUresult kvs_event_record(kvs_driver *d, uint64_t ev, uint64_t s) { return d->cuEventRecord(P(ev), P(s)); }
CUresult kvs_event_query(kvs_driver *d, uint64_t ev) { return d->cuEventQuery(P(ev)); }
CUresult kvs_event_synchronize(kvs_driver *d, uint64_t ev) { return d->cuEventSynchronize(P(ev)); }

CUresult kvs_event_elapsed_ms(kvs_driver *d, float *ms, uint64_t start, uint64_t end) {
	if (d->cuEventElapsedTime == NULL) return 801; // CUDA_ERROR_NOT_SUPPORTED
	return d->cuEventElapsedTime(ms, P(start), P(end));
}

CUresult kvs_host_register(kvs_driver *d, uint64_t p, uint64_t size, unsigned int flags) {
	return d->cuMemHostRegister(P(p), (size_t)size, flags);
}

CUresult kvs_host_unregister(kvs_driver *d, uint64_t p) { return d->cuMemHostUnregister(P(p)); }

CUresult kvs_mem_alloc(kvs_driver *d, uint64_t *p, uint64_t size) {
	CUdeviceptr dp = 0;
	CUresult r = d->cuMemAlloc(&dp, (size_t)size);
	*p = (uint64_t)dp;
	return r;
}

CUresult kvs_mem_free(kvs_driver *d, uint64_t p) { return d->cuMemFree((CUdeviceptr)p); }

CUresult kvs_copy_spans(kvs_driver *d, int h2d, const uint64_t *dst, const uint64_t *src,
                        const uint64_t *len, size_t n, uint64_t s, size_t *failed) {
	CUstream st = P(s);
	for (size_t i = 0; i < n; i++) {
		CUresult r = h2d ? d->cuMemcpyHtoDAsync((CUdeviceptr)dst[i], P(src[i]), (size_t)len[i], st)
		                 : d->cuMemcpyDtoHAsync(P(dst[i]), (CUdeviceptr)src[i], (size_t)len[i], st);
		if (r != KVS_CUDA_SUCCESS) {
			*failed = i;
			return r;
		}
	}
	return KVS_CUDA_SUCCESS;
}

CUresult kvs_copy_batch(kvs_driver *d, const uint64_t *dst, const uint64_t *src,
                        const uint64_t *len, size_t n, int src_access_order, uint64_t s,
                        size_t *failed) {
	// CUdeviceptr and size_t are 64-bit on every platform this builds for,
	// so the uint64 arrays are passed as they are.
	kvs_CUmemcpyAttributes attr;
	memset(&attr, 0, sizeof(attr));
	attr.srcAccessOrder = src_access_order;
	size_t idx = 0;
	*failed = (size_t)-1;
	if (d->cuMemcpyBatchAsync_v2 != NULL) {
		return d->cuMemcpyBatchAsync_v2((CUdeviceptr *)dst, (CUdeviceptr *)src, (size_t *)len, n,
		                                &attr, &idx, 1, P(s));
	}
	if (d->cuMemcpyBatchAsync != NULL) {
		return d->cuMemcpyBatchAsync((CUdeviceptr *)dst, (CUdeviceptr *)src, (size_t *)len, n,
		                             &attr, &idx, 1, failed, P(s));
	}
	return 801; // CUDA_ERROR_NOT_SUPPORTED
}
