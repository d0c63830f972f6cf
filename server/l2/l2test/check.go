package l2test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

// The checks below stop the test (Fatal) like the assertions of the
// adapters' tests; they use only package testing, as a test-support
// package's non-test code may (internal/archtest).

// msg formats an optional "format, args..." context.
func msg(ctx []any) string {
	if len(ctx) == 0 {
		return ""
	}
	if f, ok := ctx[0].(string); ok {
		return fmt.Sprintf(f, ctx[1:]...) + ": "
	}
	return fmt.Sprint(ctx...) + ": "
}

func check(t testing.TB, cond bool, ctx ...any) {
	t.Helper()
	if !cond {
		t.Fatalf("%scheck failed", msg(ctx))
	}
}

func noErr(t testing.TB, err error, ctx ...any) {
	t.Helper()
	if err != nil {
		t.Fatalf("%sunexpected error: %v", msg(ctx), err)
	}
}

func eq[T comparable](t testing.TB, got, want T, ctx ...any) {
	t.Helper()
	if got != want {
		t.Fatalf("%sgot %v, want %v", msg(ctx), got, want)
	}
}

func eqs[T comparable](t testing.TB, got, want []T, ctx ...any) {
	t.Helper()
	if !slices.Equal(got, want) {
		t.Fatalf("%sgot %v, want %v", msg(ctx), got, want)
	}
}

func contains(t testing.TB, s, sub string, ctx ...any) {
	t.Helper()
	if !strings.Contains(s, sub) {
		t.Fatalf("%s%q does not contain %q", msg(ctx), s, sub)
	}
}
