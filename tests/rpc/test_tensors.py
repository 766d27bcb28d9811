"""Tensors on the wire: declared headers checked against the spec, bytes and chunks."""

from __future__ import annotations

import pytest
import torch

from kvstore.errors import CapacityError, InvalidArgument
from kvstore.rpc.tensors import (
    ChunkAssembler,
    chunk_limit,
    expected_tensor,
    tensor_from_buffer,
    tensor_header,
    tensor_view,
)

from ..conftest import random_kv


def test_expected_tensor_checks_dtype_shape_and_size(spec):
    kv = random_kv(spec, 32)
    assert expected_tensor(spec, 32, tensor_header(kv)) == kv.numel() * 2
    for change, match in [({"dtype": "float16"}, "dtype"), ({"dtype": "qint8"}, "unknown"),
                          ({"shape": [2, 2, 31, 2, 16]}, "shape"),
                          ({"total_bytes": 5}, "declares")]:
        header = tensor_header(kv)
        for name, value in change.items():
            if name == "shape":
                del header.shape[:]
                header.shape.extend(value)
            else:
                setattr(header, name, value)
        with pytest.raises(InvalidArgument, match=match):
            expected_tensor(spec, 32, header)


def test_tensor_bytes_round_trip_bit_exact(spec):
    kv = random_kv(spec, 48)
    buf = bytearray(tensor_view(kv))
    back = tensor_from_buffer(buf, tensor_header(kv))
    assert back.dtype == kv.dtype and torch.equal(back, kv)


def test_chunk_assembler_refuses_short_long_and_oversized():
    with pytest.raises(CapacityError):
        ChunkAssembler(100, max_bytes=99)
    a = ChunkAssembler(4, max_bytes=4)
    a.add(b"ab")
    with pytest.raises(InvalidArgument, match="ended after 2"):
        a.finish()
    a.add(b"cd")
    with pytest.raises(InvalidArgument, match="more than"):
        a.add(b"e")
    assert a.finish() == bytearray(b"abcd")


def test_chunk_limit_stays_under_the_message_limit():
    assert chunk_limit(256 << 20) == 4 << 20
    assert chunk_limit(1 << 20) < 1 << 20
