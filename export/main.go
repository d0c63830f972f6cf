package main

import "C"

// main is required by -buildmode=c-shared and never runs.
func main() {}
