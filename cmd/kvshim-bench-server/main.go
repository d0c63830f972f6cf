// Command kvshim-bench-server measures the MP server core (`make
// bench-server`): a lookup of a 128K-token prompt at TP=8 (4,096 keys),
// ALLOC+COMMIT throughput, metadata bytes per object and memory returned by
// CLEAR. The last line of its output is one JSON object.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/kvshim/kvshim/server/serverbench"
)

func main() {
	res, err := serverbench.Run(serverbench.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvshim-bench-server:", err)
		os.Exit(1)
	}
	b, err := json.Marshal(res)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvshim-bench-server:", err)
		os.Exit(1)
	}
	fmt.Println(string(b))
}
