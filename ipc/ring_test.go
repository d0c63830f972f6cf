package ipc

import (
	"bytes"
	"encoding/binary"
	"errors"
	"sync"
	"testing"
	"time"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

func newTestRing(t testing.TB, capacity uint64, opts RingOptions) (*Ring, *Ring) {
	t.Helper()
	seg, err := CreateSegment(1, RingSize(capacity))
	assert.NilError(t, err)
	t.Cleanup(func() { seg.Close() })
	w, err := InitRing(seg.Mem(), capacity, opts)
	assert.NilError(t, err)
	r, err := AttachRing(seg.Mem(), opts)
	assert.NilError(t, err)
	return w, r
}

func soon(d time.Duration) time.Time { return time.Now().Add(d) }

func payloadFor(seq, n int) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(seq*7 + i)
	}
	if n >= 4 {
		binary.LittleEndian.PutUint32(p, uint32(seq))
	}
	return p
}

// Every payload size 0..300 through a small ring, many laps, so every wrap
// position and padding length occurs.
func TestRingWrapEverySize(t *testing.T) {
	w, r := newTestRing(t, 1024, RingOptions{Spin: -1})
	seq := 0
	for lap := 0; lap < 3; lap++ {
		for n := 0; n <= 300; n++ {
			want := payloadFor(seq, n)
			assert.NilError(t, w.Write(RecordFrame, want[:n/2], want[n/2:], soon(time.Second)))
			typ, got, err := r.Read(soon(time.Second))
			assert.NilError(t, err)
			assert.Equal(t, typ, RecordFrame)
			assert.Assert(t, bytes.Equal(got, want), "size %d seq %d", n, seq)
			r.Release()
			seq++
		}
	}
	// All consumed space is zero again.
	assert.Assert(t, bytes.Equal(r.data, make([]byte, len(r.data))))
}

// Producer and consumer goroutines stream records of varying size; the
// consumer checks order and content. Run with -race.
func TestRingTwoGoroutines(t *testing.T) {
	for _, spin := range []time.Duration{-1, 20 * time.Microsecond} {
		w, r := newTestRing(t, 4096, RingOptions{Spin: spin})
		const n = 20000
		var wg sync.WaitGroup
		defer func() { w.Interrupt(ErrClosed); wg.Wait() }() // before the mapping goes
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < n; i++ {
				if err := w.Write(RecordFrame, payloadFor(i, 4+i%600), nil, soon(5*time.Second)); err != nil {
					t.Errorf("write %d: %v", i, err)
					return
				}
			}
		}()
		for i := 0; i < n; i++ {
			_, got, err := r.Read(soon(5 * time.Second))
			assert.NilError(t, err)
			assert.Assert(t, bytes.Equal(got, payloadFor(i, 4+i%600)), "record %d", i)
			r.Release()
		}
		wg.Wait()
	}
}

func TestRingFullTimesOut(t *testing.T) {
	w, r := newTestRing(t, 1024, RingOptions{Spin: -1})
	var err error
	for err == nil {
		err = w.Write(RecordFrame, make([]byte, 100), nil, soon(20*time.Millisecond))
	}
	assert.Assert(t, errors.Is(err, ErrRingFull), "%v", err)
	assert.ErrorContains(t, err, "free")
	// Nothing was half-written: the reader sees only whole records.
	cnt := 0
	for {
		_, p, err := r.Read(soon(10 * time.Millisecond))
		if errors.Is(err, ErrTimeout) {
			break
		}
		assert.NilError(t, err)
		assert.Equal(t, len(p), 100)
		r.Release()
		cnt++
	}
	assert.Equal(t, cnt, 1024/112)
	// Space freed: writing works again.
	assert.NilError(t, w.Write(RecordFrame, make([]byte, 100), nil, soon(time.Second)))
}

// A blocked producer is woken by the consumer's release (futex path).
func TestRingFullUnblocks(t *testing.T) {
	w, r := newTestRing(t, 1024, RingOptions{Spin: -1})
	for w.Write(RecordFrame, make([]byte, 200), nil, soon(time.Millisecond)) == nil {
	}
	done := make(chan error, 1)
	go func() { done <- w.Write(RecordFrame, make([]byte, 200), nil, soon(5*time.Second)) }()
	time.Sleep(20 * time.Millisecond)
	_, _, err := r.Read(soon(time.Second))
	assert.NilError(t, err)
	r.Release()
	select {
	case err := <-done:
		assert.NilError(t, err)
	case <-time.After(2 * time.Second):
		t.Fatal("producer not woken")
	}
}

