package archtest

import (
	"encoding/json"
	"io"
	"os/exec"
	"path"
	"sort"
	"strings"
	"testing"
)

const module = "github.com/kvshim/kvshim"

// allowed maps a package (relative to the module; "x/..." covers x and
// everything under it unless a longer entry matches) to the kvshim packages
// and third-party module prefixes it may import. The standard library is
// always allowed. The import table of docs/architecture.md, with the
// packages added since (objfmt, trace, cli, server's subpackages).
var allowed = map[string][]string{
	"kv":                {},
	"objfmt":            {"kv"},
	"ipc":               {"kv", "golang.org/x/sys", "github.com/google/uuid"},
	"layout":            {"kv", "objfmt"},
	"internal/ntcopy":   {"github.com/klauspost/cpuid"},
	"internal/fakecuda": {},
	"cuda":              {"kv", "internal/ntcopy"},
	"trace":             {"kv", "github.com/apache/arrow/go/v17", "github.com/google/uuid", "golang.org/x/sys"},
	"shim":              {"kv", "ipc", "layout", "cuda", "objfmt", "trace", "github.com/google/uuid", "golang.org/x/sys"},
	"server/l2":         {"kv", "server/l2", "server/internal/metric", "github.com/redis/go-redis", "github.com/minio/minio-go", "golang.org/x/sys", "github.com/prometheus"},
	"server/l1":         {"kv", "objfmt"},
	"server/tier":       {"kv", "ipc", "objfmt", "server/l1", "server/l2", "server/internal/metric", "trace", "github.com/prometheus"},
	// the server's one metrics style (server, server/tier, server/l2 use it)
	"server/internal/metric": {"github.com/prometheus"},
	"server":                 {"kv", "ipc", "objfmt", "server", "trace", "github.com/prometheus", "github.com/google/uuid", "golang.org/x/sys"},
	"cli":                    {"kv", "ipc", "server", "trace", "github.com/prometheus", "golang.org/x/sys", "github.com/klauspost/cpuid"},
	"export":                 {"kv", "cli", "cuda", "ipc", "layout", "objfmt", "server", "shim", "trace", "export/connector", "github.com/google/uuid"},
	"export/connector":       {"kv", "ipc", "layout", "objfmt", "server", "shim", "trace", "github.com/google/uuid"},
	// the ABI's JSON Schemas and their validator (tests and tools only)
	"export/schema":     {"github.com/santhosh-tekuri/jsonschema"},
	"internal/archtest": {},
	"internal/testkit":  {},
	"cmd":               {"kv", "cli", "cuda", "ipc", "layout", "server", "shim", "internal", "github.com/google/uuid", "golang.org/x/sys"},
}

// denied narrows allowed: a package may not import these (prefixes of
// kvshim packages) even where its rule allows a parent. export names a
// backend's errors through the l2 sentinels they wrap (export/errors.go), so
// adding a backend never touches the C ABI's package.
var denied = map[string][]string{
	"export":           {"server/l2/"},
	"export/connector": {"server/l2/"},
}

func isDenied(pkg, imp string) bool {
	for _, d := range denied[pkg] {
		if strings.HasPrefix(imp, module+"/"+d) {
			return true
		}
	}
	return false
}

// rule returns the allowed list of the longest entry of allowed that is p or
// a parent of p.
func rule(p string) ([]string, bool) {
	for q := p; q != "." && q != "/"; q = path.Dir(q) {
		if r, ok := allowed[q]; ok {
			return r, true
		}
	}
	return nil, false
}

func permitted(imp string, r []string) bool {
	for _, a := range r {
		full := a
		if !strings.Contains(a, ".") { // a kvshim package
			full = module + "/" + a
		}
		if imp == full || strings.HasPrefix(imp, full+"/") || (strings.Contains(a, ".") && strings.HasPrefix(imp, a)) {
			return true
		}
	}
	return false
}

type goPackage struct {
	ImportPath string
	Imports    []string
	Standard   bool
}

// TestImportGraph lists every package of the module (tests excluded: a
// test may import what it needs to drive its package) and checks each
// import against allowed.
func TestImportGraph(t *testing.T) {
	out, err := exec.Command("go", "list", "-json", module+"/...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	var bad []string
	seen := 0
	for {
		var p goPackage
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		seen++
		rel := strings.TrimPrefix(strings.TrimPrefix(p.ImportPath, module), "/")
		r, ok := rule(rel)
		if !ok {
			bad = append(bad, rel+": no rule in allowed (add the package to the table and to docs/architecture.md)")
			continue
		}
		for _, imp := range p.Imports {
			if !strings.Contains(strings.SplitN(imp, "/", 2)[0], ".") || imp == "C" {
				continue // standard library
			}
			// A package may import its own subpackages' test helpers only
			// from tests, never here; its own subtree is allowed only when
			// listed (server/l2 adapters import server/l2).
			if !permitted(imp, r) || isDenied(rel, imp) {
				bad = append(bad, rel+" imports "+strings.TrimPrefix(imp, module+"/"))
			}
		}
	}
	if seen < 10 {
		t.Fatalf("go list returned %d packages; expected the whole module", seen)
	}
	sort.Strings(bad)
	for _, b := range bad {
		t.Error(b)
	}
}

// TestRuleCatchesAnUpwardImport checks the checker: layout importing shim
// (an upward import) is refused, layout importing objfmt is not.
func TestRuleCatchesAnUpwardImport(t *testing.T) {
	r, _ := rule("layout")
	if permitted(module+"/shim", r) {
		t.Error("layout -> shim permitted")
	}
	if !permitted(module+"/objfmt", r) {
		t.Error("layout -> objfmt refused")
	}
	if !isDenied("export", module+"/server/l2/fs") || isDenied("export", module+"/server/l2") {
		t.Error("export: wants server/l2/fs denied and server/l2 allowed")
	}
	r, _ = rule("server/l2/fs")
	if !permitted(module+"/server/l2", r) || permitted(module+"/server", r) {
		t.Error("server/l2/fs: wants server/l2 allowed and server refused")
	}
}
