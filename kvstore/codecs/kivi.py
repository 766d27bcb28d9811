"""int4 / int2 (KIVI-style): asymmetric integers, K per channel over token groups, V per token."""

from __future__ import annotations

import struct

import torch

from kvstore.codecs.base import (
    BlobPlan,
    QuantizedCodec,
    check_kv_input,
    framing_bytes,
    section_tensor,
    unpack_blob,
)
from kvstore.codecs.parts import GROUP_SIZES, KiviParts, section_shapes
from kvstore.codecs.triton.common import check_finite, use_triton
from kvstore.errors import CodecError

FORMAT_VERSION = 1
_PARAMS = struct.Struct("<BBH")  # format version, bits, group size
NUM_SECTIONS = 5  # K codes, K scale/zero, K residual, V codes, V scale/zero
META_BYTES = 4  # fp16 scale + fp16 zero point per group
FP16_MAX = 65504.0  # scales and zero points are fp16, so inputs must fit its range


def group_params(low: torch.Tensor, high: torch.Tensor, bits: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (scale, zero point) of groups spanning [low, high] with 2^bits - 1 steps.

    The zero point is rounded to fp16 first and the scale spans from it, so the stored pair is
    what quantisation uses; the float32 ops match the kernels' bit for bit.
    """
    zero = low.to(torch.float16)
    span = (high - zero.float()).clamp_min(0.0)
    inv_levels = torch.tensor(1.0 / (2**bits - 1), dtype=torch.float32, device=span.device)
    return (span * inv_levels).to(torch.float16), zero


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (uint8, unpacked) of float32 ``x``: round((x - zero) / scale), clamped to the range."""
    s = scale.float()
    inv = torch.where(s > 0, torch.reciprocal(s), torch.zeros_like(s))
    y = ((x - zero.float()) * inv).clamp(0.0, float(2**bits - 1))
    return (y + 0.5).to(torch.uint8)  # truncating a non-negative value: round half up


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack along the last dim, element j of each byte's group in bits [j * bits, (j+1) * bits)."""
    per_byte = 8 // bits
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    grouped = grouped.to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    return (grouped << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack``: int32 codes, the last dim ``8 / bits`` times longer."""
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & (2**bits - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


def encode_kivi_reference(kv: torch.Tensor, bits: int, group_size: int) -> KiviParts:
    """Torch reference of the encode kernels, bit for bit."""
    shapes = section_shapes(tuple(kv.shape), bits, group_size)
    layers, _, tokens, heads, dim = kv.shape
    full, g = shapes[0][1], group_size
    k = kv[:, 0, :full].float().reshape(layers, full // g, g, heads * dim)
    k_scale, k_zero = group_params(k.amin(2), k.amax(2), bits)
    k_codes = quantize(k, k_scale.unsqueeze(2), k_zero.unsqueeze(2), bits)
    v = kv[:, 1].float().reshape(layers, tokens, heads * dim // g, g)
    v_scale, v_zero = group_params(v.amin(-1), v.amax(-1), bits)
    v_codes = quantize(v, v_scale.unsqueeze(-1), v_zero.unsqueeze(-1), bits)
    return KiviParts(
        bits,
        group_size,
        pack(k_codes.reshape(layers, full, heads, dim), bits),
        torch.stack([k_scale, k_zero], dim=2),
        kv[:, 0, full:].contiguous(),
        pack(v_codes.reshape(layers, tokens, heads, dim), bits),
        torch.stack([v_scale, v_zero], dim=2),
    )


def decode_kivi_reference(parts: KiviParts, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference of the decode kernels: code * scale + zero in float32, cast to ``dtype``."""
    layers, full, heads, _ = parts.k_codes.shape
    tokens, g = parts.v_codes.shape[1], parts.group_size
    dim = parts.k_residual.shape[-1]
    out = torch.empty(layers, 2, tokens, heads, dim, dtype=dtype, device=parts.v_codes.device)
    k = unpack(parts.k_codes, parts.bits).float().reshape(layers, full // g, g, heads * dim)
    k_meta = parts.k_meta.float().unsqueeze(3)  # [L, groups, 2, 1, H * D]
    k = k * k_meta[:, :, 0] + k_meta[:, :, 1]
    out[:, 0, :full] = k.reshape(layers, full, heads, dim).to(dtype)
    out[:, 0, full:] = parts.k_residual.to(dtype)
    v = unpack(parts.v_codes, parts.bits).float().reshape(layers, tokens, heads * dim // g, g)
    v_meta = parts.v_meta.float().unsqueeze(-1)  # [L, T, 2, groups, 1]
    v = v * v_meta[:, :, 0] + v_meta[:, :, 1]
    out[:, 1] = v.reshape(layers, tokens, heads, dim).to(dtype)
    return out


class KiviCodec(QuantizedCodec):
    """KIVI-style asymmetric integer codec; ``Int4Codec`` and ``Int2Codec`` fix the bit width.

    K is quantised per channel over groups of ``group_size`` tokens (outlier channels get their
    own range), V per token over groups of ``group_size`` channels; trailing K tokens that do
    not fill a group stay in the input dtype. A run shorter than ``group_size`` tokens (one
    16-token page under the default 32) is encoded with the largest power-of-two group that
    fits it, so its K is quantised instead of kept whole as residual; the blob records the
    group used (it applies to the V channel groups too). Inputs with NaN/Inf, or beyond fp16's range (the
    scales and zero points are fp16), are rejected with CodecError.
    """

    bits = 0

    def __init__(self, group_size: int = 32) -> None:
        if group_size not in GROUP_SIZES:
            raise CodecError(
                f"{self.name}: group_size must be one of {GROUP_SIZES}, got {group_size}"
            )
        self.group_size = group_size

    def group_for(self, num_tokens: int) -> int:
        """The group size a run of ``num_tokens`` tokens is encoded with."""
        group = self.group_size
        while group > num_tokens and group > GROUP_SIZES[0]:
            group //= 2
        return group

    def prepare(self, kv: torch.Tensor) -> BlobPlan:
        kv = check_finite(check_kv_input(kv, self.name), self.name).contiguous()
        group = self.group_for(kv.shape[2])
        section_shapes(tuple(kv.shape), self.bits, group)
        beyond = int((kv.abs() > FP16_MAX).sum())
        if beyond:
            raise CodecError(f"{self.name}: {beyond} values beyond fp16's range +-{FP16_MAX:g}")
        if use_triton(kv):
            from kvstore.codecs.triton.kivi import encode_kivi

            parts = encode_kivi(kv, self.bits, group)
        else:
            parts = encode_kivi_reference(kv, self.bits, group)
        params = _PARAMS.pack(FORMAT_VERSION, self.bits, group)
        return BlobPlan(self.codec_id, kv.dtype, tuple(kv.shape), params, parts.tensors())

    def _reference_decode(self, parts: KiviParts, dtype: torch.dtype) -> torch.Tensor:
        return decode_kivi_reference(parts, dtype)

    def _kernel_decode(self, parts: KiviParts, out: torch.Tensor) -> None:
        from kvstore.codecs.triton.kivi import decode_kivi

        decode_kivi(parts, out)

    def parse(self, blob, verify: bool = True) -> tuple[KiviParts, torch.dtype, tuple[int, ...]]:
        """Verify a blob and view its sections as CPU tensors (valid while the blob lives)."""
        parts = unpack_blob(blob, verify)
        if parts.codec_id != self.codec_id:
            raise CodecError(f"blob was written by codec id {parts.codec_id}, not {self.name}")
        if len(parts.params) != _PARAMS.size:
            raise CodecError(f"{self.name}: blob params are {len(parts.params)} bytes")
        version, bits, group_size = _PARAMS.unpack(parts.params)
        if version != FORMAT_VERSION or bits != self.bits:
            raise CodecError(f"{self.name}: blob has format {version}, {bits} bits")
        shapes = section_shapes(parts.shape, bits, group_size)
        if len(parts.sections) != NUM_SECTIONS:
            raise CodecError(f"{self.name}: blob holds {len(parts.sections)} sections")
        dtypes = (torch.uint8, torch.float16, parts.dtype, torch.uint8, torch.float16)
        views = [section_tensor(s, d, shp)
                 for s, d, shp in zip(parts.sections, dtypes, shapes, strict=True)]
        return KiviParts(bits, group_size, *views), parts.dtype, parts.shape

    def bytes_per_element(self, spec) -> float:
        """bits/8 + 4/group_size per element, plus the residual K tokens and the framing."""
        shape = (spec.num_layers, 2, spec.block_tokens, spec.num_kv_heads, spec.head_dim)
        shapes = section_shapes(shape, self.bits, self.group_for(spec.block_tokens))
        sizes = [1, 2, spec.element_bytes, 1, 2]
        total = sum(size * _numel(s) for size, s in zip(sizes, shapes, strict=True))
        total += framing_bytes(5, NUM_SECTIONS, _PARAMS.size)
        return total / _numel(shape)

    def __repr__(self) -> str:
        return f"<codec {self.name} group_size={self.group_size}>"


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


class Int4Codec(KiviCodec):
    """4-bit KIVI: 0.5 + 4/group_size bytes per element (0.625 at the default 32)."""

    name = "int4"
    codec_id = 5
    bits = 4


class Int2Codec(KiviCodec):
    """2-bit KIVI: 0.25 + 4/group_size bytes per element (0.375 at the default 32)."""

    name = "int2"
    codec_id = 6
    bits = 2
