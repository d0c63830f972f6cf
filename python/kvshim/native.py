"""ctypes bindings of libkvshim.so, loaded lazily on first use.

Nothing here runs at import: `library()` loads the shared object the first
time a caller needs it, in the process that needs it (after any fork).
"""

from __future__ import annotations

import array
import ctypes
import enum
import json
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypedDict, Union

from kvshim import _abi
from kvshim.errors import EBADH, ERANGE, ETIMEDOUT, InvalidArgumentError, NotSupportedError, error_for

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+

# The ABI this package was built against (generated from kvshim.h): a
# library of the same major and at least this minor serves it.
ABI_MAJOR, ABI_MINOR = _abi.ABI_MAJOR, _abi.ABI_MINOR

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
    "kvshim_take_step_stats": [_c_handle, ctypes.c_void_p, ctypes.c_size_t, _sizep],  # ABI 6.0
    "kvshim_ping": [_c_handle, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, _sizep],
    "kvshim_sched_match": [_c_handle, ctypes.c_char_p, _u32p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_int64, _i64p],
    # The two below are called through ctypes.PyDLL with a py_object (_py_function), never as these CDLL functions.
    "kvshim_tokens_from_list": [ctypes.c_void_p, _u32p, ctypes.c_size_t, _sizep],
    "kvshim_sched_match_list": [_c_handle, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64, _i64p],
    "kvshim_sched_after_alloc": [_c_handle, ctypes.c_char_p, _i64p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int64,
                                 ctypes.c_int64],
    "kvshim_sched_build_meta": [_c_handle, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, _sizep],
    "kvshim_sched_finished": [_c_handle, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)],
    "kvshim_sched_finished_tokens": [_c_handle, ctypes.c_char_p, _u32p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int64,
                                     _i64p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)],
    # vLLM's controls (kvshim.h, "Scheduler role: vLLM's controls")
    "kvshim_sched_reset": [_c_handle, _u64p],
    "kvshim_sched_hit_sources": [_c_handle, ctypes.c_char_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t, _sizep],
    "kvshim_sched_request_options": [_c_handle, ctypes.c_char_p, ctypes.c_char_p],
    "kvshim_sched_received": [_c_handle, ctypes.c_char_p],
    "kvshim_worker_take_latencies": [_c_handle, ctypes.c_void_p, ctypes.c_size_t, _sizep],
    # KV events (kvshim.h, "KV events"; ABI 5.2)
    "kvshim_worker_take_save_reports": [_c_handle, ctypes.c_void_p, ctypes.c_size_t, _sizep],
    "kvshim_sched_save_reports": [_c_handle, ctypes.c_char_p],
    "kvshim_sched_take_events": [_c_handle, ctypes.c_void_p, ctypes.c_size_t, _sizep],
    "kvshim_worker_register": [_c_handle, ctypes.c_char_p],
    "kvshim_worker_bind": [_c_handle, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64],
    "kvshim_worker_start_loads": [_c_handle],
    "kvshim_worker_start_loads_wait": [_c_handle, ctypes.c_int64],  # ABI 5.6
    "kvshim_worker_start_saves": [_c_handle, ctypes.c_uint64],
    "kvshim_worker_poll": [_c_handle, ctypes.c_void_p, ctypes.c_size_t, _sizep],
    "kvshim_worker_wait": [_c_handle, ctypes.c_int64],
    "kvshim_worker_start_loads_layered": [_c_handle],
    "kvshim_worker_wait_layer": [_c_handle, ctypes.c_char_p, ctypes.c_int64],
    "kvshim_worker_wait_layers": [_c_handle, ctypes.c_int64],
    "kvshim_worker_save_layer": [_c_handle, ctypes.c_char_p, ctypes.c_uint64],
    "kvshim_worker_engine_copy": [_c_handle, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, _i64p, ctypes.c_size_t,
                                  ctypes.c_int64, _u64p],
    "kvshim_vllm_namespace": [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, _sizep],  # ABI 5.5
    "kvshim_vllm_config": [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, _sizep],  # ABI 5.6
    "kvshim_vllm_tensors": [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, _sizep],  # ABI 5.6
    # test-only (kvshim.h, "Tests and benchmarks"; ABI 5.4)
    "kvshim_meta_json": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, _sizep],
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
        lib.kvshim_abi_version.argtypes = []
        lib.kvshim_abi_version.restype = ctypes.c_int
        major, minor = check_abi(lib.kvshim_abi_version(), str(path))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name, None)
            if fn is None:  # a library of this ABI has every function of its header
                raise ImportError(f"{path} (ABI {major}.{minor}) lacks {name}")
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        _lib, _loaded_pid = lib, os.getpid()
        return lib


