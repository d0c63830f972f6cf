package cli

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

// writeConfig writes text to a config file in a fresh directory.
func writeConfig(t *testing.T, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "kvshim.conf")
	assert.NilError(t, os.WriteFile(p, []byte(text), 0o600))
	return p
}

func parseServeArgs(args ...string) (serveOptions, int, bool, string) {
	var stdout, stderr bytes.Buffer
	o, code, ok := parseServe(args, &stdout, &stderr)
	return o, code, ok, stderr.String()
}

func TestConfigFileSetsFlags(t *testing.T) {
	sock := socketPath(t)
	p := writeConfig(t, `
# a comment, then every kind of value
socket = `+sock+`
l1-size-gb = 2.5
  l1-prefault-gb=0
hold-ttl = 90s
metrics-port = 9191
metrics-host = 0.0.0.0
l2-prefetch-retain = true
l2-adapter = {"type": "fs", "base_path": "/tmp/a", "name": "a"}
l2-adapter = {"type": "fs", "base_path": "/tmp/b", "name": "b"}
`)
	o, code, ok, stderr := parseServeArgs("--config", p)
	assert.Assert(t, ok, "code %d, stderr: %s", code, stderr)
	assert.Check(t, is.Equal(o.cfg.Socket, sock))
	assert.Check(t, is.Equal(o.cfg.L1SizeGB, 2.5))
	assert.Check(t, is.Equal(o.cfg.L1PrefaultGB, 0.0))
	assert.Check(t, is.Equal(o.cfg.HoldTTL, 90*time.Second))
	assert.Check(t, is.Equal(o.cfg.MetricsPort, 9191))
	assert.Check(t, is.Equal(o.metricsHost, "0.0.0.0"))
	assert.Check(t, o.cfg.L2PrefetchRetain)
	assert.Check(t, is.DeepEqual(o.cfg.L2Adapters, []string{
		`{"type": "fs", "base_path": "/tmp/a", "name": "a"}`, `{"type": "fs", "base_path": "/tmp/b", "name": "b"}`}))
}

func TestConfigFlagsOverrideFile(t *testing.T) {
	sock := socketPath(t)
	p := writeConfig(t, "socket = /nonexistent/file.sock\nl1-size-gb = 8\nl1-prefault-gb = 0\n"+
		`l2-adapter = {"type": "fs", "base_path": "/tmp/a"}`+"\n")
	// Flags before and after --config alike win over the file.
	o, code, ok, stderr := parseServeArgs("--l1-size-gb", "3", "--config", p, "--socket", sock,
		"--l2-adapter", `{"type": "fs", "base_path": "/tmp/z"}`)
	assert.Assert(t, ok, "code %d, stderr: %s", code, stderr)
	assert.Check(t, is.Equal(o.cfg.Socket, sock))
	assert.Check(t, is.Equal(o.cfg.L1SizeGB, 3.0))
	assert.Check(t, is.Equal(o.cfg.L1PrefaultGB, 0.0), "what the command line leaves alone comes from the file")
	assert.Check(t, is.DeepEqual(o.cfg.L2Adapters, []string{`{"type": "fs", "base_path": "/tmp/z"}`}),
		"an explicit --l2-adapter replaces the file's list")
}

