"""The kvstore exception tree <-> gRPC statuses, both ways.

Every edge of the daemon translates kvstore exceptions (``kvstore.errors``) to gRPC statuses
with :func:`status_for`, and names the exception class in the trailing metadata key
``kvstore-error`` (:func:`error_metadata`), so :func:`error_from_status` on the client side
raises the same type.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import grpc

from kvstore import errors
from kvstore.errors import KVStoreError

ERROR_METADATA_KEY = "kvstore-error"
RETRY_AFTER_METADATA_KEY = "kvstore-retry-after-s"  # seconds, on RESOURCE_EXHAUSTED by rate

# Most specific first: the first class in an exception's MRO found here decides its status.
_STATUS_BY_ERROR: dict[type[KVStoreError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.CodecError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.CorruptPage: grpc.StatusCode.DATA_LOSS,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_ERROR_BY_STATUS: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.CapacityError,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.DATA_LOSS: errors.CorruptPage,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
}


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status a kvstore exception maps to; INTERNAL for anything unexpected."""
    for cls in type(exc).__mro__:
        code = _STATUS_BY_ERROR.get(cls)  # type: ignore[arg-type]
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def error_metadata(exc: KVStoreError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that names the exception class for the client (and, for a rate
    limit, how long to wait before retrying)."""
    meta = ((ERROR_METADATA_KEY, type(exc).__name__),)
    retry_after_s = getattr(exc, "retry_after_s", None)
    if retry_after_s:
        meta += ((RETRY_AFTER_METADATA_KEY, f"{retry_after_s:.3f}"),)
    return meta


def error_from_status(
    code: grpc.StatusCode, details: str, metadata: Sequence[tuple[str, Any]] | None = None
) -> KVStoreError:
    """The kvstore exception for a failed call: the class the server named, else by status."""
    named = next((str(v) for k, v in metadata or () if k == ERROR_METADATA_KEY), None)
    cls = getattr(errors, named, None) if named else None
    if not (isinstance(cls, type) and issubclass(cls, KVStoreError)):
        cls = _ERROR_BY_STATUS.get(code, KVStoreError)
    if cls is KVStoreError:
        return KVStoreError(f"{code.name}: {details}")
    exc = cls(details or code.name)
    if isinstance(exc, errors.RateLimited):
        retry = next((str(v) for k, v in metadata or () if k == RETRY_AFTER_METADATA_KEY), "")
        with contextlib.suppress(ValueError):
            exc.retry_after_s = float(retry)
    return exc


def translate(err: grpc.RpcError) -> KVStoreError:
    """The kvstore exception for a failed call, as a client's stub raised it."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    metadata = err.trailing_metadata() if hasattr(err, "trailing_metadata") else ()
    return error_from_status(code, details or "", tuple(metadata or ()))
