"""kvstore exceptions <-> gRPC statuses: every class maps to a status and survives the wire."""

from __future__ import annotations

import grpc
import pytest

from kvstore import errors
from kvstore.errors import KVStoreError
from kvstore.rpc.status import error_from_status, error_metadata, status_for

SC = grpc.StatusCode


@pytest.mark.parametrize("exc, code", [
    (errors.InvalidArgument("x"), SC.INVALID_ARGUMENT),
    (errors.ConfigError("x"), SC.INVALID_ARGUMENT),
    (errors.CodecError("x"), SC.INVALID_ARGUMENT),
    (errors.NotFound("x"), SC.NOT_FOUND),
    (errors.LeaseNotFound("x"), SC.NOT_FOUND),
    (errors.CapacityError("x"), SC.RESOURCE_EXHAUSTED),
    (errors.PermissionDenied("x"), SC.PERMISSION_DENIED),
    (errors.Unauthenticated("x"), SC.UNAUTHENTICATED),
    (errors.CorruptPage("x"), SC.DATA_LOSS),
    (errors.Unavailable("x"), SC.UNAVAILABLE),
    (errors.KVStoreError("x"), SC.INTERNAL),
    (RuntimeError("x"), SC.INTERNAL),
])
def test_status_for_every_exception(exc, code):
    assert status_for(exc) == code


@pytest.mark.parametrize("cls", [errors.InvalidArgument, errors.CodecError, errors.LeaseNotFound,
                                 errors.CapacityError, errors.CorruptPage,
                                 errors.PermissionDenied, errors.Unauthenticated])
def test_error_class_survives_the_wire(cls):
    exc = cls("what went wrong")
    back = error_from_status(status_for(exc), str(exc), error_metadata(exc))
    assert type(back) is cls and str(back) == "what went wrong"


def test_error_from_status_without_metadata_uses_the_code():
    assert type(error_from_status(SC.NOT_FOUND, "gone")) is errors.NotFound
    assert type(error_from_status(SC.UNAVAILABLE, "down")) is errors.Unavailable
    unknown = error_from_status(SC.INTERNAL, "boom")
    assert type(unknown) is KVStoreError and "INTERNAL" in str(unknown)
    # a class name that is not a kvstore error is ignored, not imported
    forged = error_from_status(SC.INVALID_ARGUMENT, "x", (("kvstore-error", "SystemExit"),))
    assert type(forged) is errors.InvalidArgument
