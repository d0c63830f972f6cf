package ipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
)

// presentPages counts the pages of mem that this process has mapped (bit 63
// of /proc/self/pagemap: a page-table entry is present). It is what
// populating is for: a present page takes no fault on the copy's write.
// (Whether an entry is writable is not visible there; the fallback's claim
// that a read fault of shmem maps the page writable is checked by counting
// minor faults in BenchmarkPopulate, not here.)
func presentPages(t testing.TB, mem []byte) (present, pages int) {
	t.Helper()
	f, err := os.Open("/proc/self/pagemap")
	assert.NilError(t, err)
	defer f.Close()
	pages = len(mem) / int(pageSize)
	buf := make([]byte, 8*pages)
	start := uintptr(unsafe.Pointer(unsafe.SliceData(mem))) / uintptr(pageSize)
	_, err = f.ReadAt(buf, int64(start)*8)
	assert.NilError(t, err)
	for i := range pages {
		if binary.LittleEndian.Uint64(buf[8*i:])&(1<<63) != 0 {
			present++
		}
	}
	return present, pages
}

// Every mode on the same server segment (written by the server first, as
// its fallocate or objects would have): auto populates through the kernel,
// "read" (KVSHIM_POPULATE forces the fallback) by reading, off not at all;
// none changes a byte; a segment announced after the dial is populated too.
func TestPopulateModes(t *testing.T) {
	for _, tc := range []struct {
		name, env    string
		want         PopulateMode
		kernel, read uint64 // segments each way
	}{
		{"auto", "", PopulateAuto, 2, 0},
		{"forced_fallback", "read", PopulateRead, 0, 2},
		{"env_off", "off", PopulateOff, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(PopulateEnv, tc.env)
			ts := startServer(t, nil)
			seg1, _ := ts.l.Segments().Get(1)
			for i := range seg1.Mem() {
				seg1.Mem()[i] = byte(i * 31)
			}
			before := PopulateCounters()
			c, err := DialConfig(ts.path, Hello{Role: RoleWorker}, 5*time.Second, &ClientConfig{Logger: quietLog, Populate: PopulateAuto})
			assert.NilError(t, err)
			defer c.Close()
			assert.Equal(t, c.PopulateMode(), tc.want)
			seg2, err := CreateSegment(2, 1<<20)
			assert.NilError(t, err)
			assert.NilError(t, ts.l.AddSegment(seg2))
			testkit.Eventually(t, 5*time.Second, "the second segment to be announced", func() bool { return c.Segments().Len() >= 2 })
			assert.Equal(t, c.Segments().Len(), 2)
			assert.NilError(t, c.WaitPopulated(5*time.Second))
			after := PopulateCounters()
			assert.Equal(t, after.Kernel-before.Kernel, tc.kernel)
			assert.Equal(t, after.Read-before.Read, tc.read)
			for _, s := range c.Segments().Segments() {
				present, pages := presentPages(t, s.Mem())
				if tc.want == PopulateOff {
					assert.Equal(t, present, 0, "segment %d", s.ID())
				} else {
					assert.Equal(t, present, pages, "segment %d", s.ID())
				}
			}
			mine, _ := c.Segments().Get(1)
			for i, b := range mine.Mem() {
				if b != byte(i*31) {
					t.Fatalf("byte %d changed: %d", i, b)
				}
			}
		})
	}
}

// A client that asks for nothing populates nothing, whatever the
// environment says; a bad environment value is the dial's error.
func TestPopulateConfig(t *testing.T) {
	ts := startServer(t, nil)
	t.Setenv(PopulateEnv, "auto")
	c := dialTest(t, ts.path)
	assert.Equal(t, c.PopulateMode(), PopulateOff)
	assert.NilError(t, c.WaitPopulated(time.Millisecond))
	t.Setenv(PopulateEnv, "sometimes")
	_, err := DialConfig(ts.path, Hello{Role: RoleWorker}, 5*time.Second, &ClientConfig{Logger: quietLog, Populate: PopulateAuto})
	assert.Assert(t, errors.Is(err, ErrConfig), "%v", err)
	for _, s := range []string{"auto", "read", "off"} {
		m, err := ParsePopulateMode(s)
		assert.NilError(t, err)
		assert.Equal(t, m.String(), s)
	}
}

