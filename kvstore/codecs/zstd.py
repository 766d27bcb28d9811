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
# The most a blob may decompress to when nothing tighter is known: a 256-token block of a
# 126-layer model with 8 kv heads of 128 dims in bf16 is 132 MiB raw; 1 GiB leaves 8x headroom.
MAX_DECOMPRESSED_BYTES = 1 << 30
# No inner codec's blob is larger than twice the raw K/V it decodes to, plus its framing (fp8 with
# a float32 scale per token-head of 4+ dims is at most 2 bytes a bf16 element; raw is 1x).
_OUT_BOUND_FACTOR = 2
_OUT_BOUND_SLACK_BYTES = 64 << 10


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
        return self.inner.decode(decompress(blob, bound_for(out)), out, verify)

    def bytes_per_element(self, spec) -> float:
        # zstd's ratio depends on the data; report the inner bound (an upper estimate).
        return self.inner.bytes_per_element(spec)


def compress(data: bytes | memoryview, level: int = 3, threads: int = -1) -> bytes:
    """Frame ``data`` as a kvstore zstd blob."""
    workers = threads if len(data) >= MULTITHREAD_MIN_BYTES else 0
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, threads=workers)
    return _HEADER.pack(ZSTD_MAGIC, len(data)) + cctx.compress(data)


def bound_for(out: torch.Tensor | None) -> int:
    """The most bytes a blob decoded into ``out`` may decompress to (its shape bounds the inner
    blob); ``MAX_DECOMPRESSED_BYTES`` without ``out``."""
    if out is None:
        return MAX_DECOMPRESSED_BYTES
    return min(MAX_DECOMPRESSED_BYTES,
               _OUT_BOUND_FACTOR * out.numel() * out.element_size() + _OUT_BOUND_SLACK_BYTES)


def decompress(blob: bytes | bytearray | memoryview,
               max_bytes: int = MAX_DECOMPRESSED_BYTES) -> bytes:
    """The bytes a kvstore zstd blob holds; CodecError if it is damaged or declares more than
    ``max_bytes`` (checked before anything is allocated: the header and zstd's own frame header
    must agree and stay within the bound)."""
    view = memoryview(blob).cast("B")
    if len(view) < _HEADER.size:
        raise CodecError(f"zstd blob truncated: {len(view)} bytes")
    magic, length = _HEADER.unpack_from(view)
    if magic != ZSTD_MAGIC:
        raise CodecError(f"not a kvstore zstd blob (magic {bytes(magic)!r})")
    if length > max_bytes:
        raise CodecError(f"zstd blob declares {length} decompressed bytes, more than the "
                         f"{max_bytes} this decode allows")
    frame = view[_HEADER.size:]
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd blob damaged: {exc}") from None
    if declared not in (-1, length):  # -1: the frame does not say; max_output_size bounds it
        raise CodecError(f"zstd frame declares {declared} decompressed bytes, the blob header "
                         f"{length}")
    try:
        data = zstandard.ZstdDecompressor().decompress(frame, max_output_size=length)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd blob damaged: {exc}") from None
    if len(data) != length:
        raise CodecError(f"zstd blob decompressed to {len(data)} bytes, header says {length}")
    return data
