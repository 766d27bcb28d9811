"""The codec contract and the framed blob every codec emits.

A codec turns a K/V tensor in the canonical layout ``[num_layers, 2, num_tokens, num_kv_heads,
head_dim]`` (dim 1: 0 = K, 1 = V) into a self-describing blob and back. Blob layout::

    magic "KVCB" | version u8 | codec_id u8 | dtype u8 | ndim u8 | shape ndim x u32 |
    params_len u16 | params | num_sections u8 | section lengths num_sections x u64 |
    sections ... | xxh3-64 of everything before it (u64)

``params`` holds codec parameters (group size, ...); ``sections`` hold quantised values and
scales. Damage anywhere (truncation, a flipped bit, a foreign blob) raises CodecError.

Encoding and decoding are CPU- or GPU-bound and may be slow: callers on an event loop run them
in a thread (``asyncio.to_thread``). Codecs are stateless and thread-safe.
"""

from __future__ import annotations

import struct
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvstore.errors import CodecError

BLOB_MAGIC = b"KVCB"
BLOB_VERSION = 1
_FIXED = struct.Struct("<4sBBBB")
_DTYPE_CODES: dict[torch.dtype, int] = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
MAX_NDIM = 8
MAX_SECTIONS = 16
# Blob views are read-only; decoders only read them, so torch's warning about that is noise.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


@dataclass(frozen=True, slots=True)
class BlobParts:
    """A verified, parsed blob: the views into it are only valid while the blob lives."""

    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    params: bytes
    sections: list[memoryview]


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise CodecError(f"unsupported dtype {dtype}; codecs take bfloat16, float16 or float32")


def as_bytes(section: bytes | bytearray | memoryview | torch.Tensor | np.ndarray) -> memoryview:
    """A byte view of a section without copying where possible (tensors must be on the CPU)."""
    if isinstance(section, torch.Tensor):
        t = section.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous().reshape(-1)
        return memoryview(t.view(torch.uint8).numpy())
    if isinstance(section, np.ndarray):
        return memoryview(np.ascontiguousarray(section).reshape(-1).view(np.uint8))
    return memoryview(section).cast("B")


def pack_blob(
    codec_id: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    params: bytes,
    sections: list[bytes | bytearray | memoryview | torch.Tensor | np.ndarray],
) -> bytes:
    """Frame ``sections`` with a header and a trailing checksum."""
    if len(shape) > MAX_NDIM or len(sections) > MAX_SECTIONS:
        raise CodecError(f"blob too complex: ndim {len(shape)}, sections {len(sections)}")
    views = [as_bytes(s) for s in sections]
    header = b"".join(
        (
            _FIXED.pack(BLOB_MAGIC, BLOB_VERSION, codec_id, dtype_code(dtype), len(shape)),
            struct.pack(f"<{len(shape)}I", *shape),
            struct.pack("<H", len(params)),
            params,
            struct.pack("<B", len(views)),
            struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views)),
        )
    )
    h = xxhash.xxh3_64(header)
    for v in views:
        h.update(v)
    return b"".join((header, *views, struct.pack("<Q", h.intdigest())))


def unpack_blob(blob: bytes | bytearray | memoryview, verify: bool = True) -> BlobParts:
    """Verify and parse a blob; CodecError names what is wrong.

    ``verify=False`` skips only the checksum, for blobs inside a page whose own checksum was
    just verified (the framing is still checked).
    """
    view = memoryview(blob).cast("B")
    if len(view) < _FIXED.size + 8:
        raise CodecError(f"blob truncated: {len(view)} bytes")
    magic, version, codec_id, dcode, ndim = _FIXED.unpack_from(view)
    if magic != BLOB_MAGIC:
        raise CodecError(f"not a kvstore codec blob (magic {bytes(magic)!r})")
    if version != BLOB_VERSION:
        raise CodecError(f"unsupported blob version {version}")
    if dcode not in _CODE_DTYPES or ndim > MAX_NDIM:
        raise CodecError(f"blob header damaged (dtype code {dcode}, ndim {ndim})")
    try:
        pos = _FIXED.size
        shape = struct.unpack_from(f"<{ndim}I", view, pos)
        pos += 4 * ndim
        (params_len,) = struct.unpack_from("<H", view, pos)
        pos += 2
        params = bytes(view[pos : pos + params_len])
        pos += params_len
        (num_sections,) = struct.unpack_from("<B", view, pos)
        pos += 1
        if num_sections > MAX_SECTIONS:
            raise CodecError(f"blob header damaged ({num_sections} sections)")
        lengths = struct.unpack_from(f"<{num_sections}Q", view, pos)
        pos += 8 * num_sections
    except struct.error:
        raise CodecError("blob truncated inside its header") from None
    end = pos + sum(lengths)
    if len(view) != end + 8:
        raise CodecError(f"blob length {len(view)} does not match its header ({end + 8})")
    (checksum,) = struct.unpack_from("<Q", view, end)
    if verify and xxhash.xxh3_64_intdigest(view[:end]) != checksum:
        raise CodecError("blob checksum mismatch: the blob is damaged")
    sections = []
    for length in lengths:
        sections.append(view[pos : pos + length])
        pos += length
    return BlobParts(codec_id, _CODE_DTYPES[dcode], tuple(shape), params, sections)


