package hostproc

import (
	"os"
	"sync"
)

// Tail keeps the last Max bytes of a child's stderr (copying all of it to
// File when set) so that an error names what the child said before dying.
type Tail struct {
	Max   int      // bytes kept
	Label string   // the suffix's lead: "host stderr", "helper stderr"
	File  *os.File // optional full copy

	mu  sync.Mutex
	buf []byte
}

// suffixMax bounds the stderr an error message carries.
const suffixMax = 600

func (t *Tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.File != nil {
		_, _ = t.File.Write(p)
	}
	t.buf = append(t.buf, p...)
	if len(t.buf) > t.Max {
		t.buf = append(t.buf[:0], t.buf[len(t.buf)-t.Max:]...)
	}
	return len(p), nil
}

// Suffix is "; <Label>: <last bytes>" for an error message, "" when the
// child wrote nothing.
func (t *Tail) Suffix() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := string(t.buf)
	if len(s) > suffixMax {
		s = s[len(s)-suffixMax:]
	}
	if s == "" {
		return ""
	}
	return "; " + t.Label + ": " + s
}
