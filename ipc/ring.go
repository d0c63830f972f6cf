package ipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Ring layout constants; see doc.go for the diagram.
const (
	RingMagic       uint64 = 0x31474e4952534b56 // "VKSRING1" little-endian
	RingVersion     uint32 = 1
	RingHeaderSize         = 4096 // header page, data region follows
	slotSize               = 128  // every shared counter owns two cache lines
	recordHeaderLen        = 8    // int32 length | int32 type
	recordAlign            = 8

	// MinRingCapacity and MaxRingCapacity bound the data region.
	MinRingCapacity = 1 << 10
	MaxRingCapacity = 1 << 30

	// RecordPadding is the type of the filler record at the wrap.
	RecordPadding int32 = -1
	// RecordFrame is the type of a codec frame (FrameHeader + body).
	RecordFrame int32 = 1
)

// Header field offsets inside slot 0 (all little-endian).
const (
	hMagic       = 0  // u64
	hVersion     = 8  // u32
	hHeaderSize  = 12 // u32
	hCapacity    = 16 // u64
	hDataOff     = 24 // u64
	hTailOff     = 32 // u32 offsets of the counter slots from the ring start
	hHeadOff     = 36
	hConsWaitOff = 40
	hProdWaitOff = 44
	hProdBeatOff = 48
	hConsBeatOff = 52
	hClosedOff   = 56
	hMaxRecord   = 60 // u32
	hProdPid     = 64 // u32
	hConsPid     = 68 // u32
)

// Standard counter slot offsets written by InitRing.
const (
	offTail     = 1 * slotSize
	offHead     = 2 * slotSize
	offConsWait = 3 * slotSize
	offProdWait = 4 * slotSize
	offProdBeat = 5 * slotSize
	offConsBeat = 6 * slotSize
	offClosed   = 7 * slotSize
)

// RingOptions tune waiting. Zero values take the defaults.
type RingOptions struct {
	// Spin is how long a waiter busy-polls before sleeping on the futex.
	// 0 means the default (DefaultSpin); a negative value disables spinning.
	Spin time.Duration
	// StallTimeout: how long an in-progress record may sit unchanged at the
	// head before the reader gives up with ErrPeerStalled.
	StallTimeout time.Duration
	// WaitSlice bounds every futex sleep; the waiter re-checks the ring,
	// stall and close state after each slice.
	WaitSlice time.Duration
	// IdleSlice: a reader whose ring stays empty doubles its sleeps from
	// WaitSlice up to this (0: 8 x WaitSlice). Wake-ups never depend on the
	// slice (a publisher wakes a sleeper); it is the re-check of the close
	// state, which Interrupt also wakes.
	IdleSlice time.Duration
}

// Defaults for RingOptions.
const (
	DefaultSpin         = 50 * time.Microsecond
	DefaultStallTimeout = 2 * time.Second
	DefaultWaitSlice    = 250 * time.Millisecond
)

func (o RingOptions) withDefaults() RingOptions {
	if o.Spin == 0 {
		o.Spin = DefaultSpin
	}
	if o.Spin < 0 {
		o.Spin = 0
	}
	if o.StallTimeout <= 0 {
		o.StallTimeout = DefaultStallTimeout
	}
	if o.WaitSlice <= 0 {
		o.WaitSlice = DefaultWaitSlice
	}
	if o.IdleSlice <= 0 {
		o.IdleSlice = 8 * o.WaitSlice
	}
	o.IdleSlice = max(o.IdleSlice, o.WaitSlice)
	return o
}

// RingSize is the mapping size of one ring with this data capacity.
func RingSize(capacity uint64) uint64 { return RingHeaderSize + capacity }

