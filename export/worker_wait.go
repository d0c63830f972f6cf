package main

/*
#include <stdint.h>
*/
import "C"

import (
	"fmt"
	"os"
	"time"
)

//export kvshim_worker_wait
func kvshim_worker_wait(h C.int64_t, timeoutMS C.int64_t) C.int {
	return call(h, func(in *instance, ws *workerState) error {
		if timeoutMS < 0 {
			return fmt.Errorf("timeout_ms %d is negative: %w", timeoutMS, errInvalid)
		}
		if !ws.w.WaitReport(time.Duration(timeoutMS) * time.Millisecond) {
			return fmt.Errorf("nothing to report after %d ms: %w", timeoutMS, os.ErrDeadlineExceeded)
		}
		return nil
	})
}

//export kvshim_worker_start_loads_wait
func kvshim_worker_start_loads_wait(h C.int64_t, waitMS C.int64_t) C.int {
	return call(h, func(in *instance, ws *workerState) error {
		if waitMS < 0 {
			return fmt.Errorf("wait_ms %d is negative: %w", waitMS, errInvalid)
		}
		m, err := ws.boundMeta()
		if err != nil {
			return err
		}
		ws.w.StartLoads(m)
		if len(m.Loads) > 0 {
			ws.w.WaitReport(time.Duration(waitMS) * time.Millisecond) // in time or not: reported when they end
		}
		return nil
	})
}