func TestConfigFileErrors(t *testing.T) {
	sock := socketPath(t)
	cases := []struct {
		name, text string
		want       []string
	}{
		{"unknown key", "l1-size-gb = 1\nl1_size_gb = 4\n", []string{`line 2: key "l1_size_gb" is not a flag of kvshim serve`}},
		{"unknown key among good", "l3-size-gb = 1\n", []string{`key "l3-size-gb" is not a flag of kvshim serve (run 'kvshim serve --help' for the keys)`}},
		{"config is no key", "config = /etc/other.conf\n", []string{`line 1: key "config" is not a flag`}},
		{"help is no key", "help = true\n", []string{`line 1: key "help" is not a flag`}},
		{"twice", "l1-size-gb = 1\n\nl1-size-gb = 2\n", []string{`line 3: key "l1-size-gb" is given twice (first on line 1)`}},
		{"bad number", "l1-size-gb = lots\n", []string{`line 1: key "l1-size-gb": want a number such as 16 or 0.5`}},
		{"bad duration", "hold-ttl = 30\n", []string{`line 1: key "hold-ttl": want a duration`}},
		{"bad bool", "l2-prefetch-retain = maybe\n", []string{`line 1: key "l2-prefetch-retain": `}},
		{"bad log level", "log-level = loud\n", []string{`line 1: key "log-level": `, `"loud"`}},
		{"no equals", "l1-size-gb 4\n", []string{`line 1: want "key = value", got "l1-size-gb 4"`}},
		{"dashes", "--l1-size-gb = 4\n", []string{`line 1: key "--l1-size-gb": write the flag's name without dashes (l1-size-gb)`}},
		{"no key", "= 4\n", []string{`line 1: no key before "="`}},
		{"value checked as the flag is", "l1-size-gb = 0\n", []string{"--l1-size-gb must be > 0"}},
		{"adapter checked as the flag is", `l2-adapter = {"type": "tape"}` + "\n", []string{`--l2-adapter #1: key "type": "tape" is not a registered adapter type`}},
		{"several problems, each reported", "a = 1\nb = 2\n", []string{`key "a"`, `key "b"`}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := writeConfig(t, tc.text)
			_, code, ok, stderr := parseServeArgs("--socket", sock, "--config", p)
			assert.Assert(t, !ok)
			assert.Check(t, is.Equal(code, 2))
			for _, w := range tc.want {
				assert.Check(t, is.Contains(stderr, w))
			}
			assert.Check(t, is.Contains(stderr, "run 'kvshim serve --help' for the flags\n"))
		})
	}
	t.Run("missing file", func(t *testing.T) {
		p := filepath.Join(t.TempDir(), "nope.conf")
		_, code, _, stderr := parseServeArgs("--config", p)
		assert.Check(t, is.Equal(code, 2))
		assert.Check(t, is.Contains(stderr, "kvshim serve: --config "+p+": no such file\n"))
	})
}

// serveFlags are the flags `kvshim serve --help` lists.
func serveFlags(t *testing.T) []string {
	t.Helper()
	code, out, _ := runCmd("serve", "--help")
	assert.Equal(t, code, 0)
	var names []string
	for _, m := range regexp.MustCompile(`(?m)^  --([a-z0-9-]+)`).FindAllStringSubmatch(out, -1) {
		names = append(names, m[1])
	}
	sort.Strings(names)
	return names
}

// The shipped config file (deploy/kvshim.conf) names every flag of
// `kvshim serve` as a key, set or commented out, and no other key; and
// what it sets parses.
func TestDeployConfigNamesEveryFlag(t *testing.T) {
	const path = "../deploy/kvshim.conf"
	data, err := os.ReadFile(path)
	assert.NilError(t, err)
	keyLine := regexp.MustCompile(`^#?\s*([a-z0-9-]+)\s*=`)
	found := map[string]bool{}
	for _, line := range strings.Split(string(data), "\n") {
		if m := keyLine.FindStringSubmatch(strings.TrimSpace(line)); m != nil {
			found[m[1]] = true
		}
	}
	var want []string
	for _, f := range serveFlags(t) {
		if f != "config" {
			want = append(want, f)
		}
	}
	var got []string
	for k := range found {
		got = append(got, k)
	}
	sort.Strings(got)
	assert.Check(t, is.DeepEqual(got, want), "keys of %s (set or commented) vs the flags of kvshim serve", path)

	// The socket's directory (systemd's RuntimeDirectory) does not exist
	// here; the command line wins over the file.
	o, code, ok, stderr := parseServeArgs("--config", path, "--socket", socketPath(t))
	assert.Assert(t, ok, "code %d, stderr: %s", code, stderr)
	assert.Check(t, o.cfg.MetricsPort != 0, "the deployed server exports metrics (and /healthz)")
}

// FuzzServeConfig: any config file either parses into serve options the
// server accepts, or is refused with exit 2; never a panic.
func FuzzServeConfig(f *testing.F) {
	for _, s := range []string{"", "# c\nl1-size-gb = 1\n", "socket=/tmp/x.sock\nl2-adapter = {\"type\":\"fs\"}\n",
		"=x", "--socket = a", "l1-size-gb\n", "hold-ttl = 1s\nhold-ttl = 2s\n", "unknown = 1", "config = /etc/x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, text string) {
		path := filepath.Join(t.TempDir(), "kvshim.conf")
		if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		o, code, ok := parseServe([]string{"--config", path}, io.Discard, io.Discard)
		switch {
		case ok && code != 0:
			t.Fatalf("ok with code %d", code)
		case ok:
			if err := o.cfg.Validate(); err != nil {
				t.Fatalf("accepted a config the server refuses: %v", err)
			}
		case code != 2 && code != 0:
			t.Fatalf("refused with code %d", code)
		}
	})
}
