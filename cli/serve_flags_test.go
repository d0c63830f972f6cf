package cli

import (
	"bytes"
	"errors"
	"io"
	"io/fs"
	"os"
	"strings"
	"testing"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

func TestServeBadFlags(t *testing.T) {
	sock := socketPath(t)
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"policy", []string{"--eviction-policy", "FIFO"}, `--eviction-policy "FIFO" is not valid; valid values: "LRU"`},
		{"size zero", []string{"--l1-size-gb", "0"}, "--l1-size-gb must be > 0"},
		{"size negative", []string{"--l1-size-gb", "-3"}, "--l1-size-gb must be > 0"},
		{"size not a number", []string{"--l1-size-gb", "lots"}, `kvshim serve: invalid value "lots" for flag -l1-size-gb: want a number such as 16 or 0.5`},
		{"size tiny", []string{"--l1-size-gb", "1e-9"}, "smaller than one 4 KiB page"},
		{"high watermark", []string{"--l1-high-watermark", "1.5"}, "--l1-high-watermark must be in (0, 1]"},
		{"low watermark", []string{"--l1-low-watermark", "-0.1"}, "--l1-low-watermark must be in [0, 1)"},
		{"low above high", []string{"--l1-high-watermark", "0.5", "--l1-low-watermark", "0.6"}, "--l1-low-watermark (0.6) must be below --l1-high-watermark (0.5)"},
		{"hold ttl zero", []string{"--hold-ttl", "0s"}, "--hold-ttl must be > 0"},
		{"hold ttl no unit", []string{"--hold-ttl", "30"}, `kvshim serve: invalid value "30" for flag -hold-ttl: want a duration such as 500ms, 90s or 30m (time: missing unit in duration "30")`},
		{"metrics port word", []string{"--metrics-port", "http"}, `invalid value "http" for flag -metrics-port: want a whole number`},
		{"metrics port high", []string{"--metrics-port", "70000"}, "--metrics-port must be in [0, 65535], got 70000"},
		{"metrics port negative", []string{"--metrics-port", "-1"}, "--metrics-port must be in [0, 65535], got -1"},
		{"metrics host", []string{"--metrics-host", ""}, "--metrics-host must not be empty"},
		{"socket", []string{"--socket", ""}, "--socket must not be empty"},
		{"l2 adapter json", []string{"--l2-adapter", `{"type": "fs"`}, "--l2-adapter #1: "},
		{"l2 adapter type", []string{"--l2-adapter", `{"type": "tape"}`}, `--l2-adapter #1: key "type": "tape" is not a registered adapter type`},
		{"l2 second adapter", []string{"--l2-adapter", `{"type": "fs", "base_path": "/tmp"}`, "--l2-adapter", `[1]`}, "--l2-adapter #2: "},
		{"l2 adapter key missing", []string{"--l2-adapter", `{"type": "fs"}`}, `--l2-adapter #1: l2: open fs adapter "fs": l2: bad adapter config: key "base_path": missing`},
		{"l2 adapter key unknown", []string{"--l2-adapter", `{"type": "fs", "base_path": "/tmp", "bogus": 1}`}, `key "bogus": unknown for type "fs"`},
		{"l2 store policy", []string{"--l2-store-policy", "some"}, "--l2-store-policy: "},
		{"l2 store after", []string{"--l2-store-after-lookups", "-1"}, "--l2-store-after-lookups must be >= 0 (0: write-through), got -1"},
		{"l2 prefetch budget", []string{"--l2-prefetch-budget-gb", "-1"}, "--l2-prefetch-budget-gb must be in [0, --l1-size-gb], got -1"},
		{"l2 inflight", []string{"--l1-size-gb", "1", "--l2-store-max-inflight-gb", "2"}, "--l2-store-max-inflight-gb must be in [0, --l1-size-gb], got 2"},
		{"l2 prefetch timeout", []string{"--l2-prefetch-timeout", "-1s"}, "--l2-prefetch-timeout must not be negative"},
		{"l2 retain", []string{"--l2-prefetch-retain=maybe"}, `invalid boolean value "maybe" for -l2-prefetch-retain`},
		{"unknown flag", []string{"--l3-size-gb", "1"}, "kvshim serve: flag provided but not defined: -l3-size-gb"},
		{"argument", []string{"now"}, `kvshim serve: unexpected argument "now" (serve takes only flags)`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"--socket", sock}, tc.args...)
			var stdout, stderr bytes.Buffer
			code := serve(args, nil, serveHooks{}, &stdout, &stderr)
			assert.Equal(t, code, 2, "stderr: %s", stderr.String())
			assert.Check(t, is.Contains(stderr.String(), tc.want))
			assert.Check(t, is.Contains(stderr.String(), "run 'kvshim serve --help' for the flags\n"))
			assert.Check(t, !strings.Contains(stderr.String(), "usage:"), "a bad flag gets its error, not the whole usage")
			assert.Check(t, is.Equal(stdout.String(), ""))
			_, err := os.Stat(sock)
			assert.Check(t, errors.Is(err, fs.ErrNotExist), "bad flags must not create the socket")
		})
	}
	// Every problem is reported at once.
	code, _, stderr := runCmd("serve", "--socket", sock, "--eviction-policy", "LFU", "--l1-size-gb", "0", "--hold-ttl", "-1s")
	assert.Equal(t, code, 2)
	assert.Check(t, is.Contains(stderr, `"LFU" is not valid`))
	assert.Check(t, is.Contains(stderr, "--l1-size-gb must be > 0"))
	assert.Check(t, is.Contains(stderr, "--hold-ttl must be > 0"))

	code, stdout, _ := runCmd("serve", "--help")
	assert.Equal(t, code, 0)
	for _, f := range []string{"-socket", "-l1-size-gb", "-eviction-policy", "-l1-high-watermark", "-l1-low-watermark", "-hold-ttl", "-metrics-port", "-metrics-host", "-l2-adapter",
		"-l2-store-policy", "-l2-store-after-lookups", "-l2-prefetch-budget-gb", "-l2-prefetch-timeout", "-l2-admission-wait", "-l2-prefetch-retain", "-l2-store-max-inflight-gb",
		"-max-lookups-per-session", "-max-lookup-cells-per-session", "-max-sessions-per-uid"} {
		assert.Check(t, is.Contains(stdout, "\n  -"+f))
	}
}

