package layout

import (
	"errors"
	"fmt"
)

var (
	// ErrGeometry reports a tensor description or a plan request that the
	// layout refuses: inconsistent, unsupported or out-of-range geometry.
	ErrGeometry = errors.New("layout: bad geometry")

	// ErrCorrupt reports an object whose header or payload does not verify:
	// wrong magic, version, size, fingerprint or checksum.
	ErrCorrupt = errors.New("layout: corrupt object")
)

// geomErr builds an ErrGeometry error naming the layer and the field.
func geomErr(layer, field, format string, args ...any) error {
	if layer == "" {
		layer = "?"
	}
	return fmt.Errorf("%w: layer %q: %s: %s", ErrGeometry, layer, field, fmt.Sprintf(format, args...))
}

func corruptErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrCorrupt, fmt.Sprintf(format, args...))
}
