package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/kvshim/kvshim/cli"
	"github.com/kvshim/kvshim/cuda"
	"github.com/kvshim/kvshim/layout"
)

// headerCodes reads the KVSHIM_OK / KVSHIM_E* defines of kvshim.h.
func headerCodes(t *testing.T) map[string]int {
	t.Helper()
	raw, err := os.ReadFile("kvshim.h")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, m := range regexp.MustCompile(`(?m)^#define\s+(KVSHIM_(?:OK|E[A-Z]+))\s+(-?\d+)`).FindAllStringSubmatch(string(raw), -1) {
		v, _ := strconv.Atoi(m[2])
		out[m[1]] = v
	}
	if len(out) == 0 {
		t.Fatal("no KVSHIM_E* defines in kvshim.h")
	}
	return out
}

func TestCodesMatchHeader(t *testing.T) {
	hdr := headerCodes(t)
	for code, name := range codeNames {
		if v, ok := hdr[name]; !ok {
			t.Errorf("%s (%d) is not declared in kvshim.h", name, code)
		} else if v != code {
			t.Errorf("%s is %d in kvshim.h, %d in the library", name, v, code)
		}
	}
	for name, v := range hdr {
		if codeNames[v] != name {
			t.Errorf("kvshim.h declares %s = %d, which the library does not know", name, v)
		}
	}
}

// Every code the header documents is something a failure can return: a
// row of codeTable produces it, or it has its own producer.
func TestEveryDocumentedCodeIsProduced(t *testing.T) {
	produced := map[int]string{
		codeOK:       "success",
		codePanic:    "guard (a recovered panic)",
		codeInternal: "codeOf (no row matches)",
	}
	for _, s := range codeTable {
		produced[s.code] = s.name
	}
	for name, v := range headerCodes(t) {
		if _, ok := produced[v]; !ok {
			t.Errorf("%s (%d) is documented in kvshim.h but nothing returns it", name, v)
		}
	}
}

// Each row's code is what its sentinel returns, however deeply wrapped: no
// earlier row shadows it.
func TestCodeTableRowsMap(t *testing.T) {
	seen := map[string]bool{}
	for _, s := range codeTable {
		if seen[s.name] {
			t.Errorf("%s has two rows", s.name)
		}
		seen[s.name] = true
		wrapped := fmt.Errorf("outer: %w", fmt.Errorf("inner: %w", s.err))
		if got := codeOf(wrapped); got != s.code {
			t.Errorf("%s wrapped twice: code %s, its row says %s", s.name, codeNames[got], codeNames[s.code])
		}
		joined := errors.Join(errors.New("unrelated"), s.err)
		if got := codeOf(joined); got != s.code {
			t.Errorf("%s joined: code %s, its row says %s", s.name, codeNames[got], codeNames[s.code])
		}
	}
	if got := codeOf(errors.New("something else")); got != codeInternal {
		t.Errorf("an error of no row: %s, want KVSHIM_EINTERNAL", codeNames[got])
	}
	if got := codeOf(nil); got != codeOK {
		t.Errorf("nil: %s", codeNames[got])
	}
}

// The codes the issue found wrong, from the real failures that produce
// them (not from the sentinels alone).
func TestRealFailuresMap(t *testing.T) {
	// Blocks 7 bytes apart overlap each other (as tests/test_layouts.py).
	var descs []layout.TensorDesc
	if err := json.Unmarshal([]byte(`[{"layer":"l0","group":0,"backend":"paged","device":"cpu","data_ptr":4096,
		"dtype_size":2,"shape":[4,2,16,8],"stride_bytes":[7,16,32,2]}]`), &descs); err != nil {
		t.Fatal(err)
	}
	_, err := layout.New(descs, 16)
	if err == nil {
		t.Fatal("layout.New accepted overlapping blocks")
	}
	if got := codeOf(fmt.Errorf("kvshim_worker_register: %w", err)); got != codeInval {
		t.Errorf("bad geometry (%v): %s, want KVSHIM_EINVAL", err, codeNames[got])
	}

	err = os.WriteFile("/dev/full", []byte("x"), 0)
	if err == nil {
		t.Skip("/dev/full accepted a write")
	}
	if got := codeOf(fmt.Errorf("embedded server: %w", err)); got != codeNoSpace {
		t.Errorf("a write to a full device (%v): %s, want KVSHIM_ENOSPC", err, codeNames[got])
	}

	if cuda.Init() == nil {
		t.Log("a CUDA driver is loadable here: the no-driver case is left to the C test")
		return
	}
	_, err = cuda.NewDeviceEngine(0)
	if got := codeOf(err); got != codeNotSup {
		t.Errorf("no CUDA driver (%v): %s, want KVSHIM_ENOTSUP", err, codeNames[got])
	}
}

