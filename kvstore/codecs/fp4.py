"""FP4 codecs: nvfp4 and mxfp4, sharing the e2m1 machinery, with their torch references.

Both store e2m1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 with a sign), two per byte, the even element
in the low nibble, in blocks along head_dim:

- nvfp4: 16-element blocks, an e4m3 block scale each, and a float32 tensor scale per (layer, K/V)
  slice: ``tensor_scale = slice_amax / (448 * 6)``, ``block_scale = e4m3(block_amax * fl(1 / (6 *
  tensor_scale)))`` clamped to ``[2^-9, 448]``. One tensor scale per slice rather than per
  tensor: on K/V whose slices differ up to 10^4x the worst slice's relative error measured 0.095
  against 0.14, and a slice 10^6x smaller than the largest rounds to zero under one scale.
- mxfp4 (OCP MX): 32-element blocks, an e8m0 scale each: ``2^(floor(log2(block_amax)) - 2)``.

Values are divided by their block's dequantisation scale (as ``|x| * fl(1 / scale)``) and rounded
to the nearest e2m1 value, ties to the even mantissa, saturating at 6. Inputs holding NaN or Inf
are rejected with CodecError. The Triton kernels in ``kvstore.codecs.triton.fp4`` produce the same
bytes as the references here, so blobs decode on either device.
"""

from __future__ import annotations

import struct
from abc import abstractmethod
from types import ModuleType

import torch

from kvstore.codecs.base import (
    BlobPlan,
    QuantizedCodec,
    check_kv_input,
    framing_bytes,
    section_tensor,
    unpack_blob,
)
from kvstore.codecs.parts import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_SCALE,
    E8M0_NAN,
    MX_BLOCK,
    NV_BLOCK,
    TENSOR_SCALE_MIN,
    Fp4Parts,
)
from kvstore.codecs.triton.common import use_triton
from kvstore.errors import CodecError

E4M3_FIRST_INVALID = 0x7F  # e4m3fn bytes from 0x7F up are NaN or negative: never a block scale
# Magnitude code c (bits e e m) -> value; c | 8 is the negative value.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Round to nearest, ties to even mantissa: the code is the number of thresholds a magnitude
# passes. At the ties 0.25, 1.25, 2.5 and 5 the lower neighbour has the even mantissa (strict >);
# at 0.75, 1.75 and 3.5 the upper one does (>=).
E2M1_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
E2M1_TIES_UP = (0.75, 1.75, 3.5)
_E2M1_SIGNED = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)