def section_tensor(section: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor view over a blob section, checked against the expected size."""
    numel = 1
    for s in shape:
        numel *= s
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if section.nbytes != expected:
        raise CodecError(f"blob section holds {section.nbytes} bytes, expected {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(section, dtype=torch.uint8).view(dtype).view(shape)


def check_kv_input(kv: object, name: str) -> torch.Tensor:
    """Common input check for codecs: a float tensor in the canonical 5-D layout."""
    if not isinstance(kv, torch.Tensor):
        raise CodecError(f"{name}: expected a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype not in _DTYPE_CODES:
        raise CodecError(f"{name}: unsupported dtype {kv.dtype}; use bfloat16/float16/float32")
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise CodecError(
            f"{name}: expected shape [num_layers, 2, num_tokens, num_kv_heads, head_dim], "
            f"got {tuple(kv.shape)}"
        )
    return kv


def check_out(out: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Validate a caller-supplied output tensor, or allocate one."""
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if tuple(out.shape) != shape or out.dtype != dtype:
        raise CodecError(
            f"out has shape {tuple(out.shape)} and dtype {out.dtype}, blob holds {shape} {dtype}"
        )
    return out


class Codec(ABC):
    """One stage of a tier's codec chain. Subclasses set ``name`` and ``codec_id``."""

    name: str = ""
    codec_id: int = 0
    lossless: bool = False

    @abstractmethod
    def encode(self, kv: torch.Tensor) -> bytes:
        """Encode ``kv`` (canonical layout, any device) into a self-describing blob."""

    @abstractmethod
    def decode(self, blob: bytes | bytearray | memoryview, out: torch.Tensor | None = None,
               verify: bool = True) -> torch.Tensor:
        """Decode a blob of this codec into ``out`` (or a new CPU tensor) and return it.

        ``verify=False`` skips the blob checksum when the caller already verified an enclosing
        checksum over the same bytes (a page).
        """

    @abstractmethod
    def bytes_per_element(self, spec: KVSpecLike) -> float:
        """Average stored bytes per K/V element for a block of ``spec``, metadata included."""

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class QuantizedCodec(Codec):
    """A lossy codec whose blob parses into parts (quantised values and scales) that both a
    torch reference and Triton kernels decode: Triton when the target is on CUDA, the
    reference otherwise. Subclasses supply ``parse`` and the four decoders."""

    @abstractmethod
    def parse(self, blob: bytes | bytearray | memoryview, verify: bool = True
              ) -> tuple[object, torch.dtype, tuple[int, ...]]:
        """Check a blob of this codec; return CPU views of its parts, its dtype and shape."""

    @abstractmethod
    def _reference_decode(self, parts: object, dtype: torch.dtype) -> torch.Tensor: ...

    @abstractmethod
    def _reference_decode_paged(self, parts: object, kv_cache: torch.Tensor,
                                block_table: torch.Tensor) -> None: ...

    @abstractmethod
    def _kernel_decode(self, parts: object, out: torch.Tensor) -> None:
        """Triton decode of device-resident parts into a contiguous ``out``."""

    @abstractmethod
    def _kernel_decode_paged(self, parts: object, kv_cache: torch.Tensor,
                             block_table: torch.Tensor) -> None: ...

    def decode(self, blob, out=None, verify=True):
        from kvstore.codecs.triton.common import use_triton

        parts, dtype, shape = self.parse(blob, verify)
        out = check_out(out, dtype, shape)
        if not use_triton(out):
            out.copy_(self._reference_decode(parts, dtype))
            return out
        # Kernels write contiguous memory; a strided target (a slice of a longer run) gets a copy.
        target = out if out.is_contiguous() else torch.empty_like(out)
        self._kernel_decode(parts.to(out.device), target)
        if target is not out:
            out.copy_(target)
        return out

    def decode_paged(self, blob: bytes | bytearray | memoryview, kv_cache: torch.Tensor,
                     block_table: torch.Tensor) -> None:
        """Decode a blob straight into an engine's paged KV cache through its block table."""
        from kvstore.codecs.triton.common import use_triton

        parts, _, _ = self.parse(blob)
        if use_triton(kv_cache):
            self._kernel_decode_paged(parts.to(kv_cache.device), kv_cache, block_table)
        else:
            self._reference_decode_paged(parts, kv_cache, block_table)


class KVSpecLike:  # structural hint only; codecs read these attributes of a KVSpec
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    element_bytes: int


def framing_bytes(ndim: int = 5, num_sections: int = 1, params_len: int = 0) -> int:
    """Bytes a blob adds around its sections (header and checksum)."""
    return _FIXED.size + 4 * ndim + 2 + params_len + 1 + 8 * num_sections + 8