// Ring is one SPSC byte ring in shared memory. One goroutine (at a time)
// may act as producer (Claim/Commit/Write) and one as consumer
// (Read/Release); the two sides may be in different processes.
type Ring struct {
	mem  []byte
	data []byte
	cap  uint64
	mask uint64
	max  uint64 // max aligned record length

	tail, head         *atomic.Uint64
	consWait, prodWait *atomic.Uint32
	prodBeat, consBeat *atomic.Uint64
	closed             *atomic.Uint32

	opts RingOptions
	intr atomic.Pointer[error] // set by Interrupt: waits return it

	// producer-local state
	ptail    uint64
	claimIdx uint64
	claimLen uint64 // unaligned record length; 0 = no claim open

	// consumer-local state
	chead       uint64
	readLen     uint64 // aligned length of the record handed out by Read
	stallPos    uint64
	stallVal    int32
	stallSince  time.Time
	stallChecks uint32
	spinning    bool          // set by wait during its spin phase (consumer only)
	sleeps      atomic.Uint64 // futex sleeps of wait (tests: the idle back-off)
}

func isPow2(x uint64) bool { return x != 0 && x&(x-1) == 0 }

// InitRing formats mem (at least RingSize(capacity) bytes, zeroed, 8-byte
// aligned, e.g. a fresh segment) as an empty ring and returns a view of it.
func InitRing(mem []byte, capacity uint64, opts RingOptions) (*Ring, error) {
	if !isPow2(capacity) || capacity < MinRingCapacity || capacity > MaxRingCapacity {
		return nil, fmt.Errorf("ipc: ring capacity %d must be a power of two in [%d, %d]", capacity, MinRingCapacity, MaxRingCapacity)
	}
	if uint64(len(mem)) < RingSize(capacity) {
		return nil, fmt.Errorf("ipc: ring mapping %d bytes, need %d", len(mem), RingSize(capacity))
	}
	h := mem[:slotSize]
	le := binary.LittleEndian
	le.PutUint32(h[hVersion:], RingVersion)
	le.PutUint32(h[hHeaderSize:], RingHeaderSize)
	le.PutUint64(h[hCapacity:], capacity)
	le.PutUint64(h[hDataOff:], RingHeaderSize)
	le.PutUint32(h[hTailOff:], offTail)
	le.PutUint32(h[hHeadOff:], offHead)
	le.PutUint32(h[hConsWaitOff:], offConsWait)
	le.PutUint32(h[hProdWaitOff:], offProdWait)
	le.PutUint32(h[hProdBeatOff:], offProdBeat)
	le.PutUint32(h[hConsBeatOff:], offConsBeat)
	le.PutUint32(h[hClosedOff:], offClosed)
	le.PutUint32(h[hMaxRecord:], uint32(capacity/2))
	// Magic last: a peer that sees it sees a complete header.
	(*atomic.Uint64)(unsafe.Pointer(&h[hMagic])).Store(RingMagic)
	return AttachRing(mem, opts)
}

