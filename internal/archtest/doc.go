// Package archtest holds the test that keeps the import graph the way
// the architecture (docs/architecture.md, "Packages and imports")
// draws it: each package imports only the kvshim packages below it and only
// the third-party modules it is allowed. It has no code of its own.
package archtest
