package cuda

import (
	"errors"
	"fmt"
)

var (
	// ErrNotSupported means there is no usable CUDA driver or device here.
	// The host engine works regardless.
	ErrNotSupported = errors.New("cuda: not supported")
	// ErrClosed is returned by an engine used after Close.
	ErrClosed = errors.New("cuda: engine closed")
	// ErrTimeout is returned by Job.Wait when the copy is not done in time.
	ErrTimeout = errors.New("cuda: timeout")
	// ErrBadSpan reports a span or request the engine refuses before copying.
	ErrBadSpan = errors.New("cuda: bad copy request")
)

// CUresult values used by name in the Go code.
const (
	cudaSuccess             = 0
	cudaErrorNotInitialized = 3
	cudaErrorStubLibrary    = 34
	cudaErrorInsufficient   = 35
	cudaErrorNoDevice       = 100
	cudaErrorInvalidDevice  = 101
	cudaErrorNotReady       = 600
	cudaErrorAlreadyHostReg = 712
	cudaErrorNotSupported   = 801
)

// DriverError is a failed CUDA driver call: the operation, the CUresult and
// the driver's name for it (cuGetErrorName).
type DriverError struct {
	Op   string
	Code int
	Name string
}

func (e *DriverError) Error() string {
	return fmt.Sprintf("cuda: %s: %s (%d)", e.Op, e.Name, e.Code)
}

// Is makes errors.Is(err, ErrNotSupported) true for results that mean
// "no usable driver or device" (no device, stub library, driver too old,
// not supported).
func (e *DriverError) Is(target error) bool {
	if target != ErrNotSupported {
		return false
	}
	switch e.Code {
	case cudaErrorStubLibrary, cudaErrorInsufficient, cudaErrorNoDevice, cudaErrorInvalidDevice, cudaErrorNotSupported:
		return true
	}
	return false
}