func TestRingWaitTimeouts(t *testing.T) {
	for _, tc := range []struct {
		name string
		spin time.Duration
	}{{"futex", -1}, {"spin-then-futex", time.Millisecond}} {
		t.Run(tc.name, func(t *testing.T) {
			_, r := newTestRing(t, 1024, RingOptions{Spin: tc.spin, WaitSlice: 5 * time.Millisecond})
			start := time.Now()
			_, _, err := r.Read(soon(30 * time.Millisecond))
			el := time.Since(start)
			assert.Assert(t, errors.Is(err, ErrTimeout), "%v", err)
			assert.Assert(t, el >= 30*time.Millisecond && el < 500*time.Millisecond, "waited %v", el)
		})
	}
}

// A sleeping reader is woken by a commit well before its wait slice ends.
func TestRingWakeup(t *testing.T) {
	w, r := newTestRing(t, 1024, RingOptions{Spin: -1, WaitSlice: 10 * time.Second})
	got := make(chan time.Duration, 1)
	go func() {
		start := time.Now()
		_, _, err := r.Read(soon(20 * time.Second))
		if err == nil {
			r.Release()
		}
		got <- time.Since(start)
	}()
	time.Sleep(30 * time.Millisecond)
	assert.NilError(t, w.Write(RecordFrame, []byte("x"), nil, soon(time.Second)))
	select {
	case d := <-got:
		assert.Assert(t, d < 2*time.Second, "%v", d)
	case <-time.After(5 * time.Second):
		t.Fatal("lost wakeup")
	}
}

func TestRingStalledWriter(t *testing.T) {
	w, r := newTestRing(t, 1024, RingOptions{Spin: -1, StallTimeout: 50 * time.Millisecond, WaitSlice: 10 * time.Millisecond})
	assert.NilError(t, w.Write(RecordFrame, []byte("ok"), nil, soon(time.Second)))
	_, err := w.Claim(RecordFrame, 40, soon(time.Second)) // never committed: writer "died"
	assert.NilError(t, err)
	_, p, err := r.Read(soon(time.Second))
	assert.NilError(t, err)
	assert.Equal(t, string(p), "ok")
	r.Release()
	start := time.Now()
	_, _, err = r.Read(soon(5 * time.Second))
	assert.Assert(t, errors.Is(err, ErrPeerStalled), "%v", err)
	assert.Assert(t, time.Since(start) < 2*time.Second)
}

func TestRingAbortAndInterrupt(t *testing.T) {
	w, r := newTestRing(t, 1024, RingOptions{Spin: -1})
	_, err := w.Claim(RecordFrame, 10, soon(time.Second))
	assert.NilError(t, err)
	w.Abort()
	assert.NilError(t, w.Write(RecordFrame, []byte("after"), nil, soon(time.Second)))
	_, p, err := r.Read(soon(time.Second))
	assert.NilError(t, err)
	assert.Equal(t, string(p), "after")
	r.Release()

	go func() { time.Sleep(20 * time.Millisecond); r.Interrupt(ErrPeerGone) }()
	_, _, err = r.Read(soon(10 * time.Second))
	assert.Assert(t, errors.Is(err, ErrPeerGone), "%v", err)

	w2, r2 := newTestRing(t, 1024, RingOptions{Spin: -1})
	w2.Shutdown()
	_, _, err = r2.Read(soon(time.Second))
	assert.Assert(t, errors.Is(err, ErrPeerGone), "%v", err)
}

func TestRingTooLarge(t *testing.T) {
	w, _ := newTestRing(t, 1024, RingOptions{})
	assert.Equal(t, w.MaxPayload(), 504)
	assert.NilError(t, w.Write(RecordFrame, make([]byte, 504), nil, soon(time.Second)))
	err := w.Write(RecordFrame, make([]byte, 505), nil, soon(time.Second))
	assert.Assert(t, errors.Is(err, ErrTooLarge), "%v", err)
}

