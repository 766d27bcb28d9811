"""The quantised parts of the lossy codecs: value types and format constants that the torch
references (``fp8``, ``fp4``, ``kivi``) and the Triton kernels (``triton/``) both read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.errors import CodecError

# ---------------------------------------------------------------------------------- fp8_e4m3

E4M3_MAX = 448.0  # largest finite float8 e4m3fn value; codes saturate here, never NaN
# Scales are clamped up to the smallest normal float32 so 1/scale stays finite on all-zero rows.
MIN_SCALE = 2.0**-126


@dataclass(frozen=True, slots=True)
class Fp8Parts:
    """The quantised sections of one run.

    ``codes``: uint8 ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``, e4m3fn bit patterns.
    ``scales``: bf16 ``[num_layers, 2, num_tokens, num_kv_heads]``; value = code * scale.
    """

    codes: torch.Tensor
    scales: torch.Tensor

    def to(self, device: torch.device) -> Fp8Parts:
        return Fp8Parts(self.codes.to(device), self.scales.to(device))


# ----------------------------------------------------------------------------- nvfp4, mxfp4

E2M1_MAX = 6.0
E4M3_MIN_SCALE = 2.0**-9  # the smallest e4m3 subnormal: no block scale is zero
TENSOR_SCALE_MIN = 2.0**-126  # smallest normal float32: an all-zero slice keeps a usable scale
NV_BLOCK = 16
MX_BLOCK = 32
E8M0_NAN = 255  # the OCP MX encoding of a NaN scale; marks a block that held NaN/Inf


@dataclass(frozen=True, slots=True)
class Fp4Parts:
    """The quantised sections of one canonical K/V tensor, on any one device.

    Attributes:
        packed: uint8 ``[num_layers, 2, num_tokens, num_kv_heads, head_dim // 2]``, element 2i
            in bits 0-3 and 2i+1 in bits 4-7 of byte i; bit 3 of a nibble is the sign.
        scales: uint8 ``[..., head_dim // block]``: e4m3fn bits (nvfp4) or the e8m0 biased
            exponent (mxfp4) of each block's scale.
        tensor_scales: float32 ``[num_layers, 2]`` for nvfp4, None for mxfp4.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    tensor_scales: torch.Tensor | None = None

    def sections(self) -> list[torch.Tensor]:
        """The blob sections, in blob order."""
        tail = [] if self.tensor_scales is None else [self.tensor_scales]
        return [self.packed, self.scales, *tail]

    def to(self, device: torch.device) -> Fp4Parts:
        """The same parts on ``device`` (a copy unless already there)."""
        ts = None if self.tensor_scales is None else self.tensor_scales.to(device)
        return Fp4Parts(self.packed.to(device), self.scales.to(device), ts)


# ------------------------------------------------------------------------------ int4, int2

GROUP_SIZES = (4, 8, 16, 32, 64, 128, 256)  # powers of two: kernel tiles need them


@dataclass(frozen=True, slots=True)
class KiviParts:
    """The sections of one run of ``T`` tokens, ``Tq = (T // g) * g`` of them quantised in K.

    K (groups of g tokens per channel): ``k_codes`` uint8 ``[L, Tq, H, D * bits / 8]``,
    ``k_meta`` fp16 ``[L, Tq / g, 2, H * D]`` (scales, then zero points) and ``k_residual``
    ``[L, T - Tq, H, D]`` in the input dtype. V (groups of g channels per token): ``v_codes``
    uint8 ``[L, T, H, D * bits / 8]``, ``v_meta`` fp16 ``[L, T, 2, H * D / g]``.
    Value = code * scale + zero; codes packed low bits first (element 2i in the low nibble).
    """

    bits: int
    group_size: int
    k_codes: torch.Tensor
    k_meta: torch.Tensor
    k_residual: torch.Tensor
    v_codes: torch.Tensor
    v_meta: torch.Tensor

    def to(self, device: torch.device) -> KiviParts:
        move = [t.to(device) for t in self.tensors()]
        return KiviParts(self.bits, self.group_size, *move)

    def tensors(self) -> list[torch.Tensor]:
        return [self.k_codes, self.k_meta, self.k_residual, self.v_codes, self.v_meta]


def section_shapes(shape: tuple[int, ...], bits: int, group_size: int) -> list[tuple[int, ...]]:
    """Shapes of the five sections for a run of canonical ``shape``; CodecError if unsupported."""
    if len(shape) != 5 or shape[1] != 2:
        raise CodecError(f"expected shape [num_layers, 2, tokens, heads, dim], got {tuple(shape)}")
    if bits not in (2, 4) or group_size not in GROUP_SIZES:
        raise CodecError(f"unsupported int{bits} group size {group_size}; use one of {GROUP_SIZES}")
    layers, _, tokens, heads, dim = shape
    if dim % group_size:
        raise CodecError(
            f"head_dim {dim} is not a multiple of group_size {group_size}: V groups span channels"
        )
    full = tokens // group_size * group_size
    packed = dim * bits // 8
    return [
        (layers, full, heads, packed),
        (layers, tokens // group_size, 2, heads * dim),
        (layers, tokens - full, heads, dim),
        (layers, tokens, heads, packed),
        (layers, tokens, 2, heads * dim // group_size),
    ]


def run_shape(parts: KiviParts) -> tuple[int, int, int, int, int]:
    """The canonical shape of the run the sections hold."""
    layers, tokens, heads, _ = parts.v_codes.shape
    return (layers, 2, tokens, heads, parts.k_residual.shape[-1])
