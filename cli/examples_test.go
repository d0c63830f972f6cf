package cli

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/plugin"
	"github.com/kvshim/kvshim/server/l2/plugin/plugintest"
)

// The examples/ files are checked with the code `kvshim serve` runs on
// them: parseServe (the flags, --config, server.Config.Validate, which
// parses each --l2-adapter with l2.ParseAdapterConfig) and l2.Open (the
// adapter's own keys, as server.Start opens them).

const examplesDir = "../examples"

// openExampleAdapter opens an adapter JSON as server.Start would, with
// what this machine cannot have replaced: an fs base_path becomes a temp
// directory; Redis opens lazily (no connection at open); Mooncake's
// helper Python does not exist here, so its open must fail starting the
// helper, after every key was accepted; the same for an S3 endpoint that
// nothing listens on; a plugin gets the example plugin built here (cc).
func openExampleAdapter(t *testing.T, raw string) {
	t.Helper()
	cfg, err := l2.ParseAdapterConfig(raw)
	assert.NilError(t, err)
	switch cfg.Type {
	case "fs":
		cfg.Extra["base_path"], _ = json.Marshal(filepath.Join(t.TempDir(), "l2"))
	case "mooncake_store":
		cfg.Extra["helper_python"], _ = json.Marshal("/nonexistent/kvshim-example-python")
	case "s3":
		cfg.Extra["endpoint"], _ = json.Marshal("http://127.0.0.1:1")
		cfg.Extra["max_retries"] = json.RawMessage("1")
	case "plugin":
		b, err := plugintest.Build()
		if errors.Is(err, plugintest.ErrNoCompiler) {
			t.Skip(err.Error())
		}
		assert.NilError(t, err)
		t.Setenv(plugin.PathEnv, b.Dir)
		t.Setenv(plugin.HostEnv, b.Host)
		cfg.Extra["dir"], _ = json.Marshal(filepath.Join(t.TempDir(), "l2"))
	}
	a, err := l2.Open(cfg, l2.Options{})
	if cfg.Type == "s3" {
		assert.Assert(t, err != nil)
		assert.Check(t, !errors.Is(err, l2.ErrBadConfig), "a key of the example is refused: %v", err)
		assert.Check(t, is.Contains(err.Error(), "127.0.0.1:1"))
		return
	}
	if cfg.Type == "mooncake_store" {
		assert.Assert(t, err != nil)
		assert.Check(t, !errors.Is(err, l2.ErrBadConfig), "a key of the example is refused: %v", err)
		assert.Check(t, is.Contains(err.Error(), "/nonexistent/kvshim-example-python"))
		return
	}
	assert.NilError(t, err)
	assert.NilError(t, a.Close())
}

func TestExampleL2AdapterFlags(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(examplesDir, "l2-*.json"))
	assert.NilError(t, err)
	types := map[string]bool{}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			assert.NilError(t, err)
			raw := strings.TrimSpace(string(data))
			o, code, ok, stderr := parseServeArgs("--socket", socketPath(t), "--l2-adapter", raw)
			assert.Assert(t, ok, "code %d, stderr: %s", code, stderr)
			cfg, err := l2.ParseAdapterConfig(o.cfg.L2Adapters[0])
			assert.NilError(t, err)
			types[cfg.Type] = true
			openExampleAdapter(t, raw)
		})
	}
	assert.Check(t, is.DeepEqual(types, map[string]bool{"fs": true, "redis": true, "mooncake_store": true, "s3": true, "plugin": true}))
}

// The connector's kv_connector_extra_config examples: their
// kvshim.l2_adapters go to the embedded server's --l2-adapter parser
// (tests/test_examples.py checks the rest with the connector's read_config).
func TestExampleConnectorL2Adapters(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(examplesDir, "vllm-kv-transfer-config-*.json"))
	assert.NilError(t, err)
	assert.Assert(t, len(files) >= 3, "examples: %v", files)
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			assert.NilError(t, err)
			var kv struct {
				Extra struct {
					Adapters []json.RawMessage `json:"kvshim.l2_adapters"`
				} `json:"kv_connector_extra_config"`
			}
			assert.NilError(t, json.Unmarshal(data, &kv))
			assert.Assert(t, len(kv.Extra.Adapters) > 0)
			for _, a := range kv.Extra.Adapters {
				_, code, ok, stderr := parseServeArgs("--socket", socketPath(t), "--l2-adapter", string(a))
				assert.Assert(t, ok, "code %d, stderr: %s", code, stderr)
				openExampleAdapter(t, string(a))
			}
		})
	}
}

// shellWords splits one shell command line as sh would for the examples'
// forms: 'single', "double" quotes, and "$(cat FILE)" (FILE relative to
// the repository root) inside double quotes.
func shellWords(t *testing.T, line string) []string {
	t.Helper()
	var words []string
	var cur strings.Builder
	in := false
	cat := regexp.MustCompile(`\$\(cat ([^)]+)\)`)
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case c == '\'':
			j := strings.IndexByte(line[i+1:], '\'')
			assert.Assert(t, j >= 0, "unterminated ' in %q", line)
			cur.WriteString(line[i+1 : i+1+j])
			i += j + 1
			in = true
		case c == '"':
			j := strings.IndexByte(line[i+1:], '"')
			assert.Assert(t, j >= 0, "unterminated \" in %q", line)
			s := cat.ReplaceAllStringFunc(line[i+1:i+1+j], func(m string) string {
				data, err := os.ReadFile(filepath.Join("..", cat.FindStringSubmatch(m)[1]))
				assert.NilError(t, err)
				return strings.TrimRight(string(data), "\n")
			})
			assert.Assert(t, !strings.ContainsAny(s, "$`\\"), "unsupported shell in %q", s)
			cur.WriteString(s)
			i += j + 1
			in = true
		case c == ' ' || c == '\t':
			if in {
				words = append(words, cur.String())
				cur.Reset()
				in = false
			}
		default:
			cur.WriteByte(c)
			in = true
		}
	}
	if in {
		words = append(words, cur.String())
	}
	return words
}

// shellCommands are the logical lines of a shell script (continuations
// joined, comments dropped) that start with prefix.
func shellCommands(t *testing.T, path, prefix string) [][]string {
	t.Helper()
	data, err := os.ReadFile(path)
	assert.NilError(t, err)
	text := strings.ReplaceAll(string(data), "\\\n", " ")
	var out [][]string
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, prefix) {
			line = strings.TrimSpace(strings.TrimSuffix(line, "&"))
			out = append(out, shellWords(t, line))
		}
	}
	return out
}

// Every `kvshim serve` line of the examples parses (the socket is moved
// to a temp directory, as the command line wins over the file; paths are
// relative to the repository root).
func TestExampleServeCommandLines(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(examplesDir, "*.sh"))
	assert.NilError(t, err)
	n := 0
	for _, f := range files {
		for _, words := range shellCommands(t, f, "kvshim serve ") {
			n++
			args := words[2:]
			for i := range args {
				if i > 0 && args[i-1] == "--config" {
					args[i] = filepath.Join("..", args[i])
				}
			}
			_, code, ok, stderr := parseServeArgs(append(args, "--socket", socketPath(t))...)
			assert.Check(t, ok, "%s: %q: code %d, stderr: %s", f, words, code, stderr)
		}
	}
	assert.Check(t, n > 0, "no kvshim serve line in examples/*.sh")
}
