"""Exceptions for libkvshim's return codes (kvshim.h's KVSHIM_E* values)."""

from __future__ import annotations

import builtins


class KVShimError(Exception):
    """A libkvshim call failed; `code` is its KVSHIM_E* return code."""

    code = -10

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgumentError(KVShimError, ValueError):
    code = -1


class BadHandleError(KVShimError):
    code = -2


class PanicError(KVShimError):
    code = -3


class BufferTooSmallError(KVShimError):
    code = -4


class NotSupportedError(KVShimError):
    code = -5


class TimeoutError(KVShimError, builtins.TimeoutError):  # noqa: A001 - mirrors KVSHIM_ETIMEDOUT
    code = -6


class IOError(KVShimError, OSError):  # noqa: A001 - mirrors KVSHIM_EIO
    code = -7


class NoSpaceError(KVShimError):
    code = -8


class ClosedError(KVShimError):
    code = -9


_BY_CODE: dict[int, type[KVShimError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        BadHandleError,
        PanicError,
        BufferTooSmallError,
        NotSupportedError,
        TimeoutError,
        IOError,
        NoSpaceError,
        ClosedError,
    )
}


def error_for(code: int, message: str) -> KVShimError:
    """The exception for a negative return code, carrying the last-error text."""
    return _BY_CODE.get(code, KVShimError)(message or f"libkvshim error {code}", code)