// TestCodeTableCoversEverySentinel reads the sources of every package
// linked into the library (go list -deps) and checks that each sentinel
// error they declare (a package-level Err* variable, and this package's
// err* ones) has a row in codeTable under its name, and that the row holds
// that sentinel (its text matches the errors.New literal).
func TestCodeTableCoversEverySentinel(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}\t{{.Dir}}\t{{join .GoFiles \" \"}} {{join .CgoFiles \" \"}}", ".").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	declared := map[string]string{} // name -> errors.New literal ("" for other forms)
	const module = "github.com/kvshim/kvshim"
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.SplitN(line, "\t", 3)
		if len(f) != 3 || (f[0] != module && !strings.HasPrefix(f[0], module+"/")) {
			continue
		}
		// A backend's sentinels (server/l2/fs, …) wrap one of package l2's,
		// which has the row: the table never imports a backend.
		backend := strings.HasPrefix(f[0], module+"/server/l2/")
		for _, file := range strings.Fields(f[2]) {
			sentinelsOf(t, filepath.Join(f[1], file), declared, backend)
		}
	}
	if len(declared) < 20 {
		t.Fatalf("found only %d sentinels: the source walk is broken", len(declared))
	}
	rows := map[string]sentinel{}
	for _, s := range codeTable {
		rows[s.name] = s
	}
	for name, lit := range declared {
		s, ok := rows[name]
		if !ok {
			t.Errorf("%s has no row in codeTable (export/errors.go): choose its KVSHIM_E* code", name)
			continue
		}
		if lit != "" && s.err.Error() != lit {
			t.Errorf("codeTable row %s holds an error reading %q, the source declares %q", name, s.err.Error(), lit)
		}
	}
	for name := range rows {
		if _, ok := declared[name]; !ok && !strings.HasPrefix(name, "stdlib ") {
			t.Errorf("codeTable row %s names no sentinel declared in the library's packages", name)
		}
	}
}

// sentinelsOf adds the sentinel errors declared at package level in file:
// exported Err* variables (and unexported err* ones in package main) set
// from errors.New or fmt.Errorf. Aliases of another package's sentinel
// (layout.ErrKeyMismatch = objfmt.ErrKeyMismatch) are that sentinel. In a
// backend's file every sentinel must be fmt.Errorf wrapping an l2.Err*
// (its code is that one's) and is not added.
func sentinelsOf(t *testing.T, file string, into map[string]string, backend bool) {
	f, err := parser.ParseFile(token.NewFileSet(), file, nil, parser.SkipObjectResolution)
	if err != nil {
		t.Fatal(err)
	}
	pkg := f.Name.Name
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.VAR {
			continue
		}
		for _, spec := range g.Specs {
			vs := spec.(*ast.ValueSpec)
			for i, id := range vs.Names {
				if i >= len(vs.Values) {
					continue
				}
				if !strings.HasPrefix(id.Name, "Err") && !(pkg == "main" && strings.HasPrefix(id.Name, "err")) {
					continue
				}
				call, ok := vs.Values[i].(*ast.CallExpr)
				if !ok {
					continue
				}
				sel, ok := call.Fun.(*ast.SelectorExpr)
				if !ok {
					continue
				}
				x, _ := sel.X.(*ast.Ident)
				if x == nil || !(x.Name == "errors" && sel.Sel.Name == "New" || x.Name == "fmt" && sel.Sel.Name == "Errorf") {
					continue
				}
				if backend {
					if !wrapsL2(call) {
						t.Errorf("%s: %s.%s must be fmt.Errorf(\"…: %%w\", l2.Err…) so that export's code table needs no import of the backend",
							file, pkg, id.Name)
					}
					continue
				}
				lit := ""
				if b, ok := call.Args[0].(*ast.BasicLit); ok && x.Name == "errors" {
					lit, _ = strconv.Unquote(b.Value)
				}
				into[pkg+"."+id.Name] = lit
			}
		}
	}
}

// wrapsL2 reports whether call is fmt.Errorf with an l2.Err* argument.
func wrapsL2(call *ast.CallExpr) bool {
	if sel, ok := call.Fun.(*ast.SelectorExpr); !ok || sel.Sel.Name != "Errorf" {
		return false
	}
	for _, a := range call.Args[1:] {
		if sel, ok := a.(*ast.SelectorExpr); ok {
			if x, ok := sel.X.(*ast.Ident); ok && x.Name == "l2" && strings.HasPrefix(sel.Sel.Name, "Err") {
				return true
			}
		}
	}
	return false
}

// The ABI version the library reports is the header's MAJOR.MINOR.
func TestABIVersionMatchesHeader(t *testing.T) {
	raw, err := os.ReadFile("kvshim.h")
	if err != nil {
		t.Fatal(err)
	}
	ver := map[string]int{}
	for _, m := range regexp.MustCompile(`(?m)^#define KVSHIM_ABI_(MAJOR|MINOR) (\d+)$`).FindAllSubmatch(raw, -1) {
		ver[string(m[1])], _ = strconv.Atoi(string(m[2]))
	}
	if len(ver) != 2 || ver["MAJOR"] != cli.ABIMajor || ver["MINOR"] != cli.ABIMinor {
		t.Fatalf("kvshim.h says ABI %v, the library %d.%d", ver, cli.ABIMajor, cli.ABIMinor)
	}
	if abiVersion != ver["MAJOR"]*1000+ver["MINOR"] {
		t.Fatalf("kvshim_abi_version returns %d", abiVersion)
	}
}
