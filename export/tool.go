package main

/*
#include <stdint.h>
#include <stddef.h>
*/
import "C"

import (
	"context"
	"fmt"
	"os"
	"time"
	"unsafe"

	"github.com/kvshim/kvshim/export/connector"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/shim"
)

// Role "tool": a plain session with a server, for health checks and the
// round-trip benchmark (make bench-ipc).

type toolState struct {
	c       *ipc.Client
	timeout time.Duration
}

func init() {
	openers["tool"] = func(in *instance, raw []byte) error {
		_, r, err := connector.Parse(raw)
		if err != nil {
			return err
		}
		c, err := ipc.Dial(r.Socket, ipc.Hello{Version: ipc.ProtocolVersion, Role: ipc.RoleTool, PID: uint32(os.Getpid()), Instance: r.Instance}, r.Timeout)
		if err != nil {
			return fmt.Errorf("%w: connect to %s: %w", shim.ErrUnavailable, r.Socket, err) // KVSHIM_EIO
		}
		in.state = &toolState{c: c, timeout: r.Timeout}
		in.closers = append(in.closers, c.Close)
		return nil
	}
}

//export kvshim_ping
func kvshim_ping(h C.int64_t, body unsafe.Pointer, n C.size_t, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return call(h, func(in *instance, ts *toolState) error {
		req, err := cSlice[byte](body, uint64(n), "body")
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), ts.timeout)
		defer cancel()
		resp, err := ts.c.Echo(ctx, req)
		if err != nil {
			return err
		}
		return output(in, resp, buf, capacity, outLen)
	})
}
