"""Tensors on the wire: raw bytes + dtype name + shape in the canonical layout, streamed in
chunks below the message limit (Put from the client, Get from the server)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from kvstore.errors import CapacityError, InvalidArgument, shown
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.spec import DTYPES, KVSpec

DEFAULT_CHUNK_BYTES = 4 << 20  # streamed tensor chunk; big enough to amortise per-message cost
_MESSAGE_OVERHEAD_BYTES = 64 << 10  # room for the proto framing around a chunk


def chunk_limit(max_message_bytes: int) -> int:
    """The largest tensor chunk that fits in one message under ``max_message_bytes``."""
    return max(64 << 10, min(DEFAULT_CHUNK_BYTES, max_message_bytes - _MESSAGE_OVERHEAD_BYTES))


def tensor_header(kv: torch.Tensor) -> pb.TensorHeader:
    return pb.TensorHeader(dtype=str(kv.dtype).removeprefix("torch."), shape=list(kv.shape),
                           total_bytes=kv.numel() * kv.element_size())


def expected_tensor(spec: KVSpec, num_tokens: int, header: pb.TensorHeader) -> int:
    """Check a declared tensor against the spec and token count; return its byte size."""
    if header.dtype not in DTYPES:
        raise InvalidArgument(f"unknown tensor dtype {shown(header.dtype)}; expected one of "
                              f"{sorted(DTYPES)}")
    if header.dtype != spec.dtype:
        raise InvalidArgument(f"kv dtype is {shown(header.dtype)}, the namespace spec says "
                              f"{spec.dtype}")
    expected = spec.shape(num_tokens)
    if tuple(header.shape) != expected:
        raise InvalidArgument(f"kv shape is {shown(tuple(header.shape))}, expected {expected} "
                              f"for {num_tokens} tokens under the namespace spec")
    nbytes = num_tokens * spec.block_bytes // spec.block_tokens
    if header.total_bytes != nbytes:
        raise InvalidArgument(f"kv declares {header.total_bytes} bytes, its shape needs {nbytes}")
    return nbytes


def tensor_from_buffer(buf: bytearray, header: pb.TensorHeader) -> torch.Tensor:
    """A tensor viewing ``buf`` (no copy) with the header's dtype and shape."""
    dtype = DTYPES.get(header.dtype)
    if dtype is None:
        raise InvalidArgument(f"unknown tensor dtype {shown(header.dtype)}")
    numel = math.prod(header.shape) if len(header.shape) else 1
    if numel * torch.empty((), dtype=dtype).element_size() != len(buf):
        raise InvalidArgument(f"tensor of shape {shown(tuple(header.shape))} {header.dtype} "
                              f"does not match its {len(buf)} bytes")
    if not buf:
        return torch.empty(tuple(header.shape), dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(tuple(header.shape))


def tensor_view(kv: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor (copied only if it is not contiguous)."""
    flat = kv.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def iter_chunks(view: memoryview, chunk_bytes: int) -> Iterator[bytes]:
    for start in range(0, len(view), chunk_bytes):
        yield bytes(view[start : start + chunk_bytes])


class ChunkAssembler:
    """Collects streamed chunks into one buffer that grows as they arrive (a header that
    declares a huge tensor and sends nothing costs nothing), refusing more than declared.

    The declared size is checked against ``max_bytes`` before anything is allocated. A put
    that fails calls :meth:`release`, which frees the bytes received at once, even while a
    traceback still refers to the assembler.
    """

    def __init__(self, total_bytes: int, max_bytes: int) -> None:
        if total_bytes > max_bytes:
            raise CapacityError(f"tensor of {total_bytes} bytes exceeds the {max_bytes}-byte "
                                "limit for one request")
        self.total_bytes = total_bytes
        self.buffer = bytearray()

    @property
    def received(self) -> int:
        return len(self.buffer)

    @property
    def is_complete(self) -> bool:
        return len(self.buffer) == self.total_bytes

    def add(self, chunk: bytes) -> None:
        if len(self.buffer) + len(chunk) > self.total_bytes:
            raise InvalidArgument(f"received more than the {self.total_bytes} bytes declared")
        # bytearray grows geometrically (and realloc moves large buffers by remapping):
        # measured here at or above the speed of copying into a preallocated buffer.
        self.buffer += chunk

    def finish(self) -> bytearray:
        if not self.is_complete:
            raise InvalidArgument(f"stream ended after {self.received} of "
                                  f"{self.total_bytes} declared bytes")
        return self.buffer

    def release(self) -> None:
        """Free the bytes received (once no tensor views them)."""
        try:
            self.buffer.clear()
        except BufferError:  # a tensor made by finish() still views it: drop our reference
            self.buffer = bytearray()
