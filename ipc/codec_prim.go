package ipc

import (
	"encoding/binary"
	"fmt"
	"math"
)

// Primitive little-endian append/read helpers shared by every codec. The
// decoder is sticky: the first failure is kept, later reads return zeros,
// so message decoders read straight through and check err once.

var le = binary.LittleEndian

type dec struct {
	b    []byte
	off  int
	err  error
	what string
}

func newDec(what string, b []byte) *dec { return &dec{b: b, what: what} }

func (d *dec) fail(format string, a ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s: %s", ErrMalformed, d.what, fmt.Sprintf(format, a...))
	}
}

func (d *dec) take(n int) []byte {
	if d.err != nil {
		return nil
	}
	if n < 0 || n > len(d.b)-d.off {
		d.fail("need %d bytes at offset %d, have %d", n, d.off, len(d.b)-d.off)
		return nil
	}
	p := d.b[d.off : d.off+n]
	d.off += n
	return p
}

func (d *dec) u8() uint8 {
	if p := d.take(1); p != nil {
		return p[0]
	}
	return 0
}

func (d *dec) u16() uint16 {
	if p := d.take(2); p != nil {
		return le.Uint16(p)
	}
	return 0
}

func (d *dec) u32() uint32 {
	if p := d.take(4); p != nil {
		return le.Uint32(p)
	}
	return 0
}

func (d *dec) u64() uint64 {
	if p := d.take(8); p != nil {
		return le.Uint64(p)
	}
	return 0
}

func (d *dec) f64() float64 { return math.Float64frombits(d.u64()) }

func (d *dec) fixed(dst []byte) { copy(dst, d.take(len(dst))) }

// count reads a u32 element count and checks it against MaxKeys and the
// bytes left (each element needs at least minElem bytes) before the caller
// allocates anything.
func (d *dec) count(minElem int) int {
	n := d.u32()
	if d.err != nil {
		return 0
	}
	if n > MaxKeys {
		d.fail("count %d exceeds MaxKeys %d", n, MaxKeys)
		return 0
	}
	if uint64(n)*uint64(minElem) > uint64(len(d.b)-d.off) {
		d.fail("count %d × %d bytes exceeds remaining %d", n, minElem, len(d.b)-d.off)
		return 0
	}
	return int(n)
}

// done fails on trailing bytes and returns the sticky error.
func (d *dec) done() error {
	if d.err == nil && d.off != len(d.b) {
		d.fail("%d trailing bytes", len(d.b)-d.off)
	}
	return d.err
}

func putU16(b []byte, v uint16) []byte { return le.AppendUint16(b, v) }
func putU32(b []byte, v uint32) []byte { return le.AppendUint32(b, v) }
func putU64(b []byte, v uint64) []byte { return le.AppendUint64(b, v) }
func putF64(b []byte, v float64) []byte {
	return le.AppendUint64(b, math.Float64bits(v))
}

func encErr(what, format string, a ...any) error {
	return fmt.Errorf("%w: encode %s: %s", ErrMalformed, what, fmt.Sprintf(format, a...))
}

func checkCount(what string, n int) error {
	if n > MaxKeys {
		return encErr(what, "%d keys exceeds MaxKeys %d", n, MaxKeys)
	}
	return nil
}
