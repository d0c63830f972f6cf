package cuda

import (
	"errors"
	"os"
	"testing"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

// skipIfNotSupported skips a test that needs a CUDA driver and device.
func skipIfNotSupported(t *testing.T, err error) {
	t.Helper()
	if errors.Is(err, ErrNotSupported) {
		t.Skipf("no CUDA: %v", err)
	}
	assert.NilError(t, err)
}

func TestInitWithoutDriver(t *testing.T) {
	err := Init()
	if err == nil {
		t.Skip("this machine has a CUDA driver")
	}
	assert.ErrorIs(t, err, ErrNotSupported)
	if os.Getenv("KVSHIM_LIBCUDA") == "" {
		assert.Check(t, is.ErrorContains(err, "cuda: not supported: load libcuda.so.1: libcuda.so.1: cannot open shared object file"))
	}
	_, err = Info()
	assert.ErrorIs(t, err, ErrNotSupported)
	_, err = NewDeviceEngine(0)
	assert.ErrorIs(t, err, ErrNotSupported)
}

func TestOpenDriverErrors(t *testing.T) {
	_, err := openDriver("/nonexistent/libcuda.so.1")
	assert.ErrorIs(t, err, ErrNotSupported)
	assert.Check(t, is.ErrorContains(err, "load /nonexistent/libcuda.so.1: /nonexistent/libcuda.so.1: cannot open"))

	// A real library without the CUDA symbols: the required-symbol check.
	_, err = openDriver("libc.so.6")
	assert.ErrorIs(t, err, ErrNotSupported)
	assert.Check(t, is.ErrorContains(err, "missing required symbol cuInit"))
}

func TestDriverError(t *testing.T) {
	tests := []struct {
		code         int
		notSupported bool
	}{
		{cudaErrorNoDevice, true}, {cudaErrorStubLibrary, true}, {cudaErrorInsufficient, true},
		{cudaErrorNotSupported, true}, {cudaErrorInvalidDevice, true}, {1, false}, {700, false},
	}
	for _, tc := range tests {
		var err error = &DriverError{Op: "cuMemcpyBatchAsync_v2(save, 64 spans)", Code: tc.code, Name: "CUDA_ERROR_X"}
		assert.Equal(t, errors.Is(err, ErrNotSupported), tc.notSupported, "code %d", tc.code)
		var de *DriverError
		assert.Assert(t, errors.As(err, &de))
		assert.Equal(t, err.Error(), "cuda: cuMemcpyBatchAsync_v2(save, 64 spans): CUDA_ERROR_X ("+itoa(tc.code)+")")
	}
}

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	s := ""
	for ; n > 0; n /= 10 {
		s = string(rune('0'+n%10)) + s
	}
	return s
}