// A segment mapped by a second process (a worker beside the server) is
// populated in that process.
func TestTwoProcessPopulate(t *testing.T) {
	ts := startServer(t, nil)
	for _, mode := range []string{"", "read"} {
		cmd := child(t, "populate", "KVSHIM_SOCK="+ts.path, PopulateEnv+"="+mode)
		out, err := cmd.CombinedOutput()
		assert.NilError(t, err, "%s", out)
		assert.Assert(t, strings.Contains(string(out), "populated 1 segments"), "%s", out)
	}
}

// runPopulateChild is the child of TestTwoProcessPopulate.
func runPopulateChild() error {
	c, err := DialConfig(os.Getenv("KVSHIM_SOCK"), Hello{Role: RoleWorker}, 5*time.Second, &ClientConfig{Populate: PopulateAuto})
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.WaitPopulated(5 * time.Second); err != nil {
		return err
	}
	n := 0
	for _, s := range c.Segments().Segments() {
		present, pages := presentPages(panicTB{}, s.Mem())
		if present != pages {
			return fmt.Errorf("segment %d: %d of %d pages present", s.ID(), present, pages)
		}
		n++
	}
	fmt.Printf("populated %d segments\n", n)
	return nil
}

// panicTB lets a child process use the test helpers: a failure panics
// (exit status 2, the message on stderr).
type panicTB struct{ testing.TB }

func (panicTB) Helper() {}
func (panicTB) Fatalf(f string, a ...any) {
	panic(fmt.Sprintf(f, a...))
}
func (panicTB) FailNow()                  { panic("failed") }
func (panicTB) Fail()                     { panic("failed") }
func (panicTB) Log(a ...any)              {}
func (panicTB) Errorf(f string, a ...any) { panic(fmt.Sprintf(f, a...)) }

// BenchmarkPopulate: the start-up cost of populating a second mapping of a
// segment whose pages the server allocated (fallocate, as the server's
// prefault does), per mode, and the minor faults a write to every page
// takes afterwards (what a save would pay):
//
//	go test -run '^$' -bench Populate -benchtime 3x ./ipc
func BenchmarkPopulate(b *testing.B) {
	const size = 256 << 20
	for _, mode := range []PopulateMode{PopulateAuto, PopulateRead, PopulateOff} {
		b.Run(mode.String(), func(b *testing.B) {
			var popNs, faults, writeNs float64
			for range b.N {
				srv, err := CreateSegment(1, size)
				assert.NilError(b, err)
				assert.NilError(b, unix.Fallocate(srv.Fd(), 0, 0, size))
				fd, err := unix.Dup(srv.Fd())
				assert.NilError(b, err)
				seg, err := MapSegment(1, fd, size)
				assert.NilError(b, err)
				t0 := time.Now()
				assert.NilError(b, seg.Populate(mode))
				popNs += float64(time.Since(t0))
				var ru0, ru1 unix.Rusage
				runtime.LockOSThread()
				unix.Getrusage(unix.RUSAGE_THREAD, &ru0)
				t0 = time.Now()
				mem := seg.Mem()
				for off := 0; off < len(mem); off += int(pageSize) {
					mem[off] = 1
				}
				writeNs += float64(time.Since(t0))
				unix.Getrusage(unix.RUSAGE_THREAD, &ru1)
				runtime.UnlockOSThread()
				faults += float64(ru1.Minflt - ru0.Minflt)
				seg.Close()
				srv.Close()
			}
			n := float64(b.N)
			b.ReportMetric(popNs/n/1e6*float64(1<<30)/size, "populate_ms/GiB")
			b.ReportMetric(writeNs/n/1e6*float64(1<<30)/size, "write_ms/GiB")
			b.ReportMetric(faults/n*float64(32<<20)/size, "faults/32MiB")
		})
	}
}
