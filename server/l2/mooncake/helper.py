"""kvshim mooncake_store helper: runs Mooncake's Python client for the Go adapter.

Protocol (stdin/stdout of this process, both binary): each message is a
4-byte little-endian length followed by that many bytes of UTF-8 JSON.

  Go -> helper  {"id": n, "op": "setup", "config": {str: str}, "workers": n}
                {"id": n, "op": "segment", "seg": s, "path": "/proc/<pid>/fd/<fd>", "size": n}
                {"id": n, "op": "put"|"get"|"exists"|"remove",
                 "keys": [str], "seg": [s], "off": [n], "len": [n]}
  helper -> Go  {"id": n, "res": [int]}   one result per key (Mooncake's codes)
                {"id": n, "error": str}   the whole request failed

Buffers are (segment, offset, length) in shared memory the Go side mapped
first (memfd segments opened here through /proc/<pid>/fd/<fd>), so payloads
never cross the pipe. Requests run concurrently on a thread pool; the
Mooncake batch calls release the GIL.
"""

import json
import mmap
import os
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704

_out_lock = threading.Lock()
# The protocol owns the original stdout; fd 1 then points at stderr so that
# nothing Mooncake prints can corrupt the framing.
_out = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
_in = sys.stdin.buffer


def send(msg):
    data = json.dumps(msg, separators=(",", ":")).encode()
    with _out_lock:
        _out.write(struct.pack("<I", len(data)) + data)
        _out.flush()


def read_exact(n):
    buf = b""
    while len(buf) < n:
        chunk = _in.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


class Helper:
    def __init__(self):
        self.store = None
        self.segs = {}  # seg id -> (mmap, base address)
        self.pool = None

    def addr(self, seg, off, length):
        m, base, size = self.segs[seg]
        if off < 0 or length < 0 or off + length > size:
            raise ValueError("buffer out of segment range")
        return base + off

    def handle(self, req):
        op = req["op"]
        if op == "setup":
            from mooncake.store import MooncakeDistributedStore

            self.store = MooncakeDistributedStore()
            rc = self.store.setup(req["config"])
            if rc != 0:
                raise RuntimeError("MooncakeDistributedStore.setup returned %d" % rc)
            return [rc]
        if op == "segment":
            import ctypes

            fd = os.open(req["path"], os.O_RDWR)
            try:
                m = mmap.mmap(fd, req["size"])
            finally:
                os.close(fd)
            base = ctypes.addressof(ctypes.c_char.from_buffer(m))
            self.segs[req["seg"]] = (m, base, req["size"])
            return [self.store.register_buffer(base, req["size"])]
        keys = req["keys"]
        if op == "exists":
            return list(self.store.batch_is_exist(keys))
        if op == "remove":
            return list(self.store.batch_remove(keys, False))
        ptrs = [self.addr(s, o, n) for s, o, n in zip(req["seg"], req["off"], req["len"])]
        if op == "put":
            return list(self.store.batch_put_from(keys, ptrs, req["len"]))
        if op == "get":
            res = list(self.store.batch_get_into(keys, ptrs, req["len"]))
            # Mooncake refuses a buffer smaller than the object with
            # INVALID_PARAMS: answer the object's size instead, which the
            # adapter reports as ErrBufferSize, as for a larger buffer.
            for i, c in enumerate(res):
                if c == INVALID_PARAMS:
                    n = self.store.get_size(keys[i])
                    if n > req["len"][i]:
                        res[i] = n
            return res
        raise ValueError("unknown op %r" % op)

    def run_one(self, req):
        try:
            send({"id": req["id"], "res": self.handle(req)})
        except Exception as e:  # reported to Go as a whole-request failure
            send({"id": req.get("id", 0), "error": "%s: %s" % (type(e).__name__, e)})

    def main(self):
        while True:
            hdr = read_exact(4)
            if hdr is None:
                break
            body = read_exact(struct.unpack("<I", hdr)[0])
            if body is None:
                break
            req = json.loads(body)
            if req["op"] in ("setup", "segment"):
                self.run_one(req)  # in order, before any data op uses them
                if req["op"] == "setup":
                    self.pool = ThreadPoolExecutor(max_workers=max(1, int(req.get("workers", 4))))
                continue
            self.pool.submit(self.run_one, req)
        if self.pool:
            self.pool.shutdown(wait=True)
        if self.store is not None:
            self.store.close()


if __name__ == "__main__":
    Helper().main()
