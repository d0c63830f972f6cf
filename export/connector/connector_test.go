package connector

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/server"
)

func TestParseDefaults(t *testing.T) {
	c, r, err := Parse([]byte(`{"role":"worker","server":"/run/kvshim/a.sock","rank":3}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Embedded() || r.Socket != "/run/kvshim/a.sock" || c.Rank != 3 {
		t.Errorf("config %+v, resolved %+v", c, r)
	}
	if r.Timeout != DefaultTimeout {
		t.Errorf("timeout %v, want the default %v", r.Timeout, DefaultTimeout)
	}
	_, r2, err := Parse([]byte(`{"role":"worker","server":"/run/kvshim/a.sock"}`))
	if err != nil {
		t.Fatal(err)
	}
	if r.Instance == uuid.Nil || r.Instance == r2.Instance {
		t.Errorf("each handle without an instance gets its own: %v, %v", r.Instance, r2.Instance)
	}
}

func TestParseResolves(t *testing.T) {
	id := uuid.New()
	c, r, err := Parse([]byte(`{"role":"scheduler","engine_id":"eng-1.a_b","instance":"` + id.String() + `","timeout_ms":250}`))
	if err != nil {
		t.Fatal(err)
	}
	if !c.Embedded() {
		t.Error("no server given: the embedded one")
	}
	if want := filepath.Join(ipc.DefaultSocketDir(), "embedded-eng-1.a_b.sock"); r.Socket != want {
		t.Errorf("socket %q, want %q", r.Socket, want)
	}
	if r.Instance != id || r.Timeout != 250*time.Millisecond {
		t.Errorf("resolved %+v", r)
	}
	if _, r, err = Parse([]byte(`{"server":"embedded","engine_id":"x"}`)); err != nil || !strings.HasSuffix(r.Socket, "embedded-x.sock") {
		t.Errorf(`"embedded" names the embedded server: %q, %v`, r.Socket, err)
	}
}

func TestParseRefuses(t *testing.T) {
	for _, tc := range []struct{ raw, msg string }{
		{`not json`, "config: invalid character"},
		{`{"role":"worker","bogus":1}`, `unknown field "bogus"`},
		{`{"namespace":{"modle":"x"}}`, `unknown field "modle"`},
		{`{"role":"scheduler"}`, `engine_id of 1-64 letters`},
		{`{"role":"scheduler","engine_id":"a/b"}`, `got "a/b"`},
		{`{"role":"scheduler","engine_id":"` + strings.Repeat("e", 65) + `"}`, "engine_id of 1-64"},
		{`{"server":"/s.sock","instance":"nope"}`, `instance "nope"`},
		{`{"server":"/s.sock","timeout_ms":-1}`, "timeout_ms -1 is out of range"},
		{`{"server":"/s.sock","l1_size_gb":-1}`, "l1_size_gb -1 is out of range"},
		{`{"server":"/s.sock","hold_ttl_s":-1}`, "hold_ttl_s -1 is out of range"},
		{`{"server":"/s.sock","l1_prefault_gb":-0.5}`, "l1_prefault_gb -0.5 is out of range"},
		{`{"server":"/s.sock","metrics_port":70000}`, "metrics_port 70000 is out of range"},
		{`{"server":"/s.sock","rank":-2}`, "rank -2 is out of range"},
		{`{"server":"/s.sock","block_size":-16}`, "block_size -16 is out of range"},
		// Keys another role reads are checked in every role (a worker's
		// config with a scheduler's bad kv_role, a scheduler's with a bad
		// verify, an external server's client with bad embedded settings).
		{`{"server":"/s.sock","role":"worker","kv_role":"kv_sometimes"}`, `kv_role "kv_sometimes": want`},
		{`{"server":"/s.sock","role":"scheduler","verify":"bogus"}`, `verify "bogus": want`},
		{`{"server":"/s.sock","role":"worker","l2_adapters":["{\"type\":\"no-such\"}"]}`, "no-such"},
		{`{"server":"/s.sock","role":"tool","namespace":{"object_format":99}}`, "namespace: object_format 99"},
		{`{"server":"/s.sock","l1_size_gb":1e9}`, "--l1-size-gb must be > 0"},
	} {
		_, _, err := Parse([]byte(tc.raw))
		if !errors.Is(err, ErrConfig) {
			t.Errorf("%s: %v, want ErrConfig", tc.raw, err)
			continue
		}
		if !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: %q does not say %q", tc.raw, err, tc.msg)
		}
	}
}

func TestNamespaceSpec(t *testing.T) {
	n := Namespace{Model: "m", DType: "bfloat16", Layout: "fp", WorldSize: 2, TPSize: 2, ChunkSize: 256, KVGroup: 1, MLA: true}
	s, err := n.Spec()
	if err != nil {
		t.Fatal(err)
	}
	if s.ObjectFormat != layout.FormatVersion || s.Model != "m" || s.LayoutFingerprint != "fp" || s.WorldSize != 2 ||
		s.TPSize != 2 || s.ChunkSize != 256 || s.KVGroup != 1 || !s.MLA || s.DType != "bfloat16" {
		t.Errorf("spec %+v", s)
	}
	n.Format = layout.FormatVersion
	if _, err := n.Spec(); err != nil {
		t.Errorf("this build's format stated: %v", err)
	}
	n.Format = layout.FormatVersion + 1
	if _, err := n.Spec(); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "object_format") {
		t.Errorf("another format: %v", err)
	}
}

func TestServerConfig(t *testing.T) {
	c, _, err := Parse([]byte(`{"server":"/s.sock"}`))
	if err != nil {
		t.Fatal(err)
	}
	def := server.DefaultConfig()
	sc := c.ServerConfig("/x.sock")
	if sc.Socket != "/x.sock" || sc.L1SizeGB != def.L1SizeGB || sc.L1PrefaultGB != def.L1PrefaultGB || sc.HoldTTL != def.HoldTTL {
		t.Errorf("absent keys keep the server's defaults: %+v", sc)
	}
	c, _, err = Parse([]byte(`{"server":"/s.sock","l1_size_gb":2,"l1_prefault_gb":0,"hold_ttl_s":1.5,"metrics_port":9,"l2_adapters":["{\"type\":\"fs\",\"base_path\":\"/x\"}"]}`))
	if err != nil {
		t.Fatal(err)
	}
	sc = c.ServerConfig("/x.sock")
	if sc.L1SizeGB != 2 || sc.L1PrefaultGB != 0 || sc.HoldTTL != 1500*time.Millisecond || sc.MetricsPort != 9 ||
		len(sc.L2Adapters) != 1 {
		t.Errorf("keys set: %+v", sc)
	}
}

// smallServer is an embedded server config that allocates nothing ahead.
func smallServer(t *testing.T) *Config {
	c, _, err := Parse([]byte(`{"server":"embedded","engine_id":"t","l1_size_gb":0.0625,"l1_prefault_gb":0}`))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestEmbeddedServerIsSharedAndStopsWithTheLastRelease(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "sock", "e.sock")
	c := smallServer(t)
	info := server.BuildInfo{Version: "test", ABI: 1}
	r1, err := AcquireEmbedded(socket, c, info)
	if err != nil {
		t.Fatal(err)
	}
	r2, err := AcquireEmbedded(socket, c, info)
	if err != nil {
		t.Fatal(err)
	}
	if n := embeddedRefs(socket); n != 2 {
		t.Fatalf("%d references, want 2 to one server", n)
	}
	dial := func() error {
		cl, err := ipc.Dial(socket, ipc.Hello{Version: ipc.ProtocolVersion, Role: ipc.RoleTool, PID: uint32(os.Getpid()),
			Instance: uuid.New()}, 2*time.Second)
		if err == nil {
			cl.Close()
		}
		return err
	}
	if err := dial(); err != nil {
		t.Fatalf("the embedded server does not answer: %v", err)
	}
	if err := r1(); err != nil {
		t.Fatal(err)
	}
	if err := r1(); err != nil || embeddedRefs(socket) != 1 {
		t.Fatalf("a second release of one reference must not drop another's: %v, %d refs", err, embeddedRefs(socket))
	}
	if err := dial(); err != nil {
		t.Fatalf("one reference left: the server must still run: %v", err)
	}
	if err := r2(); err != nil {
		t.Fatal(err)
	}
	if n := embeddedRefs(socket); n != 0 {
		t.Fatalf("%d references after the last release", n)
	}
	if err := dial(); err == nil {
		t.Fatal("the server still answers after the last release")
	}
	r3, err := AcquireEmbedded(socket, c, info)
	if err != nil {
		t.Fatalf("a new server on the same socket: %v", err)
	}
	if err := dial(); err != nil {
		t.Fatalf("the restarted server does not answer: %v", err)
	}
	if err := r3(); err != nil {
		t.Fatal(err)
	}
}

func TestEmbeddedServerRefusesBadSettings(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "sock", "bad.sock")
	c := smallServer(t)
	c.L2Adapters = []string{`{"type":"no-such-adapter"}`}
	_, err := AcquireEmbedded(socket, c, server.BuildInfo{})
	if err == nil {
		t.Fatal("an unknown L2 adapter type started a server")
	}
	if !strings.Contains(err.Error(), "no-such-adapter") || !errors.Is(err, server.ErrConfig) {
		t.Errorf("the error does not name the adapter or wrap server.ErrConfig: %v", err)
	}
	if n := embeddedRefs(socket); n != 0 {
		t.Errorf("a failed start left %d references", n)
	}
	if _, err := os.Stat(socket); err == nil {
		t.Error("a failed start left its socket behind")
	}
}

// A starting embedded server removes the sockets its dead predecessors left
// in its directory (vLLM SIGKILLs the engine core by default), and keeps a
// live server's.
func TestEmbeddedServerRemovesDeadServersSockets(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "sock")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-time.Hour)
	listen := func(name string) *net.UnixListener {
		ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: filepath.Join(dir, name), Net: "unixpacket"})
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(filepath.Join(dir, name), old, old); err != nil {
			t.Fatal(err)
		}
		return ln
	}
	dead := listen("embedded-dead.sock")
	dead.SetUnlinkOnClose(false)
	dead.Close()
	live := listen("embedded-live.sock")
	defer live.Close()

	release, err := AcquireEmbedded(filepath.Join(dir, "embedded-new.sock"), smallServer(t), server.BuildInfo{})
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	if _, err := os.Lstat(filepath.Join(dir, "embedded-dead.sock")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the dead server's socket is still there: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(dir, "embedded-live.sock")); err != nil {
		t.Errorf("the live server's socket was removed: %v", err)
	}
}
