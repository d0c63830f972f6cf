// Package plugin is the "plugin" L2 adapter: a third-party backend shipped
// as a shared library with the C ABI of include/kvshim_l2.h, loaded with no
// change to kvshim (LMCache's dynamic native connectors, LMCache #2851).
// Registered as l2 type "plugin". docs/l2-plugins.md is the guide for
// plugin authors; examples/l2-plugin is a complete plugin.
//
// # Design: the plugin runs in a host process
//
// kvshim does not dlopen the plugin itself. A small C program,
// kvshim-l2-host (host/kvshim_l2_host.c, built by make into out/), dlopens
// it, checks its ABI version and serves kvshim's batches over a pipe:
//
//	kvshim (Go)                                   kvshim-l2-host + plugin.so
//	  window: a memfd, 64 MiB ──── fd 3 ─────────►  mmap (the only kvshim memory it maps)
//	  Store(keys, bufs): copy bufs into window ──►  store(keys, window+off, len)
//	  Load(keys, bufs) ──────────────────────────►  load(keys, window+off, len)
//	           copy window → bufs, OK keys only ◄──  status per key
//	  LookupAndHold / Delete ────────────────────►  lookup / remove
//	  (frames on stdin/stdout; one host thread per batch)
//
// Why out of process:
//
//   - `kvshim serve` is a static binary built with CGO_ENABLED=0 (it runs
//     on storage hosts with no matching libc): it cannot dlopen anything.
//     The host is the only dynamically linked piece, and only plugin users
//     need it.
//   - A plugin's crash must not corrupt L1. In kvshim's process a wild
//     write would land in L1 (shared with every vLLM worker) or in the Go
//     heap. In the host, the only kvshim memory it can reach is the window,
//     and the bytes of a load reach L1 only for keys the plugin answered
//     KVSHIM_L2_OK, copied by kvshim after the answer. A crash kills the
//     host: every pending key fails with l2.ErrUnavailable (the exit
//     status, "signal: segmentation fault", in the error), and the next
//     batch starts a new host (at most once a second; batches in between
//     fail fast) that loads and opens the plugin again.
//   - A hang is bounded: a batch that passes the adapter's deadline
//     (op_timeout_ms) fails its keys with context.DeadlineExceeded like any
//     backend's; its window pages stay reserved until the host answers, and
//     a host that has not answered hang_grace_ms (default 5000) after the
//     deadline is killed (SIGKILL, logged), which frees them. Stats counts
//     restarts and such kills; Samples exports them
//     (kvshim_l2_plugin_restarts_total, kvshim_l2_plugin_hang_kills_total).
//
// The price is one memcpy per object each way (the window) and a pipe round
// trip per batch tile; `make bench-l2` measures it against the fs adapter
// (the example plugin is a file-per-object backend as fs is).
//
// # Finding the plugin and the host
//
// "library" is a path to the .so. "plugin": NAME finds an installed one:
// libkvshim-l2-NAME.so in the directories of $KVSHIM_L2_PLUGIN_PATH
// (colon-separated), or by default ~/.local/lib/kvshim/l2-plugins,
// /usr/local/lib/kvshim/l2-plugins, /usr/lib/kvshim/l2-plugins, first
// match wins. The host is "host", else $KVSHIM_L2_HOST, else
// kvshim-l2-host beside the running executable (out/kvshim finds
// out/kvshim-l2-host), else on $PATH.
//
// # Config
//
// Adapter-owned keys: "library" or "plugin" (one is required),
// "host", "window_bytes" (default 64 MiB; an object larger than the window
// fails), "hang_grace_ms" (5000), "open_timeout_ms" (30000: host start and
// the plugin's open()). Every other key (besides l2's own: type, name,
// num_workers, per_op_workers, op_timeout_ms, eviction) is the plugin's,
// passed to its open() as one JSON object. A plugin that is not a plugin,
// is built for another ABI version ("built for kvshim L2 plugin ABI 2; this
// kvshim speaks ABI 1") or refuses its config (KVSHIM_L2_EBADCONFIG) fails
// Open with an error wrapping l2.ErrBadConfig.
//
// Per-key statuses map to l2 results: OK, MISS, ESIZE (l2.ErrBufferSize),
// EUNAVAIL (l2.ErrUnavailable), EINVAL (l2.ErrBadBatch); the others fail
// the key with the status's name and the plugin's message. Holds are the
// l2 layer's: a held key never reaches the plugin's remove().
package plugin