def e2m1_codes(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """Signed e2m1 codes (uint8, 0-15) of ``x * inv_scale``, rounded as the module says.

    A value that rounds to zero gets code 0, never a negative zero.
    """
    mag = x.abs() * inv_scale
    code = torch.zeros(mag.shape, dtype=torch.uint8, device=x.device)
    for tie in E2M1_TIES_DOWN:
        code += (mag > tie).to(torch.uint8)
    for tie in E2M1_TIES_UP:
        code += (mag >= tie).to(torch.uint8)
    negative = (x < 0) & (code != 0)
    return code | (negative.to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Float32 values of signed e2m1 codes."""
    return _E2M1_SIGNED.to(codes.device)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim: the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_nibbles``."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Float32 view of ``x`` as ``[L, 2, T, H, head_dim // block, block]``."""
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def slice_amax(x: torch.Tensor) -> torch.Tensor:
    """Float32 ``[num_layers, 2]``: max |x| of each (layer, K/V) slice; NaN/Inf propagate."""
    flat = x.reshape(x.shape[0], 2, -1)
    if flat.shape[-1] == 0:
        return torch.zeros(flat.shape[:2], dtype=torch.float32, device=x.device)
    return flat.abs().amax(dim=-1).float()


def nvfp4_tensor_scales(amax: torch.Tensor) -> torch.Tensor:
    """NVIDIA's recipe: ``amax / (448 * 6)``, kept a normal float for all-zero slices."""
    return torch.clamp(amax / (E4M3_MAX * E2M1_MAX), min=TENSOR_SCALE_MIN)


def nvfp4_quantize_reference(x: torch.Tensor, tensor_scales: torch.Tensor | None = None
                             ) -> Fp4Parts:
    """Torch reference of nvfp4 encoding of a canonical tensor (head_dim % 16 == 0).

    Args:
        x: ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``, bf16/fp16/fp32.
        tensor_scales: float32 ``[num_layers, 2]``; by default one per slice from its amax.
    """
    blocks = _blocks(x, NV_BLOCK)
    if tensor_scales is None:
        tensor_scales = nvfp4_tensor_scales(slice_amax(x))
    ts = tensor_scales.reshape(x.shape[0], 2, 1, 1, 1)
    inv_six_ts = 1.0 / (ts * E2M1_MAX)  # one division per slice; blocks multiply by it
    # Clamp before the cast: torch turns values beyond 448 into NaN where Triton saturates.
    scale = (blocks.abs().amax(dim=-1) * inv_six_ts).clamp(E4M3_MIN_SCALE, E4M3_MAX)
    scale_e4m3 = scale.to(torch.float8_e4m3fn)
    dequant = scale_e4m3.float() * ts
    codes = e2m1_codes(blocks, (1.0 / dequant).unsqueeze(-1))
    return Fp4Parts(pack_nibbles(codes.flatten(-2)), scale_e4m3.view(torch.uint8), tensor_scales)


def mxfp4_quantize_reference(x: torch.Tensor) -> Fp4Parts:
    """Torch reference of mxfp4 encoding of a canonical tensor (head_dim % 32 == 0)."""
    blocks = _blocks(x, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1)
    # scale = 2^(floor(log2(amax)) - emax(e2m1) = 2); biased by 127; byte 0 for tiny or 0 blocks
    biased = (exponent.int() - 1 - 2 + 127).clamp(min=0)
    biased = torch.where(amax == 0, 0, biased)
    biased = torch.where(torch.isfinite(amax), biased, E8M0_NAN)
    inv_scale = ((254 - biased.clamp(max=254)) << 23).view(torch.float32)  # 2^(127 - biased)
    codes = e2m1_codes(blocks, inv_scale.unsqueeze(-1))
    return Fp4Parts(pack_nibbles(codes.flatten(-2)), biased.to(torch.uint8))


def e8m0_values(scales: torch.Tensor) -> torch.Tensor:
    """Float32 ``2^(byte - 127)`` of e8m0 scale bytes (byte 0 is the subnormal 2^-127)."""
    biased = scales.int()
    return torch.where(biased == 0, 0x00400000, biased << 23).view(torch.float32)


def dequantize_reference(parts: Fp4Parts, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference decoding of nvfp4 (parts with tensor scales) or mxfp4 parts."""
    num_layers, two, num_tokens, num_kv_heads, half_dim = parts.packed.shape
    num_blocks = parts.scales.shape[-1]
    values = e2m1_values(unpack_nibbles(parts.packed))
    values = values.reshape(*parts.scales.shape, 2 * half_dim // num_blocks)
    if parts.tensor_scales is None:
        dequant = e8m0_values(parts.scales)
    else:
        ts = parts.tensor_scales.reshape(num_layers, two, 1, 1, 1)
        dequant = parts.scales.view(torch.float8_e4m3fn).float() * ts
    out = values * dequant.unsqueeze(-1)
    return out.reshape(num_layers, two, num_tokens, num_kv_heads, 2 * half_dim).to(dtype)


def _triton_fp4() -> ModuleType | None:
    """The Triton kernels module, or None where triton cannot be imported."""
    try:
        from kvstore.codecs.triton import fp4
    except ImportError:
        return None
    return fp4


class _Fp4Codec(QuantizedCodec):
    """What nvfp4 and mxfp4 share: input checks, framing, dispatch, validation of blobs."""

    lossless = False
    block_size: int = 0
    num_sections: int = 0
    params: bytes = b""

    @abstractmethod
    def _reference_quantize(self, kv: torch.Tensor) -> Fp4Parts:
        """The torch reference encoder of this format."""

    @abstractmethod
    def _scales_finite(self, parts: Fp4Parts) -> bool:
        """False when the encoder marked a slice or block as holding NaN/Inf."""

    @abstractmethod
    def _validate_scales(self, parts: Fp4Parts) -> None:
        """Raise CodecError for scales a well-formed blob cannot hold."""

    def check_input(self, kv: object) -> torch.Tensor:
        """Validate an encoder input; CodecError names what is wrong."""
        kv = check_kv_input(kv, self.name)
        if kv.shape[-1] % self.block_size:
            raise CodecError(
                f"{self.name}: head_dim {kv.shape[-1]} is not a multiple of the "
                f"{self.block_size}-element block"
            )
        return kv

    def quantize(self, kv: torch.Tensor) -> Fp4Parts:
        """Quantise ``kv`` on its own device (Triton on CUDA, else the torch reference)."""
        kv = self.check_input(kv)
        kernels = _triton_fp4() if use_triton(kv) else None
        if kernels is None:
            parts = self._reference_quantize(kv)
        else:
            parts = getattr(kernels, f"{self.name}_encode")(kv.contiguous())
        if not self._scales_finite(parts):
            count = int((~torch.isfinite(kv)).sum())
            raise CodecError(f"{self.name}: input holds {count} non-finite values (NaN or Inf)")
        return parts

    def prepare(self, kv: torch.Tensor) -> BlobPlan:
        parts = self.quantize(kv)
        return BlobPlan(self.codec_id, kv.dtype, tuple(kv.shape), self.params, parts.sections())

    def parse(self, blob: bytes | bytearray | memoryview, verify: bool = True
              ) -> tuple[Fp4Parts, torch.dtype, tuple[int, ...]]:
        """Verify a blob of this codec and return CPU views of its parts, its dtype and shape."""
        blob_parts = unpack_blob(blob, verify)
        if blob_parts.codec_id != self.codec_id:
            raise CodecError(f"blob was written by codec id {blob_parts.codec_id}, not {self.name}")
        if blob_parts.params != self.params:
            raise CodecError(f"{self.name}: unknown parameters {blob_parts.params.hex()} in blob")
        shape = blob_parts.shape
        if len(shape) != 5 or shape[1] != 2 or shape[-1] % self.block_size:
            raise CodecError(f"{self.name}: blob shape {shape} is not a canonical K/V shape")
        if len(blob_parts.sections) != self.num_sections:
            raise CodecError(f"{self.name}: blob holds {len(blob_parts.sections)} sections")
        sec = blob_parts.sections
        lead = shape[:-1]
        packed = section_tensor(sec[0], torch.uint8, (*lead, shape[-1] // 2))
        scales = section_tensor(sec[1], torch.uint8, (*lead, shape[-1] // self.block_size))
        ts = section_tensor(sec[2], torch.float32, shape[:2]) if self.num_sections == 3 else None
        parts = Fp4Parts(packed, scales, ts)
        self._validate_scales(parts)
        return parts, blob_parts.dtype, shape

    def _reference_decode(self, parts: Fp4Parts, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_reference(parts, dtype)

    def _kernel_decode(self, parts: Fp4Parts, out: torch.Tensor) -> None:
        getattr(_triton_fp4(), f"{self.name}_decode")(parts, out)

    def bytes_per_element(self, spec) -> float:
        numel = spec.num_layers * 2 * spec.block_tokens * spec.num_kv_heads * spec.head_dim
        tensor_scale_bytes = 4 * spec.num_layers * 2 if self.num_sections == 3 else 0
        stored = numel // 2 + numel // self.block_size + tensor_scale_bytes
        framing = framing_bytes(5, self.num_sections, len(self.params))
        return (stored + framing) / numel


class NvFp4Codec(_Fp4Codec):
    """nvfp4: e2m1 in 16-element blocks, e4m3 block scales, a float32 scale per (layer, K/V).

    4.5 bits per element plus 8 bytes per layer and the blob framing.
    """

    name = "nvfp4"
    codec_id = 3
    block_size = NV_BLOCK
    num_sections = 3
    params = struct.pack("<BB", NV_BLOCK, 1)  # block size; 1 = one tensor scale per slice

    def _reference_quantize(self, kv: torch.Tensor) -> Fp4Parts:
        return nvfp4_quantize_reference(kv)

    def _scales_finite(self, parts: Fp4Parts) -> bool:
        return bool(torch.isfinite(parts.tensor_scales).all())

    def _validate_scales(self, parts: Fp4Parts) -> None:
        ts = parts.tensor_scales
        if not bool(torch.isfinite(ts).all()) or bool((ts <= 0).any()):
            raise CodecError(f"{self.name}: blob tensor scales are not positive finite numbers")
        if parts.scales.numel() and int(parts.scales.max()) >= E4M3_FIRST_INVALID:
            raise CodecError(f"{self.name}: blob holds a NaN or negative e4m3 block scale")


class MxFp4Codec(_Fp4Codec):
    """mxfp4 (OCP MX): e2m1 in 32-element blocks with e8m0 block scales; 4.25 bits/element."""

    name = "mxfp4"
    codec_id = 4
    block_size = MX_BLOCK
    num_sections = 2
    params = struct.pack("<B", MX_BLOCK)

    def _reference_quantize(self, kv: torch.Tensor) -> Fp4Parts:
        return mxfp4_quantize_reference(kv)

    def _scales_finite(self, parts: Fp4Parts) -> bool:
        return not bool((parts.scales == E8M0_NAN).any())

    def _validate_scales(self, parts: Fp4Parts) -> None:
        if not self._scales_finite(parts):
            raise CodecError(f"{self.name}: blob holds a NaN e8m0 block scale")
