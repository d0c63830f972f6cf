"""ctypes bindings of libkvshim.so, loaded lazily on first use.

Nothing here runs at import: `library()` loads the shared object the first
time a caller needs it, in the process that needs it (after any fork).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any

from kvshim.errors import EBADH, ERANGE, error_for

ABI_VERSION = 2  # kvshim.h's KVSHIM_ABI_VERSION

_c_handle = ctypes.c_int64
_u64p = ctypes.POINTER(ctypes.c_uint64)
_i64p = ctypes.POINTER(ctypes.c_int64)
_u32p = ctypes.POINTER(ctypes.c_uint32)
_sizep = ctypes.POINTER(ctypes.c_size_t)

# name -> argtypes; every function returns int.
_SIGNATURES: dict[str, list[type]] = {
    "kvshim_abi_version": [],
    "kvshim_version": [ctypes.c_char_p, ctypes.c_size_t],
    "kvshim_last_error": [_c_handle, ctypes.c_char_p, ctypes.c_size_t],
    "kvshim_open": [ctypes.c_char_p, ctypes.POINTER(_c_handle)],
    "kvshim_close": [_c_handle],
    "kvshim_handle_count": [],
    "kvshim_debug_panic": [_c_handle],
    "kvshim_main": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "kvshim_take_output": [_c_handle, ctypes.c_void_p, ctypes.c_size_t, _sizep],
    "kvshim_stats": [_c_handle, ctypes.c_void_p, ctypes.c_size_t, _sizep],
    "kvshim_ping": [_c_handle, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, _sizep],
    "kvshim_sched_match": [_c_handle, ctypes.c_char_p, _u32p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_int64, _i64p],
    # Called through ctypes.PyDLL with a py_object (tokens_from_list), never as this CDLL function.
    "kvshim_tokens_from_list": [ctypes.c_void_p, _u32p, ctypes.c_size_t, _sizep],
    "kvshim_sched_after_alloc": [_c_handle, ctypes.c_char_p, _i64p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int64],
    "kvshim_sched_build_meta": [_c_handle, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, _sizep],
    "kvshim_sched_finished": [_c_handle, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)],
    "kvshim_sched_finished_tokens": [_c_handle, ctypes.c_char_p, _u32p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int64,
                                     _i64p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)],
    "kvshim_worker_register": [_c_handle, ctypes.c_char_p],
    "kvshim_worker_bind": [_c_handle, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64],
    "kvshim_worker_start_loads": [_c_handle],
    "kvshim_worker_start_saves": [_c_handle, ctypes.c_uint64],
    "kvshim_worker_poll": [_c_handle, ctypes.c_void_p, ctypes.c_size_t, _sizep],
    "kvshim_worker_wait": [_c_handle, ctypes.c_int64],
    "kvshim_worker_engine_copy": [_c_handle, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, _i64p, ctypes.c_size_t,
                                  ctypes.c_int64, _u64p],
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_loaded_pid: int | None = None


def library_path() -> Path:
    """Where the shared object is: $KVSHIM_LIBRARY, else inside the package."""
    env = os.environ.get("KVSHIM_LIBRARY")
    if env:
        return Path(env)
    return Path(__file__).with_name("libkvshim.so")


def library() -> ctypes.CDLL:
    """Loads libkvshim.so once per process and checks its ABI version."""
    global _lib, _loaded_pid
    with _lock:
        if _lib is not None:
            if _loaded_pid != os.getpid():
                # The Go runtime's threads did not survive the fork; calling
                # into it here would hang or crash.
                raise RuntimeError(
                    "libkvshim.so was loaded before this process forked; load it only after fork "
                    "(create kvshim objects in the child)"
                )
            return _lib
        path = library_path()
        if not path.exists():
            raise FileNotFoundError(
                f"libkvshim.so not found at {path}: install the kvshim wheel, or build it with `make` "
                "and set KVSHIM_LIBRARY=out/libkvshim.so"
            )
        lib = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        abi = lib.kvshim_abi_version()
        if abi != ABI_VERSION:
            raise ImportError(f"{path} has ABI version {abi}, this package needs {ABI_VERSION}")
        _lib, _loaded_pid = lib, os.getpid()
        return lib


def loaded() -> bool:
    """Whether this process has loaded the library (tests check imports stay lazy)."""
    return _lib is not None


def last_error(handle: int = 0) -> str:
    buf = ctypes.create_string_buffer(4096)
    library().kvshim_last_error(handle, buf, len(buf))
    return buf.value.decode("utf-8", "replace")


def check(rc: int, handle: int = 0) -> int:
    """Raises the exception for a negative return code with its message."""
    if rc < 0:
        # Errors of an unknown handle are recorded on the library (handle 0).
        msg = last_error(handle) if handle and rc != EBADH else last_error(0)
        raise error_for(rc, msg)
    return rc


def version() -> str:
    buf = ctypes.create_string_buffer(256)
    check(library().kvshim_version(buf, len(buf)))
    return buf.value.decode()


def run_main(argv: list[str]) -> int:
    """Runs the Go command line (doctor, serve, stat) in this process."""
    args = (ctypes.c_char_p * (len(argv) + 1))(*[a.encode() for a in argv], None)
    return library().kvshim_main(len(argv), args)


class Handle:
    """An open kvshim handle; close() (or a with-block) releases it."""

    def __init__(self, config: str) -> None:
        out = _c_handle(0)
        check(library().kvshim_open(config.encode(), ctypes.byref(out)))
        self.value: int = out.value
        self._buf = ctypes.create_string_buffer(64 << 10)

    def close(self) -> None:
        if self.value:
            h, self.value = self.value, 0
            check(library().kvshim_close(h))

    def check(self, rc: int) -> int:
        return check(rc, self.value)

    def output(self, fn_name: str, *args: object) -> bytes:
        """Calls a function with variable-length output (buf, cap, out_len
        last) and returns the bytes, fetching them with kvshim_take_output
        when they did not fit the first buffer."""
        lib = library()
        n = ctypes.c_size_t(0)
        rc = getattr(lib, fn_name)(self.value, *args, self._buf, len(self._buf), ctypes.byref(n))
        if rc == ERANGE:  # kept on the handle for this thread: fetch it with a buffer that fits
            self._buf = ctypes.create_string_buffer(max(n.value, 2 * len(self._buf)))
            rc = lib.kvshim_take_output(self.value, self._buf, len(self._buf), ctypes.byref(n))
        self.check(rc)
        return self._buf.raw[: n.value]

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_from_list: Any = None  # kvshim_tokens_from_list, called with the GIL held
_from_list_len = ctypes.c_size_t()


def tokens_from_list(tokens: list, out: int, cap: int) -> bool:
    """Writes the ids of the list `tokens` as uint32 at address out (room
    for cap ids) in one C loop inside the library, and says whether it did:
    False when an id is no int in [0, 2^32), when the list is longer than
    cap, or when the library cannot read Python objects here (the caller
    then converts with Python and gets its error). About 3.5x faster than
    array('I', tokens): the loop reads the list's items in place, with no
    Python-level call per id."""
    global _from_list
    fn = _from_list
    if fn is None or _loaded_pid != os.getpid():
        try:
            lib = library()  # raises RuntimeError in a child forked after the load
            # The same loaded library, called as a PyDLL function: the GIL
            # stays held, since the loop reads Python objects.
            fn = ctypes.PyDLL(lib._name, handle=lib._handle).kvshim_tokens_from_list
        except (OSError, ImportError, AttributeError):  # no library here, or one without the function
            return False
        fn.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
        fn.restype = ctypes.c_int
        _from_list = fn
    return fn(tokens, out, cap, _from_list_len) == 0
