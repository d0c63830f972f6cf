package cli

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
)

// A config file for `kvshim serve --config FILE` holds the command's
// flags, one per line, spelled as the flags are without the dashes:
//
//	# comment
//	socket = /run/kvshim/kvshim.sock
//	l1-size-gb = 64
//	l2-adapter = {"type": "fs", "base_path": "/var/lib/kvshim/l2", "max_bytes": 1099511627776}
//
// Every key is a flag and every flag a key (flags ≡ keys): the value is
// exactly what the flag would be given (no quoting: the rest of the line
// after the first "=", spaces trimmed), and it is checked by the flag's
// own parser. A repeatable flag (l2-adapter) is a repeated key; any other
// key given twice is an error, as is a key that is no flag. Explicit
// flags on the command line win: a flag given there replaces the file's
// value (for l2-adapter: the file's whole list).

// configEntry is one "key = value" line.
type configEntry struct {
	key, value string
	line       int
}

// parseConfig reads the "key = value" lines of a config file. It checks
// only the syntax; keys are checked against the flags by applyConfig.
func parseConfig(text string) ([]configEntry, []string) {
	var out []configEntry
	var errs []string
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		switch {
		case !ok:
			errs = append(errs, fmt.Sprintf("line %d: want \"key = value\", got %q", n, line))
			continue
		case k == "":
			errs = append(errs, fmt.Sprintf("line %d: no key before \"=\"", n))
			continue
		case strings.HasPrefix(k, "-"):
			errs = append(errs, fmt.Sprintf("line %d: key %q: write the flag's name without dashes (%s)", n, k, strings.TrimLeft(k, "-")))
			continue
		}
		out = append(out, configEntry{key: k, value: v, line: n})
	}
	if err := sc.Err(); err != nil {
		errs = append(errs, err.Error())
	}
	return out, errs
}

// repeatable reports whether f may be given more than once.
func repeatable(f *flag.Flag) bool {
	_, ok := f.Value.(*stringList)
	return ok
}

// applyConfig sets, from the config file at path, every flag of fs that
// the command line did not set. Problems name the file, line and key.
// noKey are flags that are not config keys (--config itself).
func applyConfig(fs *flagSet, path string, noKey ...string) []string {
	data, err := os.ReadFile(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return []string{fmt.Sprintf("--config %s: no such file", path)}
		}
		return []string{fmt.Sprintf("--config: %v", err)}
	}
	entries, errs := parseConfig(string(data))
	for i := range errs {
		errs[i] = fmt.Sprintf("--config %s: %s", path, errs[i])
	}
	explicit := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { explicit[f.Name] = true })
	seen := map[string]int{}
	for _, e := range entries {
		where := fmt.Sprintf("--config %s: line %d: key %q", path, e.line, e.key)
		f := fs.Lookup(e.key)
		if f == nil || contains(noKey, e.key) {
			errs = append(errs, fmt.Sprintf("%s is not a flag of kvshim %s (run 'kvshim %s --help' for the keys)", where, fs.cmd, fs.cmd))
			continue
		}
		if prev, dup := seen[e.key]; dup && !repeatable(f) {
			errs = append(errs, fmt.Sprintf("%s is given twice (first on line %d)", where, prev))
			continue
		}
		seen[e.key] = e.line
		if explicit[e.key] {
			continue // the command line wins
		}
		if err := fs.Set(e.key, e.value); err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", where, err))
			continue
		}
		if e.key == "log-level" { // parse applied only the command line's
			if err := SetLogLevel(e.value); err != nil {
				errs = append(errs, fmt.Sprintf("%s: %v", where, err))
			}
		}
	}
	return errs
}