// AttachRing validates the header at the start of mem and returns a view.
// Counter positions are taken from the shared head and tail.
func AttachRing(mem []byte, opts RingOptions) (*Ring, error) {
	if len(mem) < RingHeaderSize || uintptr(unsafe.Pointer(unsafe.SliceData(mem)))%8 != 0 {
		return nil, fmt.Errorf("%w: ring mapping too small or misaligned", ErrCorrupt)
	}
	le := binary.LittleEndian
	if m := (*atomic.Uint64)(unsafe.Pointer(&mem[hMagic])).Load(); m != RingMagic {
		return nil, fmt.Errorf("%w: bad magic %#x", ErrCorrupt, m)
	}
	if v := le.Uint32(mem[hVersion:]); v != RingVersion {
		return nil, fmt.Errorf("%w: ring version %d, want %d", ErrVersion, v, RingVersion)
	}
	capacity := le.Uint64(mem[hCapacity:])
	dataOff := le.Uint64(mem[hDataOff:])
	hs := uint64(le.Uint32(mem[hHeaderSize:]))
	if !isPow2(capacity) || capacity < MinRingCapacity || capacity > MaxRingCapacity ||
		hs < slotSize || hs > dataOff || dataOff%8 != 0 || dataOff > uint64(len(mem)) || uint64(len(mem))-dataOff < capacity {
		return nil, fmt.Errorf("%w: bad geometry cap=%d data=%d len=%d", ErrCorrupt, capacity, dataOff, len(mem))
	}
	slot := func(field int) (unsafe.Pointer, error) {
		off := uint64(le.Uint32(mem[field:]))
		if off < slotSize || off%8 != 0 || off+8 > hs {
			return nil, fmt.Errorf("%w: counter offset %d", ErrCorrupt, off)
		}
		return unsafe.Pointer(&mem[off]), nil
	}
	r := &Ring{mem: mem, data: mem[dataOff : dataOff+capacity : dataOff+capacity], cap: capacity, mask: capacity - 1, opts: opts.withDefaults()}
	r.max = min(uint64(le.Uint32(mem[hMaxRecord:])), capacity/2) &^ (recordAlign - 1)
	var ps [7]unsafe.Pointer
	for i, f := range []int{hTailOff, hHeadOff, hConsWaitOff, hProdWaitOff, hProdBeatOff, hConsBeatOff, hClosedOff} {
		p, err := slot(f)
		if err != nil {
			return nil, err
		}
		ps[i] = p
	}
	r.tail, r.head = (*atomic.Uint64)(ps[0]), (*atomic.Uint64)(ps[1])
	r.consWait, r.prodWait = (*atomic.Uint32)(ps[2]), (*atomic.Uint32)(ps[3])
	r.prodBeat, r.consBeat = (*atomic.Uint64)(ps[4]), (*atomic.Uint64)(ps[5])
	r.closed = (*atomic.Uint32)(ps[6])
	r.ptail = r.tail.Load()
	r.chead = r.head.Load()
	if r.ptail-r.chead > capacity || r.ptail%recordAlign != 0 || r.chead%recordAlign != 0 {
		return nil, fmt.Errorf("%w: head %d tail %d", ErrCorrupt, r.chead, r.ptail)
	}
	return r, nil
}

// Capacity is the data region size in bytes.
func (r *Ring) Capacity() uint64 { return r.cap }

// MaxPayload is the largest payload one record can carry.
func (r *Ring) MaxPayload() int { return int(r.max - recordHeaderLen) }

// SetPids records producer and consumer pids in the header (informational).
func (r *Ring) SetPids(producer, consumer int) {
	le := binary.LittleEndian
	le.PutUint32(r.mem[hProdPid:], uint32(producer))
	le.PutUint32(r.mem[hConsPid:], uint32(consumer))
}

// Interrupt makes every current and future wait on this view return err
// (wrapped), e.g. when the session's socket closed. It wakes local sleepers.
func (r *Ring) Interrupt(err error) {
	r.intr.CompareAndSwap(nil, &err)
	futexWakeAll(r.consWait)
	futexWakeAll(r.prodWait)
}

// Why a side shut a ring down: the shared closed word (0 while open), so
// the peer can say why its session ended.
const (
	shutClosed    uint32 = 1 // closed, or the peer's socket went
	shutHeartbeat uint32 = 2 // this side's heartbeat was older than the limit
	shutMalformed uint32 = 3 // this side sent something malformed
)

func shutCode(err error) uint32 {
	switch {
	case errors.Is(err, ErrNoHeartbeat):
		return shutHeartbeat
	case errors.Is(err, ErrMalformed), errors.Is(err, ErrCorrupt), errors.Is(err, ErrPeerStalled):
		return shutMalformed
	}
	return shutClosed
}

var shutText = map[uint32]string{
	shutClosed:    "the peer ended the session",
	shutHeartbeat: "the peer ended the session: no heartbeat from this side within its limit (was this process stalled?)",
	shutMalformed: "the peer ended the session: it read malformed or stalled records from this side",
}

// Shutdown marks the ring closed in shared memory (the peer's waits end with
// ErrPeerGone) and wakes both sides.
func (r *Ring) Shutdown() { r.shutdown(shutClosed) }

func (r *Ring) shutdown(code uint32) {
	r.closed.CompareAndSwap(0, code)
	futexWakeAll(r.consWait)
	futexWakeAll(r.prodWait)
}

