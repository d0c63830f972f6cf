package main

import (
	"bufio"
	"debug/elf"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/cli"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/server/l2/plugin/plugintest"
)

var (
	buildOnce sync.Once
	built     string
	buildErr  error
	buildDir  string
)

func TestMain(m *testing.M) {
	code := m.Run()
	plugintest.Remove() // the plugin host and plugins the L2 tests built
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// binary builds the static kvshim binary the way the Makefile's out/kvshim
// rule does (CGO_ENABLED=0, version stamped), once per test run, or takes
// $KVSHIM_BINARY (a path to an already built one, e.g. out/kvshim).
func binary(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("KVSHIM_BINARY"); p != "" {
		return p
	}
	buildOnce.Do(func() {
		if buildDir, buildErr = os.MkdirTemp("", "kvshim-bin"); buildErr != nil {
			return
		}
		built = filepath.Join(buildDir, "kvshim")
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-X main.version=9.9.9-test", "-o", built, ".")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build: %v: %s", err, out)
		}
	})
	assert.NilError(t, buildErr)
	return built
}

// The binary is static: no ELF interpreter, no shared libraries (it runs
// on a storage host with neither Python nor a matching libc).
func TestStaticBinary(t *testing.T) {
	f, err := elf.Open(binary(t))
	assert.NilError(t, err)
	defer f.Close()
	for _, p := range f.Progs {
		assert.Check(t, p.Type != elf.PT_INTERP, "the binary has an ELF interpreter: it is dynamically linked")
	}
	libs, err := f.ImportedLibraries()
	assert.NilError(t, err)
	assert.Check(t, is.Len(libs, 0), "shared libraries: %v", libs)
}

// `make` (its default goal, all) builds out/kvshim this way.
func TestMakeBuildsStaticBinary(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("no make")
	}
	out, err := exec.Command("make", "-n", "-B", "-C", "../..", "all").CombinedOutput()
	assert.NilError(t, err, "%s", out)
	want := regexp.MustCompile(`(?m)^CGO_ENABLED=0 \S*go build .*-o out/kvshim \./cmd/kvshim$`)
	assert.Check(t, want.Match(out), "make -n all:\n%s", out)
}

func TestVersionAndDoctor(t *testing.T) {
	bin := binary(t)
	out, err := exec.Command(bin, "--version").Output()
	assert.NilError(t, err)
	if os.Getenv("KVSHIM_BINARY") == "" {
		assert.Check(t, is.Equal(string(out), "kvshim 9.9.9-test (C ABI "+cli.ABIString(abiVersion)+", protocol "+strconv.Itoa(int(ipc.ProtocolVersion))+")\n"))
	}
	assert.Check(t, is.Regexp(`^kvshim \S+ \(C ABI \d+\.\d+, protocol \d+\)\n$`, string(out)))

	out, err = exec.Command(bin, "doctor").Output()
	assert.NilError(t, err, "doctor: %s", out)
	assert.Check(t, is.Contains(string(out), "CUDA probe not built into the static kvshim binary"))
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	assert.NilError(t, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	assert.NilError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// serve on a temp socket, read from the config file; stat against it;
// /healthz and /metrics answer; SIGTERM stops it and removes the socket.
func TestServeStatSIGTERM(t *testing.T) {
	bin := binary(t)
	dir, err := os.MkdirTemp("", "kvbin") // short: sun_path holds 107 bytes
	assert.NilError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "kvshim.sock")
	port := freePort(t)
	conf := filepath.Join(dir, "kvshim.conf")
	l2dir := filepath.Join(dir, "l2")
	assert.NilError(t, os.WriteFile(conf, []byte("socket = "+sock+"\nl1-size-gb = 0.0625\nl1-prefault-gb = 0\n"+
		"metrics-port = "+strconv.Itoa(port)+"\n"+
		`l2-adapter = {"type": "fs", "base_path": "`+l2dir+`", "max_bytes": 1048576}`+"\n"), 0o600))

	cmd := exec.Command(bin, "serve", "--config", conf)
	stdout, err := cmd.StdoutPipe()
	assert.NilError(t, err)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	assert.NilError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	lines := make(chan string, 16)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	select {
	case l := <-lines:
		assert.Check(t, is.Equal(l, "kvshim serve: L2 adapters: fs"))
	case <-time.After(20 * time.Second):
		t.Fatalf("serve did not start; stderr: %s", stderr.String())
	}
	select {
	case l := <-lines:
		assert.Check(t, is.Contains(l, "kvshim serve: listening on "+sock+", L1 0.0625 GiB, metrics http://127.0.0.1:"+strconv.Itoa(port)+"/metrics"))
	case <-time.After(20 * time.Second):
		t.Fatalf("serve did not start; stderr: %s", stderr.String())
	}

	out, err := exec.Command(bin, "stat", "--socket", sock).CombinedOutput()
	assert.NilError(t, err, "stat: %s", out)
	assert.Check(t, is.Contains(string(out), "kvshim server at "+sock))
	assert.Check(t, is.Contains(string(out), "of 64.0 MiB"))

	code, body := httpGet(t, "http://127.0.0.1:"+strconv.Itoa(port)+"/healthz")
	assert.Check(t, is.Equal(code, 200))
	assert.Check(t, is.Equal(body, "ok\n"))
	code, body = httpGet(t, "http://127.0.0.1:"+strconv.Itoa(port)+"/metrics")
	assert.Check(t, is.Equal(code, 200))
	assert.Check(t, is.Contains(body, "kvshim_l1_capacity_bytes 6.7108864e+07"))
	assert.Check(t, is.Contains(body, `kvshim_l2_tasks_total{adapter="fs",op="store"} 0`))

	assert.NilError(t, cmd.Process.Signal(syscall.SIGTERM))
	done := make(chan error, 1)
	go func() {
		var rest []string
		for l := range lines {
			rest = append(rest, l)
		}
		err := cmd.Wait()
		if err == nil && !strings.Contains(strings.Join(rest, "\n"), "kvshim serve: stopped on SIGTERM") {
			t.Errorf("no stop line in %q", rest)
		}
		done <- err
	}()
	select {
	case err := <-done:
		assert.NilError(t, err, "stderr: %s", stderr.String())
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop on SIGTERM")
	}
	_, err = os.Stat(sock)
	assert.Check(t, os.IsNotExist(err), "the socket is removed on SIGTERM")
}
