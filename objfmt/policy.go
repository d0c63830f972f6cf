package objfmt

import "fmt"

// VerifyPolicy says where payload CRCs are computed and checked (the
// kvshim.verify setting; see the package documentation). The zero value is
// VerifyL2, the default.
type VerifyPolicy uint8

const (
	// VerifyL2 checks payloads where corruption can enter: the L2 store
	// computes each object's payload CRC before it writes it, and an L2
	// fill serves only objects whose payload CRC is set and matches.
	// Workers seal headers only and check headers only (128 bytes a
	// chunk), with no pass over the payload.
	VerifyL2 VerifyPolicy = iota
	// VerifyAlways is VerifyL2 plus a payload pass on the worker: saves
	// compute the payload CRC when they seal, and every load verifies it
	// (an object without one is a load error).
	VerifyAlways
	// VerifyOff checks no payload anywhere, L2 fills included: headers,
	// keys and sizes only. Unsafe with an L2 tier (a corrupt disk or
	// network byte is served).
	VerifyOff
)

var policyNames = [...]string{VerifyL2: "l2", VerifyAlways: "always", VerifyOff: "off"}

func (p VerifyPolicy) String() string {
	if int(p) < len(policyNames) {
		return policyNames[p]
	}
	return fmt.Sprintf("VerifyPolicy(%d)", p)
}

// ParseVerifyPolicy parses a kvshim.verify value: "l2" (or "", the
// default), "always" or "off".
func ParseVerifyPolicy(s string) (VerifyPolicy, error) {
	if s == "" {
		return VerifyL2, nil
	}
	for p, name := range policyNames {
		if s == name {
			return VerifyPolicy(p), nil
		}
	}
	return 0, fmt.Errorf("verify %q: want %q (default: payload checksums checked where bytes enter from L2), %q (and on every load) or %q (never: unsafe with L2)",
		s, "l2", "always", "off")
}