// IsShutdown reports whether either side called Shutdown.
func (r *Ring) IsShutdown() bool { return r.closed.Load() != 0 }

func (r *Ring) interrupted() error {
	if p := r.intr.Load(); p != nil {
		return *p
	}
	if c := r.closed.Load(); c != 0 {
		why, ok := shutText[c]
		if !ok {
			why = fmt.Sprintf("ring shut down (code %d)", c)
		}
		return fmt.Errorf("%w: %s", ErrPeerGone, why)
	}
	return nil
}

// MonoNow is CLOCK_MONOTONIC in ns: comparable across processes on a host.
func MonoNow() uint64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return uint64(ts.Nano())
}

// BeatProducer / BeatConsumer store the caller's heartbeat (MonoNow).
func (r *Ring) BeatProducer() { r.prodBeat.Store(MonoNow()) }

// BeatConsumer stores the consumer's heartbeat.
func (r *Ring) BeatConsumer() { r.consBeat.Store(MonoNow()) }

// ProducerBeat and ConsumerBeat return the last heartbeats (0 = never).
func (r *Ring) ProducerBeat() uint64 { return r.prodBeat.Load() }

// ConsumerBeat returns the consumer's last heartbeat.
func (r *Ring) ConsumerBeat() uint64 { return r.consBeat.Load() }

func (r *Ring) len32(idx uint64) *atomic.Int32 {
	return (*atomic.Int32)(unsafe.Pointer(&r.data[idx]))
}

func align(n uint64) uint64 { return (n + recordAlign - 1) &^ (recordAlign - 1) }

// wait polls check (spinning first, then sleeping on word) until it reports
// done, fails, or the deadline passes (ErrTimeout). Every sleep is bounded by
// WaitSlice and followed by a re-check. word is set to 1 while sleeping; the
// other side clears it and wakes us after it publishes (see doc.go).
func (r *Ring) wait(word *atomic.Uint32, deadline time.Time, check func() (bool, error)) error {
	spinning := new(bool) // the consumer's checkStall reads r.spinning
	if word == r.consWait {
		spinning = &r.spinning
	}
	if r.opts.Spin > 0 {
		*spinning = true
		defer func() { *spinning = false }()
		start := time.Now()
		for i := 1; ; i++ {
			if ok, err := check(); ok || err != nil {
				return err
			}
			if i&63 == 0 {
				now := time.Now()
				if now.Sub(start) >= r.opts.Spin || !now.Before(deadline) {
					break
				}
				// Give the core away now and then (sched_yield, not
				// runtime.Gosched: a caller that came in from C runs on a
				// locked OS thread, where Gosched is a futex hand-off). When
				// the machine has fewer free cores than spinners, the peer we
				// wait for may need exactly this core.
				osYield()
			}
		}
	}
	*spinning = false
	slice := r.opts.WaitSlice
	for {
		if ok, err := check(); ok || err != nil {
			return err
		}
		if err := r.interrupted(); err != nil {
			return err
		}
		left := time.Until(deadline)
		if left <= 0 {
			return ErrTimeout
		}
		word.Store(1) // full fence (Go atomics are sequentially consistent)
		if ok, err := check(); ok || err != nil {
			word.Store(0)
			return err
		}
		r.sleeps.Add(1)
		futexWaitTimeout(word, 1, min(left, slice))
		word.Store(0)
		// An idle reader (empty ring, no record in progress: no stall to
		// time) sleeps longer and longer: fewer wake-ups of an idle server
		// (kvshim-bench-idle).
		if word == r.consWait && slice < r.opts.IdleSlice && r.len32(r.chead&r.mask).Load() == 0 {
			slice = min(2*slice, r.opts.IdleSlice)
		}
	}
}

// wake clears word and wakes the sleeper if one announced itself. Called
// after a publishing store; the atomic load orders after it.
func wake(word *atomic.Uint32) {
	if word.Load() != 0 && word.CompareAndSwap(1, 0) {
		futexWakeAll(word)
	}
}
