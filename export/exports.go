package main

/*
#include <stdint.h>
#include <stddef.h>
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"unsafe"

	"github.com/kvshim/kvshim/cli"
)

// abiVersion is what kvshim_abi_version returns (cli.ABIVersion: one
// number for the library and the static binary).
const abiVersion = cli.ABIVersion

// version is stamped by the build (-ldflags -X main.version=...).
var version = "0.0.0-dev"

// copyOut copies s NUL-terminated into buf[:n]; errRange when truncated.
func copyOut(buf *C.char, n C.size_t, s string) error {
	if buf == nil || n == 0 {
		return fmt.Errorf("output buffer is NULL or empty: %w", errInvalid)
	}
	dst := unsafe.Slice((*byte)(unsafe.Pointer(buf)), int(n))
	k := copy(dst[:len(dst)-1], s)
	dst[k] = 0
	if k < len(s) {
		return fmt.Errorf("need %d bytes, have %d: %w", len(s)+1, int(n), errRange)
	}
	return nil
}

//export kvshim_abi_version
func kvshim_abi_version() C.int { return abiVersion }

//export kvshim_version
func kvshim_version(buf *C.char, n C.size_t) C.int {
	return callLib(func() error { return copyOut(buf, n, version) })
}

//export kvshim_last_error
func kvshim_last_error(h C.int64_t, buf *C.char, n C.size_t) (rc C.int) {
	defer guard(0, &rc)
	var msg string
	if h == 0 {
		globalErr.mu.Lock()
		msg = globalErr.msg
		globalErr.mu.Unlock()
	} else {
		in, err := handles.lookup(int64(h))
		if err != nil {
			return C.int(fail(0, err))
		}
		in.mu.Lock()
		msg = in.lastErr
		in.mu.Unlock()
	}
	// Reading the error must not overwrite it, so no fail() here.
	if buf == nil || n == 0 {
		return codeInval
	}
	if err := copyOut(buf, n, msg); err != nil {
		return C.int(codeOf(err))
	}
	return codeOK
}

// openConfig is the JSON given to kvshim_open. Role selects what the handle
// is; the other fields belong to that role.
type openConfig struct {
	Role string `json:"role"`
}

// openers builds the state of a handle for each role.
var openers = map[string]func(in *instance, cfg []byte) error{}

func roleNames() string {
	names := make([]string, 0, len(openers))
	for k := range openers {
		names = append(names, k)
	}
	slices.Sort(names)
	return strings.Join(names, ", ")
}

//export kvshim_open
func kvshim_open(config *C.char, out *C.int64_t) C.int {
	return callLib(func() error {
		if config == nil || out == nil {
			return fmt.Errorf("kvshim_open: config and out must not be NULL: %w", errInvalid)
		}
		raw := []byte(C.GoString(config))
		var cfg openConfig
		if err := json.Unmarshal(raw, &cfg); err != nil {
			return fmt.Errorf("kvshim_open: config is not JSON: %w: %w", err, errInvalid)
		}
		open, ok := openers[cfg.Role]
		if !ok {
			return fmt.Errorf("kvshim_open: unknown role %q (valid: %s): %w", cfg.Role, roleNames(), errInvalid)
		}
		in := &instance{}
		if err := open(in, raw); err != nil {
			_ = in.close()
			return fmt.Errorf("kvshim_open: %w", err)
		}
		*out = C.int64_t(handles.add(in))
		return nil
	})
}

//export kvshim_close
func kvshim_close(h C.int64_t) C.int {
	return callLib(func() error {
		if err := handles.closeHandle(int64(h)); err != nil {
			return fmt.Errorf("kvshim_close: %w", err)
		}
		return nil
	})
}

//export kvshim_handle_count
func kvshim_handle_count() C.int { return C.int(handles.len()) }

//export kvshim_debug_panic
func kvshim_debug_panic(h C.int64_t) (rc C.int) {
	defer guard(int64(h), &rc)
	panic("kvshim_debug_panic called")
}

//export kvshim_main
func kvshim_main(argc C.int, argv **C.char) (rc C.int) {
	defer guard(0, &rc)
	args := unsafe.Slice(argv, int(argc))
	goArgs := make([]string, len(args))
	for i, a := range args {
		goArgs[i] = C.GoString(a)
	}
	return C.int(cli.Main(goArgs, cli.Info{Version: version, ABI: abiVersion}))
}

// The library's log level comes from $KVSHIM_LOG_LEVEL in every role (a
// vLLM process has no command line of ours).
func init() { cli.LogLevelFromEnv() }
