"""Device pages: one block's codec sections laid out for kernels, without the blob's framing.

A slot of a GPU pool (and a staging buffer a load copies host pages into) holds a block as its
codec's sections at aligned offsets, so a kernel reads them with wide loads through one base
address per block. The host page of the same block frames the same section bytes as a codec
blob (``kvstore.codecs.base``): converting between the two copies bytes and never re-encodes.

Only codecs with engine kernels (``kvstore.codecs.triton.engine``) have a device layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstore.codecs import fp8
from kvstore.codecs.base import pack_blob, unpack_blob
from kvstore.codecs.parts import section_shapes
from kvstore.errors import CodecError
from kvstore.spec import KVSpec

SECTION_ALIGN = 256  # bytes; every section (and slot) starts on this boundary
# Their order is the kernels' numbering (kvstore.codecs.triton.engine).
DEVICE_CODECS = ("raw", "fp8_e4m3", "nvfp4", "mxfp4", "int4", "int2")
ENCODABLE = ("raw", "fp8_e4m3", "nvfp4", "mxfp4")  # codecs the engine kernels also encode


@dataclass(frozen=True, slots=True)
class Section:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the device page

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True)
class DeviceLayout:
    """How one block of ``spec`` under ``codec`` sits in a device page."""

    codec: str
    codec_id: int
    params: bytes
    dtype: torch.dtype  # what the sections decode to
    shape: tuple[int, ...]  # the block's canonical shape
    sections: tuple[Section, ...]
    nbytes: int  # the device page, padded to SECTION_ALIGN
    group_size: int = 0  # int4/int2: the KIVI group (tokens of a K group, channels of a V one)

    @property
    def span(self) -> int:
        """Bytes from the first section's start to the last one's end."""
        last = self.sections[-1]
        return last.offset + last.nbytes

    @property
    def packed(self) -> bool:
        """Whether the sections lie back to back (no padding): then a blob's sections, which
        always do, are byte for byte the device page, and one copy moves them."""
        at = 0
        for section in self.sections:
            if section.offset != at:
                return False
            at += section.nbytes
        return True

    @property
    def engine_codec(self) -> int:
        """The kernels' codec number (``kvstore.codecs.triton.engine``)."""
        return DEVICE_CODECS.index(self.codec)

    def to_blob(self, sections: list[memoryview | bytes | torch.Tensor]) -> bytes:
        """The codec blob of a block whose sections were copied out of a device page."""
        sizes = [s.numel() * s.element_size() if isinstance(s, torch.Tensor)
                 else memoryview(s).nbytes for s in sections]
        if sizes != [s.nbytes for s in self.sections]:
            raise CodecError(f"{self.codec}: sections of {sizes} bytes, the layout has "
                             f"{[s.nbytes for s in self.sections]}")
        return pack_blob(self.codec_id, self.dtype, self.shape, self.params, list(sections))

    def from_blob(self, blob: bytes | memoryview) -> list[memoryview]:
        """The sections of a blob of this layout's codec and shape, checked (views)."""
        parts = unpack_blob(blob)
        if (parts.codec_id, parts.params, parts.shape, parts.dtype) != (
                self.codec_id, self.params, self.shape, self.dtype):
            raise CodecError(
                f"blob (codec id {parts.codec_id}, shape {parts.shape}, {parts.dtype}) is not a "
                f"{self.codec} block of shape {self.shape} {self.dtype}")
        if [s.nbytes for s in parts.sections] != [s.nbytes for s in self.sections]:
            raise CodecError(f"{self.codec}: blob sections have the wrong sizes")
        return parts.sections


def _align(n: int) -> int:
    return -(-n // SECTION_ALIGN) * SECTION_ALIGN


def device_layout(codec: str, spec: KVSpec) -> DeviceLayout:
    """The device page of one block of ``spec`` under ``codec`` (CodecError if no kernels)."""
    shape = spec.block_shape
    if codec == "raw":
        parts = [(spec.torch_dtype, shape)]
        codec_id, params = 1, b""
    elif codec == "fp8_e4m3":
        parts = [(torch.uint8, shape), (torch.bfloat16, shape[:-1])]
        codec_id, params = 2, fp8.PARAMS
    elif codec in ("nvfp4", "mxfp4"):
        from kvstore.codecs.fp4 import MxFp4Codec, NvFp4Codec

        cls = NvFp4Codec if codec == "nvfp4" else MxFp4Codec
        if spec.head_dim % cls.block_size:
            raise CodecError(f"{codec} device pages need head_dim a multiple of "
                             f"{cls.block_size}, got {spec.head_dim}")
        parts = [(torch.uint8, (*shape[:-1], shape[-1] // 2)),
                 (torch.uint8, (*shape[:-1], shape[-1] // cls.block_size))]
        if codec == "nvfp4":
            parts.append((torch.float32, shape[:2]))
        codec_id, params = cls.codec_id, cls.params
    elif codec in ("int4", "int2"):
        from kvstore.codecs import kivi

        cls = kivi.Int4Codec if codec == "int4" else kivi.Int2Codec
        if spec.head_dim % 8:  # the kernels decode codes in units of eight channels
            raise CodecError(f"{codec} device pages need head_dim a multiple of 8, got "
                             f"{spec.head_dim}")
        group = cls().group_for(spec.block_tokens)
        shapes = section_shapes(shape, cls.bits, group)
        dtypes = (torch.uint8, torch.float16, spec.torch_dtype, torch.uint8, torch.float16)
        parts = list(zip(dtypes, shapes))
        codec_id = cls.codec_id
        params = kivi._PARAMS.pack(kivi.FORMAT_VERSION, cls.bits, group)
    else:
        raise CodecError(f"codec {codec!r} has no device kernels; device tiers and engine loads "
                         f"take {list(DEVICE_CODECS)}")
    sections, offset = [], 0
    for dtype, sec_shape in parts:
        section = Section(dtype, tuple(sec_shape), offset)
        sections.append(section)
        offset = _align(offset + section.nbytes)
    group = group if codec in ("int4", "int2") else 0
    return DeviceLayout(codec, codec_id, params, spec.torch_dtype, shape, tuple(sections), offset,
                        group)
