"""zstd: a lossless stage that can follow any codec (``fp8_e4m3+zstd``, ``raw+zstd``)."""

from __future__ import annotations

import struct

import torch
import zstandard

from kvstore.codecs.base import Codec, FinishedPayload
from kvstore.errors import CodecError

ZSTD_MAGIC = b"KVZS"
_HEADER = struct.Struct("<4sQ")  # magic, decompressed length
MULTITHREAD_MIN_BYTES = 4 << 20  # below this, zstd's worker threads cost more than they save


class ZstdStage(Codec):
    """Wraps an inner codec and compresses its blob. zstd's own frame checksum catches damage."""

    lossless = True

    def __init__(self, inner: Codec, level: int = 3, threads: int = -1) -> None:
        if not -7 <= level <= 22:
            raise CodecError(f"zstd level must be in [-7, 22], got {level}")
        self.inner = inner
        self.level = level
        self.threads = threads
        self.name = f"{inner.name}+zstd"
        self.codec_id = inner.codec_id
        self.lossless = inner.lossless

    def prepare(self, kv: torch.Tensor) -> FinishedPayload:
        # The compressed size is only known once compressed: the stage's output is finished
        # bytes, copied once into place.
        return FinishedPayload(compress(self.inner.encode(kv), self.level, self.threads))

    def decode(self, blob, out=None, verify=True):
        return self.inner.decode(decompress(blob), out, verify)

    def bytes_per_element(self, spec) -> float:
        # zstd's ratio depends on the data; report the inner bound (an upper estimate).
        return self.inner.bytes_per_element(spec)


def compress(data: bytes | memoryview, level: int = 3, threads: int = -1) -> bytes:
    """Frame ``data`` as a kvstore zstd blob."""
    workers = threads if len(data) >= MULTITHREAD_MIN_BYTES else 0
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, threads=workers)
    return _HEADER.pack(ZSTD_MAGIC, len(data)) + cctx.compress(data)


def decompress(blob: bytes | bytearray | memoryview) -> bytes:
    view = memoryview(blob).cast("B")
    if len(view) < _HEADER.size:
        raise CodecError(f"zstd blob truncated: {len(view)} bytes")
    magic, length = _HEADER.unpack_from(view)
    if magic != ZSTD_MAGIC:
        raise CodecError(f"not a kvstore zstd blob (magic {bytes(magic)!r})")
    try:
        data = zstandard.ZstdDecompressor().decompress(view[_HEADER.size:], max_output_size=length)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd blob damaged: {exc}") from None
    if len(data) != length:
        raise CodecError(f"zstd blob decompressed to {len(data)} bytes, header says {length}")
    return data
