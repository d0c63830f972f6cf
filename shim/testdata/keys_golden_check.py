#!/usr/bin/env python3
"""Independent reference of kvshim's key encoding (namespace v1, root v2,
chunk v1; shim/keys_hash.go), checked against keys_golden.json. Standard
library only:

    python3 shim/testdata/keys_golden_check.py
"""
import hashlib
import json
import os
import struct
import sys


def lp(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def namespace(s: dict) -> bytes:
    tp = s["TPSize"] or s["WorldSize"]
    world, tp = (s["WorldSize"] // tp, 1) if s["MLA"] else (s["WorldSize"], tp)
    msg = (b"kvshim.namespace" + struct.pack("<I", 1)
           + lp(s["Model"].encode()) + lp(s["DType"].encode()) + lp(s["LayoutFingerprint"].encode())
           + struct.pack("<IIIIIB", s["ObjectFormat"], world, tp, s["ChunkSize"], s["KVGroup"], int(s["MLA"])))
    return hashlib.sha256(msg).digest()[:16]


def root_hash(ns: bytes, salt: str, lora: dict | None) -> bytes:
    """lora: None (no adapter) or {"name": ..., "path": ...}."""
    msg = b"kvshim.root.v2" + ns + lp(salt.encode())
    if lora is None:
        msg += b"\x00"
    else:
        msg += b"\x01" + lp(lora["name"].encode()) + lp(lora["path"].encode())
    return hashlib.sha256(msg).digest()


def chunk_hashes(ns, tokens, chunk, salt="", lora=None, mm=()):
    """mm: iterable of (hash_bytes, offset, length)."""
    prev = root_hash(ns, salt, lora)
    mm = sorted((o, n, h) for h, o, n in mm)
    out = []
    for i in range(len(tokens) // chunk):
        s, e = i * chunk, (i + 1) * chunk
        sel = [m for m in mm if m[0] < e and m[0] + m[1] > s]
        msg = (b"kvshim.chunk.v1" + prev + struct.pack("<I", chunk)
               + struct.pack("<%dI" % chunk, *tokens[s:e]) + struct.pack("<I", len(sel))
               + b"".join(lp(h) + struct.pack("<QQ", o, n) for o, n, h in sel))
        prev = hashlib.sha256(msg).digest()
        out.append(prev)
    return out


def main() -> int:
    with open(os.path.join(os.path.dirname(__file__), "keys_golden.json")) as f:
        g = json.load(f)
    bad = 0
    for c in g["namespaces"]:
        if namespace(c["spec"]).hex() != c["namespace"]:
            print("namespace mismatch:", c["name"]); bad += 1
    for c in g["chunks"]:
        ns = bytes.fromhex(c["namespace"])
        toks = [(i * 2654435761 + c["seed"]) % 2**32 for i in range(c["num_tokens"])]
        mm = [(m["hash"].encode(), m["offset"], m["length"]) for m in c.get("mm", [])]
        if root_hash(ns, c.get("cache_salt", ""), c.get("lora")).hex() != c["root"]:
            print("root mismatch:", c["name"]); bad += 1
        got = [h.hex() for h in chunk_hashes(ns, toks, c["chunk_size"], c.get("cache_salt", ""), c.get("lora"), mm)]
        if got != c["hashes"]:
            print("hash mismatch:", c["name"]); bad += 1
    print("ok" if not bad else f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
