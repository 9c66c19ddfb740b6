"""Exceptions mirroring libdetattn's statuses: every failed call raises a DetattnError (or
the subclass for its status) carrying the gRPC status code, its name and the daemon's
message."""

from __future__ import annotations

from ._lib import STATUS_NAMES, errmsg


class DetattnError(Exception):
    """A call failed. ``code`` is the gRPC status number, ``status`` its name (as
    ``detattn_status_name``), ``message`` the daemon's or the library's message."""

    code = 2

    def __init__(self, code: int, message: str, call: str = ""):
        self.code = code
        self.status = STATUS_NAMES.get(code, "UNKNOWN_STATUS")
        self.message = message
        self.call = call
        super().__init__(f"{call + ': ' if call else ''}{self.status}: {message}")


class InvalidArgument(DetattnError):
    code = 3


class DeadlineExceeded(DetattnError):
    code = 4


class NotFound(DetattnError):
    code = 5


class PermissionDenied(DetattnError):
    code = 7


class ResourceExhausted(DetattnError):
    code = 8


class FailedPrecondition(DetattnError):
    code = 9


class Unimplemented(DetattnError):
    code = 12


class Internal(DetattnError):
    code = 13


class Unavailable(DetattnError):
    code = 14


class Cancelled(DetattnError):
    code = 1


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, DeadlineExceeded, NotFound, PermissionDenied,
                                      ResourceExhausted, FailedPrecondition, Unimplemented, Internal, Unavailable,
                                      Cancelled)}


def error(code: int, call: str = "") -> DetattnError:
    """The exception for status ``code``, with this thread's last message."""
    return _BY_CODE.get(code, DetattnError)(code, errmsg(), call)


def check(code: int, call: str) -> None:
    if code != 0:
        raise error(code, call)
