package shim

import "github.com/kvshim/kvshim/objfmt"

// setLoadOptions sets the load job size and kvshim.verify for
// BenchmarkLoadPipeline; it reports whether this build has them.
func setLoadOptions(w *Worker, batch int, verify string) bool {
	p, err := objfmt.ParseVerifyPolicy(verify)
	if err != nil {
		panic(err)
	}
	loadBatchMax = batch
	w.cfg.Verify = p
	return true
}
