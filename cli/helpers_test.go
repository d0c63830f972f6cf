package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/server/l2/plugin/plugintest"
)

// childEnv, when set, makes the test binary run `kvshim serve` with the
// value's space-separated flags instead of the tests (TestMain), so a test
// can signal a real process.
const childEnv = "KVSHIM_CLI_TEST_SERVE_ARGS"

func TestMain(m *testing.M) {
	if args, ok := os.LookupEnv(childEnv); ok {
		os.Exit(Main(append([]string{"kvshim", "serve"}, strings.Fields(args)...), Info{Version: "test"}))
	}
	code := m.Run()
	plugintest.Remove() // what the examples' plugin test built
	os.Exit(code)
}

// socketPath is a fresh socket path short enough for sun_path (108 bytes;
// t.TempDir() names can be long).
func socketPath(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvcli")
	assert.NilError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "kvshim.sock")
}

// runCmd runs one command through run (as kvshim_main does).
func runCmd(args ...string) (code int, stdout, stderr string) {
	var o, e bytes.Buffer
	code = run(append([]string{"kvshim"}, args...), Info{Version: "test", ABI: 1}, &o, &e)
	return code, o.String(), e.String()
}
