package ipc

import (
	"encoding/binary"
	"fmt"
	"time"
)

// Claim reserves a record of n payload bytes of type typ (≥ 1) and returns
// the payload slice inside the ring. The record stays invisible (negative
// length) until Commit; Abort turns it into padding. If the ring is full,
// Claim waits until the deadline and then returns ErrRingFull.
func (r *Ring) Claim(typ int32, n int, deadline time.Time) ([]byte, error) {
	if r.claimLen != 0 {
		return nil, fmt.Errorf("ipc: claim while a claim is open")
	}
	if typ < 1 || n < 0 {
		return nil, fmt.Errorf("ipc: claim type %d size %d", typ, n)
	}
	recLen := uint64(n) + recordHeaderLen
	aligned := align(recLen)
	if aligned > r.max {
		return nil, fmt.Errorf("%w: %d bytes, max %d", ErrTooLarge, n, r.MaxPayload())
	}
	var corrupt error
	fits := func() (bool, error) {
		head := r.head.Load()
		if head > r.ptail || r.ptail-head > r.cap || head%recordAlign != 0 {
			corrupt = fmt.Errorf("%w: head %d tail %d", ErrCorrupt, head, r.ptail)
			return false, corrupt
		}
		need := aligned
		if toEnd := r.cap - r.ptail&r.mask; aligned > toEnd {
			need += toEnd
		}
		return r.cap-(r.ptail-head) >= need, nil
	}
	if ok, err := fits(); !ok {
		if err == nil {
			err = r.wait(r.prodWait, deadline, fits)
		}
		switch {
		case err == ErrTimeout:
			return nil, fmt.Errorf("%w: %d bytes free of %d, need %d", ErrRingFull, r.cap-(r.ptail-r.head.Load()), r.cap, aligned)
		case err != nil:
			return nil, err
		}
	}
	idx := r.ptail & r.mask
	if toEnd := r.cap - idx; aligned > toEnd {
		// Filler to the end; committed at once, the reader skips it.
		// The tail moves first so that it never lags the reader's head.
		putI32(r.data[idx+4:], RecordPadding)
		r.ptail += toEnd
		r.tail.Store(r.ptail)
		r.len32(idx).Store(int32(toEnd))
		idx = 0
	}
	r.len32(idx).Store(-int32(recLen)) // in progress
	putI32(r.data[idx+4:], typ)
	r.ptail += aligned
	r.tail.Store(r.ptail)
	r.claimIdx, r.claimLen = idx, recLen
	return r.data[idx+recordHeaderLen : idx+recLen : idx+recLen], nil
}

// Commit publishes the claimed record with one release store and wakes the
// consumer if it sleeps.
func (r *Ring) Commit() {
	if r.claimLen == 0 {
		return
	}
	r.len32(r.claimIdx).Store(int32(r.claimLen))
	r.claimLen = 0
	wake(r.consWait)
}

// Abort turns the claimed record into padding (the reader skips it).
func (r *Ring) Abort() {
	if r.claimLen == 0 {
		return
	}
	putI32(r.data[r.claimIdx+4:], RecordPadding)
	r.len32(r.claimIdx).Store(int32(align(r.claimLen)))
	r.claimLen = 0
	wake(r.consWait)
}

// Write copies a and b (either may be empty) into one record and commits it.
func (r *Ring) Write(typ int32, a, b []byte, deadline time.Time) error {
	buf, err := r.Claim(typ, len(a)+len(b), deadline)
	if err != nil {
		return err
	}
	copy(buf[copy(buf, a):], b)
	r.Commit()
	return nil
}

// Read waits until a committed record is at the head and returns its type
// and payload. The payload aliases the ring: it is valid until Release,
// which must be called before the next Read. Padding is skipped. A record
// left in progress past StallTimeout returns ErrPeerStalled; an invalid
// record header returns ErrCorrupt (close the session then).
func (r *Ring) Read(deadline time.Time) (typ int32, payload []byte, err error) {
	if r.readLen != 0 {
		return 0, nil, fmt.Errorf("ipc: read before release")
	}
	for {
		var l int32
		ready := func() (bool, error) {
			l = r.len32(r.chead & r.mask).Load()
			if l > 0 {
				return true, nil
			}
			return false, r.checkStall(l)
		}
		if ok, err := ready(); !ok {
			if err == nil {
				err = r.wait(r.consWait, deadline, ready)
			}
			if err != nil {
				return 0, nil, err
			}
		}
		r.stallSince = time.Time{}
		idx := r.chead & r.mask
		rl := uint64(l)
		al := align(rl)
		if rl < recordHeaderLen || al > r.cap-idx {
			return 0, nil, fmt.Errorf("%w: record length %d at %d", ErrCorrupt, l, idx)
		}
		typ = int32(binary.LittleEndian.Uint32(r.data[idx+4:]))
		if typ == RecordPadding {
			if rl != al {
				return 0, nil, fmt.Errorf("%w: padding length %d at %d", ErrCorrupt, l, idx)
			}
			r.readLen = al
			r.Release()
			continue
		}
		if typ < 1 || al > r.max {
			return 0, nil, fmt.Errorf("%w: record type %d length %d at %d", ErrCorrupt, typ, l, idx)
		}
		r.readLen = al
		return typ, r.data[idx+recordHeaderLen : idx+rl : idx+rl], nil
	}
}

// Release zeroes the record returned by Read, advances the head, and wakes
// a producer blocked on a full ring.
func (r *Ring) Release() {
	if r.readLen == 0 {
		return
	}
	idx := r.chead & r.mask
	clear(r.data[idx+4 : idx+r.readLen])
	r.len32(idx).Store(0)
	r.chead += r.readLen
	r.readLen = 0
	r.head.Store(r.chead)
	wake(r.prodWait)
}

// checkStall tracks an unpublished record at the head (negative length, or
// zero while the tail says something was claimed) and fails once it has not
// changed for StallTimeout.
func (r *Ring) checkStall(l int32) error {
	if l == 0 {
		t := r.tail.Load()
		if t == r.chead {
			r.stallSince = time.Time{}
			return nil
		}
		if t < r.chead || t-r.chead > r.cap {
			return fmt.Errorf("%w: tail %d head %d", ErrCorrupt, t, r.chead)
		}
	} else if uint64(-int64(l)) < recordHeaderLen || align(uint64(-int64(l))) > r.cap-r.chead&r.mask {
		return fmt.Errorf("%w: in-progress length %d", ErrCorrupt, l)
	}
	if r.stallSince.IsZero() || r.stallPos != r.chead || r.stallVal != l {
		r.stallPos, r.stallVal, r.stallSince, r.stallChecks = r.chead, l, time.Now(), 0
		return nil
	}
	// Same record, same length: look at the clock only now and then, so a
	// spinning reader stays cheap while a live writer fills the record.
	if r.stallChecks++; r.spinning && r.stallChecks&255 != 0 {
		return nil
	}
	now := time.Now()
	if now.Sub(r.stallSince) > r.opts.StallTimeout {
		return fmt.Errorf("%w: record at %d stuck at length %d for %v", ErrPeerStalled, r.chead, l, now.Sub(r.stallSince).Round(time.Millisecond))
	}
	return nil
}

// Pending reports whether a committed record is ready at the head.
func (r *Ring) Pending() bool { return r.len32(r.chead&r.mask).Load() > 0 }

func putI32(b []byte, v int32) { binary.LittleEndian.PutUint32(b, uint32(v)) }
