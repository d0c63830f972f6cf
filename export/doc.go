// Command export is the c-shared entry point of kvshim: `go build
// -buildmode=c-shared` turns it into libkvshim.so. It owns the //export
// functions, the handle table, the error codes and the handwritten public
// header kvshim.h; all logic lives in the packages it calls (shim, server,
// ipc).
//
// ABI rules (after tailscale's libtailscale):
//
//   - Names are snake_case and match kvshim.h exactly; build/check-header.py
//     fails the build when the header and the exports disagree.
//   - Objects are integer handles, never pointers; C never keeps a Go pointer.
//   - Every function returns 0 or a negative KVSHIM_E* code; the text of the
//     last error of a handle (or of the library, handle 0) is copied into a
//     caller's buffer by kvshim_last_error. The code of an error is the
//     first row of codeTable (errors.go) it wraps: every sentinel of every
//     linked package has one, and the Go test fails on a sentinel without.
//   - Every export runs its body through call (a handle) or callLib (none):
//     panics become KVSHIM_EPANIC, the handle is looked up and its role
//     checked, and the error is recorded where kvshim_last_error reads it.
//   - Output that does not fit a caller's buffer is kept for the calling
//     thread (kvshim_take_output), never shared between threads.
//   - Role configs and the embedded server live in export/connector.
//   - The Go runtime does not survive fork(): load the library after forking.
package main
