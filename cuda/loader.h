// Just enough CUDA driver API to dlopen libcuda.so.1 and copy memory:
// typedefs, a table of function pointers filled with dlsym, and trampolines
// that Go calls (cgo cannot call C function pointers). No CUDA headers or
// libraries are needed to build; nothing here is an undefined symbol.
#ifndef KVSHIM_CUDA_LOADER_H
#define KVSHIM_CUDA_LOADER_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult; // CUDA_SUCCESS == 0
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;

#define KVS_CUDA_SUCCESS 0
#define KVS_CUDA_ERROR_NOT_READY 600
#define KVS_CU_STREAM_NON_BLOCKING 0x1
#define KVS_CU_EVENT_DISABLE_TIMING 0x2
#define KVS_CU_MEMHOSTREGISTER_PORTABLE 0x1

// CUmemLocation and CUmemcpyAttributes (CUDA 12.8+), 24 bytes.
typedef struct {
	int type; // CUmemLocationType; 0 = invalid (hint ignored)
	int id;
} kvs_CUmemLocation;

typedef struct {
	int srcAccessOrder; // CUmemcpySrcAccessOrder
	kvs_CUmemLocation srcLocHint;
	kvs_CUmemLocation dstLocHint;
	unsigned int flags;
} kvs_CUmemcpyAttributes;

#define KVS_SRC_ACCESS_ORDER_STREAM 0x1
#define KVS_SRC_ACCESS_ORDER_ANY 0x3

typedef struct kvs_driver {
	void *handle;
	// required
	CUresult (*cuInit)(unsigned int);
	CUresult (*cuDriverGetVersion)(int *);
	CUresult (*cuGetErrorName)(CUresult, const char **);
	CUresult (*cuDeviceGetCount)(int *);
	CUresult (*cuDeviceGet)(CUdevice *, int);
	CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
	CUresult (*cuCtxSetCurrent)(CUcontext);
	CUresult (*cuStreamCreate)(CUstream *, unsigned int);
	CUresult (*cuStreamDestroy)(CUstream);
	CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned int);
	CUresult (*cuStreamQuery)(CUstream);
	CUresult (*cuEventCreate)(CUevent *, unsigned int);
	CUresult (*cuEventDestroy)(CUevent);
	CUresult (*cuEventRecord)(CUevent, CUstream);
	CUresult (*cuEventQuery)(CUevent);
	CUresult (*cuEventSynchronize)(CUevent);
	CUresult (*cuMemHostRegister)(void *, size_t, unsigned int);
	CUresult (*cuMemHostUnregister)(void *);
	CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
	CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
	CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
	CUresult (*cuMemFree)(CUdeviceptr);
	// optional (NULL when the driver lacks them)
	CUresult (*cuMemcpyBatchAsync_v2)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
	                                  kvs_CUmemcpyAttributes *, size_t *, size_t, CUstream);
	CUresult (*cuMemcpyBatchAsync)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
	                               kvs_CUmemcpyAttributes *, size_t *, size_t, size_t *, CUstream);
	CUresult (*cuEventElapsedTime)(float *, CUevent, CUevent);
} kvs_driver;

// kvs_open loads path and fills a new table. On failure it returns NULL and
// writes a message into err.
kvs_driver *kvs_open(const char *path, char *err, size_t errlen);
void kvs_close(kvs_driver *d);

// Which batch entry point the table has: 2 = cuMemcpyBatchAsync_v2 (CUDA
// 13, no failIdx), 1 = cuMemcpyBatchAsync (CUDA 12.8, with failIdx), 0 = none.
int kvs_batch_kind(kvs_driver *d);

const char *kvs_error_name(kvs_driver *d, CUresult r);

// Trampolines. Addresses travel as uint64 so no Go pointer crosses.
CUresult kvs_init(kvs_driver *d);
CUresult kvs_driver_version(kvs_driver *d, int *v);
CUresult kvs_device_count(kvs_driver *d, int *n);
CUresult kvs_primary_ctx_retain(kvs_driver *d, int ordinal, uint64_t *ctx, int *dev);
CUresult kvs_primary_ctx_release(kvs_driver *d, int dev);
CUresult kvs_ctx_set_current(kvs_driver *d, uint64_t ctx);
CUresult kvs_stream_create(kvs_driver *d, uint64_t *s);
CUresult kvs_stream_destroy(kvs_driver *d, uint64_t s);
CUresult kvs_stream_wait_event(kvs_driver *d, uint64_t s, uint64_t ev);
CUresult kvs_stream_query(kvs_driver *d, uint64_t s);
CUresult kvs_event_create(kvs_driver *d, uint64_t *ev, unsigned int flags);
CUresult kvs_event_destroy(kvs_driver *d, uint64_t ev);
CUresult kvs_event_record(kvs_driver *d, uint64_t ev, uint64_t s);
CUresult kvs_event_query(kvs_driver *d, uint64_t ev);
CUresult kvs_event_synchronize(kvs_driver *d, uint64_t ev);
CUresult kvs_event_elapsed_ms(kvs_driver *d, float *ms, uint64_t start, uint64_t end);
CUresult kvs_host_register(kvs_driver *d, uint64_t p, uint64_t size, unsigned int flags);
CUresult kvs_host_unregister(kvs_driver *d, uint64_t p);
CUresult kvs_mem_alloc(kvs_driver *d, uint64_t *p, uint64_t size);
CUresult kvs_mem_free(kvs_driver *d, uint64_t p);

// kvs_copy_spans enqueues n copies (dst[i] <- src[i], len[i]) on stream s,
// one cuMemcpy{HtoD,DtoH}Async_v2 per span. h2d selects the direction. On
// error *failed is the index of the span that failed.
CUresult kvs_copy_spans(kvs_driver *d, int h2d, const uint64_t *dst, const uint64_t *src,
                        const uint64_t *len, size_t n, uint64_t s, size_t *failed);

// kvs_copy_batch enqueues n copies with one cuMemcpyBatchAsync call (either
// signature), srcAccessOrder as given for all of them.
CUresult kvs_copy_batch(kvs_driver *d, const uint64_t *dst, const uint64_t *src,
                        const uint64_t *len, size_t n, int src_access_order, uint64_t s,
                        size_t *failed);

#endif
