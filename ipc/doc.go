// Package ipc is kvshim's control plane between clients (the c-shared
// library in vLLM processes) and the server: shared-memory segments, SPSC
// byte rings with futex wakeups, a Unix-socket handshake that passes file
// descriptors, and a versioned, bounds-checked message codec.
//
// # Pieces
//
//	segment.go   memfd (fallback: unlinked /dev/shm file) + ftruncate + mmap(MAP_SHARED),
//	             sealed against resize; SegmentTable resolves a Loc with range checks
//	ring.go      ring header, attach/validate, the spin-then-futex wait
//	ring_rw.go   Claim/Commit/Abort/Write (producer), Read/Release (consumer)
//	futex.go     FUTEX_WAIT/FUTEX_WAKE on shared memory (no PRIVATE flag)
//	codec*.go    frame header, hello, every request/response body of msg.go
//	sock.go      socket dir/path, SO_PEERCRED check, SCM_RIGHTS messages
//	stale.go     RemoveDeadSockets: dead servers' socket files (ours, nobody listening)
//	server.go    Listen, Listener, handshake;  serverconn.go: ServerConn, Serve, Handler
//	client.go    Dial, Client.Call (goroutine-safe), Resolve;  service.go: typed API
//
// # Ring layout (one ring; a session's mapping holds SQ then CQ back to back)
//
//	offset 0     ┌──────────────────────────────────────────────────────────────┐
//	 slot 0      │ magic u64 "VKSRING1" │ version u32 │ header size u32          │
//	 (128 B)     │ capacity u64 │ data offset u64                               │
//	             │ tail/head/consWait/prodWait/prodBeat/consBeat/closed: u32    │
//	             │   offsets of the counter slots (io_uring style: readers use  │
//	             │   these, so the layout can move without a format break)      │
//	             │ max record u32 │ producer pid u32 │ consumer pid u32         │
//	 128         ├─ tail u64      (producer position, free-running)  ───────────┤
//	 256         ├─ head u64      (consumer position, free-running)  ───────────┤
//	 384         ├─ consWait u32  (1 = consumer sleeps on this futex) ──────────┤
//	 512         ├─ prodWait u32  (1 = producer sleeps: ring was full) ─────────┤
//	 640         ├─ prodBeat u64  (producer heartbeat, CLOCK_MONOTONIC ns) ─────┤
//	 768         ├─ consBeat u64  (consumer heartbeat) ─────────────────────────┤
//	 896         ├─ closed u32    (either side shut the ring down) ─────────────┤
//	             │ ... (each counter owns a 128-byte slot: no false sharing)    │
//	4096         ├──────────────────────────────────────────────────────────────┤
//	 data        │ record │ record │ ... │ padding │   capacity = 2^k bytes     │
//	             └──────────────────────────────────────────────────────────────┘
//
//	record (8-byte aligned):  int32 length │ int32 type │ payload (length-8 bytes)
//	  length  < 0  in progress (claimed, being written)
//	  length == 0  nothing written yet (consumed space is zeroed again)
//	  length  > 0  committed: one atomic store publishes the whole record
//	  type == -1   padding to the end of the data region (records never wrap)
//	  type ==  1   a codec frame: FrameHeader (16 B) + body
//
// The producer writes -len, moves the tail, fills the payload, then stores
// +len (release). The consumer loads the length at head (acquire), hands the
// payload out, then zeroes the record and stores the new head. A record
// larger than capacity/2 is refused (ErrTooLarge). A full ring blocks the
// producer until the deadline, then ErrRingFull: nothing is dropped.
//
// # Wakeups
//
// A waiter spins for RingOptions.Spin (default 50 µs), then:
//
//	waiter:   word = 1 ; (full fence) ; re-check ring ; FUTEX_WAIT(word, 1, ≤ WaitSlice) ; word = 0 ; re-check
//	notifier: publish (len or head store) ; (full fence) ; if word == 1 && CAS(word, 1→0): FUTEX_WAKE
//
// Go's sync/atomic operations are sequentially consistent, so the store →
// load pairs above are the Dekker handshake that makes a lost wakeup
// impossible; wakeups are still only hints: every sleep is bounded by
// WaitSlice and every wait has a deadline. An idle session costs no CPU
// beyond one heartbeat tick per HeartbeatInterval per side.
//
// # Failure handling
//
//   - A record left in progress (negative length) unchanged for
//     StallTimeout, e.g. a writer SIGKILLed mid-record: Read returns
//     ErrPeerStalled and the session ends.
//   - Bad record header, lying head/tail counters: ErrCorrupt, session ends.
//   - Malformed frame or body: ErrMalformed, session ends (logged).
//   - Socket closed (peer exit or crash), or no heartbeat for
//     HeartbeatTimeout: ErrPeerGone, session ends. Done() is closed.
//
// The server never trusts client-written memory: it keeps its own head and
// tail, validates every length against the ring, and copies or decodes
// bodies with bounds checks. Every Loc is range-checked (SegmentTable).
//
// # Handshake (SOCK_SEQPACKET socket, dir 0700, socket 0600)
//
//	client → hello {magic, version, role, pid, instance uuid}
//	server    SO_PEERCRED uid check, version check   → refuse {code, reason}
//	server → welcome {version, session, server uuid, ring capacities,
//	                  N initial segments, heartbeat settings} + ring pair fd
//	server → N × segment {id, size} + fd             (Dial returns after these)
//	  ... later: segment announcements as L1 grows, always sent before the
//	  ring answer that names them; Client.Resolve waits for an unknown id.
//
// # Versions, KV events (protocol 4), answers in the ack (protocol 5)
//
// A hello may carry any version from MinProtocolVersion (3) to
// ProtocolVersion (5); the welcome echoes the client's, so an older client
// keeps working against a newer server (a newer client is refused by an
// older server at the hello, never misread later). Version 5 adds
// LookupReq.AnswerFinal: a LOOKUP final at registration (nothing to fill
// from L2) is answered, and consumed, by its ack, sparing the scheduler the
// OpLookupResult round trip it would start at once; a pending one's ack
// stays empty. Version 4 adds OpEvents
// (events.go): a scheduler announces the chunk keys it told vLLM's
// KV-event publisher about and takes the events the server queued for its
// session (an announced chunk evicted from L1 or dropped by an L2, or
// written to an L2). The server notifies, nobody polls: an answer to a
// session with events queued carries FlagEventsPending in its frame header
// (only sessions that sent OpEvents are flagged, so a version-3 client never
// sees the bit); a direct session's client is marked through
// Client.MarkEventsPending. The client asks with OpEvents only then.
//
// # Server usage
//
//	l, _ := ipc.Listen(ipc.DefaultSocketPath(), &ipc.ServerConfig{})
//	l.AddSegment(seg)                       // every session gets it (now or at accept)
//	for {
//		c, err := l.Accept()                  // handshake done; refused peers never show up
//		if err != nil { break }
//		go func() {
//			err := c.Serve(ipc.ServiceHandler(newSessionState(c)))  // or a raw Handler
//			cleanupSession(c, err)              // c.Done() is closed, c.Err() == err
//		}()
//	}
//
// One goroutine per session runs Serve: it reads a request, calls the
// handler (body valid during the call), writes the answer. A Handler
// returns (status, body, err); err ends the session (malformed input). A
// panic in the handler answers StatusInternal and the session continues.
//
// # Client usage
//
//	c, _ := ipc.Dial(path, ipc.Hello{Role: ipc.RoleWorker}, 5*time.Second)
//	resp, err := c.Alloc(ctx, &ipc.AllocReq{...})   // or c.Call(ctx, op, body)
//	buf, err := c.Resolve(resp.Locs[i])             // range-checked []byte in L1
//
// Client methods are safe from any goroutine: a mutex serialises producers
// on the submission ring; callers take turns reading the completion ring
// and hand each other's answers over by request id.
package ipc
