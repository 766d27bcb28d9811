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

Encoding goes through a :class:`Payload`: ``Codec.prepare(kv)`` quantises (or, for raw, only
looks at the input) and knows the blob's exact size; ``Payload.write_into(out)`` then writes
header, sections and checksum straight into a caller's buffer (a page in a shared-memory slot,
a reused write buffer) in one pass that copies each section and hashes it while it is still in
cache. ``encode`` is the same into a fresh buffer.
"""

from __future__ import annotations

import struct
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import xxhash

from kvstore.errors import CodecError

BLOB_MAGIC = b"KVCB"
BLOB_VERSION = 1
_FIXED = struct.Struct("<4sBBBB")
# uint8: a cache group's bytes (kvstore.groups), which only lossless codecs take.
_DTYPE_CODES: dict[torch.dtype, int] = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3,
                                        torch.uint8: 4}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
MAX_NDIM = 8
MAX_SECTIONS = 16
# Sections are copied and hashed in pieces of about this size, so each piece is hashed while it
# is still in a cache it was just written through. On the 2-core box (L2 512 KiB a core, L3 32
# MiB) a 2 MiB raw page took 0.42 / 0.34 / 0.30 / 0.29 ms in 64 KiB / 256 KiB / 1 MiB / whole
# pieces (medians of 200, interleaved, 2026-12-01): per-piece calls cost more than the cache
# saves while the L3 holds a page; pieces matter for pages larger than the L3.
COPY_PIECE_BYTES = 1 << 20
_CHECKSUM = struct.Struct("<Q")
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


Section = bytes | bytearray | memoryview | torch.Tensor | np.ndarray
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Hasher(Protocol):
    """A streaming hash (``xxhash.xxh3_64``): what sections are fed to as they are written."""

    def update(self, data: memoryview | bytes, /) -> None: ...


def as_array(section: Section) -> np.ndarray:
    """A numpy view of a section in its own shape and strides (no copy, except a device
    tensor, which comes to the CPU): integers of its element size for torch tensors, so
    bfloat16 and float8 need no numpy dtype of their own."""
    if isinstance(section, torch.Tensor):
        t = section.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype not in _INT_OF_SIZE.values():
            t = t.view(_INT_OF_SIZE[t.element_size()])
        return t.numpy()
    if isinstance(section, np.ndarray):
        return section
    return np.frombuffer(memoryview(section).cast("B"), dtype=np.uint8)


def copy_section(out: memoryview, section: Section | np.ndarray,
                 hashers: Sequence[Hasher] = ()) -> int:
    """Copy ``section`` (any strides) into the front of ``out`` in C order and feed the copied
    bytes to ``hashers`` piece by piece as they land; return the bytes written.

    numpy does the copy: one thread, the GIL released, whatever the caller's torch thread
    settings (torch copies run on its OpenMP team, which halves or worse on a busy host).
    """
    src = as_array(section)
    nbytes = src.nbytes
    if nbytes > out.nbytes:
        raise CodecError(f"a {nbytes}-byte section does not fit the {out.nbytes} bytes left")
    if nbytes == 0:
        return 0
    dst = np.frombuffer(out, dtype=src.dtype, count=src.size).reshape(src.shape)
    _copy_pieces(dst, src, out, hashers)
    return nbytes


def _copy_pieces(dst: np.ndarray, src: np.ndarray, out: memoryview,
                 hashers: Sequence[Hasher]) -> None:
    """Copy ``src`` into the C-contiguous ``dst`` (whose bytes are ``out[:dst.nbytes]``) in
    pieces of about ``COPY_PIECE_BYTES`` along the leading axes, hashing each piece after it."""
    if src.ndim == 0 or src.nbytes <= COPY_PIECE_BYTES:
        np.copyto(dst, src)
        for h in hashers:
            h.update(out[: dst.nbytes])
        return
    row_bytes = src.nbytes // src.shape[0]
    if row_bytes > COPY_PIECE_BYTES and src.ndim > 1:
        for i in range(src.shape[0]):
            _copy_pieces(dst[i], src[i], out[i * row_bytes : (i + 1) * row_bytes], hashers)
        return
    step = max(1, COPY_PIECE_BYTES // max(row_bytes, 1))
    for start in range(0, src.shape[0], step):
        stop = min(start + step, src.shape[0])
        np.copyto(dst[start:stop], src[start:stop])
        piece = out[start * row_bytes : stop * row_bytes]
        for h in hashers:
            h.update(piece)


class Payload(ABC):
    """An encoded blob of known size, ready to be written where it will live.

    ``write_into`` writes it at the front of ``out`` and also feeds every byte written to
    ``hashers`` (an enclosing page's checksum), so the bytes are hashed while in cache.
    """

    nbytes: int

    @abstractmethod
    def write_into(self, out: memoryview, hashers: Sequence[Hasher] = ()) -> int:
        """Write the blob into ``out`` (at least ``nbytes`` long); return ``nbytes``."""

    def to_bytes(self) -> bytes:
        """The blob as a new bytes object."""
        buf = bytearray(self.nbytes)
        self.write_into(memoryview(buf))
        return bytes(buf)

    def _check_room(self, out: memoryview) -> memoryview:
        view = memoryview(out).cast("B")
        if view.nbytes < self.nbytes:
            raise CodecError(f"a {self.nbytes}-byte blob does not fit a {view.nbytes}-byte "
                             "buffer")
        return view


class FinishedPayload(Payload):
    """A blob already in memory (a compressed stage's output): written by one copy."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data = memoryview(data).cast("B")
        self.nbytes = self.data.nbytes

    def write_into(self, out: memoryview, hashers: Sequence[Hasher] = ()) -> int:
        view = self._check_room(out)
        copy_section(view, self.data, hashers)
        return self.nbytes


class BlobPlan(Payload):
    """A framed blob not written yet: its header and the sections that follow it (views of
    the input or of quantised parts, any strides)."""

    def __init__(self, codec_id: int, dtype: torch.dtype, shape: tuple[int, ...],
                 params: bytes, sections: Sequence[Section]) -> None:
        if len(shape) > MAX_NDIM or len(sections) > MAX_SECTIONS:
            raise CodecError(f"blob too complex: ndim {len(shape)}, sections {len(sections)}")
        self.sections = [as_array(s) for s in sections]
        sizes = [a.nbytes for a in self.sections]
        self.header = blob_header_bytes(codec_id, dtype, shape, params, sizes)
        self.nbytes = len(self.header) + sum(sizes) + _CHECKSUM.size

    def write_into(self, out: memoryview, hashers: Sequence[Hasher] = (),
                   own_sum: bool = True) -> int:
        """``Payload.write_into``; ``own_sum=False`` leaves the blob's trailing checksum zero
        and hashes nothing (with no ``hashers``): for a page the store seals, which computes
        every checksum on its own copy (``kvstore.page.PageSeal``)."""
        view = self._check_room(out)
        every = (xxhash.xxh3_64(), *hashers) if own_sum else tuple(hashers)
        pos = len(self.header)
        view[:pos] = self.header
        for h in every:
            h.update(self.header)
        for section in self.sections:
            pos += copy_section(view[pos:], section, every)
        _CHECKSUM.pack_into(view, pos, every[0].intdigest() if own_sum else 0)
        for h in hashers:
            h.update(view[pos : pos + _CHECKSUM.size])
        return self.nbytes


def blob_header_bytes(codec_id: int, dtype: torch.dtype, shape: Sequence[int], params: bytes,
                      section_sizes: Sequence[int]) -> bytes:
    """The header a blob of these sections starts with (what ``blob_header`` parses)."""
    return b"".join((
        _FIXED.pack(BLOB_MAGIC, BLOB_VERSION, codec_id, dtype_code(dtype), len(shape)),
        struct.pack(f"<{len(shape)}I", *shape),
        struct.pack("<H", len(params)),
        params,
        struct.pack("<B", len(section_sizes)),
        struct.pack(f"<{len(section_sizes)}Q", *section_sizes),
    ))


def pack_blob(
    codec_id: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    params: bytes,
    sections: list[Section],
) -> bytes:
    """Frame ``sections`` with a header and a trailing checksum."""
    return BlobPlan(codec_id, dtype, shape, params, sections).to_bytes()


def unpack_blob(blob: bytes | bytearray | memoryview, verify: bool = True) -> BlobParts:
    """Verify and parse a blob; CodecError names what is wrong.

    ``verify=False`` skips only the checksum, for blobs inside a page whose own checksum was
    just verified (the framing is still checked).
    """
    view = memoryview(blob).cast("B")
    if len(view) < _FIXED.size + 8:
        raise CodecError(f"blob truncated: {len(view)} bytes")
    head = blob_header(view)
    if head is None:
        raise CodecError("blob truncated inside its header")
    end = head.nbytes - _CHECKSUM.size
    if len(view) != head.nbytes:
        raise CodecError(f"blob length {len(view)} does not match its header ({head.nbytes})")
    (checksum,) = struct.unpack_from("<Q", view, end)
    if verify and xxhash.xxh3_64_intdigest(view[:end]) != checksum:
        raise CodecError("blob checksum mismatch: the blob is damaged")
    sections = []
    pos = head.header_bytes
    for length in head.section_bytes:
        sections.append(view[pos : pos + length])
        pos += length
    return BlobParts(head.codec_id, head.dtype, head.shape, head.params, sections)


@dataclass(frozen=True, slots=True)
class BlobHeader:
    """What a blob's header says: enough to find its sections before the rest is there."""

    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    params: bytes
    header_bytes: int  # where the first section starts
    section_bytes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """The whole blob's length, its trailing checksum included."""
        return self.header_bytes + sum(self.section_bytes) + _CHECKSUM.size


def blob_header(prefix: bytes | bytearray | memoryview) -> BlobHeader | None:
    """Parse the header at the front of ``prefix`` (a blob, or only its first bytes); None if
    ``prefix`` ends inside the header. CodecError if the header is not a blob's."""
    view = memoryview(prefix).cast("B")
    if len(view) < _FIXED.size:
        return None
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
        if len(view) < pos + params_len:
            return None
        params = bytes(view[pos : pos + params_len])
        pos += params_len
        (num_sections,) = struct.unpack_from("<B", view, pos)
        pos += 1
        if num_sections > MAX_SECTIONS:
            raise CodecError(f"blob header damaged ({num_sections} sections)")
        lengths = struct.unpack_from(f"<{num_sections}Q", view, pos)
        pos += 8 * num_sections
    except struct.error:
        return None
    return BlobHeader(codec_id, _CODE_DTYPES[dcode], tuple(shape), params, pos, lengths)


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


# The all-ones exponent of each float dtype, on its bits: a value is NaN or Inf exactly when its
# exponent bits are all ones. Read as a signed integer, a positive NaN/Inf is at least the
# exponent (nothing finite is that large); read unsigned, a negative one is at least sign |
# exponent. So two max reductions over integer views of the bits, no temporaries, give the
# verdict. On the busy 2-core box (2026-12-01, medians): a commit's check of a 2 MiB bf16 page
# in the daemon 0.19 ms against 0.26 for the mask-then-max it replaced and 0.25 for the copy
# into the published slot before it; 0.09 ms on 2-byte-aligned bits (a page's raw section
# starts at an odd offset, and numpy reduces unaligned data without SIMD); torch.isfinite(t)
# .all() 3.5-11 ms, its OpenMP team fighting other processes. dtype -> (element bytes,
# exponent bits, sign bit).
_NONFINITE = {torch.bfloat16: (2, 0x7F80, 0x8000), torch.float16: (2, 0x7C00, 0x8000),
              torch.float32: (4, 0x7F800000, 0x80000000)}
_SIGNED = {2: np.int16, 4: np.int32}
_UNSIGNED = {2: np.uint16, 4: np.uint32}


def is_all_finite(t: torch.Tensor) -> bool:
    """Whether a CPU float tensor holds no NaN or Inf: bf16/fp16/fp32 checked on their bits
    with numpy, on one thread whatever torch's settings (see ``_NONFINITE``)."""
    if t.dtype == torch.uint8:  # a group's bytes: no bit pattern is out of range
        return True
    if t.dtype not in _NONFINITE:
        return bool(torch.isfinite(t).all())
    if t.numel() == 0:
        return True
    return bits_all_finite(as_array(t), t.dtype)


def bits_all_finite(bits: np.ndarray, dtype: torch.dtype) -> bool:
    """Whether ``bits`` (any shape and strides, integers of ``dtype``'s size) hold no NaN or
    Inf of float ``dtype`` (bfloat16, float16 or float32); True when empty."""
    masks = _NONFINITE.get(dtype)
    if masks is None:
        raise CodecError(f"no bit-level finite check for {dtype}; use bfloat16/float16/float32")
    size, exponent, sign = masks
    if bits.dtype.itemsize != size or bits.dtype.kind not in "iu":
        raise CodecError(f"{bits.dtype} values are not the bits of {dtype} values")
    if bits.size == 0:
        return True
    return (int(bits.view(_SIGNED[size]).max()) < exponent
            and int(bits.view(_UNSIGNED[size]).max()) < (sign | exponent))


def check_kv_input(kv: object, name: str, takes_bytes: bool = False) -> torch.Tensor:
    """Common input check for codecs: a float tensor in the canonical 5-D layout (or uint8,
    a cache group's bytes, where ``takes_bytes``: lossless codecs only)."""
    if not isinstance(kv, torch.Tensor):
        raise CodecError(f"{name}: expected a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype == torch.uint8 and not takes_bytes:
        raise CodecError(f"{name}: a lossy codec re-encodes only bfloat16/float16/float32 "
                         "attention and latent groups; fp8 engine pages and state groups "
                         "(uint8) are stored raw or zstd")
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
    def prepare(self, kv: torch.Tensor) -> Payload:
        """Check ``kv`` (canonical layout, any device) and do the codec's work up to the bytes:
        the payload knows its exact size and writes itself where the caller says."""

    def encode(self, kv: torch.Tensor) -> bytes:
        """Encode ``kv`` (canonical layout, any device) into a self-describing blob."""
        return self.prepare(kv).to_bytes()

    def encode_into(self, kv: torch.Tensor, out: memoryview) -> int:
        """Encode ``kv`` straight into the writable buffer ``out``; return the blob's bytes.

        CodecError if ``out`` is too small (nothing is written then).
        """
        return self.prepare(kv).write_into(out)

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
    reference otherwise. Subclasses supply ``parse`` and the two decoders."""

    @abstractmethod
    def parse(self, blob: bytes | bytearray | memoryview, verify: bool = True
              ) -> tuple[object, torch.dtype, tuple[int, ...]]:
        """Check a blob of this codec; return CPU views of its parts, its dtype and shape."""

    @abstractmethod
    def _reference_decode(self, parts: object, dtype: torch.dtype) -> torch.Tensor: ...

    @abstractmethod
    def _kernel_decode(self, parts: object, out: torch.Tensor) -> None:
        """Triton decode of device-resident parts into a contiguous ``out``."""

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

class KVSpecLike:  # structural hint only; codecs read these attributes of a KVSpec
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    element_bytes: int


def framing_bytes(ndim: int = 5, num_sections: int = 1, params_len: int = 0) -> int:
    """Bytes a blob adds around its sections (header and checksum)."""
    return _FIXED.size + 4 * ndim + 2 + params_len + 1 + 8 * num_sections + 8
