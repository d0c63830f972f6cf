// Package serverbench measures the server core (package server) with no
// transport: lookup latency over 512 chunks × 8 ranks, ALLOC+COMMIT
// throughput, metadata bytes per object and bytes left after CLEAR.
// A cmd/ program calls Run and prints the Result as JSON.
//
// L1 memory comes from anonymous MAP_NORESERVE mappings (untouched pages
// cost no RAM, and they sit outside the Go heap, so heap growth is pure
// metadata).
package serverbench