def check_abi(abi: int, path: str) -> tuple[int, int]:
    """(major, minor) of a library's kvshim_abi_version(); ImportError unless
    it serves this package: the same major and at least its minor."""
    major, minor = divmod(abi, 1000)
    if major != ABI_MAJOR or minor < ABI_MINOR:
        raise ImportError(
            f"{path} has ABI version {major}.{minor}, this package needs {ABI_MAJOR}.{ABI_MINOR} "
            f"(the same major, a minor at least {ABI_MINOR})"
        )
    return major, minor


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


def _lib_output(fn_name: str, *args: Any) -> bytes:
    """The output of an export that takes no handle and answers the same on
    every call: asked again with a buffer of the size it said (ERANGE)."""
    lib, n, cap = library(), ctypes.c_size_t(0), 4096
    while True:
        buf = ctypes.create_string_buffer(cap)
        rc = getattr(lib, fn_name)(*args, buf, cap, ctypes.byref(n))
        if rc != ERANGE:
            check(rc)
            return buf.raw[: n.value]
        cap = n.value


def vllm_namespace(spec: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's configuration as plain data -> the namespace kvshim_open takes,
    with sched_block_size and groups (kvshim_vllm_namespace: Go decides
    compatibility, groups and refusals; InvalidArgumentError names the
    field or says why)."""
    return dict(json.loads(_lib_output("kvshim_vllm_namespace", json.dumps(spec).encode())))


def vllm_config(doc: Mapping[str, Any]) -> dict[str, Any]:
    """kv_connector_extra_config and vLLM's configuration as plain data ->
    the settings and the role's open config (kvshim_vllm_config: every
    kvshim.* key's default and check live in Go; InvalidArgumentError names
    the key)."""
    return dict(json.loads(_lib_output("kvshim_vllm_config", json.dumps(doc).encode())))


def vllm_tensors(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """vLLM's KV tensors as raw facts (the scheduler's block_size, the
    KV-cache groups, each tensor's layer, device, pointers, shape and
    strides) -> the descriptors Worker.register takes (kvshim_vllm_tensors:
    Go decides groups, shared tensors, backends, kernel-block and Mamba
    state views; InvalidArgumentError names the field and says why)."""
    return list(json.loads(_lib_output("kvshim_vllm_tensors", json.dumps(doc).encode())))


def meta_json(meta: bytes) -> dict[str, Any]:
    """Tests and debugging: a step's metadata as its JSON text form, read by
    Go's own decoder (kvshim_meta_json); InvalidArgumentError (a ValueError)
    for bad metadata."""
    return dict(json.loads(_lib_output("kvshim_meta_json", meta, len(meta))))


def run_main(argv: list[str]) -> int:
    """Runs the Go command line (doctor, serve, stat) in this process."""
    args = (ctypes.c_char_p * (len(argv) + 1))(*[a.encode() for a in argv], None)
    return int(library().kvshim_main(len(argv), args))


class Handle:
    """An open kvshim handle; close() (or a with-block) releases it."""

    def __init__(self, config: str) -> None:
        out = _c_handle(0)
        check(library().kvshim_open(config.encode(), ctypes.byref(out)))
        self.value: int = out.value
        # One output buffer per calling thread: the library keeps output
        # that did not fit for the thread that asked (kvshim.h), and two
        # threads sharing a buffer would read each other's bytes.
        self._local = threading.local()

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
        buf: ctypes.Array[ctypes.c_char] = getattr(self._local, "buf", None) or ctypes.create_string_buffer(64 << 10)
        n = ctypes.c_size_t(0)
        rc = getattr(lib, fn_name)(self.value, *args, buf, len(buf), ctypes.byref(n))
        if rc == ERANGE:  # kept on the handle for this thread: fetch it with a buffer that fits
            buf = ctypes.create_string_buffer(max(n.value, 2 * len(buf)))
            rc = lib.kvshim_take_output(self.value, buf, len(buf), ctypes.byref(n))
        self._local.buf = buf
        self.check(rc)
        return buf.raw[: n.value]

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_py_functions: dict[str, Any] = {}  # PyDLL functions of the loaded library, by name
_from_list_len = ctypes.c_size_t()
# Their ctypes signatures as PyDLL functions: the list a py_object.
_FROM_LIST_ARGS = [ctypes.py_object, ctypes.c_void_p, ctypes.c_size_t, _sizep]
_MATCH_LIST_ARGS = [_c_handle, ctypes.c_char_p, ctypes.py_object, ctypes.c_char_p, ctypes.c_int64, _i64p]


def _py_function(name: str, argtypes: list[Any]) -> Any:
    """The library's function `name` called as a ctypes.PyDLL function (its
    list a py_object in argtypes): the GIL stays held while the library reads
    Python objects (it may release it itself, kvshim.h). None when there is
    no library here, or one without the function."""
    fn = _py_functions.get(name)
    if fn is None or _loaded_pid != os.getpid():
        try:
            lib = library()  # raises RuntimeError in a child forked after the load
            fn = getattr(ctypes.PyDLL(lib._name, handle=lib._handle), name)
        except (OSError, ImportError, AttributeError):  # no library here, or one without the function
            return None
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        _py_functions[name] = fn
    return fn


def tokens_from_list(tokens: list[Any], out: int, cap: int) -> bool:
    """Writes the ids of the list `tokens` as uint32 at address out (room
    for cap ids) in one C loop inside the library, and says whether it did:
    False when an id is no int in [0, 2^32), when the list is longer than
    cap, or when the library cannot read Python objects here (the caller
    then converts with Python and gets its error). About 3.5x faster than
    array('I', tokens): the loop reads the list's items in place, with no
    Python-level call per id."""
    fn = _py_function("kvshim_tokens_from_list", _FROM_LIST_ARGS)
    return fn is not None and fn(tokens, out, cap, _from_list_len) == 0


# ---------------------------------------------------------------- typed roles
#
# Scheduler and Worker are the connector's two roles as Python objects: one
# method per C function, Python values in (str, int, sequences, dicts) and
# out (ints, bytes, the dataclasses below). They only marshal: what a value
# means is decided in Go and documented in kvshim.h.


class _ArrayInterface(Protocol):
    """What a numpy array exposes without numpy being imported here (the
    demo with --device cuda runs without numpy)."""

    @property
    def __array_interface__(self) -> dict[str, Any]: ...


# Token and block ids: an array('I') / array('q'), a contiguous 1-D numpy
# array of uint32 / int64 (both passed without a copy), or any sequence of
# ints (packed into an array first).
IntArray = Union["array.array[int]", _ArrayInterface, Sequence[int]]

_NATIVE_ORDER = "<" if sys.byteorder == "little" else ">"
# array typecode -> numpy's typestr for the same C type.
_TYPESTR = {"I": f"{_NATIVE_ORDER}u4", "q": f"{_NATIVE_ORDER}i8"}
if array.array("I").itemsize != 4 or array.array("q").itemsize != 8:  # pragma: no cover - every platform vLLM runs on
    raise ImportError("kvshim needs array('I') of 4 bytes and array('q') of 8")


def _as_is(values: Any, typecode: str) -> bool:
    """Whether values can be passed as a `const T *` without a copy: an
    array of typecode, or a 1-D C-contiguous numpy array of the same type."""
    if isinstance(values, array.array):
        return values.typecode == typecode
    iface = getattr(values, "__array_interface__", None)
    return (iface is not None and iface["typestr"] == _TYPESTR[typecode] and len(iface["shape"]) == 1
            and iface.get("strides") is None)


def token_ids(tokens: IntArray) -> IntArray:
    """Token ids as one contiguous uint32 buffer: an array('I') or a 1-D
    contiguous uint32 numpy array as it is; a list (vLLM's) written by the
    library's C loop (tokens_from_list); any other sequence, array or tensor
    through its tolist(). An id outside [0, 2^32) is a ValueError, anything
    else that is no integer a TypeError, both naming the first bad id: never
    a silent wrap (np.asarray(..., dtype=uint32) wraps -1 to 4294967295)."""
    if _as_is(tokens, "I"):
        return tokens
    if isinstance(tokens, (str, bytes, bytearray)):
        raise TypeError(f"token ids must be a sequence or array of integers, not {type(tokens).__name__}")
    ids = tokens if isinstance(tokens, list) else tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)  # type: ignore[arg-type]
    out = array.array("I", [0]) * len(ids)
    if tokens_from_list(ids, out.buffer_info()[0], len(ids)):
        return out
    try:
        return array.array("I", ids)  # what the C loop leaves: ints of other types (numpy's, say)
    except (OverflowError, TypeError):
        for i, t in enumerate(ids):  # the first id array('I') refuses, for the error
            index = getattr(t, "__index__", None)
            if index is None:
                raise TypeError(f"token id {t!r} at position {i} is not an integer") from None
            if not 0 <= index() <= 0xFFFFFFFF:
                raise ValueError(f"token id {t} at position {i} is outside [0, 2**32)") from None
        raise


def _c_array(values: IntArray, typecode: str, ctype: type[ctypes._SimpleCData[int]]) -> tuple[Any, int, object]:
    """values as (pointer, length, owner) for a `const T *, size_t` pair
    (token ids, "I", through token_ids). The pointer holds no reference to
    the memory: the caller keeps owner in a local variable until the call
    has returned. Raises OverflowError or TypeError for a value the C type
    cannot hold (for token ids token_ids' ValueError or TypeError naming it)."""
    pointer = ctypes.POINTER(ctype)
    if typecode == "I":
        values = token_ids(values)
    if isinstance(values, array.array) and values.typecode == typecode:
        address, n = values.buffer_info()
        return ctypes.cast(address, pointer), n, values
    if _as_is(values, typecode):
        iface = values.__array_interface__  # type: ignore[union-attr]
        return ctypes.cast(iface["data"][0], pointer), iface["shape"][0], values
    packed = array.array(typecode, values)  # type: ignore[arg-type]  # any iterable of ints
    address, n = packed.buffer_info()
    return ctypes.cast(address, pointer), n, packed


class Direction(enum.IntEnum):
    """kvshim_worker_engine_copy's direction."""

    SAVE = 1  # KV cache -> objects
    LOAD = 2  # objects -> KV cache


class StepRequest(TypedDict, total=False):
    """One scheduled request of a step (kvshim_sched_build_meta's step_json):
    req, and either blocks (all its block ids: new or resumed) or new_blocks
    (the blocks added this step), both in kvshim.h's one form of block ids
    (groups equal parts, each padded with -1), computed and scheduled tokens."""

    req: str
    blocks: list[int]
    new_blocks: list[int]
    groups: int  # the KV-cache groups blocks / new_blocks hold (absent: 1)
    tokens: list[int]  # a decoding request's token ids from tokens_from to a chunk boundary (saved as it runs)
    tokens_from: int
    computed: int
    scheduled: int


class Step(TypedDict, total=False):
    """One engine step as the scheduler role reads it."""

    requests: list[StepRequest]
    preempted: list[str]


@dataclass(frozen=True)
class FinishedTokens:
    """Scheduler.finished_tokens' answer: delay (vLLM keeps the blocks until
    the workers report the request in finished_sending), and why the
    request's computed chunks were not saved (tokens that do not fit the
    request), None when they were. The request is finished either way."""

    delay: bool
    not_saved: InvalidArgumentError | None = None


@dataclass(frozen=True)
class SchedulerStats:
    """kvshim_stats of a scheduler handle."""

    requests: int  # requests the scheduler still tracks
    server: dict[str, float] | None  # the server's counters by metric name; None when unreachable
    server_error: str | None  # why the server's counters are missing


@dataclass(frozen=True)
class WorkerStats:
    """kvshim_stats of a worker handle."""

    counters: dict[str, int]  # shim.WorkerStats by Go field name (SavedChunks, LoadedBytes, ...)
    jobs: int  # copy jobs still running


@dataclass(frozen=True)
class Finished:
    """kvshim_worker_poll: what ended since the last poll."""

    sending: list[str]  # delay-freed requests whose saves have read their blocks
    recving: list[str]  # requests whose loads ended
    error_blocks: list[int]  # blocks whose loads failed
    failed: list[str] = field(default_factory=list)  # requests whose loads failed


class _Role:
    """A handle opened for one role; close() (or a with-block) releases it."""

    role: ClassVar[str]

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.handle = Handle(json.dumps({**config, "role": self.role}))

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stats(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.handle.output("kvshim_stats"))
        return out

    def take_step_stats(self) -> dict[str, Any]:
        """vLLM's get_kv_connector_stats: the counters since the last call,
        by metric name (kvshim_take_step_stats)."""
        out: dict[str, Any] = json.loads(self.handle.output("kvshim_take_step_stats"))
        return out


class Scheduler(_Role):
    """The scheduler-side connector: one per engine. With "server":
    "embedded" it starts the server inside this process."""

    role = "scheduler"

    def match(self, req_id: str, tokens: IntArray, extras: Mapping[str, Any] | None = None,
              num_computed: int = 0) -> int | None:
        """Tokens beyond num_computed that can be loaded, or None while the
        lookup is pending (ask again next step). extras: the request's
        cache_salt, lora {name, path} and mm [{hash, offset, length}]."""
        ptr, n, _owner = _c_array(tokens, "I", ctypes.c_uint32)
        out = ctypes.c_int64()
        raw_extras = None if extras is None else json.dumps(extras).encode()
        self.handle.check(library().kvshim_sched_match(
            self.handle.value, req_id.encode(), ptr, n, raw_extras, num_computed, ctypes.byref(out)))
        return None if out.value < 0 else out.value

    def match_list(self, req_id: str, tokens: list[int], extras: Mapping[str, Any] | None = None,
                   num_computed: int = 0) -> int | None:
        """match() for ids in a Python list (vLLM's prompt_token_ids), with
        no conversion on the Python side: the library reads the list in one
        C loop, only when req_id is not keyed yet, and releases the GIL while
        the lookup runs. Cold (caches and the Python code around a ctypes
        call out of cache, as between two scheduler steps) this skips a
        numpy array, its ctypes address and a second call into the library.
        Raises NotSupportedError when the library cannot read the list here
        and InvalidArgumentError for an id that is no int in [0, 2^32):
        convert with Python then (match()), for the path or the error."""
        fn = _py_function("kvshim_sched_match_list", _MATCH_LIST_ARGS)
        if fn is None:
            raise NotSupportedError("kvshim_sched_match_list is not available here")
        out = ctypes.c_int64()
        raw_extras = None if extras is None else json.dumps(extras).encode()
        self.handle.check(fn(self.handle.value, req_id.encode(), tokens, raw_extras, num_computed, ctypes.byref(out)))
        return None if out.value < 0 else out.value

    def after_alloc(self, req_id: str, blocks: IntArray, num_external: int, num_computed: int | None = None,
                    groups: int = 1) -> None:
        """Plans the load of num_external tokens into blocks (all the
        request's block ids in token order, `groups` KV-cache groups of
        them: kvshim.h's Block ids). num_computed None: the local
        prefix-cache hit given to match."""
        ptr, n, _owner = _c_array(blocks, "q", ctypes.c_int64)
        self.handle.check(library().kvshim_sched_after_alloc(
            self.handle.value, req_id.encode(), ptr, n, groups, -1 if num_computed is None else num_computed,
            num_external))

    def build_meta(self, step: Step) -> bytes:
        """The workers' metadata for one step."""
        return self.handle.output("kvshim_sched_build_meta", json.dumps(step).encode())

    def finished(self, req_id: str) -> bool:
        """Releases the request; True when vLLM must keep its blocks until
        the workers report it in finished_sending."""
        delay = ctypes.c_int()
        self.handle.check(library().kvshim_sched_finished(self.handle.value, req_id.encode(), ctypes.byref(delay)))
        return bool(delay.value)

    def finished_tokens(self, req_id: str, tokens: IntArray, first: int, num_computed: int,
                        blocks: IntArray, groups: int = 1) -> FinishedTokens:
        """finished() for a request that finished normally, also saving every
        full chunk it computed: tokens are its ids from token `first` on,
        num_computed the tokens whose KV its blocks hold."""
        tok_ptr, n_tok, _tokens_owner = _c_array(tokens, "I", ctypes.c_uint32)
        blk_ptr, n_blk, _blocks_owner = _c_array(blocks, "q", ctypes.c_int64)
        delay = ctypes.c_int()
        rc = library().kvshim_sched_finished_tokens(
            self.handle.value, req_id.encode(), tok_ptr, n_tok, first, num_computed, blk_ptr, n_blk, groups,
            ctypes.byref(delay))
        try:
            self.handle.check(rc)
        except InvalidArgumentError as e:  # delay is set: the request is finished, unsaved
            return FinishedTokens(bool(delay.value), e)
        return FinishedTokens(bool(delay.value))

    def stats(self) -> SchedulerStats:
        st = self._stats()
        return SchedulerStats(st["requests"], st.get("server"), st.get("server_error"))

    # vLLM's controls: thin calls; what they do is in Go (shim/controls.go, shim/options.go).

    def reset(self) -> int:
        """reset_cache: this deployment's new generation (nothing stored
        before is found in any tier). Raises IOError-like KVShimError when the
        server was not reached (nothing was reset)."""
        gen = ctypes.c_uint64()
        self.handle.check(library().kvshim_sched_reset(self.handle.value, ctypes.byref(gen)))
        return gen.value

    def hit_sources(self, req_id: str, num_external: int) -> dict[str, int]:
        """get_external_cache_hit_sources: {CacheHitSource value: tokens}."""
        out: dict[str, int] = json.loads(self.handle.output("kvshim_sched_hit_sources", req_id.encode(), num_external))
        return out

    def request_options(self, req_id: str, params: Mapping[str, Any]) -> None:
        """The request's kvshim.* kv_transfer_params, before its first
        match. InvalidArgumentError names a bad key or value (the request is
        then neither loaded nor saved)."""
        self.handle.check(library().kvshim_sched_request_options(
            self.handle.value, req_id.encode(), json.dumps(dict(params)).encode()))

    def received(self, req_ids: list[str]) -> None:
        """The requests whose loads vLLM saw finish (finished_recving)."""
        self.handle.check(library().kvshim_sched_received(self.handle.value, json.dumps(req_ids).encode()))

    def save_reports(self, per_rank: Sequence[bytes]) -> None:
        """One step's save reports: every rank's take_save_reports() bytes
        (JSON arrays), passed to Go unparsed."""
        self.handle.check(library().kvshim_sched_save_reports(self.handle.value, b"[" + b",".join(per_rank) + b"]"))

    def take_events(self) -> dict[str, Any]:
        """KV events since the last call (the first call starts recording):
        {"events": [...], "done": [request ids], "dropped", "pending", "reported"}."""
        out: dict[str, Any] = json.loads(self.handle.output("kvshim_sched_take_events"))
        return out


class Worker(_Role):
    """The worker-side connector: one per rank."""

    role = "worker"

    def register(self, tensors: Sequence[Mapping[str, Any]]) -> None:
        """Registers the KV cache tensors (layer, group, backend, device,
        data_ptr, dtype_size, shape, stride_bytes, ...)."""
        self.handle.check(library().kvshim_worker_register(self.handle.value, json.dumps(tensors).encode()))

    def bind(self, meta: bytes, timeout_ms: int) -> None:
        """Binds one step's metadata; waits at most timeout_ms for the copies
        of the requests it lists as preempted."""
        buf = ctypes.create_string_buffer(meta, len(meta))
        self.handle.check(library().kvshim_worker_bind(self.handle.value, buf, len(meta), timeout_ms))

    def start_loads(self, wait_ms: int = 0) -> None:
        """Starts the bound step's loads; with wait_ms, and loads in the
        step, waits that long at most for one to end (a step without a
        forward pass: kvshim_worker_start_loads_wait)."""
        if wait_ms:
            self.handle.check(library().kvshim_worker_start_loads_wait(self.handle.value, wait_ms))
        else:
            self.handle.check(library().kvshim_worker_start_loads(self.handle.value))

    def start_loads_layered(self) -> None:
        """Starts the bound step's loads layer by layer (kvshim.layerwise)."""
        self.handle.check(library().kvshim_worker_start_loads_layered(self.handle.value))

    def wait_layer(self, layer: str, timeout_ms: int) -> bool:
        """Blocks until the step's copies of this layer ended (True) or
        timeout_ms passes (False)."""
        rc = library().kvshim_worker_wait_layer(self.handle.value, layer.encode(), timeout_ms)
        if rc == ETIMEDOUT:
            return False
        self.handle.check(rc)
        return True

    def wait_layers(self, timeout_ms: int) -> bool:
        """Blocks until the step's layer-wise loads ended and their failures
        are in poll() (True), or timeout_ms passes (False)."""
        rc = library().kvshim_worker_wait_layers(self.handle.value, timeout_ms)
        if rc == ETIMEDOUT:
            return False
        self.handle.check(rc)
        return True

    def save_layer(self, layer: str, stream_event: int = 0) -> None:
        """save_kv_layer: the bound step's layer is written (stream_event: a
        CUevent recorded on vLLM's stream after it, 0 for CPU caches); its
        save starts now. start_saves() of the same step then ends it."""
        self.handle.check(library().kvshim_worker_save_layer(self.handle.value, layer.encode(), stream_event))

    def start_saves(self, stream_event: int = 0) -> None:
        """stream_event: a CUevent recorded on vLLM's stream after the forward
        pass (0 for CPU caches)."""
        self.handle.check(library().kvshim_worker_start_saves(self.handle.value, stream_event))

    def poll(self) -> Finished:
        p = json.loads(self.handle.output("kvshim_worker_poll"))
        return Finished(p["sending"] or [], p["recving"] or [], p["error_blocks"] or [], p.get("failed") or [])

    def wait(self, timeout_ms: int) -> bool:
        """Blocks until poll() has something to report (True) or timeout_ms
        passes (False), instead of calling poll() in a loop."""
        rc = library().kvshim_worker_wait(self.handle.value, timeout_ms)
        if rc == ETIMEDOUT:
            return False
        self.handle.check(rc)
        return True

    def take_latencies(self) -> dict[str, Any]:
        """Load and save job durations (seconds) since the last call:
        {"load": [...], "save": [...], "dropped": n}, a list None when no job
        of its kind ended (export/schema/latencies.json)."""
        out: dict[str, Any] = json.loads(self.handle.output("kvshim_worker_take_latencies"))
        return out

    def take_save_reports(self) -> bytes:
        """How each save chunk ended since the last call, as Go's JSON array
        (the first call starts recording); the scheduler parses it."""
        return self.handle.output("kvshim_worker_take_save_reports")

    def stats(self) -> WorkerStats:
        st = self._stats()
        return WorkerStats(st["worker"], st["jobs"])

    def engine_copy(self, direction: Direction, objects: int, object_stride: int, block_ids: IntArray,
                    timeout_ms: int) -> float:
        """The copy engine alone (no server, no checks) between the blocks and
        caller memory at address `objects`, one object per chunk every
        object_stride bytes; returns the seconds from planning to the end."""
        ptr, n, _owner = _c_array(block_ids, "q", ctypes.c_int64)
        elapsed_ns = ctypes.c_uint64()
        self.handle.check(library().kvshim_worker_engine_copy(
            self.handle.value, int(direction), objects, object_stride, ptr, n, timeout_ms, ctypes.byref(elapsed_ns)))
        return elapsed_ns.value / 1e9