func TestAttachRingRejects(t *testing.T) {
	mk := func(mut func(m []byte)) error {
		m := make([]byte, RingSize(1024))
		_, err := InitRing(m, 1024, RingOptions{})
		assert.NilError(t, err)
		mut(m)
		_, err = AttachRing(m, RingOptions{})
		return err
	}
	for _, tc := range []struct {
		name string
		mut  func(m []byte)
		want error
	}{
		{"ok", func([]byte) {}, nil},
		{"magic", func(m []byte) { m[0] ^= 1 }, ErrCorrupt},
		{"version", func(m []byte) { m[hVersion] = 9 }, ErrVersion},
		{"capacity", func(m []byte) { binary.LittleEndian.PutUint64(m[hCapacity:], 1000) }, ErrCorrupt},
		{"too big", func(m []byte) { binary.LittleEndian.PutUint64(m[hCapacity:], 4096) }, ErrCorrupt},
		{"counter offset", func(m []byte) { binary.LittleEndian.PutUint32(m[hHeadOff:], 5000) }, ErrCorrupt},
		{"head after tail", func(m []byte) { binary.LittleEndian.PutUint64(m[offHead:], 64) }, ErrCorrupt},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := mk(tc.mut)
			if tc.want == nil {
				assert.NilError(t, err)
				return
			}
			assert.Assert(t, errors.Is(err, tc.want), "%v", err)
		})
	}
	_, err := InitRing(make([]byte, 8192), 1000, RingOptions{})
	assert.Assert(t, is.ErrorContains(err, "power of two"))
}

// Garbage in the data region and counters never panics: Read returns a
// record, a timeout, or an error.
func FuzzRingRead(f *testing.F) {
	f.Add([]byte{}, uint64(0), uint64(0))
	f.Add([]byte{16, 0, 0, 0, 1, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8}, uint64(16), uint64(0))
	f.Add([]byte{0xf0, 0xff, 0xff, 0xff, 1, 0, 0, 0}, uint64(8), uint64(0))
	f.Add([]byte{0, 4, 0, 0, 0xff, 0xff, 0xff, 0xff}, uint64(1024), uint64(0))
	f.Add([]byte{8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 8, 0, 0, 0, 1, 0, 0, 0}, uint64(99), uint64(8))
	f.Fuzz(func(t *testing.T, garbage []byte, tail, head uint64) {
		m := make([]byte, RingSize(1024))
		_, err := InitRing(m, 1024, RingOptions{})
		if err != nil {
			t.Fatal(err)
		}
		copy(m[RingHeaderSize:], garbage)
		binary.LittleEndian.PutUint64(m[offTail:], tail)
		binary.LittleEndian.PutUint64(m[offHead:], head&^7)
		r, err := AttachRing(m, RingOptions{Spin: -1, StallTimeout: time.Millisecond, WaitSlice: time.Millisecond})
		if err != nil {
			return
		}
		for i := 0; i < 8; i++ {
			_, p, err := r.Read(time.Now().Add(2 * time.Millisecond))
			if err != nil {
				return
			}
			_ = len(p)
			r.Release()
		}
		// The producer side must not panic on a lying head either.
		_ = r.Write(RecordFrame, []byte("x"), nil, time.Now().Add(time.Millisecond))
	})
}

// A reader of an empty ring doubles its sleeps up to IdleSlice (an idle
// server wakes rarely), and a record published meanwhile is still read at
// once: the publisher wakes the sleeper whatever the slice.
func TestRingIdleReaderBacksOff(t *testing.T) {
	w, r := newTestRing(t, 4096, RingOptions{Spin: -1, WaitSlice: 2 * time.Millisecond, IdleSlice: 2 * time.Second})
	_, _, err := r.Read(soon(400 * time.Millisecond))
	assert.ErrorIs(t, err, ErrTimeout)
	// 2+4+...+256 ms: 8 sleeps; 200 at a fixed 2 ms.
	assert.Assert(t, r.sleeps.Load() <= 20, "%d sleeps in 400 ms", r.sleeps.Load())

	got := make(chan time.Duration, 1)
	go func() {
		_, _, err := r.Read(soon(5 * time.Second))
		assert.Check(t, err)
		got <- 0
	}()
	time.Sleep(1200 * time.Millisecond) // the reader is in a 1 s slice by now
	buf, err := w.Claim(RecordFrame, 8, soon(time.Second))
	assert.NilError(t, err)
	copy(buf, "abcdefgh")
	start := time.Now()
	w.Commit()
	select {
	case <-got:
		assert.Assert(t, time.Since(start) < 300*time.Millisecond, "read %v after the publish: not woken", time.Since(start))
	case <-time.After(5 * time.Second):
		t.Fatal("record not read")
	}
}
