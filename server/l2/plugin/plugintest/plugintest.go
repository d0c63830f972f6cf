// Package plugintest builds the plugin host and the C plugins of the
// repository for tests (as `make` does, with $CC or cc), once per test
// binary, into a temporary directory.
package plugintest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
)

// ErrNoCompiler: no C compiler; tests skip with it.
var ErrNoCompiler = errors.New("plugintest: no C compiler ($CC or cc)")

// Root is the repository's root directory (from this file's path).
func Root() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", "..", "..", ".."))
}

// Built are the artefacts' paths.
type Built struct {
	Dir      string // holds them all
	Host     string // kvshim-l2-host
	Example  string // libkvshim-l2-example_files.so (examples/l2-plugin)
	Faulty   string // server/l2/plugin/testdata/faulty.c
	WrongABI string // faulty.c claiming ABI 99
}

var (
	once  sync.Once
	built Built
	err   error
)

// Build compiles everything once; later calls return the same paths.
func Build() (Built, error) {
	once.Do(func() { built, err = build() })
	return built, err
}

func cc() (string, error) {
	c := os.Getenv("CC")
	if c == "" {
		c = "cc"
	}
	p, err := exec.LookPath(c)
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrNoCompiler, err)
	}
	return p, nil
}

func build() (Built, error) {
	c, err := cc()
	if err != nil {
		return Built{}, err
	}
	dir, err := os.MkdirTemp("", "kvshim-l2-plugins-")
	if err != nil {
		return Built{}, err
	}
	root := Root()
	inc := "-I" + filepath.Join(root, "server", "l2", "plugin", "include")
	b := Built{Dir: dir, Host: filepath.Join(dir, "kvshim-l2-host"),
		Example: filepath.Join(dir, "libkvshim-l2-example_files.so"),
		Faulty:  filepath.Join(dir, "libkvshim-l2-faulty.so"), WrongABI: filepath.Join(dir, "libkvshim-l2-wrongabi.so")}
	faulty := filepath.Join(root, "server", "l2", "plugin", "testdata", "faulty.c")
	for _, args := range [][]string{
		{"-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", inc, "-o", b.Host, filepath.Join(root, "server", "l2", "plugin", "host", "kvshim_l2_host.c"), "-ldl", "-pthread"},
		{"-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", inc, "-o", b.Example, filepath.Join(root, "examples", "l2-plugin", "kvshim_l2_files.c")},
		{"-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", inc, "-o", b.Faulty, faulty},
		{"-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-DFAULTY_ABI=99", inc, "-o", b.WrongABI, faulty},
	} {
		if out, err := exec.Command(c, args...).CombinedOutput(); err != nil {
			os.RemoveAll(dir)
			return Built{}, fmt.Errorf("plugintest: %s %v: %v: %s", c, args, err, out)
		}
	}
	return b, nil
}

// Remove deletes what Build made (call it from TestMain after m.Run).
func Remove() {
	if built.Dir != "" {
		os.RemoveAll(built.Dir)
	}
}
