package cuda

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "loader.h"
*/
import "C"

import (
	"fmt"
	"os"
	"sync"
	"unsafe"
)

// DefaultLibrary is the driver library opened at run time. KVSHIM_LIBCUDA
// overrides it (a path or a soname).
const DefaultLibrary = "libcuda.so.1"

// driver is an opened libcuda with its function table.
type driver struct {
	d       *C.kvs_driver
	path    string
	version int // cuDriverGetVersion, e.g. 12080 or 13000
	batch   int // 2: cuMemcpyBatchAsync_v2, 1: cuMemcpyBatchAsync (12.8), 0: none
}

var (
	loadOnce sync.Once
	loaded   *driver
	loadErr  error
)

// Init opens the CUDA driver once per process and initialises it. Without
// a driver the error wraps ErrNotSupported and reads like
// "cuda: not supported: load libcuda.so.1: libcuda.so.1: cannot open shared
// object file: No such file or directory".
func Init() error {
	_, err := defaultDriver()
	return err
}

func defaultDriver() (*driver, error) {
	loadOnce.Do(func() {
		path := DefaultLibrary
		if p := os.Getenv("KVSHIM_LIBCUDA"); p != "" {
			path = p
		}
		loaded, loadErr = openDriver(path)
	})
	return loaded, loadErr
}

// openDriver dlopens path, resolves the table and calls cuInit.
func openDriver(path string) (*driver, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var buf [512]C.char
	d := C.kvs_open(cpath, &buf[0], C.size_t(len(buf)))
	if d == nil {
		return nil, fmt.Errorf("%w: load %s: %s", ErrNotSupported, path, C.GoString(&buf[0]))
	}
	drv := &driver{d: d, path: path, batch: int(C.kvs_batch_kind(d))}
	if err := drv.check("cuInit", C.kvs_init(d)); err != nil {
		C.kvs_close(d)
		return nil, fmt.Errorf("%w: load %s: %w", ErrNotSupported, path, err)
	}
	var v C.int
	if err := drv.check("cuDriverGetVersion", C.kvs_driver_version(d, &v)); err != nil {
		C.kvs_close(d)
		return nil, err
	}
	drv.version = int(v)
	return drv, nil
}

// check turns a CUresult into a *DriverError (nil on success).
func (drv *driver) check(op string, r C.CUresult) error {
	if r == cudaSuccess {
		return nil
	}
	return &DriverError{Op: op, Code: int(r), Name: C.GoString(C.kvs_error_name(drv.d, r))}
}

// DriverInfo describes the loaded driver.
type DriverInfo struct {
	Library string // what was dlopened
	Version int    // cuDriverGetVersion: 1000*major + 10*minor
	Devices int    // cuDeviceGetCount
	// BatchAPI is the batched-copy entry point found: "cuMemcpyBatchAsync_v2"
	// (CUDA 13), "cuMemcpyBatchAsync" (CUDA 12.8/12.9) or "" (per-span copies).
	BatchAPI string
}

// Info loads the driver (see Init) and describes it.
func Info() (DriverInfo, error) {
	drv, err := defaultDriver()
	if err != nil {
		return DriverInfo{}, err
	}
	var n C.int
	if err := drv.check("cuDeviceGetCount", C.kvs_device_count(drv.d, &n)); err != nil {
		return DriverInfo{}, err
	}
	return DriverInfo{Library: drv.path, Version: drv.version, Devices: int(n), BatchAPI: batchName(drv.batch)}, nil
}

func batchName(kind int) string {
	switch kind {
	case 2:
		return "cuMemcpyBatchAsync_v2"
	case 1:
		return "cuMemcpyBatchAsync"
	}
	return ""
}
