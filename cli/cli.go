package cli

import (
	"fmt"
	"io"
	"os"
	"sort"
	"strings"

	"github.com/kvshim/kvshim/ipc"
)

// Info describes the library the CLI runs in.
type Info struct {
	Version string
	ABI     int // ABIVersion
}

// The C ABI of libkvshim.so (export/kvshim.h's KVSHIM_ABI_MAJOR and _MINOR;
// export's TestABIVersionMatchesHeader holds them to the header). They live
// here so the library and the static out/kvshim, which has no C ABI but
// prints the version beside it, state one number: MINOR grows when
// something is added, MAJOR when anything is removed or changes meaning.
const (
	ABIMajor   = 6
	ABIMinor   = 0
	ABIVersion = ABIMajor*1000 + ABIMinor // what kvshim_abi_version returns
)

// ABIString is abi (MAJOR*1000 + MINOR) as "MAJOR.MINOR".
func ABIString(abi int) string { return fmt.Sprintf("%d.%d", abi/1000, abi%1000) }

type command struct {
	summary string
	run     func(args []string, info Info, stdout, stderr io.Writer) int
}

var commands = map[string]command{}

func usage(w io.Writer) {
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	fmt.Fprintln(w, "usage: kvshim <command> [flags]\n\ncommands:")
	for _, n := range names {
		fmt.Fprintf(w, "  %-8s %s\n", n, commands[n].summary)
	}
	fmt.Fprintf(w, "  %-8s %s\n", "demo", "store and restore a model-shaped KV cache (provided by the Python package's kvshim entry point)")
	fmt.Fprintln(w, "\nrun 'kvshim <command> --help' for a command's flags; 'kvshim --version' for the version")
}

// Main runs the command named by args[1] (args[0] is the program name) and
// returns the process exit code: 0 success, 1 failure, 2 usage error.
func Main(args []string, info Info) int {
	return run(args, info, os.Stdout, os.Stderr)
}

func run(args []string, info Info, stdout, stderr io.Writer) int {
	if len(args) < 2 {
		usage(stderr)
		return 2
	}
	switch args[1] {
	case "-h", "--help", "help":
		usage(stdout)
		return 0
	case "--version", "version":
		fmt.Fprintf(stdout, "kvshim %s (C ABI %s, protocol %d)\n", info.Version, ABIString(info.ABI), ipc.ProtocolVersion)
		return 0
	}
	cmd, ok := commands[args[1]]
	if !ok {
		fmt.Fprintf(stderr, "kvshim: unknown command %q\n", args[1])
		usage(stderr)
		return 2
	}
	return cmd.run(args[2:], info, stdout, stderr)
}

// joinQuoted is for error messages that list valid choices.
func joinQuoted(xs []string) string {
	q := make([]string, len(xs))
	for i, x := range xs {
		q[i] = fmt.Sprintf("%q", x)
	}
	return strings.Join(q, ", ")
}
