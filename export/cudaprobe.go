package main

import (
	"fmt"

	"github.com/kvshim/kvshim/cli"
	"github.com/kvshim/kvshim/cuda"
)

// The doctor's CUDA line comes from the real loader (cli itself stays free
// of cgo packages).
func init() {
	cli.CUDAProbe = func() (string, error) {
		info, err := cuda.Info()
		if err != nil {
			return "", err
		}
		batch := info.BatchAPI
		if batch == "" {
			batch = "none (per-span copies)"
		}
		return fmt.Sprintf("driver %d.%d at %s, %d device(s), batched copies: %s",
			info.Version/1000, info.Version%1000/10, info.Library, info.Devices, batch), nil
	}
}
