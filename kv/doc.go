// Package kv is kvshim's vocabulary: the names every other package uses
// for what a KV object is (Namespace, Hash, Tag, Key) and how a copy moves
// it (Span, Direction). It sits at the bottom of the import graph (standard
// library only), so ipc, layout, cuda, objfmt, shim, server and server/l2
// share one declaration of each instead of converting between copies.
//
// A Key's String form is stable: it names L2 files and remote objects.
package kv