// FuzzServeFlags: any argument list either parses into a config the server
// accepts, or is refused with exit 2 (0 for help) — never a panic.
func FuzzServeFlags(f *testing.F) {
	for _, seed := range []string{
		"--l1-size-gb\x000.5",
		"--eviction-policy\x00lru\x00--hold-ttl\x0090s",
		"--l1-high-watermark\x000.3\x00--l1-low-watermark\x000.2",
		"--metrics-port\x0065535\x00--metrics-host\x00::1",
		"--l2-adapter\x00{\"type\":\"fs\",\"base_path\":\"/tmp\"}",
		"--l1-size-gb=NaN",
		"-h",
		"--l2-store-policy\x00none\x00--l2-prefetch-budget-gb\x001",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, joined string) {
		args := strings.Split(joined, "\x00")
		o, code, ok := parseServe(args, io.Discard, io.Discard)
		if !ok {
			if code != 0 && code != 2 {
				t.Fatalf("exit %d for %q", code, args)
			}
			return
		}
		if err := o.cfg.Validate(); err != nil {
			t.Fatalf("accepted %q but the server refuses it: %v", args, err)
		}
		if o.cfg.Socket == "" || o.metricsHost == "" || o.cfg.EvictionPolicy != "LRU" {
			t.Fatalf("accepted %q with %+v", args, o)
		}
	})
}
