package main

import (
	"context"
	"errors"
	"os"
	"sync"
)

// Return codes; kvshim.h declares the same values.
const (
	codeOK       = 0
	codeInval    = -1  // bad argument (null pointer, malformed JSON, bad geometry)
	codeBadH     = -2  // unknown or closed handle
	codePanic    = -3  // a panic inside the library, recovered
	codeRange    = -4  // caller's buffer too small; output truncated
	codeNotSup   = -5  // not supported here (e.g. no CUDA driver)
	codeTimedOut = -6  // a wait ran past its timeout
	codeIO       = -7  // the server or a peer failed
	codeNoSpace  = -8  // the cache is full
	codeClosed   = -9  // the handle or its connection is shutting down
	codeInternal = -10 // anything else
)

// Sentinel errors that map to codes; packages wrap them with %w.
var (
	errInvalid   = errors.New("invalid argument")
	errBadHandle = errors.New("unknown or closed handle")
	errRange     = errors.New("buffer too small")
)

// codeOf maps an error to its return code.
func codeOf(err error) int {
	switch {
	case err == nil:
		return codeOK
	case errors.Is(err, errInvalid):
		return codeInval
	case errors.Is(err, errBadHandle):
		return codeBadH
	case errors.Is(err, errRange):
		return codeRange
	case errors.Is(err, errors.ErrUnsupported):
		return codeNotSup
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, context.DeadlineExceeded):
		return codeTimedOut
	case errors.Is(err, os.ErrClosed):
		return codeClosed
	}
	for _, m := range codeMappers {
		if c := m(err); c != 0 {
			return c
		}
	}
	return codeInternal
}

// codeMappers let other files map package sentinels to codes without this
// file importing every package.
var codeMappers []func(error) int

// globalErr is the last error of calls made without a valid handle
// (kvshim_open failures, unknown handles), read with handle 0.
var globalErr struct {
	mu  sync.Mutex
	msg string
}

func setGlobalErr(err error) {
	globalErr.mu.Lock()
	globalErr.msg = err.Error()
	globalErr.mu.Unlock()
}

// fail records err for handle h (or globally) and returns its code.
func fail(h int64, err error) int {
	if inst := handles.get(h); inst != nil {
		inst.setErr(err)
	} else {
		setGlobalErr(err)
	}
	return codeOf(err)
}
