package fakecuda

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// ChildEnv is set in the child processes Run starts.
const ChildEnv = "KVSHIM_FAKECUDA_CHILD"

// Run re-runs the current test binary with the tests matching pattern, the
// fake at lib as the CUDA driver and env added, and fails t unless they all
// pass and none skips. It returns the child's output.
func Run(t testing.TB, lib, pattern string, env ...string) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run", pattern, "-test.v", "-test.count=1", "-test.timeout=120s")
	cmd.Env = append(os.Environ(), LibraryEnv+"="+lib, ChildEnv+"=1")
	cmd.Env = append(cmd.Env, env...)
	b, err := cmd.CombinedOutput()
	out := string(b)
	if err != nil {
		t.Fatalf("child %s with %s: %v\n%s", pattern, lib, err, out)
	}
	if !strings.Contains(out, "--- PASS") || strings.Contains(out, "--- SKIP") {
		t.Fatalf("child %s with %s: a test skipped or none ran\n%s", pattern, lib, out)
	}
	return out
}

// InChild reports whether this process is a child started by Run.
func InChild() bool { return os.Getenv(ChildEnv) != "" }

// Main runs a package's tests (call it from TestMain) and, in a child
// started by Run, then fails the process on any violation the fake saw or
// anything left retained, registered, allocated or alive. It returns the
// exit code.
func Main(m *testing.M) int {
	code := m.Run()
	if code != 0 || !InChild() {
		return code
	}
	d, ok := Open()
	if !ok {
		fmt.Fprintln(os.Stderr, "fakecuda child: the fake driver was never loaded")
		return 1
	}
	if err := d.CheckClean(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}
