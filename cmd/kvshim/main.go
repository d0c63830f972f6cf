// Command kvshim is the standalone kvshim tool for storage hosts without
// Python: the same commands as the Python package's `kvshim` entry point
// (serve, stat, doctor), built static (CGO_ENABLED=0) by `make`.
//
// It links no cgo package: the CUDA loader (cuda/) lives only in
// libkvshim.so, so `kvshim doctor` here reports the CUDA probe as not
// built in (cli.CUDAProbe's default), which a storage host does not need.
package main

import (
	"errors"
	"os"

	"github.com/kvshim/kvshim/cli"
)

// version is stamped by the Makefile (-X main.version=…), like the .so's.
var version = "0.0.0-dev"

// abiVersion is libkvshim.so's C ABI version this binary was built beside;
// it has no C ABI itself, but `kvshim --version` prints the same line
// whichever way kvshim was started.
const abiVersion = cli.ABIVersion

func init() {
	cli.LogLevelFromEnv()
	cli.CUDAProbe = func() (string, error) {
		return "", errors.New("CUDA probe not built into the static kvshim binary (a storage host needs no GPU; " +
			"the Python package's `kvshim doctor` probes the driver)")
	}
}

func main() {
	os.Exit(cli.Main(os.Args, cli.Info{Version: version, ABI: abiVersion}))
}
