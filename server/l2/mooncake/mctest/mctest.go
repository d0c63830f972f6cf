// Package mctest finds a Python with Mooncake's wheel and starts a
// throwaway mooncake_master on loopback, for tests and the benchmark.
package mctest

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// PythonEnv names the interpreter to use (default python3).
const PythonEnv = "KVSHIM_MOONCAKE_PYTHON"

// ErrNoWheel: no interpreter can import mooncake.store.
var ErrNoWheel = errors.New("mooncake: no Python with the Mooncake wheel (pip install mooncake-transfer-engine-non-cuda; set " + PythonEnv + " to its python)")

// Python returns an interpreter that imports mooncake.store, and the
// mooncake package directory (where the wheel puts mooncake_master).
func Python() (python, pkgDir string, err error) {
	python = os.Getenv(PythonEnv)
	if python == "" {
		python = "python3"
	}
	out, err := exec.Command(python, "-c",
		"import os, mooncake, mooncake.store; print(os.path.dirname(mooncake.__file__))").Output()
	if err != nil {
		return "", "", fmt.Errorf("%w: %s -c 'import mooncake.store': %v", ErrNoWheel, python, err)
	}
	return python, strings.TrimSpace(string(out)), nil
}

// Master is a running mooncake_master.
type Master struct {
	RPCAddr     string // host:port for master_server_addr
	MetadataURL string // http metadata server for metadata_server
	cmd         *exec.Cmd
	done        chan struct{}
}

// StartMaster runs the wheel's mooncake_master with its HTTP metadata
// server on free loopback ports; leaseMS sets default_kv_lease_ttl.
func StartMaster(pkgDir, logDir string, leaseMS int) (*Master, error) {
	bin := filepath.Join(pkgDir, "mooncake_master")
	if _, err := os.Stat(bin); err != nil {
		if p, lerr := exec.LookPath("mooncake_master"); lerr == nil {
			bin = p
		} else {
			return nil, fmt.Errorf("mooncake: mooncake_master not in %s nor on PATH", pkgDir)
		}
	}
	rpc, http, admin := freePort(), freePort(), freePort()
	log, err := os.Create(filepath.Join(logDir, "mooncake_master.log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "--rpc_port", strconv.Itoa(rpc), "--rpc_address", "127.0.0.1",
		"--enable_http_metadata_server=true", "--http_metadata_server_host", "127.0.0.1",
		"--http_metadata_server_port", strconv.Itoa(http), "--metrics_port", strconv.Itoa(admin),
		"--default_kv_lease_ttl", strconv.Itoa(leaseMS))
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, fmt.Errorf("mooncake: start master (missing libibverbs1/libnuma1/libcurl4?): %w", err)
	}
	m := &Master{RPCAddr: fmt.Sprintf("127.0.0.1:%d", rpc),
		MetadataURL: fmt.Sprintf("http://127.0.0.1:%d/metadata", http), cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); log.Close(); close(m.done) }()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-m.done:
			b, _ := os.ReadFile(filepath.Join(logDir, "mooncake_master.log"))
			return nil, fmt.Errorf("mooncake: master exited: %s", lastLines(string(b), 5))
		default:
		}
		if up(m.RPCAddr) && up(fmt.Sprintf("127.0.0.1:%d", http)) {
			return m, nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	m.Stop()
	return nil, errors.New("mooncake: master did not listen within 20 s")
}

// Stop kills the master and waits (bounded).
func (m *Master) Stop() {
	_ = m.cmd.Process.Kill()
	select {
	case <-m.done:
	case <-time.After(5 * time.Second):
	}
}

func up(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

func freePort() int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}

// Config returns an adapter JSON config for a single-host TCP store
// against m (segment and buffer sizes in bytes).
func Config(python string, m *Master, segment, localBuf int, extra string) string {
	return fmt.Sprintf(`{"type":"mooncake_store","helper_python":%q,"local_hostname":"127.0.0.1",
		"metadata_server":%q,"master_server_addr":%q,"protocol":"tcp",
		"global_segment_size":%d,"local_buffer_size":%d%s}`, python, m.MetadataURL, m.RPCAddr, segment, localBuf, extra)
}
